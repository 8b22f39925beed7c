"""Unit tests: pure functions and in-memory objects (see tests/README.md)."""
