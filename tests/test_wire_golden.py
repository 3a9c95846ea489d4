"""The bytes healthlog writes for its stream and its snapshots, pinned (STREAM-91).

A data directory with a fixed instance, stream and signing key folds the same deliveries into
the same objects, so every frame it sends, every event payload and outcome's counters it
stores, and the snapshot file and signed reference it builds are known to the byte. The
expected texts below were taken from the code before these documents became attrs classes
(T3); a change of a byte here is a change for followers, replicas and older snapshots'
signatures. The changes since: each event frame carries its event's random ``tag`` after its
``id`` (STREAM-111), set here to a known value once written, and the snapshot file's header
the tag of the event at its sequence, last (STREAM-116), which changes its sha256 and so its
signature.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import re
import sqlite3
from pathlib import Path

import trio
from _service_helpers import serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    post,
    prune,
    small,
    subscribe,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from trio_websocket import ConnectionClosed, WebSocketConnection

from healthlog.storage.datadir import SIGNING_KEY_FILE, DataDir
from transport.follow import _ack_frame

INSTANCE = "11111111111111111111111111111111"
STREAM = "22222222222222222222222222222222"
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))

# The counters of a delivery that folded one point into one new object, and of a failed one.
PARSED_COUNTERS = (
    '{"metrics":1,"sections":0,"points":1,"points_new":1,"points_unchanged":0,"points_replaced"'
    ':0,"points_held":0,"points_erased":0,"overwrites":0,"unit_mismatches":0,"sealed_writes":0,'
    '"points_rejected":0,"entries_rejected":0,"unknown_sections":0,"objects_written":1,'
    '"objects_unchanged":0}'
)
FAILED_COUNTERS = (
    '{"metrics":0,"sections":0,"points":0,"points_new":0,"points_unchanged":0,"points_replaced"'
    ':0,"points_held":0,"points_erased":0,"overwrites":0,"unit_mismatches":0,"sealed_writes":0,'
    '"points_rejected":0,"entries_rejected":0,"unknown_sections":0,"objects_written":0,'
    '"objects_unchanged":0}'
)
HASH_0 = "505e254b2c0c509ca28754d64bd9b8a77d416ab24abf5357ce22d35bedf301a6"
HASH_1 = "db4ad1e6b8f65b41a3c3ea4ae42225f9b7d667e7f2b627af15abebce1bb2dee5"
HASH_01 = "dc63900006698c432e63f9e546a4dd4224547353a10a053dbf3f4a761004ada2"
BODY_01 = (
    "H4sIAAAAAAAAAzM0NzS0NLI0M4ACTkN0gWqllMSSVCUrJSMDIxNdAyAyVDAwsAIjBW2QEiUdpcKSSiUrg1oumG4z"
    "dOPMCBlniGGcYS0XAE23RNeeAAAA"
)
BODY_1 = (
    "H4sIAAAAAAAAAzM0NzS0NDY2MoACTkN0gWqllMSSVCUrJSMDIxNdAyAyVDAwtDIwACIFbZASJR2lwpJKJSszg1ou"
    "AHbNq3dQAAAA"
)
OBJECT_0 = (
    f'{{"units":"count","hash":"{HASH_01}","first":1711929600000000,"last":1711929660000000,'
    f'"points":2,"created_by":1,"sealed":false,"body":"{BODY_01}"}}'
)
OBJECT_1 = (
    f'{{"units":"count","hash":"{HASH_1}","first":1711933200000000,"last":1711933200000000,'
    f'"points":1,"created_by":2,"sealed":false,"body":"{BODY_1}"}}'
)
CHANGED_0 = (
    '{{"metric":"step_count","layer":"minutes","hour":"2024-04-01T00:00:00Z","hash":"{}",'
    '"points":{},"delivery_id":{}}}'
)
CHANGED_1 = (
    '{{"metric":"step_count","layer":"minutes","hour":"2024-04-01T01:00:00Z","hash":"{}",'
    '"points":{},"delivery_id":{}}}'
)
FOLDED = '{{"delivery_id":{},"status":"{}","counters":{}}}'
# The stored payloads of the events, in sequence order.
PAYLOADS = [
    CHANGED_0.format(HASH_0, 1, 1),
    FOLDED.format(1, "parsed", PARSED_COUNTERS),
    CHANGED_1.format(HASH_1, 1, 2),
    FOLDED.format(2, "parsed", PARSED_COUNTERS),
    CHANGED_0.format(HASH_01, 2, 3),
    FOLDED.format(3, "parsed", PARSED_COUNTERS),
    FOLDED.format(4, "failed", FAILED_COUNTERS),
]
KINDS = ["object.changed", "delivery.folded"] * 3 + ["delivery.folded"]
# The current object each object.changed event's frame carries.
OBJECTS = [OBJECT_0, None, OBJECT_1, None, OBJECT_0, None, None]
SNAPSHOT_SHA256 = "9c3f0d2920aff908f7a4576b87ba1fb744952cf3cc8e3ea883cb95b577b6a9f7"
SIGNATURE = (
    "52DrxiyGAK43y+4Mkb8ZDoKFNJ8DIVBzWnzoYe27kgg6baMQfkXLX+QZecZZmJD8M37vHo6uIczhLK3Hq0kBAQ=="
)
MANIFEST = (
    f'{{"url":"/v1/snapshots/7","seq":7,"sha256":"{SNAPSHOT_SHA256}",'
    f'"schema":"healthlog.snapshot.v1","instance":"{INSTANCE}","stream":"{STREAM}",'
    f'"signature":"{SIGNATURE}"}}'
)
SNAPSHOT_LINES = [
    f'{{"schema":"healthlog.snapshot.v1","instance":"{INSTANCE}","stream":"{STREAM}",'
    '"seq":7,"objects":2,"tag":"0000000000000007"}',
    '{"metric":"step_count","layer":"minutes","hour":1711929600000000,' + OBJECT_0[1:],
    '{"metric":"step_count","layer":"minutes","hour":1711933200000000,' + OBJECT_1[1:],
]


def event_frame(seq: int) -> str:
    """The frame of event ``seq``: its head (its tag as :func:`fixed_tags` set it), its stored
    payload, its object if it names one."""
    head = (
        f'{{"type":"event","seq":{seq},"id":"{STREAM}:{seq}","tag":"{seq:016x}",'
        f'"kind":"{KINDS[seq - 1]}",'
    )
    tail = "" if OBJECTS[seq - 1] is None else f',"object":{OBJECTS[seq - 1]}'
    return head + PAYLOADS[seq - 1][1:-1] + tail + "}"


def fixed_data_dir(path: Path) -> DataDir:
    """A data directory whose instance, stream and signing key are the ones above."""
    data = DataDir(path)
    with data.open_journal(), data.open_store():
        pass
    (path / SIGNING_KEY_FILE).write_bytes(
        KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    )
    with contextlib.closing(sqlite3.connect(data.journal_path)) as conn, conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'instance_id'", (INSTANCE,))
    with contextlib.closing(sqlite3.connect(data.store_path)) as conn, conn:
        conn.execute("UPDATE marks SET value = ? WHERE key = 'stream'", (f'"{STREAM}"',))
    return data


def fixed_tags(data: DataDir) -> None:
    """Check that every event was written with a tag of 16 hex digits (random: STREAM-111),
    then set event ``seq``'s to ``seq`` in 16 hex digits, so that its frame is known."""
    with contextlib.closing(sqlite3.connect(data.store_path)) as conn, conn:
        tags = [r[0] for r in conn.execute("SELECT tag FROM events ORDER BY seq")]
        assert all(re.fullmatch("[0-9a-f]{16}", tag) for tag in tags), tags
        assert len(set(tags)) == len(tags)
        conn.execute("UPDATE events SET tag = printf('%016x', seq)")


async def messages(ws: WebSocketConnection) -> list[str]:
    """Every message the server sends until it closes."""
    got: list[str] = []
    with trio.fail_after(FRAME_LIMIT_S), contextlib.suppress(ConnectionClosed):
        while True:
            got.append(str(await ws.get_message()))
    return got


def stored(data: DataDir) -> tuple[list[str], list[str]]:
    """The stored payload of every event, in sequence order, and the counters of every outcome,
    in delivery order, as their text."""
    with contextlib.closing(sqlite3.connect(data.store_path)) as conn:
        events = [r[0] for r in conn.execute("SELECT payload FROM events ORDER BY seq")]
        rows = conn.execute("SELECT counters FROM outcomes ORDER BY delivery_id")
        counters = [r[0] for r in rows]
    return events, counters


async def test_wire_bytes(tmp_path: Path) -> None:
    """STREAM-91: event frames of both kinds, the error frames, the stored event payloads and
    counters, the snapshot file and its signed reference (in a CURSOR_TOO_OLD frame and from
    ``GET /v1/snapshots``), and the follower's ACK are these bytes."""
    data = fixed_data_dir(tmp_path / "data")
    async with serving(data.path) as service:
        for content in (small(0), small(60), small(1), b"not json"):
            await post(service, content)
        total = int((await service.wait_folded())["stream"]["head"])
        assert total == len(PAYLOADS)
        assert stored(data) == (
            PAYLOADS,
            [FAILED_COUNTERS if n == 4 else PARSED_COUNTERS for n in range(1, 5)],
        )
        fixed_tags(data)
        async with subscribe(service, after=0) as ws:
            with trio.fail_after(FRAME_LIMIT_S):
                frames = [await ws.get_message() for _ in range(total)]
            assert frames == [event_frame(seq) for seq in range(1, total + 1)]
            await ws.send_message('{"type": "ack", "seq": 99}')
            assert await messages(ws) == ['{"type":"error","code":"ACK_BEYOND_SENT","sent":7}']
        async with subscribe(service, after=total + 5) as ws:
            assert await messages(ws) == ['{"type":"error","code":"CURSOR_IN_FUTURE","head":7}']
        async with subscribe(service, after=total) as ws:
            await ws.send_message('{"type": "nack"}')
            assert await messages(ws) == ['{"type":"error","code":"BAD_FRAME"}']

        await prune(data, keep=2)
        async with subscribe(service, after=1) as ws:
            assert await messages(ws) == [
                f'{{"type":"error","code":"CURSOR_TOO_OLD","snapshot":{MANIFEST}}}'
            ]
        latest = await service.get("/v1/snapshots")
        assert latest.content == MANIFEST.encode()
        snapshot = (await service.get("/v1/snapshots/7")).content
        assert gzip.decompress(snapshot).decode().splitlines() == SNAPSHOT_LINES
        assert hashlib.sha256(snapshot).hexdigest() == SNAPSHOT_SHA256
    assert _ack_frame(7) == '{"type":"ack","seq":7}'
