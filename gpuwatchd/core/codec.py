"""One codec for the JSON files of ``state_dir`` and the documents the daemon writes there: a
:class:`Format` names a document's version, size bound, layout and checked fields.

In detail: docs/internals.md, section `gpuwatchd.core.codec`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.core.checked import as_map, is_version, shown

Reader = Callable[[object, str], Any]  # a checked reader: (value, key) -> value, or ValueError


def decode_json_object(raw: bytes) -> dict[str, object]:
    """The JSON object in ``raw``; ValueError (never another exception) when it is not one."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid JSON: not UTF-8 ({err.reason})") from None
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, and Python's limit on integer digits
        raise ValueError(f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


@dataclass(frozen=True)
class Format:
    """A JSON document: its ``version`` (None: none) first under ``version_key``, at most
    ``limit`` bytes, ``fields`` checked in order. Written in ``json.dumps``' layout (a final
    newline when ``newline``), or ``compact``: sorted keys, no spaces, no NaN."""

    name: str
    limit: int
    version: int | None = None
    fields: Mapping[str, Reader] = field(default_factory=dict)
    version_key: str = "version"
    compact: bool = False
    newline: bool = False

    def envelope(self, values: Mapping[str, object]) -> dict[str, object]:
        return dict(values) if self.version is None else {self.version_key: self.version, **values}

    def encode(self, doc: Mapping[str, object]) -> bytes:
        if self.compact:
            text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
        else:
            text = json.dumps(doc)
        return (text + "\n" if self.newline else text).encode("utf-8")

    def load(self, raw: bytes) -> dict[str, object]:
        """The JSON object in ``raw``, of any version, within the size bound; ValueError."""
        if len(raw) > self.limit:
            raise ValueError(f"larger than {self.limit} bytes")
        return decode_json_object(raw)

    def check(self, data: Mapping[str, object]) -> dict[str, Any]:
        """``data`` of this version (the integer itself: ``true`` or ``1.0`` is another), each
        field as its reader returns it; ValueError."""
        found = data.get(self.version_key)
        if self.version is not None and not is_version(found, self.version):
            raise ValueError(f"unsupported {self.name} version {shown(found)}")
        return {**data, **{key: read(data.get(key), key) for key, read in self.fields.items()}}

    def decode(self, raw: bytes) -> dict[str, Any]:
        return self.check(self.load(raw))


def pick(data: object, fields: Mapping[str, Callable[[object], object]]) -> dict[str, Any]:
    """Each key of ``fields`` read leniently from the object ``data`` by its ``as_*`` reader."""
    found = as_map(data)
    return {key: read(found.get(key)) for key, read in fields.items()}
