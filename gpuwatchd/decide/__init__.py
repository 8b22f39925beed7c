"""Decide: pure functions from snapshots and carried state to findings, intents and events
(``assess``, ``plan``; ``targets`` and ``floor``: who may never be touched). No I/O, no clock.
"""
