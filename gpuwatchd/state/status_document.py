"""The status document: everything ``gpuwatchd status`` shows, worked out by the daemon.

In detail: docs/internals.md, section `gpuwatchd.state.status_document`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatchd.core.checked import as_count, as_flag, as_list, as_map, as_number, as_one_of, as_text
from gpuwatchd.core.codec import Format, pick
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import as_int
from gpuwatchd.core.vocabulary import EventName, LadderStatus
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.verdict import UNREADABLE
from gpuwatchd.events.catalogue import render
from gpuwatchd.events.words import JournalNamer, finding_label
from gpuwatchd.state.saved import MAX_STATE_BYTES, signalled_last_hour

DOCUMENT_FORMAT = 1  # the "format" of ``status.document`` in state.json
DOCUMENT = Format("status document", MAX_STATE_BYTES, version=DOCUMENT_FORMAT, version_key="format")
CLEAR_LATCHES = "gpuwatchd resume --clear-latches"
MAX_ACTIONS = 20  # recent actions kept and shown
NVML_STATES = ("ok", "wedged", "unavailable")
# A recent action, as kept in the status section and as shown (a missing sentence is said
# again from the rest).
ACTION = {
    "at": as_number,
    "event": as_text,
    "gpu": as_text,
    "pid": as_int,
    "signal": as_text,
    "hook": as_text,
    "outcome": as_text,
    "dry_run": as_flag,
    "sentence": as_text,
}
NVML = {"state": as_one_of(*NVML_STATES), "error": as_text, "since": as_number}  # as last seen
# A ladder's fields kept in the plan and shown as they are: what it is about, where it stands.
LADDER_OF = {"pid": as_int, "rule": as_text, "gpu": as_text, "finding": as_text}
LADDER_STATE = {"status": as_one_of(*LadderStatus), "dry_run": as_flag}
GPU = {"index": as_int, "uuid": as_text, "state": as_one_of("clean", "dirty", "unknown")}
REASON = {"kind": as_text, "reason": as_text}  # a GPU's first reason not to be clean
VERDICT = {"clean": as_flag, "error": as_text}  # the node's, beside each GPU's
SPARE = {"target": as_text, "until": as_number, "reason": as_text}
REJECTED = {"at": as_number, "error": as_text, "at_start": lambda v: v is True, "running": as_text}


def build_document(
    state: Mapping[str, object], *, policy: Policy, wall: float, monotonic: float | None
) -> dict[str, object]:
    """The status document for ``state`` (the envelope of ``state.json``: its ``plan``, its
    ``status`` facts, ``reset_in_progress``), written at wall time ``wall``, when the daemon's
    monotonic clock read ``monotonic`` (None: its deadlines cannot be placed)."""
    data = as_map(state)
    status = as_map(data.get("status"))
    plan = as_map(data.get("plan"))
    offset = None if monotonic is None else wall - monotonic
    modes = _modes(status, plan)
    ladders = _ladders(plan, offset)
    kill_cap = _kill_cap(plan, policy, monotonic)
    breaker = {
        "open": as_flag(plan.get("circuit_open")),
        "failures": as_count(plan.get("reset_failures")),
        "max_failures": policy.reset.max_failures,
    }
    files = status.get("policy")
    spares = [pick(item, SPARE) for item in as_list(status.get("spares"))[:64]]  # in force
    # As plan gates it: in dry-run (configured or forced), a dry-run reset starts a cooldown too.
    dry = modes["mode"] == "dry-run" or modes["effective_mode"] == "forced-dry-run"
    doc = {
        "written_at": wall,
        **modes,
        "kill_cap": kill_cap,
        "circuit_breaker": breaker,
        "clear_latches": CLEAR_LATCHES if kill_cap["latched"] or breaker["open"] else None,
        "nvml": pick(status.get("nvml"), NVML),
        "spares": [spare for spare in spares if spare["target"] is not None],
        "gpus": as_count(status.get("gpus")),
        "findings": as_count(status.get("findings")),
        "verdict": _verdict(status.get("verdict")),
        "policy": {  # the files it runs with, and the configured policy it rejected
            "files": [f for f in files if isinstance(f, str)] if isinstance(files, list) else None,
            "rejected": optional(status.get("policy_rejected"), REJECTED),
        },
        "ladders": ladders,
        "pending": _pending(plan, ladders, offset),
        "recent_actions": _actions(status.get("recent_actions")),
        "resets": _resets(plan, data.get("reset_in_progress"), policy, wall, dry),
    }
    doc["attention"] = _attention(doc)
    return DOCUMENT.envelope(doc)


def action_sentence(name: str, fields: Mapping[str, object]) -> str:
    return render(name, fields, JournalNamer())


def optional(raw: object, spec: Mapping[str, Callable[[object], object]]) -> dict[str, Any] | None:
    """An object's fields by ``spec``; None (not said) when ``raw`` is no object."""
    return pick(raw, spec) if isinstance(raw, Mapping) else None


def _wall(offset: float | None, monotonic: float | None) -> float | None:
    return None if monotonic is None or offset is None else monotonic + offset


def _modes(status: Mapping[str, object], plan: Mapping[str, object]) -> dict[str, object]:
    dry = as_flag(status.get("dry_run"))
    mode = as_text(status.get("mode"))
    if mode not in ("enforcing", "dry-run"):
        mode = None if dry is None else ("dry-run" if dry else "enforcing")
    paused = as_flag(plan.get("paused"))
    forced = as_flag(plan.get("forced_dry_run"))
    return {
        "mode": mode,
        "effective_mode": "paused" if paused else ("forced-dry-run" if forced else mode),
        "paused": paused,
        "paused_reason": as_text(plan.get("paused_reason")) if paused else None,
        "paused_until": as_number(plan.get("paused_until")) if paused else None,
    }


def _kill_cap(
    plan: Mapping[str, object], policy: Policy, monotonic: float | None
) -> dict[str, object]:
    latched = as_flag(plan.get("forced_dry_run"))
    scopes = plan.get("scope_latches")
    users = sorted(str(k) for k in scopes) if isinstance(scopes, dict) else []
    return {
        "latched": latched,
        "reason": as_text(plan.get("forced_reason")) if latched else None,
        "users_latched": users[:64],
        "signalled_last_hour": signalled_last_hour(plan.get("signal_history"), monotonic),
        "max_per_hour": policy.limits.node_max_signalled_per_hour,
        "max_per_user_hour": policy.limits.max_signalled_per_hour,
        "max_per_poll": policy.limits.max_signalled_per_poll,
    }


def _label(key: str | None) -> str | None:
    return None if key is None else finding_label(key, JournalNamer())


def _ladders(plan: Mapping[str, object], offset: float | None) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for target, raw in sorted(as_map(plan.get("ladders")).items()):
        lad = as_map(raw)
        steps = lad.get("steps")
        total = len(steps) if isinstance(steps, list) else None
        step = as_count(lad.get("step"))
        nxt: str | None = None
        if isinstance(steps, list) and step is not None and step < len(steps):
            pair = steps[step]
            signal = pair[0] if isinstance(pair, list) and len(pair) == 2 else 0
            nxt = signal if isinstance(signal, str) else ("report" if signal is None else None)
        elif step is not None and step == total:
            nxt = "end"
        row = pick(lad, LADDER_OF)
        out.append(
            {
                "target": target,
                **row,
                **pick(lad, LADDER_STATE),
                "label": _label(row["finding"]),
                "step": step,
                "steps": total,
                "next": nxt,
                "scheduled": as_number(lad.get("due")) is not None,
                "due": _wall(offset, as_number(lad.get("due"))),
                "started": _wall(offset, as_number(lad.get("started"))),
            }
        )
    return out


def _pending(
    plan: Mapping[str, object], ladders: Sequence[Mapping[str, object]], offset: float | None
) -> list[dict[str, object]]:
    """Confirmation windows and delays not already shown as a ladder's next step."""
    laddered = {lad["finding"] for lad in ladders if lad["status"] == LadderStatus.ACTIVE}
    return [
        {"finding": key, "label": _label(key), "due": _wall(offset, as_number(raw))}
        for key, raw in sorted(as_map(plan.get("waiting")).items())
        if key not in laddered
    ]


def _verdict(raw: object) -> dict[str, object] | None:
    """The daemon's last verdict on each GPU (decide/verdict.py, what ``check-clean`` says):
    ``clean`` (true, false, or null when NVML could not be asked) and each GPU's ``state``
    with its first reason. None when the daemon wrote none."""
    if not isinstance(raw, Mapping):
        return None
    gpus = []
    for item in as_list(raw.get("gpus"))[:256]:
        entry = as_map(item)
        reasons = as_list(entry.get("reasons"))
        gpus.append(
            {
                **pick(entry, GPU),
                **pick(reasons[0] if reasons else {}, REASON),
                "reasons": len(reasons),
                "reset_blockers": len(as_list(entry.get("reset_blockers"))),
            }
        )
    return {**pick(raw, VERDICT), "gpus": gpus}


def _actions(raw: object) -> list[dict[str, object]]:
    out = [pick(item, ACTION) for item in as_list(raw)[-MAX_ACTIONS:]]
    for action in out:
        if action["sentence"] is None and action["event"] is not None:
            # Remembered without its sentence: said from what was kept of its fields.
            fields = {k: v for k, v in action.items() if v is not None}
            if action["event"] == EventName.RESET_OUTCOME:
                fields["result"] = action["outcome"]
            action["sentence"] = action_sentence(str(action["event"]), fields)
    return out


def _times(raw: object) -> dict[str, float]:
    return {k: t for k, v in as_map(raw).items() if (t := as_number(v)) is not None}


def _resets(
    plan: Mapping[str, object], record: object, policy: Policy, wall: float, dry: bool
) -> dict[str, object]:
    reset = policy.reset
    last, last_dry = _times(plan.get("last_reset")), _times(plan.get("last_dry_reset"))
    history: dict[str, list[float]] = {}
    for pair in as_list(plan.get("reset_history")):
        if isinstance(pair, list) and len(pair) == 2:
            gpu, at = as_text(pair[0]), as_number(pair[1])
            if gpu is not None and at is not None:
                history.setdefault(gpu, []).append(at)
    in_progress = None
    if isinstance(record, Mapping):
        recovery = as_map(record.get("recovery"))  # a MIG GPU instance's re-creation
        in_progress = {
            "gpu": as_text(record.get("uuid")),
            **pick(record, {"pci_bus_id": as_text, "step": as_text, "since": as_number}),
            "instance": as_text(recovery.get("mig_uuid")),
            "gi": as_int(recovery.get("gi")),
        }
    gpus = []
    for gpu in sorted(set(last) | set(last_dry) | set(history)):
        times = sorted(history.get(gpu, []))
        window = [t for t in times if wall - t < reset.window]
        ends = [t for t in (last.get(gpu), last_dry.get(gpu) if dry else None) if t is not None]
        latest = max(ends, default=None)
        # The limit lifts when enough of the resets in the window have aged out of it.
        most = reset.max_resets
        limit_lifts = window[-most] + reset.window if 1 <= most <= len(window) else None
        gpus.append(
            {
                "gpu": gpu,
                "last": last.get(gpu),
                "last_dry_run": last_dry.get(gpu),
                "history": times,
                "in_window": len(window),
                "cooldown_ends": None if latest is None else latest + reset.cooldown,
                "limit_lifts": limit_lifts,
                "never": reset.max_resets < 1,
            }
        )
    return {
        "cooldown": reset.cooldown,
        "max_resets": reset.max_resets,
        "window": reset.window,
        "in_progress": in_progress,
        "gpus": gpus,
    }


def _attention(doc: Mapping[str, Any]) -> list[str]:
    """What needs a human in the document ``doc`` (said even when the daemon is gone)."""
    kill_cap, breaker, nvml = doc["kill_cap"], doc["circuit_breaker"], doc["nvml"]
    rejected = doc["policy"]["rejected"]
    out = []
    reason = kill_cap["reason"]
    if kill_cap["latched"] and isinstance(reason, str) and reason.startswith(UNREADABLE):
        out.append(f"{reason}: dry-run forced; clear with `{CLEAR_LATCHES}`")
    elif kill_cap["latched"]:
        why = f" ({reason})" if reason else ""
        out.append(f"kill cap reached{why}: dry-run forced; clear with `{CLEAR_LATCHES}`")
    if kill_cap["users_latched"]:  # a list (_kill_cap)
        shown = ", ".join(escape(str(u)) for u in kill_cap["users_latched"])
        out.append(f"kill cap reached for {shown}: their targets in dry-run until it expires")
    if breaker["open"]:
        failures = breaker["failures"]
        after = f" after {failures} failed reset(s)" if failures is not None else ""
        out.append(f"reset circuit breaker open{after}; clear with `{CLEAR_LATCHES}`")
    if nvml["state"] == "wedged":
        out.append("NVML wedged: the driver did not answer (drain and reboot if it persists)")
    elif nvml["state"] == "unavailable":
        why = f": {nvml['error']}" if nvml["error"] else ""
        out.append(f"NVML unavailable{why}: no GPU is watched")
    if rejected is not None:
        error = rejected["error"] or "unknown error"
        if rejected["at_start"]:
            running = rejected["running"] or "another policy"
            out.append(
                f"policy rejected at start ({error}); running {running} instead: fix the "
                "policy, then `systemctl reload gpuwatchd`"
            )
        else:
            out.append(
                f"policy files rejected ({error}); the running policy stays in force: fix "
                "them (`gpuwatchd check-config`), then reload"
            )
    stuck = [lad for lad in doc["ladders"] if lad["status"] == LadderStatus.STUCK]
    if stuck:
        pids = ", ".join(str(lad["pid"] if lad["pid"] is not None else "?") for lad in stuck)
        out.append(f"target(s) stuck in D state (pid {pids}): needs drain/reboot")
    return out
