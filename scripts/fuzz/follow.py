"""Fuzz what ``healthlog follow`` reads from a server: stream frames and snapshot files
(requirement X, specs/proof.md).

The first byte of an input picks what the rest is. Even: text frames of the replay stream,
one a line (a line that is not UTF-8 is a binary frame), decoded as the follower decodes
them and, where they hold events, applied to a real replica (an SQLite file) as the follower
applies them; an error frame's ``snapshot`` is read as the follower reads a manifest. Odd: the
JSON lines of a snapshot file, gzipped (or, when the byte is 3 mod 4, the file's bytes as they
are), read as a restore reads a file that passed its checks, into the replica. The outcomes
the follower knows: a malformed batch (it stops with ``FollowError``), ``FollowError``,
``SnapshotError`` (it stops with ``FollowError``); after a refused snapshot the replica holds
what it held before. Anything else raised is a finding.

Run: ``.venv/bin/python scripts/fuzz/follow.py -max_total_time=600``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import sys
import tempfile
from typing import Any

import _common
import atheris
import orjson

with atheris.instrument_imports():
    from healthlog import objects, snapshots
    from healthlog.documents import Manifest, ObjectChanged, dumps
    from healthlog.storage.replica import Replica
    from transport import follow

STREAM = "stream-1"
INSTANCE = "instance-1"
MANIFEST = Manifest(
    url="/v1/snapshots/7",
    seq=7,
    sha256="0" * 64,
    schema=snapshots.SCHEMA,
    instance=INSTANCE,
    stream=STREAM,
    signature="",
)

_directory = tempfile.TemporaryDirectory(prefix="fuzz-follow-")
replica = Replica(_directory.name)
replica.bind(INSTANCE, "key")


def state() -> tuple[Any, ...]:
    binding = replica.binding()
    with replica._lock:
        rows = replica._conn.execute("SELECT count(*), total(hour) FROM objects").fetchone()
    return binding.stream, binding.cursor, binding.tag, *rows


def reset() -> None:
    replica.restore(STREAM, 0, [], None)


reset()


def frames(data: bytes) -> None:
    messages: list[str | None] = []
    for line in data.split(b"\n"):
        try:
            messages.append(line.decode())
        except UnicodeDecodeError:
            messages.append(None)
    batch = follow._Batch.decode(messages)
    skipped = batch.gap(0)
    if skipped is not None:
        batch = batch.before(skipped)
    if batch.seqs:
        replica.apply(STREAM, batch.changes, batch.seqs[-1], follow._tag(batch.tags[-1]))
        reset()
    for error in batch.errors:
        with contextlib.suppress(follow.FollowError):
            follow._structured(error.get("snapshot"), Manifest, "the snapshot reference")


def snapshot(data: bytes, raw: bool) -> None:
    file = io.BytesIO(data if raw else gzip.compress(data, mtime=0))
    before = state()
    try:
        tag = follow._tag(snapshots.header_tag(file))
        file.seek(0)
        replica.restore(MANIFEST.stream, MANIFEST.seq, snapshots.read(file, MANIFEST), tag)
    except snapshots.SnapshotError:
        assert state() == before, "a refused snapshot changed the replica"
        return
    reset()


def test(data: bytes) -> None:
    if not data:
        return
    if data[0] % 2 == 0:
        frames(data[1:])
    else:
        snapshot(data[1:], raw=data[0] % 4 == 3)


def seeds() -> list[bytes]:
    from fixtures import MemoryProjection, fold, make_body

    written, _ = fold(make_body(1, hours=2), MemoryProjection(), aggregation="minutes")
    lines = []
    snapshot_lines = [dumps(snapshots.SnapshotHeader(snapshots.SCHEMA, INSTANCE, STREAM, 7, 2))]
    for seq, obj in enumerate(written[:2], start=1):
        event = ObjectChanged(
            obj.key.metric, obj.key.layer, "2024-02-06T15:00:00Z", obj.hash.hex(), obj.count, 1
        )
        frame = {
            "type": "event",
            "seq": seq,
            "id": f"e{seq}",
            "tag": f"{seq:016x}",
            "kind": ObjectChanged.KIND,
            **orjson.loads(dumps(event)),
            "object": objects.to_wire(obj),
        }
        lines.append(orjson.dumps(frame))
        wire = {"metric": obj.key.metric, "layer": obj.key.layer, "hour": obj.key.hour}
        snapshot_lines.append(orjson.dumps({**wire, **objects.to_wire(obj)}))
    gone = {"type": "event", "seq": 3, "id": "e3", "kind": ObjectChanged.KIND, "object": None}
    lines.append(orjson.dumps({**gone, "metric": "m", "layer": "minutes", "hour": "2024-02-06"}))
    lines.append(b'{"type":"event","seq":4,"id":"e4","kind":"delivery.folded","delivery_id":1}')
    error = {"type": "error", "code": "CURSOR_TOO_OLD", "snapshot": orjson.loads(dumps(MANIFEST))}
    lines.append(orjson.dumps(error))
    stream = b"\n".join(lines)
    content = b"\n".join(snapshot_lines) + b"\n"
    return [b"\x00" + stream, b"\x01" + content, b"\x03" + gzip.compress(content, mtime=0)]


if __name__ == "__main__":
    _common.run("follow", test, seeds)
    sys.exit(0)
