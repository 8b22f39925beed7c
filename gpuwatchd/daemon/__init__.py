"""The daemon's lifecycle around the engine: wiring to the real host, systemd, metrics, serving."""
