"""Health Auto Export bodies: envelopes, sections and lazy point extraction (P1, P2, P6).

The body is never decoded whole into Python objects. The envelope is decoded down to each
metric's ``data`` array as raw JSON; a metric's points are then read once for their
coordinates (:func:`read_series`), each compacted first (whitespace removed, strings and
numbers verbatim), and their content is decoded again only where two of them collide.
"""

from __future__ import annotations

import bisect
import operator
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, NamedTuple

import attrs
import msgspec

from healthlog import layers
from healthlog.points import (
    MAX_NESTING,
    Coordinates,
    PointError,
    body_nesting,
    coordinates,
    instant_of,
    nesting,
    point_object,
)
from healthlog.timestamps import US_PER_HOUR, TimestampError, hour_of

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
RECORD_NAMES = {"symptoms": "name", "cycleTracking": "name", "medications": "displayText"}
"""The field naming what a record of a section records, in the sections where one moment holds
several records: the Health app logs a cycle day's symptoms over that whole day, so they share
their start and end, and the doses of a schedule logged at once share their time. Such records
are told apart by it, not reduced to one (MERGE-35)."""
UTF8_BOM = b"\xef\xbb\xbf"
# A body of more than ``DENSE_MIN_BYTES`` holding more JSON values than one per
# ``MIN_BYTES_PER_VALUE`` bytes (counted by its commas and opening brackets) is not read. Its
# values are read one by one, at about 60 bytes of memory each besides the body, so that a
# body of one-digit elements would take 30 times its size, one at the limit about 10 times;
# the app's own bodies hold one value per 15 to 22 bytes.
MIN_BYTES_PER_VALUE = 8
DENSE_MIN_BYTES = 2**20
_NOT_SEPARATOR = bytes(c for c in range(256) if c not in b",[{")
MAX_BODY_NESTING = 512
"""The deepest a body may nest arrays and objects, counted without recursion before it is
decoded. The decoder recurses and gives up at the recursion limit (1,000 frames) less the depth of
the stack it runs on, which differs between a fold in a worker thread, one in a worker process
and a rebuild; below this bound it never does on any of them, so whether a body is read never
depends on where it is folded (PARSE-40). A point nests at most 64 levels, its envelope a few."""

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


def detached(arrays: list[msgspec.Raw]) -> list[msgspec.Raw]:
    """``arrays`` copied out of the body they were read from: each array read keeps the whole
    body in memory for as long as it is held, which a share of a delivery waiting for a rebuild's
    worker is (STORE-145)."""
    return [raw.copy() for raw in arrays]


def read_envelope(body: bytes) -> Envelope:
    """Decode the envelope of a body; raise EnvelopeError when it is not JSON or not an envelope."""
    if body.startswith(UTF8_BOM):
        body = body[len(UTF8_BOM) :]
    if len(body) > DENSE_MIN_BYTES:
        values = len(body.translate(None, _NOT_SEPARATOR))
        if values * MIN_BYTES_PER_VALUE > len(body):
            raise EnvelopeError(
                f"body holds more than one JSON value per {MIN_BYTES_PER_VALUE} bytes"
            )
    if body_nesting(body) > MAX_BODY_NESTING:
        raise EnvelopeError(f"body nests deeper than {MAX_BODY_NESTING} levels")
    envelope = Envelope()
    # The app's own shape, ``{"data": {sections}}``, in one reading of the body.
    wrapped = _decode(body, dict[str, _Object])
    if wrapped is not None and wrapped.keys() == {"data"}:
        _read_sections(wrapped["data"], envelope)
        return envelope
    try:
        top = msgspec.json.decode(body, type=_Top)
    except (msgspec.DecodeError, RecursionError):
        raise EnvelopeError("body is not a JSON object or array") from None
    _read_top(top, envelope, depth=0)
    return envelope


# Envelopes inside envelopes (``data`` holding a list of envelopes, each with a ``data`` of its
# own) are read this deep at most; the app sends none.
MAX_ENVELOPE_DEPTH = 8


def _read_top(
    top: _Object | list[msgspec.Raw], envelope: Envelope, depth: int, *, in_list: bool = False
) -> None:
    """Read a list of envelopes or an envelope; ``in_list`` when ``top`` is an element of a
    list of envelopes, where a list is not an envelope."""
    if isinstance(top, list):
        if in_list:
            envelope.problems.append("nested array envelope")
            envelope.rejected_entries += 1
            return
        for item in top:
            inner = _decode(item, _Top)
            if inner is None:
                envelope.problems.append("array element is not an object")
                envelope.rejected_entries += 1
            else:
                _read_top(inner, envelope, depth, in_list=True)
        return
    if "data" in top:
        inner = _decode(top["data"], _Top)
        if inner is None:
            envelope.problems.append("data is not an object")
            envelope.rejected_entries += 1
            return
        if isinstance(inner, list):
            if depth + 1 >= MAX_ENVELOPE_DEPTH:
                envelope.problems.append("envelope nested too deep")
                envelope.rejected_entries += 1
            else:
                _read_top(inner, envelope, depth + 1)
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
    entries: list[_Object | None] | None = _decode(raw, list[_Object])
    if entries is None:
        entry_raws = _decode(raw, list[msgspec.Raw])
        if entry_raws is None:
            envelope.problems.append("metrics is not an array")
            envelope.rejected_entries += 1
            return
        entries = [_decode(entry_raw, _Object) for entry_raw in entry_raws]
    for entry in entries:
        name = _decode(entry["name"], str) if entry is not None and "name" in entry else None
        if entry is None or not name:
            envelope.problems.append("metric without a name")
            envelope.rejected_entries += 1
            continue
        if "\x00" in name:
            # SQLite's JSON functions end a string at U+0000: the stream could not name it.
            envelope.problems.append("metric name holds U+0000")
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


def _decode(raw: bytes | msgspec.Raw, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, RecursionError):
        return None


@attrs.frozen
class Series:
    """The points of one metric (or record section) after a first reading.

    Points are known by index. Starts are kept as an integer array, ends only where they
    differ from the start, and a point's bytes stay where they are (the body, or its points
    compacted one by one if its array came with whitespace), so a metric costs a few bytes
    per point until its hours are folded one at a time. A point is decoded again only if it
    meets another. A rejected point costs its index, and its reason is counted: a body of
    nothing but elements that cannot be points holds one reason per kind, not one per element.
    """

    sources: list[_Source]
    starts: array[int]
    ends: dict[int, int]
    # The indices of the rejected points, increasing, and how many were rejected for each reason.
    rejected: array[int]
    rejections: Counter[str]
    spacing: int | None

    @property
    def accepted(self) -> int:
        return len(self.starts) - len(self.rejected)

    def hours(self) -> Iterator[Hour]:
        """The accepted points by hour of their start: hours in order, points in array order."""
        elements: list[msgspec.Raw | bytes] = []
        for source in self.sources:
            if isinstance(source, list):
                elements.extend(source)
            else:
                elements.extend(msgspec.json.decode(source, type=list[msgspec.Raw]))
        starts, ends = self.starts, self.ends
        if not self.rejected and all(map(operator.le, starts, islice(starts, 1, None))):
            # Points in order (what the app sends): an hour is a run of consecutive points.
            first = 0
            while first < len(starts):
                hour = hour_of(starts[first])
                last = bisect.bisect_left(starts, hour + US_PER_HOUR, first)
                yield Hour(
                    hour,
                    _keys(starts[first:last], first, ends),
                    list(map(bytes, elements[first:last])),
                )
                first = last
            return
        refused = bytearray(len(starts))
        for index in self.rejected:
            refused[index] = 1
        by_hour: dict[int, list[int]] = {}
        for index, start in enumerate(starts):
            if not refused[index]:
                by_hour.setdefault(hour_of(start), []).append(index)
        for hour in sorted(by_hour):
            members = by_hour.pop(hour)
            yield Hour(
                hour,
                [(starts[i], ends.get(i, starts[i])) for i in members],
                [bytes(elements[i]) for i in members],
            )


def _keys(run: array[int], first: int, ends: dict[int, int]) -> list[Coordinates]:
    """Coordinates of the points ``first, first + 1, ...`` whose starts are ``run``."""
    if not ends:
        return list(zip(run, run, strict=True))
    return [(start, ends.get(i, start)) for i, start in enumerate(run, first)]


class Hour(NamedTuple):
    """The accepted points of a series in one hour.

    Point ``n`` is at ``keys[n]`` with the bytes ``raws[n]``.
    """

    hour: int
    keys: list[Coordinates]
    raws: list[bytes]


# An array of points that is compact already, or its points compacted one by one (empty for
# a point that cannot be).
_Source = msgspec.Raw | list[bytes]


def read_series(arrays: list[msgspec.Raw], *, spacing: bool) -> Series:
    """Read the coordinates of every point of raw arrays, and their spacing when asked.

    A point is kept verbatim, compacted (whitespace between tokens removed); one that cannot
    be read keeps its index, and the reason it was rejected is counted.
    """
    reading = _Reading(spacing)
    for raw_array in arrays:
        source, elements, originals = _compacted(raw_array)
        reading.sources.append(source)
        if originals is not None:
            for element, original in zip(elements, originals, strict=True):
                reading.point(element, original)
            continue
        at = 0
        for values in _decoded_slices(raw_array, elements):
            part = elements[at : at + _SLICE_POINTS]
            at += len(part)
            if values is None:
                for element in part:
                    reading.point(element, element)
            else:
                reading.decoded(part, values)
    return reading.series()


_decoder = msgspec.json.Decoder()
_OTHER_STAMPS = frozenset({"start", "startDate", "end", "endDate"})


def _decoded_slices(
    raw_array: msgspec.Raw, elements: Sequence[msgspec.Raw | bytes]
) -> Iterator[list[Any] | None]:
    """For each slice of ``_SLICE_POINTS`` points of a compact array, its points decoded if
    every one is nested at most ``MAX_NESTING`` levels, else None.

    The slice is decoded as each point is (plain JSON, no type), so it decodes exactly when
    each point does, and as an array it nests one level deeper than its deepest point: its
    depth is counted before it is decoded, as a point's is. A slice holding one brace per point
    and no bracket but its own is counted only if one of its elements is not an object: were
    they all objects, none holds another object or an array (two levels).
    """
    view = memoryview(raw_array)
    at = 1
    for first in range(0, len(elements), _SLICE_POINTS):
        part = elements[first : first + _SLICE_POINTS]
        size = sum(map(len, part)) + len(part) - 1
        text = b"".join((b"[", view[at : at + size], b"]"))
        at += size + 1
        flat = text.count(b"{") == len(part) and text.count(b"[") == 1
        if not flat and nesting(text) > MAX_NESTING + 1:
            yield None
            continue
        try:
            values = _decoder.decode(text)
        except (msgspec.DecodeError, RecursionError):
            yield None
            continue
        if flat and not set(map(type, values)) <= {dict} and nesting(text) > MAX_NESTING + 1:
            yield None
            continue
        yield values


@attrs.define
class _Reading:
    """A series being read: what :class:`Series` holds, and the starts that give its spacing."""

    spacing: bool
    sources: list[_Source] = attrs.Factory(list)
    starts: array[int] = attrs.Factory(lambda: array("q"))
    ends: dict[int, int] = attrs.Factory(dict)
    rejected: array[int] = attrs.Factory(lambda: array("q"))
    rejections: Counter[str] = attrs.Factory(Counter)
    # The starts that give the spacing; None while they are all the starts read so far (every
    # point stamped by ``date`` alone), so that the app's shape costs no second array.
    stamps: array[int] | None = None

    def decoded(self, elements: Sequence[msgspec.Raw | bytes], values: list[Any]) -> None:
        """Read points already decoded, each from a compact element no deeper than points may
        nest. The app's own shape (an object stamped by ``date`` alone, in a form
        ``instant_of`` reads) is read here at once; any other value as :meth:`point` reads
        it once decoded."""
        starts = self.starts
        for element, value in zip(elements, values, strict=True):
            if type(value) is dict and _OTHER_STAMPS.isdisjoint(value):
                date = value.get("date")
                if type(date) is str:
                    try:
                        start = instant_of(date)
                    except TimestampError:
                        pass
                    else:
                        starts.append(start)
                        if self.stamps is not None:
                            self.stamps.append(start)
                        continue
            self.value(value, element)

    def point(self, element: msgspec.Raw | bytes, original: msgspec.Raw | bytes) -> None:
        """Read one point, decoding it whole; ``original`` is the element as it came."""
        try:
            if not element:
                raise PointError("point is not valid JSON")
            if nesting(bytes(element)) > MAX_NESTING:
                raise PointError(f"point nested deeper than {MAX_NESTING} levels")
            value = point_object(element)
        except PointError as exc:
            self._reject(str(exc), original)
            return
        self.value(value, original)

    def value(self, value: Any, original: msgspec.Raw | bytes) -> None:
        """Read one point from its decoded value; ``original`` is its element as it came."""
        if type(value) is not dict:
            # As point_object rejects it; nor does a value that is not an object bring a
            # start to the spacing (``layers.spacing_start`` reads objects only).
            self._reject(f"point is a JSON {type(value).__name__}, not an object", None)
            return
        try:
            start, end = coordinates(value)
        except PointError as exc:
            self._reject(str(exc), original)
            return
        if self.spacing and self.stamps is None:
            self.stamps = array("q", self.starts)
        if end != start:
            self.ends[len(self.starts)] = end
        self.starts.append(start)
        if self.stamps is not None and ("start" in value or "startDate" not in value):
            self.stamps.append(start)

    def _reject(self, reason: str, original: msgspec.Raw | bytes | None) -> None:
        """Reject the next point; ``original`` (its element as it came) may still bring a
        start to the spacing."""
        if self.spacing and self.stamps is None:
            self.stamps = array("q", self.starts)
        self.rejected.append(len(self.starts))
        self.rejections[reason] += 1
        self.starts.append(0)
        if self.stamps is not None and original is not None:
            stamp = layers.spacing_start(original)
            if stamp is not None:
                self.stamps.append(stamp)

    def series(self) -> Series:
        stamps = self.starts if self.stamps is None else self.stamps
        gap = layers.smallest_spacing(stamps) if self.spacing else None
        return Series(self.sources, self.starts, self.ends, self.rejected, self.rejections, gap)


def _compacted(
    raw_array: msgspec.Raw,
) -> tuple[_Source, list[msgspec.Raw] | list[bytes], list[msgspec.Raw] | None]:
    """The array as kept, its compact elements, and its original elements if compacted here.

    An array that is compact already (what the app sends) is kept as it is, not copied;
    any other has its points compacted one by one.
    """
    originals = msgspec.json.decode(raw_array, type=list[msgspec.Raw])
    if _is_compact(raw_array, originals):
        return raw_array, originals, None
    singles = [_compact(original) for original in originals]
    return singles, singles, originals


def _is_compact(raw_array: msgspec.Raw, elements: list[msgspec.Raw]) -> bool:
    """Whether the array has no whitespace between its tokens, checked a slice at a time.

    Elements one byte apart are separated by their commas alone; each slice of them, as an
    array, is then compared with its compaction, so no copy of the whole array is made.
    """
    lengths = list(map(len, elements))
    if sum(lengths) + len(lengths) + 1 != len(raw_array):
        return not lengths and len(raw_array) == 2
    view = memoryview(raw_array)
    at = 1
    for first in range(0, len(lengths), _SLICE_POINTS):
        part = lengths[first : first + _SLICE_POINTS]
        size = sum(part) + len(part) - 1
        text = b"".join((b"[", view[at : at + size], b"]"))
        if msgspec.json.format(text, indent=-1) != text:
            return False
        at += size + 1
    return True


_SLICE_POINTS = 2048


def _compact(raw: msgspec.Raw) -> bytes:
    try:
        return msgspec.json.format(raw, indent=-1)
    except (msgspec.DecodeError, RecursionError):
        return b""
