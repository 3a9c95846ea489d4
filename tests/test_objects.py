"""Hourly objects: encoding, hash, corruption (specs/merge.md, MERGE-15 to MERGE-17)."""

from __future__ import annotations

import gzip
import random
import re

import pytest

from healthlog import objects
from healthlog.objects import ObjectCorrupt, ObjectKey

HOUR = 1_707_231_600_000_000
MINUTE = 60_000_000
KEY = ObjectKey("heart_rate", "minutes", HOUR)


def minute_points(count: int) -> dict[tuple[int, int], bytes]:
    return {
        (HOUR + m * MINUTE, HOUR + m * MINUTE): b'{"date":"m%d","Avg":%d.5,"note":"a&<>"}' % (m, m)
        for m in range(count)
    }


def shuffled(points: dict[tuple[int, int], bytes], seed: int) -> dict[tuple[int, int], bytes]:
    items = list(points.items())
    random.Random(seed).shuffle(items)
    return dict(items)


def test_body_is_gzip_of_sorted_lines() -> None:
    """MERGE-15: the body is gzip of `start TAB end TAB point` lines sorted by (start, end)."""
    points = {
        (HOUR + 5, HOUR + 9): b'{"b":1}',
        (HOUR, HOUR + 10): b'{"a":"x\xc3\xa9"}',
        (HOUR + 5, HOUR + 6): b'{"c":[1]}',
    }
    obj = objects.encode(KEY, "count", points, created_by=7)
    assert gzip.decompress(obj.body) == (
        b'%d\t%d\t{"a":"x\xc3\xa9"}\n%d\t%d\t{"c":[1]}\n%d\t%d\t{"b":1}\n'
        % (HOUR, HOUR + 10, HOUR + 5, HOUR + 6, HOUR + 5, HOUR + 9)
    )
    assert (obj.first, obj.last, obj.count, obj.created_by, obj.units, obj.sealed) == (
        HOUR,
        HOUR + 10,
        3,
        7,
        "count",
        False,
    )


def test_round_trip_and_metadata() -> None:
    """MERGE-15: decode gives the points back; first, last, count, created_by as given."""
    points = shuffled(minute_points(60), 1)
    points[(HOUR + 30 * MINUTE, HOUR + 95 * MINUTE)] = b'{"startDate":"s","endDate":"e"}'
    obj = objects.encode(KEY, "count/min", points, created_by=42, sealed=True)
    assert objects.decode(obj.body) == points
    assert list(objects.decode(obj.body)) == sorted(points)
    assert (obj.key, obj.units, obj.created_by, obj.sealed) == (KEY, "count/min", 42, True)
    assert obj.first == HOUR
    assert obj.last == HOUR + 95 * MINUTE
    assert obj.count == 61


def test_hash_follows_content_only() -> None:
    """MERGE-16: the hash changes iff the units or a point's bytes change."""
    points = minute_points(10)
    base = objects.encode(KEY, "count", points, created_by=1)
    same = objects.encode(KEY, "count", shuffled(points, 2), created_by=9, sealed=True)
    assert same.hash == base.hash
    assert same.body == base.body
    changed_point = {**points, (HOUR, HOUR): b'{"date":"m0","Avg":0.6,"note":"a&<>"}'}
    key_order = {**points, (HOUR, HOUR): b'{"Avg":0.5,"date":"m0","note":"a&<>"}'}
    one_more = {**points, (HOUR + 1, HOUR + 1): b"{}"}
    other_end = {**points}
    other_end[(HOUR, HOUR + 1)] = other_end.pop((HOUR, HOUR))
    variants = [
        objects.encode(KEY, "count", changed_point, created_by=1),
        objects.encode(KEY, "count", key_order, created_by=1),
        objects.encode(KEY, "count", one_more, created_by=1),
        objects.encode(KEY, "count", other_end, created_by=1),
        objects.encode(KEY, "steps", points, created_by=1),
        objects.encode(KEY, None, points, created_by=1),
    ]
    hashes = {base.hash, *(variant.hash for variant in variants)}
    assert len(hashes) == 1 + len(variants)


def test_encoding_is_deterministic() -> None:
    """MERGE-16: the same points always give the same body bytes (gzip without a timestamp)."""
    points = minute_points(30)
    bodies = {objects.encode(KEY, "count", shuffled(points, s), 1).body for s in range(5)}
    assert len(bodies) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"not gzip at all",
        gzip.compress(b"1\t2\t{}\n")[:-6],
        gzip.compress(b"1\t2\t{}\n")[:12] + b"\x00" * 20,
        gzip.compress(b"no tabs here\n"),
        gzip.compress(b"1\t2\n"),
        gzip.compress(b"one\t2\t{}\n"),
        gzip.compress(b"1\t2.5\t{}\n"),
    ],
    ids=[
        "not gzip",
        "truncated",
        "bad block type",
        "no tabs",
        "one tab",
        "start not a number",
        "end not an integer",
    ],
)
def test_corrupt_bodies(body: bytes) -> None:
    """MERGE-17: a body that cannot be decoded raises ObjectCorrupt, quoting nothing of it."""
    with pytest.raises(ObjectCorrupt) as caught:
        objects.decode(body)
    try:
        plain = gzip.decompress(body)
    except (OSError, EOFError):
        plain = body
    pieces = {piece for piece in re.split(rb"[\t\n]", plain) if piece}
    assert pieces
    for piece in pieces:
        assert piece.decode(errors="replace") not in str(caught.value)


def test_damaged_deflate_stream() -> None:
    """MERGE-17: a gzip header followed by a damaged deflate stream raises ObjectCorrupt."""
    body = gzip.compress(b"1\t2\t{}\n")[:10] + b"\xff" * 20
    with pytest.raises(ObjectCorrupt):
        objects.decode(body)


@pytest.mark.parametrize("body", [b"", gzip.compress(b"")], ids=["empty", "gzip of nothing"])
def test_empty_bodies(body: bytes) -> None:
    """MERGE-17: a body without a single point is corrupt (an object holds at least one)."""
    with pytest.raises(ObjectCorrupt):
        objects.decode(body)
