"""The content digest of a delivery with an idempotency key (I1).

Two bodies have the same content when they are the same bytes, or the same JSON once decoded
and encoded again with sorted keys and no whitespace (the app does not keep key order): the
digest is the sha256 of that canonical text, or the raw sha256 of a body that is not JSON, that
cannot be canonicalised (integers beyond 64 bits, nesting deeper than 254 levels), or that is
larger than ``CANONICAL_MAX_BYTES``: decoding a body whole takes about six times its size in
memory (an array of tiny values more), and no way was found to canonicalise in bounded memory
with the libraries at hand (splitting a body into its members costs a Python object per member,
which an array of tiny values turns into thirty times the body).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec
import orjson

CANONICAL_MAX_BYTES = 8 * 2**20


def content_digest(length: int, read: Callable[[], bytes], raw_sha256: bytes) -> bytes:
    """sha256 of the canonical JSON text of the body of ``length`` bytes that ``read`` returns
    (called only when it is to be canonicalised), or ``raw_sha256`` when it has none."""
    if length > CANONICAL_MAX_BYTES:
        return raw_sha256
    try:
        canonical = orjson.dumps(msgspec.json.decode(read()), option=orjson.OPT_SORT_KEYS)
    except (msgspec.DecodeError, orjson.JSONEncodeError, RecursionError):
        return raw_sha256
    return hashlib.sha256(canonical).digest()
