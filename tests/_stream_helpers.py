"""Helpers for the replay stream tests (specs/stream.md): bodies, websocket subscribers, and a
census of the stream handlers running in the test's trio run.

The service runs in the test's own trio run (``tests/_service_helpers.py``), so the subscribers
here are trio-websocket clients in the same run (:func:`serving_process` runs it as a process
of its own instead, for a test whose trio clock is a MockClock the service must not share).
trio-websocket leaves its socket open when the server closes first, so :func:`connect` owns the
TCP stream and closes it itself, as ``transport/follow.py`` does.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import _bodies
import httpx
import orjson
import trio
import trio.testing
from _cli_bodies import body, metric, point
from _service_helpers import CLIENT_TIMEOUT_S, POLL_S, STOP_LIMIT_S, TOKEN_NAME, Service
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from healthlog import snapshots
from healthlog.documents import Manifest
from healthlog.export import export_lines
from healthlog.objects import HourlyObject
from healthlog.storage.datadir import DataDir
from healthlog.storage.replica import REPLICA_FILE, Replica
from transport.stream import StreamEndpoint

MINUTES = {"automation-aggregation": "minutes"}
SECONDS = {"automation-aggregation": "seconds"}
FRAME_LIMIT_S = 15.0
ACK_LIMIT_S = 10.0
MAX_MESSAGE_BYTES = 16 * 2**20
TINY_RECEIVE_BUFFER = 4096
# What `follow` says of a token the server refuses, however it is refused (STREAM-122).
TOKEN_REFUSED = (
    "the server refused the token: it was revoked, or is not one of this service's"
    " (healthlog token add NAME, run on the service, makes a new one)"
)


def small(n: int) -> bytes:
    """A distinct small delivery: one step count point at minute ``n`` from 2024-04-01.

    Folded as minutes it writes one object, so it adds two events (changed, folded)."""
    day, minute = divmod(n, 24 * 60)
    date = f"2024-04-{1 + day:02d} {minute // 60:02d}:{minute % 60:02d}:00 +0000"
    return body(metric("step_count", "count", point(date, qty=n)))


def hourly(count: int) -> bytes:
    """``count`` heart rate points one hour apart from 2024-01-01: ``count`` objects."""
    points = []
    for n in range(count):
        day, hour = divmod(n, 24)
        month, day = divmod(day, 28)
        date = f"2024-{1 + month:02d}-{1 + day:02d} {hour:02d}:00:00 +0000"
        points.append(point(date, qty=60 + n % 40))
    return body(metric("heart_rate", "count/min", *points))


def noisy(first: int, count: int) -> bytes:
    """``count`` points at seconds ``first``... of 2024-05-01 10:00 UTC, each with 200 random hex
    characters, so the one object they make compresses badly and its frames are large."""
    points = []
    for second in range(first, first + count):
        date = f"2024-05-01 10:{second // 60:02d}:{second % 60:02d} +0000"
        points.append(point(date, qty=second, note=os.urandom(100).hex()))
    return body(metric("noise", "count", *points))


async def post(service: Service, content: bytes, headers: dict[str, str] = MINUTES) -> None:
    response = await service.post(content, headers)
    assert response.status_code == 200, response.text


HEAD_END = b"\r\n\r\n"


async def read_head(stream: trio.abc.Stream) -> bytes:
    """The bytes of a connection up to the end of its first request head (or its end)."""
    head = b""
    while HEAD_END not in head:
        data = await stream.receive_some(2**16)
        if not data:
            break
        head += data
    return head


async def listen(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> int:
    """Serve ``handler`` on a free port of 127.0.0.1 in ``nursery``; the port."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def post_small(service: Service, *minutes: int) -> int:
    """Post one small delivery per minute, wait until folded; the head after them."""
    for minute in minutes:
        await post(service, small(minute))
    return int((await service.wait_folded())["stream"]["head"])


def resource(after: int | str | None = 0, **query: str) -> str:
    """``/v1/stream`` with ``after`` (left out when None) and the other query parameters."""
    params = {} if after is None else {"after": str(after)}
    return f"/v1/stream?{urllib.parse.urlencode({**params, **query})}"


def bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


def upgrade(path: str, token: str) -> bytes:
    """A websocket upgrade request for ``path``, written by hand."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
    ).encode()


@contextlib.asynccontextmanager
async def stalled(service: Service, after: int = 0) -> AsyncIterator[trio.SocketStream]:
    """A subscriber that never reads: a raw socket with a tiny receive buffer that sends the
    upgrade request and nothing else, so the server's sends soon wait on full buffers."""
    sock = trio.socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RECEIVE_BUFFER)
        await sock.connect(("127.0.0.1", service.port))
    except BaseException:
        sock.close()
        raise
    tcp = trio.SocketStream(sock)
    try:
        await tcp.send_all(upgrade(resource(after), service.token))
        yield tcp
    finally:
        await tcp.aclose()


@contextlib.asynccontextmanager
async def connect(
    port: int, path: str, headers: list[tuple[bytes, bytes]], **options: Any
) -> AsyncIterator[WebSocketConnection]:
    """A trio-websocket client connection to the local service, on a TCP stream of our own."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(
                nursery,
                tcp,
                "127.0.0.1",
                path,
                extra_headers=headers,
                max_message_size=MAX_MESSAGE_BYTES,
                **options,
            )
            try:
                yield ws
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await tcp.aclose()


def subscribe(
    service: Service, after: int | str | None = 0, **query: str
) -> contextlib.AbstractAsyncContextManager[WebSocketConnection]:
    """A subscriber with the service's token."""
    return connect(service.port, resource(after, **query), bearer(service.token))


async def receive(ws: WebSocketConnection, count: int) -> list[dict[str, Any]]:
    """The next ``count`` frames, each a text frame."""
    with trio.fail_after(FRAME_LIMIT_S):
        return [text_frame(await ws.get_message()) for _ in range(count)]


async def receive_through(ws: WebSocketConnection, seq: int) -> list[dict[str, Any]]:
    """Frames up to and including the event ``seq``."""
    frames: list[dict[str, Any]] = []
    with trio.fail_after(FRAME_LIMIT_S):
        while not frames or frames[-1]["seq"] < seq:
            frames.append(text_frame(await ws.get_message()))
    return frames


def text_frame(message: str | bytes) -> dict[str, Any]:
    """A frame the server sent: a text frame (never a binary one) holding one JSON object."""
    assert isinstance(message, str), f"a binary frame: {message[:40]!r}"
    frame = orjson.loads(message)
    assert isinstance(frame, dict)
    return frame


async def refusal(
    ws: WebSocketConnection, limit_s: float = FRAME_LIMIT_S
) -> tuple[dict[str, Any], int]:
    """Read until the server closes, within ``limit_s``; the last frame it sent and the close
    code."""
    frames: list[dict[str, Any]] = []
    with trio.fail_after(limit_s), contextlib.suppress(ConnectionClosed):
        while True:
            frames.append(orjson.loads(await ws.get_message()))
    assert ws.closed is not None
    assert frames, f"closed {ws.closed} without an error frame"
    return frames[-1], ws.closed.code


async def send_ack(ws: WebSocketConnection, seq: int) -> None:
    await ws.send_message(orjson.dumps({"type": "ack", "seq": seq}).decode())


async def head(service: Service) -> int:
    return int((await service.status())["stream"]["head"])


async def acked(service: Service, name: str, seq: int, limit_s: float = ACK_LIMIT_S) -> None:
    """Wait (up to ``limit_s``) until the stored ACK of ``name`` is ``seq``."""
    with trio.fail_after(limit_s):
        while (await service.status())["subscribers"].get(name) != seq:
            await trio.sleep(POLL_S)


def consecutive(frames: list[dict[str, Any]], after: int) -> bool:
    """True when the frames are exactly the events after+1, after+2, ..."""
    return [f["seq"] for f in frames] == list(range(after + 1, after + 1 + len(frames)))


def stream_handlers() -> int:
    """How many stream endpoint handlers are running in this trio run."""
    code = StreamEndpoint.__call__.__code__

    def count(task: trio.lowlevel.Task) -> int:
        here = any(frame.f_code is code for frame, _ in task.iter_await_frames())
        return int(here) + sum(
            count(child) for nursery in task.child_nurseries for child in nursery.child_tasks
        )

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return count(root)


async def prune(data: DataDir, keep: int) -> int:
    """Drop every event but the newest ``keep``, through a store connection of our own."""

    def run() -> int:
        with data.open_store() as store:
            return store.prune_events(keep=keep, older_than_us=time.time_ns() // 1000 + 1)

    return await trio.to_thread.run_sync(run)


async def server_export(service: Service) -> bytes:
    """What ``healthlog export`` writes for the service (``GET /v1/points``)."""
    response = await service.get("/v1/points")
    assert response.status_code == 200, response.text
    return response.content


async def replica_export(replica: Replica) -> bytes:
    """What ``healthlog export --replica`` writes for the replica."""

    return await trio.to_thread.run_sync(lambda: b"".join(export_lines(replica.iter_objects())))


HOURS = 500


def fold_metrics(data: DataDir, metrics: int) -> None:
    """Fold into ``data``'s store one delivery per metric, each of ``HOURS`` hourly objects of
    30 points: ``metrics * HOURS`` objects."""
    with data.open_journal() as journal, data.open_store() as store:
        epoch = store.acquire_lease("test", now=_bodies.NOW, ttl=_bodies.TTL)
        assert epoch is not None
        points = [
            _bodies.point(60 * hour + minute, 60 + minute)
            for hour in range(HOURS)
            for minute in range(0, 60, 2)
        ]
        for name in range(metrics):
            new = _bodies.delivery(_bodies.body({f"metric_{name}": points}))
            meta = journal.get_meta(journal.append(new).delivery_id)
            assert meta is not None
            store.fold(journal, meta, epoch)


def validate(
    manifest: Manifest,
    data: bytes,
    *,
    public_key: str,
    instance: str,
    stream: str | None,
    after: int,
) -> list[HourlyObject]:
    """A snapshot file held in memory, checked and read as a follower does from its file."""
    digest = hashlib.sha256(data).hexdigest()
    snapshots.check(
        manifest, digest, public_key=public_key, instance=instance, stream=stream, after=after
    )
    return list(snapshots.read(io.BytesIO(data), manifest))


def event_tag(data: DataDir, seq: int) -> str | None:
    """The tag the store of ``data`` holds for event ``seq`` (STREAM-111), read with a
    connection of its own."""
    with contextlib.closing(sqlite3.connect(data.store_path)) as conn:
        row = conn.execute("SELECT tag FROM events WHERE seq = ?", (seq,)).fetchone()
    assert row is not None, f"no event {seq}"
    return None if row[0] is None else str(row[0])


def revoke_token(path: Path) -> None:
    """Let ``serving`` create its token again on the same data directory."""
    with DataDir(path).open_tokens() as tokens:
        tokens.revoke(TOKEN_NAME)


async def until_cursor(replica: Replica, seq: int) -> None:
    """Wait until the replica's cursor reaches ``seq``."""
    with trio.fail_after(FRAME_LIMIT_S):
        while (await trio.to_thread.run_sync(replica.binding)).cursor < seq:
            await trio.sleep(POLL_S)


@contextlib.asynccontextmanager
async def following_process(
    service: Service, directory: Path, stderr: Path, seq: int, *options: str
) -> AsyncIterator[trio.Process]:
    """``healthlog follow`` as a real process following ``service`` live into the replica
    ``directory``, with more ``options`` (``--subscriber NAME``), its stderr into the file
    ``stderr``, once its replica holds ``seq``; the block's end waits for the process to end."""
    command = [
        *(sys.executable, "-m", "healthlog.cli", "follow", "--url", service.url),
        *("--token", service.token, "--replica", str(directory), *options),
    ]
    with open(stderr, "wb") as err:
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                functools.partial(trio.run_process, command, stderr=err, check=False)
            )
            with trio.fail_after(FRAME_LIMIT_S):
                while not (directory / REPLICA_FILE).exists():
                    await trio.sleep(POLL_S)
                with Replica(directory) as reading:
                    await until_cursor(reading, seq)
            yield process
            with trio.fail_after(FRAME_LIMIT_S):
                await process.wait()


@contextlib.asynccontextmanager
async def serving_process(path: Path, **settings: int) -> AsyncIterator[Service]:
    """``healthlog serve`` as a process of its own on a free port of 127.0.0.1, its ``[serve]``
    ``settings`` in the data directory's ``healthlog.toml``, as a :class:`Service` (whose
    ``stop`` is not used); stopped with SIGTERM at the block's end, its exit awaited. Its
    timers run on the system's clock whatever the test's trio clock does."""
    data = DataDir(path)
    with data.open_tokens() as tokens:
        token = tokens.add(TOKEN_NAME)
    lines = "".join(f"{name} = {value}\n" for name, value in settings.items())
    data.config_path.write_text(f"[serve]\n{lines}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(path)]
    process = await trio.lowlevel.open_process(command, env=env, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        announced = b""
        with trio.fail_after(FRAME_LIMIT_S):
            while b"\n" not in announced:
                chunk = await process.stdout.receive_some()
                assert chunk, "serve ended before it announced its address"
                announced += chunk
        found = re.search(rb"healthlog serving on (http://127\.0\.0\.1:\d+) ", announced)
        assert found, announced
        url = found.group(1).decode()
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            yield Service(url, data, token, client, trio.Event())
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(STOP_LIMIT_S):
            await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()
    assert process.returncode == 0


class Stamped(logging.Handler):
    """The records at INFO and above of one logger, as (trio time when logged, level,
    message): the time is a MockClock's in a test that moves it on."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[tuple[float, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append((trio.current_time(), record.levelno, record.getMessage()))

    def at(self, prefix: str) -> list[float]:
        """When each message beginning with ``prefix`` was logged."""
        return [when for when, _, message in self.said if message.startswith(prefix)]

    def messages(self, prefix: str = "", level: int = logging.INFO) -> list[str]:
        """The messages beginning with ``prefix`` at ``level`` or above."""
        return [m for _, n, m in self.said if m.startswith(prefix) and n >= level]


@contextlib.contextmanager
def stamped(name: str) -> Iterator[Stamped]:
    """A :class:`Stamped` on the logger ``name``, set to INFO, for the block."""
    logger = logging.getLogger(name)
    handler, level = Stamped(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# How far a test moves a MockClock at a time while a follower waits, and the most moves it makes
# before it gives up on the follower.
STEP_S = 1.0
MAX_STEPS = 1000


async def step_until(clock: trio.testing.MockClock, done: Callable[[], bool]) -> None:
    """Move ``clock`` on a second at a time, letting what woke run (a moment of real time at
    its rate of 1, for a service in another process to answer), until ``done()``."""
    for _ in range(MAX_STEPS):
        if done():
            return
        clock.jump(STEP_S)
        await trio.sleep(POLL_S)
    raise AssertionError("not done after the clock moved on")
