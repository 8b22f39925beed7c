"""Which Linux capabilities this process has (``CapEff``), against those gpuwatchd needs to read
other users' fds and maps, and to signal them (docs/design-notes.md §9).
"""

from __future__ import annotations

import os

_INSPECT_CAPABILITIES = {"CAP_DAC_READ_SEARCH": 2, "CAP_SYS_PTRACE": 19}
# ... and to signal them.
ACT_CAPABILITIES = {**_INSPECT_CAPABILITIES, "CAP_KILL": 5}


def missing_capabilities(
    proc_root: str, wanted: dict[str, int] = _INSPECT_CAPABILITIES
) -> list[str]:
    """Which of the ``wanted`` capabilities this process lacks (from CapEff)."""
    try:
        with open(os.path.join(proc_root, "self", "status"), encoding="ascii") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    effective = int(line.split()[1], 16)
                    return [name for name, bit in wanted.items() if not effective & (1 << bit)]
    except (OSError, ValueError, IndexError):
        pass
    return [] if os.geteuid() == 0 else list(wanted)
