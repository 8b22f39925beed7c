"""Names a simulation timeline gives (gpuwatchd/sim/timeline.py ``Names``), fixed for tests."""

from __future__ import annotations


class TrainerNames:
    """Every process is ``pid N (trainer)``, every GPU ``GPU 0``."""

    def pname(self, pid: object) -> str:
        return f"pid {pid} (trainer)"

    def gname(self, uuid: object) -> str:
        return "GPU 0"
