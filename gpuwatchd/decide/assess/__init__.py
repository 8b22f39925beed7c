"""Snapshot to findings: the passes, what they share and carry between polls."""
