"""Health Auto Export bodies: envelopes, sections and lazy point extraction (P1, P2, P6).

The body is never decoded whole into Python objects. The envelope is decoded down to each
metric's ``data`` array as raw JSON, and points are decoded one metric at a time when
folded, each compacted first (whitespace removed, strings and numbers verbatim).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import msgspec

from healthlog.points import Point, PointError, decode_point

RECORD_SECTIONS = frozenset(
    {
        "workouts",
        "symptoms",
        "ecg",
        "stateOfMind",
        "medications",
        "cycleTracking",
        "heartRateNotifications",
    }
)
UTF8_BOM = b"\xef\xbb\xbf"

_Object = dict[str, msgspec.Raw]
_Top = dict[str, msgspec.Raw] | list[msgspec.Raw]


class EnvelopeError(ValueError):
    """The body cannot be read as a Health Auto Export envelope; the message carries no value."""


@attrs.define
class MetricGroup:
    """Every entry of one metric name in a delivery, still raw."""

    name: str
    units: list[str | None] = attrs.Factory(list)
    arrays: list[msgspec.Raw] = attrs.Factory(list)
    points: int = 0


@attrs.define
class Envelope:
    """What a body holds, by section, before any point is decoded."""

    metrics: dict[str, MetricGroup] = attrs.Factory(dict)
    sections: dict[str, list[msgspec.Raw]] = attrs.Factory(dict)
    unknown_sections: int = 0
    rejected_entries: int = 0
    problems: list[str] = attrs.Factory(list)


def read_envelope(body: bytes) -> Envelope:
    """Decode the envelope of a body; raise EnvelopeError when it is not JSON or not an envelope."""
    if body.startswith(UTF8_BOM):
        body = body[len(UTF8_BOM) :]
    try:
        top = msgspec.json.decode(body, type=_Top)
    except (msgspec.DecodeError, RecursionError):
        raise EnvelopeError("body is not a JSON object or array") from None
    envelope = Envelope()
    _read_top(top, envelope, depth=0)
    return envelope


def _read_top(top: _Object | list[msgspec.Raw], envelope: Envelope, depth: int) -> None:
    if isinstance(top, list):
        if depth > 0:
            envelope.problems.append("nested array envelope")
            envelope.rejected_entries += 1
            return
        for item in top:
            inner = _decode(item, _Top)
            if inner is None:
                envelope.problems.append("array element is not an object")
                envelope.rejected_entries += 1
            else:
                _read_top(inner, envelope, depth + 1)
        return
    if "data" in top:
        inner = _decode(top["data"], _Top)
        if inner is None:
            envelope.problems.append("data is not an object")
            envelope.rejected_entries += 1
            return
        if isinstance(inner, list):
            _read_top(inner, envelope, depth)
        else:
            _read_sections(inner, envelope)
        _read_sections({k: v for k, v in top.items() if k != "data"}, envelope)
        return
    _read_sections(top, envelope)


def _read_sections(sections: _Object, envelope: Envelope) -> None:
    for name, raw in sections.items():
        if name == "metrics":
            _read_metrics(raw, envelope)
        elif name in RECORD_SECTIONS:
            if _decode(raw, list[msgspec.Raw]) is None:
                envelope.problems.append(f"section {name} is not an array")
                envelope.rejected_entries += 1
            else:
                envelope.sections.setdefault(name, []).append(raw)
        else:
            envelope.unknown_sections += 1


def _read_metrics(raw: msgspec.Raw, envelope: Envelope) -> None:
    entries = _decode(raw, list[msgspec.Raw])
    if entries is None:
        envelope.problems.append("metrics is not an array")
        envelope.rejected_entries += 1
        return
    for entry_raw in entries:
        entry = _decode(entry_raw, _Object)
        name = _decode(entry["name"], str) if entry is not None and "name" in entry else None
        if entry is None or not name:
            envelope.problems.append("metric without a name")
            envelope.rejected_entries += 1
            continue
        units = _decode(entry["units"], str) if "units" in entry else None
        data = entry.get("data", msgspec.Raw(b"[]"))
        points = _decode(data, list[msgspec.Raw])
        if points is None:
            envelope.problems.append("metric data is not an array")
            envelope.rejected_entries += 1
            continue
        group = envelope.metrics.setdefault(name, MetricGroup(name))
        group.units.append(units or None)
        group.arrays.append(data)
        group.points += len(points)


def _decode(raw: msgspec.Raw, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, RecursionError):
        return None


def iter_points(arrays: list[msgspec.Raw]) -> Iterator[Point | PointError]:
    """Decode the points of raw arrays one by one; a bad point is yielded as its error."""
    for array in arrays:
        for raw in msgspec.json.decode(array, type=list[msgspec.Raw]):
            try:
                yield decode_point(msgspec.json.format(raw, indent=-1))
            except (msgspec.DecodeError, RecursionError):
                yield PointError("point is not valid JSON")
            except PointError as exc:
                yield exc
