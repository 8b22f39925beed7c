"""Act: the irreversible steps, each re-verified right before it is taken.

Signals through pidfds, admin-configured commands and hooks, and the recorded GPU reset
procedure. Nothing here decides *whether* to act: that is ``decide``'s, carried out by the
engine.
"""
