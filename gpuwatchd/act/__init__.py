"""Act: the irreversible steps (signals, commands and hooks, the recorded GPU reset), each
re-verified right before it is taken. Whether to act is ``decide``'s, carried out by the engine.
"""
