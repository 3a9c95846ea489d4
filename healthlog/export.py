"""The export line formats (``healthlog export``, ``GET /v1/points``), from hourly objects.

Points come out sorted by metric, layer, start and end, each embedded verbatim.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator

import orjson

from healthlog import objects
from healthlog.objects import HourlyObject
from healthlog.timestamps import format_instant

FORMATS = ("jsonl", "csv")
CSV_HEADER = b"metric,layer,start,end,units,point\r\n"
# How many bytes of lines `healthlog export` writes at a time (:func:`chunked`).
CHUNK_BYTES = 64 * 1024
# What mends an object whose body does not decode, said with it: a data directory's rebuilds
# from the journal; a follow replica has no journal, and `verify` or `reindex` run on it only
# say there is no healthlog data there (CLI-178).
STORE_REMEDY = "`healthlog verify` lists such objects, `healthlog reindex` rebuilds them"
REPLICA_REMEDY = (
    "the replica's copy of it: `healthlog follow` into an empty directory copies every object again"
)


def export_lines(
    stored: Iterable[HourlyObject],
    *,
    start_from: int | None = None,
    start_to: int | None = None,
    fmt: str = "jsonl",
    remedy: str = STORE_REMEDY,
) -> Iterator[bytes]:
    """Lines for every point whose start lies in ``[start_from, start_to)``."""
    yield from header(fmt)
    for obj in stored:
        yield from object_lines(
            obj, start_from=start_from, start_to=start_to, fmt=fmt, remedy=remedy
        )


def chunked(lines: Iterable[bytes], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``lines`` joined into chunks of at least ``size`` bytes (the last one shorter), each for
    one write: with ``PYTHONUNBUFFERED=1`` (as many container images set it) stdout writes
    each line it is given at once, one system call a line: 1.2 million for a year of
    minute-level data, and a quarter's export took 4.6 s instead of 2.6 s (CLI-205). The
    lines before an object whose body does not decode are given before its error, as they
    were written before it line by line."""
    chunk: list[bytes] = []
    gathered = 0
    try:
        for line in lines:
            chunk.append(line)
            gathered += len(line)
            if gathered >= size:
                yield b"".join(chunk)
                chunk, gathered = [], 0
    except objects.ObjectCorrupt:
        if chunk:
            yield b"".join(chunk)
        raise
    if chunk:
        yield b"".join(chunk)


def header(fmt: str) -> Iterator[bytes]:
    """What comes before the first point: the CSV header line, nothing for JSON lines."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    if fmt == "csv":
        yield CSV_HEADER


def object_lines(
    obj: HourlyObject,
    *,
    start_from: int | None,
    start_to: int | None,
    fmt: str,
    remedy: str = STORE_REMEDY,
) -> Iterator[bytes]:
    """The lines of one object's points in the window, sorted by start and end; a body that
    does not decode raises :class:`objects.ObjectCorrupt` naming the object and ``remedy``."""
    line = _jsonl if fmt == "jsonl" else _csv
    try:
        points = objects.entries(obj.body)
    except objects.ObjectCorrupt as exc:
        key = obj.key
        where = f"{key.metric} {key.layer} {format_instant(key.hour)}"
        raise objects.ObjectCorrupt(f"{exc} ({where}); {remedy}") from None
    for start, end, raw in points:
        if start_from is not None and start < start_from:
            continue
        if start_to is not None and start >= start_to:
            continue
        yield line(obj, start, end, raw)


def _jsonl(obj: HourlyObject, start: int, end: int, raw: bytes) -> bytes:
    return b"".join(
        (
            b'{"metric":',
            orjson.dumps(obj.key.metric),
            b',"layer":',
            orjson.dumps(obj.key.layer),
            b',"start":"',
            format_instant(start).encode(),
            b'","end":"',
            format_instant(end).encode(),
            b'","units":',
            orjson.dumps(obj.units),
            b',"point":',
            raw,
            b"}\n",
        )
    )


def _csv(obj: HourlyObject, start: int, end: int, raw: bytes) -> bytes:
    out = io.StringIO()
    csv.writer(out).writerow(
        [
            obj.key.metric,
            obj.key.layer,
            format_instant(start),
            format_instant(end),
            obj.units or "",
            raw.decode(),
        ]
    )
    return out.getvalue().encode()
