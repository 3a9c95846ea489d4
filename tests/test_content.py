"""The content digest of a body with an idempotency key, a piece at a time (specs/journal.md,
JOURNAL-31): always the digest of the whole body's canonical text, in bounded memory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

import healthlog
from healthlog.content import WINDOW_BYTES, content_digest
from healthlog.workload import big_body, encode

RAW = b"raw digest"


def whole(body: bytes) -> bytes:
    """The digest by the definition: the whole body decoded, encoded with sorted keys."""
    try:
        canonical = orjson.dumps(msgspec.json.decode(body), option=orjson.OPT_SORT_KEYS)
    except (msgspec.DecodeError, orjson.JSONEncodeError, RecursionError):
        return RAW
    return hashlib.sha256(canonical).digest()


def scalar(rng: random.Random) -> bytes:
    """A scalar as JSON text: numbers up to 400 digits, strings with escapes of every kind
    (surrogate pairs included) and of any length, written raw or ASCII-escaped."""
    text = rng.choice(
        ('a,b]}"', "é😀" * rng.randint(0, 30), "[{", "x" * rng.randint(0, 300), "\\" * 3 + "\n\x01")
    )
    return rng.choice(
        (
            b"1",
            b"-0.0",
            b"2.5e-7",
            b"1E5",
            b"10000000000000000000",
            b"9" * rng.choice((20, 309, 400)),
            b"true",
            b"null",
            json.dumps(text, ensure_ascii=rng.random() < 0.5).encode(),
        )
    )


def document(rng: random.Random, depth: int = 0) -> bytes:
    """A JSON text with whitespace anywhere between tokens, keys repeated (the earlier value
    of a repeated key is dropped by a decoding, but must be JSON), and nesting."""

    def space() -> bytes:
        return rng.choice((b"", b" ", b"\n  ", b"\t")) if rng.random() < 0.3 else b""

    roll = rng.random()
    if depth > 5 or roll < 0.35:
        return scalar(rng)
    if roll < 0.65:
        items = [document(rng, depth + 1) for _ in range(rng.randint(0, 7))]
        inner = (space() + b"," + space()).join(items)
        return b"[" + space() + inner + space() + b"]"
    members: list[bytes] = []
    for _ in range(rng.randint(0, 6)):
        name = json.dumps(rng.choice(("a", "b", "é", 'c"d', "[", "😀", "z" * rng.randint(1, 5))))
        key = name if rng.random() < 0.5 else name.replace("a", "\\u0061")
        members.append(key.encode() + space() + b":" + space() + document(rng, depth + 1))
    if members and rng.random() < 0.3:
        members.append(members[0].split(b":", 1)[0] + b":" + document(rng, depth + 1))
    rng.shuffle(members)
    return b"{" + space() + b",".join(members) + space() + b"}"


def mutate(body: bytes, rng: random.Random) -> bytes:
    """``body`` with one byte changed, removed or doubled, or cut short."""
    at = rng.randrange(len(body))
    edit = rng.choice((b"", b",", b"]", b"}", b'"', b"\xff", b"\\", body[at : at + 1] * 2))
    if rng.random() < 0.2:
        return body[:at]
    return body[:at] + edit + body[at + 1 :]


@settings(max_examples=500)
@given(st.randoms(use_true_random=False), st.booleans())
def test_every_piece_size_gives_the_whole_digest_journal_31(
    rng: random.Random, damaged: bool
) -> None:
    """JOURNAL-31: whatever the window (so wherever the pieces fall, down to a few bytes), the
    digest of a body, valid or damaged, is that of the whole body's canonical text, or the raw
    one when the whole body has none."""
    body = document(rng)
    if damaged:
        body = mutate(body, rng)
    expected = whole(body)
    for window in (16, 40, 128, 1024):
        assert content_digest(body, RAW, window=window) == expected, window


def test_duplicate_keys_and_edges_journal_31() -> None:
    """JOURNAL-31: a later duplicate key wins, as in a whole decoding, but the earlier value must
    still be JSON; integers beyond 64 bits, a byte order mark, trailing content, a missing colon
    and an empty body have no canonical text."""
    long = '"' + "x" * 50 + '"'
    bodies = [
        f'{{"a": [{long}, {long}], "b": 1, "a": {{"z": {long}, "y": 2}}}}',
        f'{{"a": [{long}, "\udcff"], "a": 1, "b": {long}}}',
        f'{{"a": [{long}, 1e999], "a": 1, "b": {long}}}',
        f'[{long}, {{"n": 18446744073709551616}}, {long}]',
        f"\ufeff[{long}, {long}]",
        f"[{long}, {long}] x",
        f"[{long}, {long}],",
        f"[{long}, {long},]",
        f'{{"a": {long}, "b" {long}}}',
        "   ",
        f'{{"pad": {long}, "a": [{"9" * 309}], "a": 1}}',
        json.dumps(["😀é\\" * 40, "x" * 500], ensure_ascii=True),
        '{"\\u0061": ' + json.dumps(["😀" * 100]) + ', "a": 1, "\\u0061": [2]}',
        "[" + "1," * 20 + "true" + " " * 40 + "]",
        '{"a":null' + "\t" * 30 + ', "b": 1}',
        "false" + "\n" * 40,
    ]
    for text in bodies:
        body = text.encode(errors="surrogateescape")
        expected = whole(body)
        for window in (8, 30, 100, 2**20):
            assert content_digest(body, RAW, window=window) == expected, (text[:40], window)
    assert [whole(text.encode(errors="surrogateescape")) == RAW for text in bodies] == [
        False,
        *[True] * 9,
        *[False] * 6,
    ]
    # Orjson's decoder, once the judge of where a value ends, failed inside 156 levels of
    # nesting (40 of them larger than the window here, fewer than MAX_LARGE_DEPTH).
    deep = b"[" * 189 + b"{}" + b"]" * 189
    assert content_digest(deep, RAW, window=300) == whole(deep) != RAW


def test_nesting_past_254_levels_journal_31() -> None:
    """JOURNAL-31: 254 levels of nesting are canonicalised and 255 are not, counted across the
    pieces: 60 levels larger than the window around a piece that fits it."""
    pad = '"' + "p" * 600 + '"'
    for inner, canonical in ((194, True), (195, False)):
        text = "[" * inner + "1" + "]" * inner
        for _ in range(60):
            text = f"[{pad}, {text}]"
        body = text.encode()
        assert (whole(body) != RAW) is canonical
        assert content_digest(body, RAW, window=512) == whole(body)


def test_bodies_no_app_sends_fall_back_to_their_raw_bytes_at_the_limits_journal_33() -> None:
    """JOURNAL-33: an object larger than the window with 4,096 members, and values larger than
    the window nested 64 deep, are canonicalised; one member more, or one level more, and the
    digest is the raw one, though the whole body has a canonical text."""

    def members(count: int) -> bytes:
        return ("{" + ",".join(f'"k{n:05d}": {n}' for n in range(count)) + "}").encode()

    def nested(levels: int) -> bytes:
        text = "1"
        for _ in range(levels):
            text = f'["{"p" * 100}", {text}]'
        return text.encode()

    for body, canonical in (
        (members(4096), True),
        (members(4097), False),
        (nested(64), True),
        (nested(65), False),
    ):
        assert whole(body) != RAW
        assert content_digest(body, RAW, window=64) == (whole(body) if canonical else RAW)


def test_an_app_body_in_another_key_order_journal_31() -> None:
    """JOURNAL-31: a minute-level body of several MiB and the same body in another key order
    have one digest, computed a 64 KiB piece at a time, that of the whole body."""
    body = big_body(31, target_bytes=3 * 2**20)
    reordered = encode(orjson.loads(body), 310)
    assert reordered != body
    digest = content_digest(body, RAW, window=2**16)
    assert digest == content_digest(reordered, RAW, window=2**16) == whole(body) != RAW


_MEASURE = """
import resource, sys
import healthlog
from healthlog.content import content_digest
with open(sys.argv[1], "rb") as f:
    body = f.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
digest = content_digest(body, b"raw")
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(digest.hex(), grown * 1024)
"""


def test_memory_stays_bounded_journal_31(tmp_path: Path) -> None:
    """JOURNAL-31: 32 MiB arrays of tiny values or of empty objects (thirty times their size if
    decoded whole), a 28 MiB string (held by the old reading's regular expression at 120 bytes
    a byte) and a body ending in whitespace are canonicalised
    within 64 MiB beyond the body, in a process of its own that imports this checkout."""
    string = "é😀x" * (4 * 2**20)
    tiny = b"[" + b",".join([b"1"] * (8 * 2**20)) + b"]"
    empty = b"[" + b",".join([b"{}"] * (7 * 2**20)) + b"]"
    # Each body, and its canonical text (built without decoding it whole).
    bodies = {
        "tiny values": (tiny.replace(b",", b" , "), tiny),
        "empty objects": (empty.replace(b",", b" , "), empty),
        "a long string": (
            json.dumps([1, string], ensure_ascii=False).encode(),
            orjson.dumps([1, string]),
        ),
        "trailing whitespace": (tiny + b"\n" * 2**20, tiny),
    }
    checkout = Path(healthlog.__file__).parents[1]
    for name, (body, canonical) in bodies.items():
        assert len(body) > 16 * WINDOW_BYTES
        path = tmp_path / "body.json"
        path.write_bytes(body)
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(path)],
            capture_output=True,
            check=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(checkout)},
        )
        digest, grown = done.stdout.split()
        assert bytes.fromhex(digest) == hashlib.sha256(canonical).digest(), name
        assert int(grown) < 64 * 2**20, (name, int(grown))
