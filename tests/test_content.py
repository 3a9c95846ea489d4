"""The content digest of a body with an idempotency key, a piece at a time (specs/journal.md,
JOURNAL-31): always the digest of the whole body's canonical text, in bounded memory."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import orjson
from fixtures import shuffled
from hypothesis import given, settings
from hypothesis import strategies as st

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


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab,:[]{}"\\é😀 \n'), max_size=12)
)
_KEYS = st.text(alphabet=st.sampled_from('ab,:[]{}"\\é😀'), max_size=4)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_KEYS, inner, max_size=6),
    max_leaves=40,
)


def render(value: Any, rng: random.Random) -> bytes:
    """``value`` as JSON, its keys shuffled, compact or indented; integers beyond 64 bits too."""
    indent = rng.choice((None, 1, "\t"))
    return json.dumps(shuffled(value, rng), indent=indent, ensure_ascii=rng.random() < 0.5).encode()


def mutate(body: bytes, rng: random.Random) -> bytes:
    """``body`` with one byte changed, removed or doubled, or cut short."""
    at = rng.randrange(len(body))
    edit = rng.choice((b"", b",", b"]", b"}", b'"', b"\xff", b"\\", body[at : at + 1] * 2))
    if rng.random() < 0.2:
        return body[:at]
    return body[:at] + edit + body[at + 1 :]


@settings(max_examples=400)
@given(_VALUES, st.randoms(use_true_random=False), st.booleans())
def test_every_piece_size_gives_the_whole_digest_journal_31(
    value: Any, rng: random.Random, damaged: bool
) -> None:
    """JOURNAL-31: whatever the window (so wherever the pieces fall, down to a few bytes), the
    digest of a body, valid or damaged, is that of the whole body's canonical text, or the raw
    one when the whole body has none."""
    body = render(value, rng)
    if damaged:
        body = mutate(body, rng)
    expected = whole(body)
    for window in (8, 24, 100, 4096):
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
    ]
    for text in bodies:
        body = text.encode(errors="surrogateescape")
        expected = whole(body)
        for window in (8, 30, 100, 2**20):
            assert content_digest(body, RAW, window=window) == expected, (text[:40], window)
    assert [whole(text.encode(errors="surrogateescape")) == RAW for text in bodies] == [
        False,
        *[True] * (len(bodies) - 1),
    ]


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
from healthlog.content import content_digest
with open(sys.argv[1], "rb") as f:
    body = f.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
digest = content_digest(body, b"raw")
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(digest.hex(), grown * 1024)
"""


def test_memory_stays_bounded_for_tiny_values_journal_31(tmp_path: Path) -> None:
    """JOURNAL-31: a 32 MiB array of tiny values, or of empty objects (thirty times its size if
    decoded whole), is canonicalised within 64 MiB beyond the body, in a process of its own."""
    for element in (b"1", b"{}"):
        count = 32 * 2**20 // (len(element) + 3)
        body = b"[ " + b" , ".join([element] * count) + b" ]"
        path = tmp_path / "body.json"
        path.write_bytes(body)
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(path)],
            capture_output=True,
            check=True,
            text=True,
            timeout=120,
        )
        digest, grown = done.stdout.split()
        assert bytes.fromhex(digest) == hashlib.sha256(body.replace(b" ", b"")).digest()
        assert int(grown) < 64 * 2**20, (element, int(grown))
    assert len(body) > 30 * WINDOW_BYTES
