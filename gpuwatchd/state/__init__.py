"""The state directory and every file in it: saved state, pause, spares, accepted and compiled
policy, the status document."""
