"""gpuwatchd: find GPU memory left behind by dead jobs and free it, safely."""

__version__ = "0.1.0"
