"""What a reload changed, for ``EventName.CONFIG_RELOADED``: the policy keys whose value
differs, each as ``old -> new``, named as the policy file spells them, dotted
(``reset.cooldown``); a list of sections (``rules``) is one key, compared whole. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from gpuwatchd.config.schema import policy_data
from gpuwatchd.decide.policy import Policy

VALUE_LIMIT = 120  # characters of one side of a change; a longer one ends in "..."


def policy_changes(old: Policy, new: Policy) -> dict[str, str]:
    """``{"interval": "5s -> 10s", ...}`` for every key whose value differs, in file order;
    a key only one side has shows as ``(unset)`` on the other."""
    before, after = _flat(policy_data(old)), _flat(policy_data(new))
    changes = {}
    for key in [*after, *(k for k in before if k not in after)]:
        was, now = before.get(key, _UNSET), after.get(key, _UNSET)
        if was != now:
            changes[key] = f"{_shown(was)} -> {_shown(now)}"
    return changes


_UNSET = object()


def _flat(data: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def _shown(value: object) -> str:
    if value is _UNSET:
        return "(unset)"
    text = (
        value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)
    )
    return text if len(text) <= VALUE_LIMIT else text[: VALUE_LIMIT - 3] + "..."
