"""Decide: pure functions from snapshots and carried state to findings, intents and events.

``assess`` turns a snapshot into findings, ``plan`` turns findings into intents (signals,
resets, hooks) under the policy, ``targets`` and ``floor`` say who may never be touched.
Nothing in this package does I/O, reads a clock or imports from ``collect`` or ``act``;
``tests/unit/test_layers.py`` enforces that from the import graph.
"""
