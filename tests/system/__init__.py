"""System tests: the whole daemon, real systemd, Slurm, dpkg or a GPU (tests/README.md)."""
