"""Integration tests: real processes, files and the fake NVML library (tests/README.md)."""
