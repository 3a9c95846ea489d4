"""``healthlog follow``: the reference replay subscriber (R7).

It keeps a local replica equal to the server's objects. Each received event is applied and
the cursor advanced in one replica transaction; the ACK sent is the highest contiguous
durable sequence. On ``CURSOR_TOO_OLD`` (or when the server's stream changed) it fetches
the signed snapshot, validates schema, sha256, signature, instance and stream binding and
sequence, restores, and resumes strictly after the snapshot. It reconnects with backoff.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import orjson
import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, wrap_client_stream

from healthlog import snapshots
from healthlog.acks import AckTracker
from healthlog.documents import converter
from healthlog.objects import ObjectKey, from_wire
from healthlog.snapshots import Manifest, SnapshotError
from healthlog.storage._sqlite import StorageError
from healthlog.storage.replica import Change, Replica, ReplicaMismatch
from healthlog.timestamps import parse_instant

log = logging.getLogger("healthlog.follow")

MAX_MESSAGE_BYTES = 256 * 2**20
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
ACK_EVERY = 64
ACK_IDLE_S = 0.2
BATCH = 512
# Errors after which reconnecting from the acknowledged cursor is the remedy.
RETRYABLE = frozenset({"TOO_SLOW", "GOING_AWAY"})


class FollowError(Exception):
    """A reason to stop following for good (a wrong token, another instance, a bad snapshot)."""


@attrs.frozen
class Endpoints:
    http: str
    ws_host: str
    ws_port: int
    ws_path: str
    tls: bool

    @classmethod
    def parse(cls, url: str) -> Endpoints:
        """From the service's base URL (``http://host:8787``) or its stream URL (``ws://...``)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise FollowError(f"not a service or stream URL: {url}")
        tls = parts.scheme in ("https", "wss")
        port = parts.port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        http = f"{'https' if tls else 'http'}://{host}:{port}"
        return cls(http, parts.hostname, port, "/v1/stream", tls)


@attrs.define
class Follower:
    """One follower of one service into one replica."""

    endpoints: Endpoints
    token: str
    replica: Replica
    subscriber: str | None = None
    until_caught_up: bool = False
    on_event: Callable[[int], None] | None = None
    _target: int | None = None

    async def run(self) -> None:
        """Follow until caught up (with ``until_caught_up``) or cancelled; reconnect on breaks."""
        backoff = BACKOFF_START_S
        async with httpx.AsyncClient(
            base_url=self.endpoints.http, headers={"Authorization": f"Bearer {self.token}"}
        ) as http:
            while True:
                done, lost = False, False
                try:
                    done = await self._session(http)
                except* (OSError, httpx.TransportError, HandshakeError, ConnectionClosed):
                    lost = True
                if done:
                    return
                if lost:
                    log.info("follow: connection lost, retrying in %.1f s", backoff)
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                else:
                    backoff = BACKOFF_START_S

    async def _session(self, http: httpx.AsyncClient) -> bool:
        """One connection; True when done (caught up)."""
        status = await _get_json(http, "/v1/status")
        key = await _get_json(http, "/v1/snapshots/key")
        stream = status["stream"]
        await trio.to_thread.run_sync(
            self.replica.bind, str(stream["instance"]), str(key["public_key"])
        )
        binding = await trio.to_thread.run_sync(self.replica.binding)
        if binding.stream is None and stream["oldest_cursor"] == 0:
            await trio.to_thread.run_sync(self.replica.restore, str(stream["id"]), 0, [])
            binding = await trio.to_thread.run_sync(self.replica.binding)
        elif binding.stream != stream["id"]:
            manifest = converter.structure(await _get_json(http, "/v1/snapshots"), Manifest)
            await self._restore(http, manifest, after=0, stream=None)
            binding = await trio.to_thread.run_sync(self.replica.binding)
        if self._target is None:
            self._target = int(stream["head"])
        if self.until_caught_up and self.subscriber is None and binding.cursor >= self._target:
            return True
        return await self._stream(http, binding.cursor, str(stream["id"]))

    async def _stream(self, http: httpx.AsyncClient, after: int, stream: str) -> bool:
        query = {"after": str(after)}
        if self.subscriber is not None:
            query["subscriber"] = self.subscriber
        resource = f"{self.endpoints.ws_path}?{urllib.parse.urlencode(query)}"
        tcp = await trio.open_tcp_stream(self.endpoints.ws_host, self.endpoints.ws_port)
        try:
            async with trio.open_nursery() as nursery:
                ws = await wrap_client_stream(
                    nursery,
                    tcp,
                    self.endpoints.ws_host,
                    resource,
                    extra_headers=[(b"authorization", f"Bearer {self.token}".encode())],
                    max_message_size=MAX_MESSAGE_BYTES,
                )
                try:
                    return await self._receive(http, ws, after, stream)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await tcp.aclose()

    async def _receive(
        self, http: httpx.AsyncClient, ws: WebSocketConnection, after: int, stream: str
    ) -> bool:
        """Apply frames in batches (one replica transaction each) and acknowledge them."""
        acks = AckTracker(after)
        acked = after
        while True:
            if self._caught_up(acks.contiguous):
                await _ack(ws, acks.contiguous)
                await ws.aclose()
                return True
            if acks.contiguous - acked >= ACK_EVERY:
                acked = await _ack(ws, acks.contiguous)
            with trio.move_on_after(ACK_IDLE_S) as idle:
                frames = await _frames(ws)
            if idle.cancelled_caught:
                if acks.contiguous > acked:
                    acked = await _ack(ws, acks.contiguous)
                continue
            events = [f for f in frames if f.get("type") == "event"]
            if events:
                changes = [c for c in map(_change, events) if c is not None]
                last = int(events[-1]["seq"])
                through = await trio.to_thread.run_sync(self.replica.apply, stream, changes, last)
                acks.durable(through)
                if self.on_event is not None:
                    for event in events:
                        self.on_event(int(event["seq"]))
            for frame in frames:
                if frame.get("type") != "error":
                    continue
                if frame.get("code") == "CURSOR_TOO_OLD":
                    manifest = converter.structure(frame["snapshot"], Manifest)
                    await self._restore(http, manifest, after=acks.contiguous, stream=stream)
                    return False
                if frame.get("code") in RETRYABLE:
                    return False
                raise FollowError(f"the server refused the stream: {frame.get('code')}")

    def _caught_up(self, cursor: int) -> bool:
        return self.until_caught_up and self._target is not None and cursor >= self._target

    async def _restore(
        self, http: httpx.AsyncClient, manifest: Manifest, *, after: int, stream: str | None
    ) -> None:
        binding = await trio.to_thread.run_sync(self.replica.binding)
        assert binding.instance is not None
        assert binding.public_key is not None
        response = await http.get(manifest.url)
        if response.status_code != 200:
            raise FollowError(f"snapshot fetch answered {response.status_code}")
        try:
            objects = snapshots.validate(
                manifest,
                response.content,
                public_key=binding.public_key,
                instance=binding.instance,
                stream=stream,
                after=after,
            )
        except SnapshotError as exc:
            raise FollowError(f"snapshot refused: {exc}") from None
        await trio.to_thread.run_sync(self.replica.restore, manifest.stream, manifest.seq, objects)
        log.info("follow: restored snapshot at seq %d (%d objects)", manifest.seq, len(objects))


async def _frames(ws: WebSocketConnection) -> list[dict[str, Any]]:
    """The next frame, and every frame already waiting behind it (up to a batch)."""
    frames = [orjson.loads(await ws.get_message())]
    while len(frames) < BATCH:
        with trio.move_on_after(0) as empty:
            message = await ws.get_message()
        if empty.cancelled_caught:
            break
        frames.append(orjson.loads(message))
    return frames


async def _ack(ws: WebSocketConnection, seq: int) -> int:
    await ws.send_message(orjson.dumps({"type": "ack", "seq": seq}).decode())
    return seq


def _change(frame: dict[str, object]) -> Change | None:
    if frame.get("kind") != "object.changed":
        return None
    key = ObjectKey(str(frame["metric"]), str(frame["layer"]), parse_instant(frame["hour"]))
    state = frame.get("object")
    if state is None:
        return Change(int(str(frame["seq"])), key, None)
    assert isinstance(state, dict)
    obj = from_wire(key, state)
    return Change(int(str(frame["seq"])), key, obj)


async def _get_json(http: httpx.AsyncClient, path: str) -> Any:
    response = await http.get(path)
    if response.status_code == 401:
        raise FollowError("the server refused the token")
    response.raise_for_status()
    return response.json()


async def follow(
    url: str,
    token: str,
    replica: Replica,
    *,
    subscriber: str | None = None,
    until_caught_up: bool = False,
) -> None:
    """Run a follower; raises FollowError for conditions that retrying cannot fix."""
    try:
        await Follower(Endpoints.parse(url), token, replica, subscriber, until_caught_up).run()
    except (ReplicaMismatch, StorageError) as exc:
        raise FollowError(str(exc)) from None
