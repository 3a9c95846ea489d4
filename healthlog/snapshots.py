"""Signed snapshots of every object at a stream sequence (R4), and their validation.

A snapshot file is gzip of JSON lines: a header line ``{"schema", "instance", "stream",
"seq", "objects"}`` then one line per object with its body base64-encoded. Its manifest
names the file by URL and binds it with an Ed25519 signature over the schema, instance,
stream, sequence and the sha256 of the file. A client restores only after checking all of
them, and resumes strictly after the snapshot's sequence; one that saved the file checks it
(:func:`check`) and then reads its objects one at a time (:func:`read`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from healthlog.documents import Manifest, SnapshotHeader, converter, dumps
from healthlog.objects import WIRE_INTEGER_RANGE, HourlyObject, ObjectKey, from_wire, to_wire

SCHEMA = "healthlog.snapshot.v1"
# Sequences are SQLite integers handed out from 1: a manifest's is never outside this range.
MAX_SEQ = 2**63 - 1
_HEADER_DIFFERS = "snapshot header does not match its manifest"


class SnapshotError(ValueError):
    """A snapshot that must not be restored; the message says which check failed."""


def _signed_bytes(schema: str, instance: str, stream: str, seq: int, sha256: str) -> bytes:
    return orjson.dumps(
        {"instance": instance, "schema": schema, "seq": seq, "sha256": sha256, "stream": stream},
        option=orjson.OPT_SORT_KEYS,
    )


def public_key_text(key: Ed25519PrivateKey) -> str:
    """The public half, as the base64 of its 32 raw bytes."""
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def write(
    out: BinaryIO,
    objects: Iterable[HourlyObject],
    *,
    count: int,
    instance: str,
    stream: str,
    seq: int,
    tag: str | None = None,
) -> str:
    """Write the snapshot file of ``count`` objects at ``seq`` (whose event's tag is ``tag``)
    to ``out`` one line at a time; return the sha256 of the bytes written."""
    hashed = _Hashing(out)
    with gzip.GzipFile(fileobj=hashed, mode="wb", mtime=0) as file:
        file.write(dumps(SnapshotHeader(SCHEMA, instance, stream, seq, count, tag)) + b"\n")
        for o in objects:
            line = {"metric": o.key.metric, "layer": o.key.layer, "hour": o.key.hour, **to_wire(o)}
            file.write(orjson.dumps(line) + b"\n")
    return hashed.digest.hexdigest()


class _Hashing:
    """A writable file that hashes what it passes on to ``out``."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()


def sign(
    key: Ed25519PrivateKey, digest: str, *, url: str, instance: str, stream: str, seq: int
) -> Manifest:
    """The manifest of a snapshot file whose sha256 is ``digest``."""
    signature = key.sign(_signed_bytes(SCHEMA, instance, stream, seq, digest))
    return Manifest(
        url=url,
        seq=seq,
        sha256=digest,
        schema=SCHEMA,
        instance=instance,
        stream=stream,
        signature=base64.b64encode(signature).decode(),
    )


def check(
    manifest: Manifest,
    digest: str,
    *,
    public_key: str,
    instance: str,
    stream: str | None,
    after: int,
) -> None:
    """Check a snapshot file whose sha256 is ``digest`` before it is read with :func:`read`:
    schema, hash, sequence, signature, instance and stream binding, and that it is not older
    than the cursor ``after`` the client asked from. ``stream`` None accepts any stream (a
    replica that has not bound to one yet)."""
    if manifest.schema != SCHEMA:
        raise SnapshotError(f"unknown snapshot schema {manifest.schema!r}")
    if digest != manifest.sha256:
        raise SnapshotError("snapshot content does not match its sha256")
    if not 0 <= manifest.seq <= MAX_SEQ:
        raise SnapshotError("snapshot sequence is out of range")
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key))
        key.verify(
            base64.b64decode(manifest.signature),
            _signed_bytes(
                manifest.schema, manifest.instance, manifest.stream, manifest.seq, manifest.sha256
            ),
        )
    except (InvalidSignature, ValueError, orjson.JSONEncodeError):
        # A field that cannot be encoded (a lone surrogate) was never signed by anyone.
        raise SnapshotError("snapshot signature does not verify") from None
    if manifest.instance != instance:
        raise SnapshotError("snapshot belongs to another instance")
    if stream is not None and manifest.stream != stream:
        raise SnapshotError("snapshot belongs to another stream")
    if manifest.seq < after:
        raise SnapshotError("snapshot is older than the cursor")


def header_tag(file: BinaryIO) -> object:
    """The ``tag`` of the header of a snapshot file that passed :func:`check`, as written
    (None without one: a file of an older healthlog, or of a head event without a tag)."""
    try:
        with gzip.GzipFile(fileobj=file, mode="rb") as content:
            header = orjson.loads(content.readline())
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise SnapshotError(f"snapshot cannot be decoded: {type(exc).__name__}") from None
    return header.get("tag") if isinstance(header, dict) else None


def _key(metric: object, layer: object, hour: object) -> ObjectKey:
    """An object line's key; TypeError or ValueError when its fields are not a key's, which a
    replica would store as they came (an hour as text, under no hour a query finds) or could
    not store at all (STREAM-201)."""
    if type(metric) is not str or type(layer) is not str or type(hour) is not int:
        raise TypeError("an object key whose fields are not of their types")
    if hour not in WIRE_INTEGER_RANGE:
        raise ValueError("an object hour past SQLite's integers")
    return ObjectKey(metric, layer, hour)


def read(file: BinaryIO, manifest: Manifest) -> Iterator[HourlyObject]:
    """The objects of a snapshot file that passed :func:`check`, decompressed and decoded one
    line at a time as they are iterated.

    A header that does not match the manifest, a line that cannot be decoded, or more or fewer
    object lines than the header counts raise :class:`SnapshotError` when they are reached,
    after the objects before them: a caller applies them where it can undo them all.
    """
    try:
        with gzip.GzipFile(fileobj=file, mode="rb") as content:
            # A last piece without its newline is not a line, as when the file was split at once.
            lines = (line for line in content if line.endswith(b"\n"))
            header = orjson.loads(next(lines, b""))
            # Every field but the count is the manifest's; the count is checked by the lines.
            expected = converter.unstructure(
                SnapshotHeader(
                    manifest.schema,
                    manifest.instance,
                    manifest.stream,
                    manifest.seq,
                    header.get("objects"),
                )
            )
            if {k: header.get(k) for k in expected} != expected:
                raise SnapshotError(_HEADER_DIFFERS)
            count, seen = header["objects"], 0
            for line in lines:
                if seen == count:
                    raise SnapshotError(_HEADER_DIFFERS)
                seen += 1
                o = orjson.loads(line)
                yield from_wire(_key(o["metric"], o["layer"], o["hour"]), o)
            if seen != count:
                raise SnapshotError(_HEADER_DIFFERS)
    except (
        OSError,
        EOFError,
        zlib.error,
        ValueError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
    ) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"snapshot cannot be decoded: {type(exc).__name__}") from None
