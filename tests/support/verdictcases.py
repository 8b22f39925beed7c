"""What the verdict's tests share: a leak's size, the default policy, root's own
nvidia-persistenced."""

from __future__ import annotations

from typing import Any

from gpuwatchd.core.model import MIB
from gpuwatchd.decide.policy import Policy

LEAK = 1200 * MIB
POLICY = Policy()
# Root's own nvidia-persistenced: infrastructure by facts a user cannot forge (floor.py).
ROOTS_PERSISTENCED: dict[str, Any] = {
    "comm": "nvidia-persistenced",
    "exe": "/usr/bin/nvidia-persistenced",
    "uid": 0,
    "user": "root",
    "exe_trusted": True,
}
