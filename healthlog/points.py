"""Points: coordinates, canonical form and completeness (S1, S4, S5).

A point is one element of a metric's ``data`` array or one section record. It is kept
verbatim (``raw``: the compact JSON bytes as they arrived) and compared by its canonical
form, which is what collisions are decided on, never the raw bytes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import msgspec
import orjson

from healthlog.timestamps import TimestampError, parse_instant

TIMESTAMP_KEYS = frozenset({"date", "start", "end", "startDate", "endDate"})
START_KEYS = ("start", "startDate", "date")
END_KEYS = ("end", "endDate")

_decoder = msgspec.json.Decoder()


class PointError(ValueError):
    """A point that cannot be folded; the message never carries a value."""


class Point(NamedTuple):
    """One point of one delivery, ready to merge."""

    start: int
    end: int
    canonical: bytes
    completeness: int
    raw: bytes


def instant_of(value: object) -> int:
    """``parse_instant``, fast for the app's own shape ``yyyy-MM-dd HH:mm:ss ±hhmm``.

    The metrics of one delivery share their timestamps, so recent strings are remembered;
    and since minute-level bodies bring a new timestamp on almost every point, the instant
    of the hour (date, hour and offset) is cached too and the minutes and seconds are added.
    Anything else goes through ``parse_instant`` unchanged.
    """
    if type(value) is not str:
        return parse_instant(value)
    known = _recent.get(value)
    if known is not None:
        return known
    instant = _app_shape(value)
    if instant is None:
        instant = parse_instant(value)
    if len(_recent) >= _RECENT_LIMIT:
        _recent.clear()
    _recent[value] = instant
    return instant


def _app_shape(value: str) -> int | None:
    if len(value) != _APP_SHAPE_LENGTH or value[13] != ":" or value[16] != ":":
        return None
    minutes, seconds = value[14:16], value[17:19]
    if not (minutes.isascii() and minutes.isdigit() and seconds.isascii() and seconds.isdigit()):
        return None
    if int(minutes) >= 60 or int(seconds) >= 60:
        return None
    hour = _hour_instant(value[:13] + ":00:00" + value[19:])
    return hour + (int(minutes) * 60 + int(seconds)) * 1_000_000


_recent: dict[str, int] = {}
_RECENT_LIMIT = 1 << 16
_APP_SHAPE_LENGTH = len("2024-02-06 07:00:00 -0800")
_hour_instant = functools.lru_cache(maxsize=1 << 12)(parse_instant)


def coordinates(value: dict[str, Any]) -> tuple[int, int]:
    """Start and end of a point (P3): the first start key present decides, no fallback."""
    for key in START_KEYS:
        if key in value:
            try:
                start = instant_of(value[key])
            except TimestampError as exc:
                raise PointError(f"unparseable {key}: {exc}") from None
            break
    else:
        raise PointError("no start, startDate or date")
    end = start
    for key in END_KEYS:
        if key in value:
            try:
                end = instant_of(value[key])
            except TimestampError as exc:
                raise PointError(f"unparseable {key}: {exc}") from None
            break
    if end < start:
        raise PointError("end before start")
    return start, end


def decode_point(raw: bytes) -> Point:
    """Decode one verbatim point into its coordinates, canonical form and completeness."""
    try:
        value = _decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise PointError("point is not valid JSON") from None
    if type(value) is not dict:
        raise PointError(f"point is a JSON {type(value).__name__}, not an object")
    start, end = coordinates(value)
    normal = _normalise_object(value)
    return Point(start, end, _encode(normal), len(normal), raw)


def is_empty(value: object) -> bool:
    """Empty in the sense of S4: null, "", [] or {}."""
    return value is None or (isinstance(value, str | list | dict) and len(value) == 0)


def completeness(value: dict[str, Any]) -> int:
    """Number of significant fields: those left in the canonical form."""
    return len(_normalise_object(value))


def canonical_form(value: dict[str, Any]) -> bytes:
    """The canonical bytes of a point (S4).

    Keys sorted, empty values left out, numbers as ``%.12g`` doubles (integers beyond that
    precision keep their digits), timestamp fields as their UTC instant in microseconds,
    compact UTF-8 JSON.
    """
    return _encode(_normalise_object(value))


def _encode(normal: dict[str, object]) -> bytes:
    try:
        encoded = orjson.dumps(normal, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return _encode_slow(normal)
    # orjson may hand back a buffer of several KiB for a short result; a point keeps its
    # canonical form for the whole fold, so keep a right-sized copy.
    return bytes(memoryview(encoded))


_TWELVE_DIGITS = 10**12


def _number(value: int | float) -> int | float:
    if type(value) is int and abs(value) >= _TWELVE_DIGITS:
        return value
    rounded = float(f"{value:.12g}")
    if rounded.is_integer() and abs(rounded) < _TWELVE_DIGITS:
        return int(rounded)
    return rounded


def _normalise_object(value: dict[str, Any]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, item in value.items():
        kind = type(item)
        if kind is str:
            if not item:
                continue
            if key in TIMESTAMP_KEYS:
                try:
                    out[key] = instant_of(item)
                except TimestampError:
                    out[key] = item
            else:
                out[key] = item
        elif kind is float or kind is int:
            out[key] = _number(item)
        elif kind is bool:
            out[key] = item
        elif kind is dict:
            nested = _normalise_object(item)
            if nested:
                out[key] = nested
        elif kind is list:
            items = [_normalise_item(i) for i in item]
            if items:
                out[key] = items
    return out


def _normalise_item(item: object) -> object:
    if isinstance(item, bool) or item is None or isinstance(item, str):
        return item
    if isinstance(item, int | float):
        return _number(item)
    if isinstance(item, dict):
        return _normalise_object(item)
    if isinstance(item, list):
        return [_normalise_item(i) for i in item]
    return item


def _encode_slow(value: object) -> bytes:
    """Canonical encoding for what orjson refuses: integers beyond 64 bits."""
    if isinstance(value, dict):
        items = sorted(value.items())
        return b"{" + b",".join(orjson.dumps(k) + b":" + _encode_slow(v) for k, v in items) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_encode_slow(v) for v in value) + b"]"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    return orjson.dumps(value)
