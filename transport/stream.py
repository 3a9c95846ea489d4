"""``WS /v1/stream``: replay from a cursor, then live, at least once (R2 to R6).

The sender never keeps more than one page of events per subscriber: it reads the events
after its cursor from the store, sends them, and when it has caught up waits for the head
to move. Replay and live are the same loop, so there is no switch-over to lose an event in.
A subscriber that stops reading is closed (4408) once a send stalls past the timeout, and
resumes from its acknowledged cursor.

Close codes: 4400 bad request (cursor, subscriber name, frame, ACK beyond what was sent),
4401 unauthorized, 4408 too slow, 4410 cursor older than the online window (after an
error frame with a signed snapshot reference), 1001 server going away.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio
from quart import websocket

from actors.runtime import Runtime
from healthlog.objects import ObjectKey
from healthlog.snapshots import Manifest
from healthlog.storage.store import Event, Store
from healthlog.timestamps import TimestampError, parse_instant

log = logging.getLogger("healthlog.stream")

PAGE = 256
MAX_SUBSCRIBER = 128
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_TOO_SLOW = 4408
CLOSE_CURSOR_TOO_OLD = 4410


class EventHub:
    """Follows the store's head sequence and wakes every subscriber waiting past it."""

    def __init__(self, runtime: Runtime, poll_s: float = 0.1) -> None:
        self._runtime = runtime
        self._poll_s = poll_s
        self.head = 0
        self._moved = trio.Event()

    async def run(self) -> None:
        while True:
            _, head = await self._runtime.read_store(Store.event_window)
            if head > self.head:
                self.head = head
                self._moved.set()
                self._moved = trio.Event()
            await trio.sleep(self._poll_s)

    async def wait_beyond(self, seq: int) -> None:
        while self.head <= seq:
            await self._moved.wait()


class StreamRefused(Exception):
    """A reason to end a subscription with an error frame and a close code."""

    def __init__(self, code: str, close: int, extra: dict[str, Any] | None = None) -> None:
        super().__init__(code)
        self.code = code
        self.close = close
        self.extra = extra or {}


@attrs.define
class _Subscription:
    name: str | None
    cursor: int
    sent: int
    acked: int = 0


SnapshotFor = Callable[[int], Awaitable[Manifest]]


async def serve_stream(
    runtime: Runtime,
    hub: EventHub,
    authenticate: Callable[[str], Awaitable[str | None]],
    snapshot_for: SnapshotFor,
    send_timeout_s: float,
) -> None:
    """One websocket subscription, from authentication to close."""
    await websocket.accept()
    try:
        await _authenticate(authenticate)
        sub = await _open(runtime, snapshot_for)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_loop, runtime, hub, sub, snapshot_for, send_timeout_s)
            await _receive_loop(runtime, sub)
            nursery.cancel_scope.cancel()
    except* StreamRefused as group:
        refused = group.exceptions[0]
        assert isinstance(refused, StreamRefused)
        frame = {"type": "error", "code": refused.code, **refused.extra}
        with trio.move_on_after(send_timeout_s):
            await websocket.send(orjson.dumps(frame).decode())
        await websocket.close(refused.close, refused.code)


async def _authenticate(authenticate: Callable[[str], Awaitable[str | None]]) -> None:
    presented = websocket.headers.get("api-key") or websocket.args.get("token")
    authorization = websocket.headers.get("Authorization", "")
    if authorization[:7].lower() == "bearer ":
        presented = authorization[7:].strip()
    if not presented or await authenticate(presented) is None:
        raise StreamRefused("UNAUTHORIZED", CLOSE_UNAUTHORIZED)


async def _open(runtime: Runtime, snapshot_for: SnapshotFor) -> _Subscription:
    name = websocket.args.get("subscriber")
    if name is not None and not (0 < len(name) <= MAX_SUBSCRIBER and name.isprintable()):
        raise StreamRefused("BAD_SUBSCRIBER", CLOSE_BAD_REQUEST)
    raw_after = websocket.args.get("after", "0")
    if not raw_after.isascii() or not raw_after.isdigit() or len(raw_after) > 18:
        raise StreamRefused("BAD_CURSOR", CLOSE_BAD_REQUEST)
    after = int(raw_after)
    window_start, head = await runtime.read_store(Store.event_window)
    if after > head:
        raise StreamRefused("CURSOR_IN_FUTURE", CLOSE_BAD_REQUEST, {"head": head})
    if after < window_start:
        manifest = await snapshot_for(after)
        raise StreamRefused(
            "CURSOR_TOO_OLD", CLOSE_CURSOR_TOO_OLD, {"snapshot": attrs.asdict(manifest)}
        )
    return _Subscription(name, after, after)


async def _send_loop(
    runtime: Runtime,
    hub: EventHub,
    sub: _Subscription,
    snapshot_for: SnapshotFor,
    send_timeout_s: float,
) -> None:
    stream = await runtime.read_store(Store.stream_id)
    while True:
        events = await runtime.read_store(
            functools.partial(Store.events_after, after=sub.cursor, limit=PAGE)
        )
        if not events:
            await hub.wait_beyond(sub.cursor)
            continue
        if events[0].seq != sub.cursor + 1:
            manifest = await snapshot_for(sub.cursor)
            raise StreamRefused(
                "CURSOR_TOO_OLD", CLOSE_CURSOR_TOO_OLD, {"snapshot": attrs.asdict(manifest)}
            )
        for event in events:
            frame = await _frame(runtime, stream, event)
            with trio.move_on_after(send_timeout_s) as timer:
                await websocket.send(frame)
            if timer.cancelled_caught:
                raise StreamRefused("TOO_SLOW", CLOSE_TOO_SLOW)
            sub.cursor = sub.sent = event.seq


async def _frame(runtime: Runtime, stream: str, event: Event) -> str:
    frame: dict[str, Any] = {
        "type": "event",
        "seq": event.seq,
        "id": f"{stream}:{event.seq}",
        "kind": event.kind,
        **event.payload,
    }
    if event.kind == "object.changed":
        try:
            hour = parse_instant(event.payload["hour"])
        except (KeyError, TimestampError):
            hour = None
        current = None
        if hour is not None:
            key = ObjectKey(event.payload["metric"], event.payload["layer"], hour)
            current = await runtime.read_store(functools.partial(Store.object, key=key))
        frame["object"] = (
            None
            if current is None
            else {
                "units": current.units,
                "hash": current.hash.hex(),
                "points": current.count,
                "first": current.first,
                "last": current.last,
                "created_by": current.created_by,
                "sealed": current.sealed,
                "body": base64.b64encode(current.body).decode(),
            }
        )
    return orjson.dumps(frame).decode()


async def _receive_loop(runtime: Runtime, sub: _Subscription) -> None:
    while True:
        message = await websocket.receive()
        if not isinstance(message, str):
            raise StreamRefused("BINARY_FRAME", CLOSE_BAD_REQUEST)
        try:
            frame = orjson.loads(message)
        except orjson.JSONDecodeError:
            raise StreamRefused("BAD_FRAME", CLOSE_BAD_REQUEST) from None
        if not isinstance(frame, dict) or frame.get("type") != "ack":
            raise StreamRefused("BAD_FRAME", CLOSE_BAD_REQUEST)
        seq = frame.get("seq")
        if type(seq) is not int or seq < 0:
            raise StreamRefused("BAD_FRAME", CLOSE_BAD_REQUEST)
        if seq > sub.sent:
            raise StreamRefused("ACK_BEYOND_SENT", CLOSE_BAD_REQUEST, {"sent": sub.sent})
        if sub.name is not None and seq > sub.acked:
            sub.acked = await runtime.read_store(
                functools.partial(Store.ack, subscriber=sub.name, seq=seq)
            )
