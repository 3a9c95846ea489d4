"""Hourly objects (S2, S3, S6 to S9): one per metric, layer and UTC hour of the point start.

The body is gzip of one line per point, sorted by time: ``start<TAB>end<TAB>point``, where
start and end are microseconds since the epoch and the point is its verbatim compact JSON
(which holds no raw tab or newline). The hash covers the units and the uncompressed body,
so two objects with the same hash hold the same points byte for byte.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import zlib
from operator import itemgetter
from typing import Any

import attrs

from healthlog.points import Coordinates, named_at

GZIP_LEVEL = 6


class ObjectCorrupt(ValueError):
    """A stored object body that cannot be decoded."""


@attrs.frozen
class ObjectKey:
    """Where an hourly object lives."""

    metric: str
    layer: str
    hour: int


@attrs.frozen
class HourlyObject:
    """An encoded hourly object, as stored."""

    key: ObjectKey
    units: str | None
    body: bytes
    hash: bytes
    first: int
    last: int
    count: int
    created_by: int
    sealed: bool = False


def encode(
    key: ObjectKey,
    units: str | None,
    points: dict[Coordinates, bytes],
    created_by: int,
    sealed: bool = False,
    *,
    compressed: bool = True,
) -> HourlyObject:
    """Encode points into an object body, sorted by (start, end); with ``compressed`` off the
    body is left plain (a partitioned rebuild's scratch files, see :func:`compress`)."""
    ordered = sorted(points.items())
    plain = b"".join([b"%d\t%d\t%s\n" % (at[0], at[1], raw) for at, raw in ordered])
    return HourlyObject(
        key=key,
        units=units,
        body=compress(plain) if compressed else plain,
        hash=content_hash(units, plain),
        first=ordered[0][0][0],
        last=max(map(itemgetter(1), points)),
        count=len(ordered),
        created_by=created_by,
        sealed=sealed,
    )


def content_hash(units: str | None, plain: bytes) -> bytes:
    """sha256 over the units and the uncompressed body."""
    digest = hashlib.sha256()
    digest.update((units or "").encode())
    digest.update(b"\0")
    digest.update(plain)
    return digest.digest()


def compress(plain: bytes) -> bytes:
    """The stored body of a plain one."""
    return gzip.compress(plain, compresslevel=GZIP_LEVEL, mtime=0)


def decompress(body: bytes) -> bytes:
    """The plain bytes of a stored body; :class:`ObjectCorrupt` if it does not decompress."""
    try:
        return gzip.decompress(body)
    except (OSError, EOFError, zlib.error) as exc:
        raise ObjectCorrupt(f"object body cannot be decoded: {type(exc).__name__}") from None


def holds(body: bytes, plain: bytes) -> bool:
    """Whether a stored body decompresses to exactly ``plain``, so that it can be kept instead
    of compressing ``plain`` again."""
    try:
        return decompress(body) == plain
    except ObjectCorrupt:
        return False


def decode(
    body: bytes, *, compressed: bool = True, named: str | None = None
) -> dict[Coordinates, bytes]:
    """Points of an object body keyed by coordinates (a plain one with ``compressed`` off),
    each with the string under ``named`` where it has one (``points.named_at``)."""
    points: dict[Coordinates, bytes] = {}
    lines = _lines(body, compressed)
    try:
        for line in lines:
            start, end, raw = line.split(b"\t", 2)
            if named is None:
                points[(int(start), int(end))] = raw
            else:
                points[named_at(int(start), int(end), raw, named)] = raw
    except ValueError as exc:
        raise ObjectCorrupt(f"object body cannot be decoded: {type(exc).__name__}") from None
    return points


def entries(body: bytes) -> list[tuple[int, int, bytes]]:
    """The points of a stored object body as they are stored, in order: start, end and bytes."""
    lines = _lines(body, True)
    try:
        return [
            (int(start), int(end), raw)
            for start, end, raw in (line.split(b"\t", 2) for line in lines)
        ]
    except ValueError as exc:
        raise ObjectCorrupt(f"object body cannot be decoded: {type(exc).__name__}") from None


def _lines(body: bytes, compressed: bool) -> list[bytes]:
    plain = decompress(body) if compressed else body
    lines = plain.split(b"\n")[:-1]
    if not lines:
        raise ObjectCorrupt("object body holds no point")
    return lines


def to_wire(obj: HourlyObject) -> dict[str, Any]:
    """An object's state as JSON-ready data (stream frames, snapshot lines)."""
    return {
        "units": obj.units,
        "hash": obj.hash.hex(),
        "first": obj.first,
        "last": obj.last,
        "points": obj.count,
        "created_by": obj.created_by,
        "sealed": obj.sealed,
        "body": base64.b64encode(obj.body).decode(),
    }


_WIRE_INTEGERS = ("first", "last", "points", "created_by")
WIRE_INTEGER_RANGE = range(-(2**63), 2**63)
"""The integers an object holds are SQLite's: a JSON decoder reads up to 2**64 - 1 as an
integer, which a replica could not write (STREAM-200)."""


def from_wire(key: ObjectKey, state: dict[str, Any]) -> HourlyObject:
    """The inverse of :func:`to_wire`; raises KeyError, ValueError or TypeError when malformed
    (a field missing, or not of its type or range)."""
    if (
        not (state["units"] is None or type(state["units"]) is str)
        or type(state["hash"]) is not str
        or type(state["body"]) is not str
        or type(state["sealed"]) is not bool
        or any(type(state[name]) is not int for name in _WIRE_INTEGERS)
    ):
        raise TypeError("an object state whose fields are not of their types")
    if any(state[name] not in WIRE_INTEGER_RANGE for name in _WIRE_INTEGERS):
        raise ValueError("an object state whose numbers are past SQLite's integers")
    return HourlyObject(
        key=key,
        units=state["units"],
        body=base64.b64decode(state["body"]),
        hash=bytes.fromhex(state["hash"]),
        first=state["first"],
        last=state["last"],
        count=state["points"],
        created_by=state["created_by"],
        sealed=state["sealed"],
    )
