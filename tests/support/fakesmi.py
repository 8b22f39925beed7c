"""A fake ``nvidia-smi`` (and hook) script for tests: records its argv, behaves as told.

Owns writing an executable POSIX shell script (shell, not Python: it starts in a millisecond)
into a temp folder. Every call appends one line to ``fakesmi.log`` (its argv after the program
name and its ``GPUWATCHD_*`` environment), then acts by operation — ``reset``
(``--gpu-reset``/``-r``), ``persistence`` (``-pm``), ``query`` (``-q``), the MIG instance
commands ``mig.dci``/``mig.dgi``/``mig.cgi`` (``nvidia-smi mig -dci``, ``-dgi``, ``-cgi``), a
named hook (argv ``hook NAME``) or ``other`` — as the ``fakesmi.<operation>`` files beside it
say. Those are re-read on every call, so a test can change the behaviour between calls. It
never calls a real ``nvidia-smi`` and knows nothing about gpuwatchd.

Behaviours: ``ok``, ``in_use`` (exit 255 with nvidia-smi's "In use by another client" text),
``error255`` (exit 255, other text), ``fell_off_bus`` (15), ``not_supported`` (3),
``no_permission`` (4), ``exit:N``, ``hang`` (starts a grandchild ``sleep 1000`` in its own
process group, writes "LEADER GRANDCHILD" pids to ``hang.pids``, then waits forever).

Typical use::

    smi = FakeSmi(tmp_path)
    smi.set(reset="in_use", hooks={"drain": "exit:1"})
    policy = ResetPolicy(command=smi.argv("--gpu-reset", "-i", "{uuid}"), ...)
    ...
    assert smi.calls() == [["-pm", "0", "-i", UUID], ...]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BEHAVIOURS = (
    "ok",
    "in_use",
    "error255",
    "fell_off_bus",
    "not_supported",
    "no_permission",
    "hang",
)

_SCRIPT = r"""#!/bin/sh
# Fake nvidia-smi written by tests/support/fakesmi.py. Logs its call, then behaves as told.
here=${0%/*}
{
    printf 'CALL'
    for arg in "$@"; do printf '\037%s' "$arg"; done
    printf '\036'
    env | grep '^GPUWATCHD_' | tr '\n' '\037'
    printf '\n'
} >> "$here/fakesmi.log"

operation=other
case " $* " in
    *" --gpu-reset "* | *" -r "*) operation=reset ;;
    *" -pm "*) operation=persistence ;;
    *" -q "*) operation=query ;;
    *" -dci "*) operation=mig.dci ;;
    *" -dgi "*) operation=mig.dgi ;;
    *" -cgi "*) operation=mig.cgi ;;
esac
if [ "$1" = hook ]; then operation="hook.$2"; fi
behaviour=ok
if [ -f "$here/fakesmi.$operation" ]; then read -r behaviour < "$here/fakesmi.$operation"; fi
bus=00000000:1A:00.0
if [ -f "$here/fakesmi.bus" ]; then read -r bus < "$here/fakesmi.bus"; fi

case $behaviour in
ok)
    case $operation in
        reset) printf 'GPU %s was successfully reset.\nAll done.\n' "$bus" ;;
        persistence) printf 'Persistence mode set for GPU %s.\n' "$bus" ;;
        query) printf 'GPU %s\n    Product Name : Fake GPU\n' "$bus" ;;
        mig.dci) printf 'Successfully destroyed compute instance from GPU %s\n' "$bus" ;;
        mig.dgi) printf 'Successfully destroyed GPU instance from GPU %s\n' "$bus" ;;
        mig.cgi) printf 'Successfully created GPU and compute instance on GPU %s\n' "$bus" ;;
    esac
    exit 0 ;;
in_use)
    case $operation in mig.*)
        printf 'Unable to destroy compute instance from GPU %s: In use by another client\n' "$bus"
        printf 'Failed to destroy compute instances: In use by another client\n'
        exit 255 ;;
    esac
    printf 'The following GPUs could not be reset:\n  GPU %s: In use by another client\n\n' "$bus"
    printf '1 device is currently being used by one or more other processes (e.g., Fabric '
    printf 'Manager, CUDA application, graphics application such as an X server, or a '
    printf 'monitoring application such as another instance of nvidia-smi). Please first kill '
    printf 'all processes using this device and all compute applications running in the system.\n'
    exit 255 ;;
error255)
    printf 'Unknown Error resetting GPU %s\n' "$bus"
    exit 255 ;;
fell_off_bus)
    printf 'Unable to determine the device handle for GPU %s: GPU is lost. ' "$bus"
    printf 'Reboot the system to recover this GPU\n'
    exit 15 ;;
not_supported)
    printf "GPU Reset couldn't run because GPU %s is not supported.\n" "$bus"
    exit 3 ;;
no_permission)
    echo "Insufficient Permissions"
    exit 4 ;;
hang)
    sleep 1000 &
    printf '%s %s' "$$" "$!" > "$here/hang.pids.tmp"
    mv "$here/hang.pids.tmp" "$here/hang.pids"
    echo "resetting..."
    wait
    exit 1 ;;
exit:*)
    echo "fake exit ${behaviour#exit:}"
    exit "${behaviour#exit:}" ;;
*)
    echo "fakesmi: unknown behaviour $behaviour" >&2
    exit 99 ;;
esac
"""


class FakeSmi:
    """The fake script in ``directory`` (created if needed), its call log and its settings."""

    def __init__(self, directory: Path, name: str = "nvidia-smi") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / name
        self.log_path = directory / "fakesmi.log"
        self.path.write_text(_SCRIPT)
        self.path.chmod(0o755)
        self.set()

    def set(
        self,
        *,
        reset: str = "ok",
        persistence: str = "ok",
        query: str = "ok",
        other: str = "ok",
        hooks: dict[str, str] | None = None,
        mig: dict[str, str] | None = None,
        bus_id: str = "00000000:1A:00.0",
    ) -> None:
        """Set the behaviour of each operation (files replaced atomically; re-read per call).

        Hooks not named in ``hooks`` succeed; so do the MIG commands (``dci``, ``dgi``, ``cgi``)
        not named in ``mig``.
        """
        for stale in [
            *self.directory.glob("fakesmi.hook.*"),
            *self.directory.glob("fakesmi.mig.*"),
        ]:
            stale.unlink()
        settings = {"reset": reset, "persistence": persistence, "query": query, "other": other}
        settings.update({f"hook.{name}": value for name, value in (hooks or {}).items()})
        settings.update({f"mig.{name}": value for name, value in (mig or {}).items()})
        for value in settings.values():
            if value not in BEHAVIOURS and not value.startswith("exit:"):
                raise ValueError(f"unknown fake nvidia-smi behaviour {value!r}")
        settings["bus"] = bus_id
        for operation, value in settings.items():
            path = self.directory / f"fakesmi.{operation}"
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text(value + "\n")
            os.replace(temporary, path)

    def argv(self, *args: str) -> tuple[str, ...]:
        """An argv that runs the fake with ``args``."""
        return (str(self.path), *args)

    def hook(self, name: str) -> tuple[str, ...]:
        """The argv of a hook called ``name`` (its behaviour set with ``set(hooks=...)``)."""
        return self.argv("hook", name)

    def entries(self) -> list[dict[str, Any]]:
        """Every call so far, in order: ``{"argv": [...], "event": ..., "env": {...}}``.

        ``env`` holds the call's ``GPUWATCHD_*`` variables, ``event`` its ``GPUWATCHD_EVENT``.
        """
        if not self.log_path.exists():
            return []
        found = []
        for line in self.log_path.read_text().split("\n"):  # not splitlines: \x1e/\x1f split it
            if not line.startswith("CALL"):
                continue
            call, _sep, variables = line.partition("\x1e")
            env = dict(item.split("=", 1) for item in variables.split("\x1f") if "=" in item)
            argv = call.split("\x1f")[1:]
            found.append({"argv": argv, "event": env.get("GPUWATCHD_EVENT"), "env": env})
        return found

    def calls(self) -> list[list[str]]:
        """The argv (after the program name) of every call so far, in order."""
        return [list(entry["argv"]) for entry in self.entries()]

    def clear(self) -> None:
        """Forget the calls so far."""
        self.log_path.unlink(missing_ok=True)

    def hang_pids(self) -> tuple[int, int] | None:
        """(leader, grandchild) of the last ``hang``, once it has started."""
        path = self.directory / "hang.pids"
        if not path.exists():
            return None
        leader, grandchild = path.read_text().split()
        return int(leader), int(grandchild)
