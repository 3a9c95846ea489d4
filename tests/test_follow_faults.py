"""``healthlog follow`` against servers and fronts that misbehave, and replicas whose files go
(specs/stream.md, STREAM-71 to STREAM-77; specs/cli.md, CLI-60 and CLI-61): a connection gone
silent, an answer that never ends or trickles, a snapshot at the cursor, a binary frame or a
sequence that is not an integer, a replica file removed or replaced, or a disk full under it, a
store restored from a backup, a second follower of one replica, and a replica path that is no
directory.

A :class:`Fake` on 127.0.0.1 forwards each request to a real service (or answers it itself),
and scripts what it pleases: the answer to a path, the frames of a websocket connection, or a
freeze of every connection open at the time.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from _cli_bodies import body, metric, point
from _disk import files_limited_to
from _service_helpers import POLL_S, Service, serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    HEAD_END,
    HOURS,
    SECONDS,
    TOKEN_REFUSED,
    event_tag,
    fold_metrics,
    following_process,
    hourly,
    listen,
    post,
    post_small,
    prune,
    read_head,
    replica_export,
    revoke_token,
    server_export,
    serving_process,
    until_cursor,
)
from conftest import CliRun, RunCli
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Request,
    TextMessage,
)

import transport.follow
from healthlog import snapshots
from healthlog.documents import Manifest, converter
from healthlog.storage import snapshot_files
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.replica import REPLICA_FILE, Replica
from transport.follow import Endpoints, Follower, FollowError, follow

Answer = Callable[[trio.abc.Stream], Awaitable[None]]


def json_answer(document: Any) -> bytes:
    content = orjson.dumps(document)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (len(content), content)
    )


async def restored_only(
    service: Service,
) -> tuple[int, str, bytes, dict[bytes, bytes | Answer]]:
    """Post 100 small deliveries to ``service`` and prune its window to the last 2 events, so
    that a fresh replica must restore its snapshot: the number of events, the snapshot file's
    path and content, and a fake front's answers (each on a connection of its own, so that the
    fake sees every request) for the status, the snapshot key and the manifest."""
    total = await post_small(service, *range(0, 6000, 60))
    await prune(service.data, keep=2)
    manifest = (await service.get("/v1/snapshots")).json()
    path = urllib.parse.urlsplit(manifest["url"]).path
    content = (await service.get(path)).content
    answers: dict[bytes, bytes | Answer] = {
        b"/v1/status": json_answer(await service.status()),
        b"/v1/snapshots/key": json_answer((await service.get("/v1/snapshots/key")).json()),
        b"/v1/snapshots": json_answer(manifest),
    }
    return total, path, content, answers


class Fake:
    """A server on 127.0.0.1. A request whose path is in ``answers`` gets that answer (bytes,
    or a coroutine writing to the connection); a websocket upgrade is accepted and sent
    ``frames`` (text, or bytes for a binary frame) then closed with ``close``, when frames are
    given; anything else goes to the service at ``upstream``, both ways, until :meth:`freeze`
    stops every connection open at the time (no byte passes either way, both stay open), as
    a server that lost its power or a NAT that forgot the connection would. ``paths`` is the
    path of every request, ``upgrades`` counts the websocket ones."""

    def __init__(
        self,
        upstream: int | None = None,
        *,
        answers: dict[bytes, bytes | Answer] | None = None,
        frames: list[str | bytes] | None = None,
        close: int = 1000,
    ) -> None:
        self.upstream = upstream
        self.answers = answers or {}
        self.frames = frames
        self.close = close
        self.port = 0
        self.paths: list[bytes] = []
        self.upgrades = 0
        self._open: set[int] = set()
        self._frozen: set[int] = set()
        self._next = 0

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self._frozen |= self._open

    async def handle(self, client: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with client:
                head = await read_head(client)
                if HEAD_END not in head:
                    return
                path = head.split(b" ", 2)[1].split(b"?")[0]
                self.paths.append(path)
                upgrade = b"upgrade: websocket" in head.lower()
                self.upgrades += upgrade
                answer = self.answers.get(path)
                if isinstance(answer, bytes):
                    await client.send_all(answer)
                elif answer is not None:
                    await answer(client)
                elif upgrade and self.frames is not None:
                    await self._script(client, head)
                else:
                    await self._forward(client, head)

    async def _script(self, client: trio.SocketStream, head: bytes) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        ws.receive_data(head)
        assert any(isinstance(event, Request) for event in ws.events())
        out = ws.send(AcceptConnection())
        for frame in self.frames or []:
            out += ws.send(TextMessage(frame) if isinstance(frame, str) else BytesMessage(frame))
        await client.send_all(out + ws.send(CloseConnection(code=self.close)))
        with trio.move_on_after(FRAME_LIMIT_S):
            while await client.receive_some(2**16):
                pass

    async def _forward(self, client: trio.SocketStream, head: bytes) -> None:
        assert self.upstream is not None
        number, self._next = self._next, self._next + 1
        self._open.add(number)
        try:
            async with await trio.open_tcp_stream("127.0.0.1", self.upstream) as server:
                await server.send_all(head)
                async with trio.open_nursery() as nursery:
                    for source, sink in ((client, server), (server, client)):
                        nursery.start_soon(self._pipe, source, sink, number, nursery.cancel_scope)
        finally:
            self._open.discard(number)

    async def _pipe(
        self, source: trio.abc.Stream, sink: trio.abc.Stream, number: int, scope: trio.CancelScope
    ) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some(2**16):
                if number in self._frozen:
                    await trio.sleep_forever()
                await sink.send_all(data)
        scope.cancel()


@contextlib.asynccontextmanager
async def faking(upstream: int | None = None, **options: Any) -> AsyncIterator[Fake]:
    fake = Fake(upstream, **options)
    async with trio.open_nursery() as nursery:
        fake.port = await listen(nursery, fake.handle)
        yield fake
        nursery.cancel_scope.cancel()


async def cursor_of(replica: Replica) -> int:
    return (await trio.to_thread.run_sync(replica.binding)).cursor


async def test_a_connection_gone_silent_is_given_up_stream_71(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-71: a follower at the head pings a connection silent for its keepalive time; the
    service answers, and the connection stays. WHEN every byte of it stops passing both ways
    (a server without power, a NAT that dropped it: no FIN, no reset) THEN the follower gives
    it up once as long again has passed without an answer, reconnects and gets the events it
    missed meanwhile. (Before, it waited on that connection for good.) The freeze stops the
    follower's kept-alive HTTP connection too, used again for its next status request, which
    it gives up after its request timeout (STREAM-136), shortened here as the keepalive is."""
    keepalive_s = 0.3
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service, faking(service.port) as fake:
            before = await post_small(service, 0, 60)
            follower = Follower(
                Endpoints.parse(fake.url()),
                service.token,
                replica,
                keepalive_s=keepalive_s,
                request_timeout_s=2.0,
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower.run)
                await until_cursor(replica, before)
                await trio.sleep(5 * keepalive_s)
                assert fake.upgrades == 1
                with caplog.at_level(logging.INFO, "healthlog.follow"):
                    fake.freeze()
                    frozen_at = trio.current_time()
                    total = await post_small(service, 120)
                    await until_cursor(replica, total)
                    assert trio.current_time() - frozen_at >= keepalive_s
                nursery.cancel_scope.cancel()
            assert fake.upgrades == 2
            assert f"no answer to a ping within {keepalive_s:g} s" in caplog.text
            assert await replica_export(replica) == await server_export(service)


async def test_a_slow_apply_is_not_taken_for_a_silent_server_stream_71(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-71: frames read while the replica could not be written (another connection held
    its write lock for three keepalive times) are applied late, with nothing more read from
    the connection meanwhile; the follower then pings and stays on its one connection, its
    silence being its own, not the server's. (Before, it gave the connection up at once, 'no
    answer to a ping', though it had sent none.)"""
    keepalive_s = 0.3
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service, faking(service.port) as fake:
            before = await post_small(service, 0)
            follower = Follower(
                Endpoints.parse(fake.url()), service.token, replica, keepalive_s=keepalive_s
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower.run)
                await until_cursor(replica, before)
                with caplog.at_level(logging.INFO, "healthlog.follow"):
                    with contextlib.closing(
                        sqlite3.connect(replica.path, isolation_level=None)
                    ) as holder:
                        holder.execute("BEGIN IMMEDIATE")
                        total = await post_small(service, 1)
                        await trio.sleep(3 * keepalive_s)
                        holder.execute("ROLLBACK")
                    await until_cursor(replica, total)
                    await trio.sleep(3 * keepalive_s)
                nursery.cancel_scope.cancel()
            assert "no answer to a ping" not in caplog.text
            assert fake.upgrades == 1
            assert await replica_export(replica) == await server_export(service)


async def endless(sent: list[int], client: trio.abc.Stream) -> None:
    """A 200 whose chunked JSON-looking body never ends; ``sent`` counts its bytes."""
    await client.send_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = b" " * 2**16
    while True:
        await client.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent[0] += len(chunk)


async def trickle(client: trio.abc.Stream) -> None:
    """A 200 announcing 1,000 bytes and sending one every 50 ms, never too slowly for a read
    timeout."""
    await client.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
    for _ in range(1000):
        await trio.sleep(0.05)
        await client.send_all(b" ")


async def test_an_answer_that_never_ends_or_trickles_stream_72(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-72: WHEN the status request's answer never ends THEN the follower stops with a
    FollowError saying it is larger than healthlog's answers are, having read little more
    than that bound (it used to read it all, its memory growing by the second); WHEN one
    trickles in a byte at a time THEN it is given up after the request timeout as a lost
    connection and asked again after the backoff (it used to wait for its end)."""
    monkeypatch.setattr(transport.follow, "MAX_JSON_BYTES", 2**20)
    sent = [0]
    with Replica(tmp_path / "endless") as replica:
        async with faking(answers={b"/v1/status": functools.partial(endless, sent)}) as fake:
            with (
                trio.fail_after(FRAME_LIMIT_S),
                pytest.raises(FollowError, match="/v1/status answered more than 1 MiB"),
            ):
                await follow(fake.url(), "hl_token", replica)
            # What the kernel buffers on either side besides.
            assert sent[0] < 2**20 + 16 * 2**20
    with Replica(tmp_path / "trickle") as replica:
        async with faking(answers={b"/v1/status": trickle}) as fake:
            follower = Follower(
                Endpoints.parse(fake.url()), "hl_token", replica, request_timeout_s=0.3
            )
            with caplog.at_level(logging.INFO, "healthlog.follow"):
                with trio.move_on_after(0.3 + 0.5 + 0.3 + 0.2):
                    await follower.run()
            assert fake.paths == [b"/v1/status", b"/v1/status"]
            assert "/v1/status was not answered within 0.3 s" in caplog.text
            assert await cursor_of(replica) == 0


async def test_a_snapshot_at_the_cursor_is_not_fetched_again_and_again_stream_73(
    tmp_path: Path,
) -> None:
    """STREAM-73: GIVEN a follower at the head WHEN every stream connection is refused with
    CURSOR_TOO_OLD and a (valid, signed) snapshot at its cursor THEN it fetches no snapshot and
    reconnects only after its backoff, doubling, its replica unchanged. (Before, it restored
    that snapshot and reconnected at once, rewriting its replica many times a second.)"""
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service:
            total = await post_small(service, 0, 60)
            await follow(service.url, service.token, replica, until_caught_up=True)
            manifest = (await service.get("/v1/snapshots")).json()
            assert manifest["seq"] == total
            refusal = {"type": "error", "code": "CURSOR_TOO_OLD", "snapshot": manifest}
            async with faking(
                service.port, frames=[orjson.dumps(refusal).decode()], close=4410
            ) as fake:
                with trio.move_on_after(2 * transport.follow.BACKOFF_START_S + 0.4):
                    await follow(fake.url(), service.token, replica)
            assert fake.upgrades == 2
            assert not [path for path in fake.paths if path.startswith(b"/v1/snapshots/")]
            assert await cursor_of(replica) == total
            assert await replica_export(replica) == await server_export(service)


def event(seq: Any) -> str:
    return orjson.dumps(
        {
            "type": "event",
            "seq": seq,
            "id": f"s:{seq}",
            "kind": "delivery.folded",
            "delivery_id": 1,
            "status": "parsed",
            "counters": {},
        }
    ).decode()


@pytest.mark.parametrize(
    ("last", "says"),
    [
        pytest.param(b"\x00" * 100, "a binary frame", id="binary"),
        pytest.param(event(2.0), "TypeError", id="float"),
        pytest.param(event(2.9), "TypeError", id="fraction"),
        pytest.param(event(True), "TypeError", id="bool"),
        pytest.param(event("2"), "TypeError", id="string"),
    ],
)
async def test_a_frame_not_of_healthlogs_shape_stops_the_follower_stream_74(
    tmp_path: Path, last: str | bytes, says: str
) -> None:
    """STREAM-74: WHEN the stream sends a binary frame, or an event whose sequence is not an
    integer (2.0, 2.9, true, "2") THEN the follower applies the events before it and stops
    with a FollowError saying the frame is not healthlog's. (Before, it skipped the binary
    frame and took 2.9 for 2, true for 1 and "2" for 2.)"""
    stream = {"id": "s", "instance": "i", "head": 3, "oldest_cursor": 0, "public_key": "k"}
    answers: dict[bytes, bytes | Answer] = {
        b"/v1/status": json_answer({"stream": stream}),
        b"/v1/snapshots/key": json_answer({"public_key": "k"}),
    }
    with Replica(tmp_path / "replica") as replica:
        async with faking(answers=answers, frames=[event(1), last, event(2)]) as fake:
            with (
                trio.fail_after(FRAME_LIMIT_S),
                pytest.raises(FollowError, match=f"a frame that is not healthlog's: {says}"),
            ):
                await follow(fake.url(), "hl_token", replica)
        assert await cursor_of(replica) == 1


def changed(seq: int, **state: Any) -> str:
    """An ``object.changed`` event frame whose object state has the fields ``state`` changed."""
    obj = {
        "units": "count",
        "hash": "00" * 32,
        "body": "",
        "sealed": False,
        "first": 0,
        "last": 0,
        "points": 1,
        "created_by": 1,
        **state,
    }
    frame = {"type": "event", "seq": seq, "id": f"s:{seq}", "kind": "object.changed"}
    key = {"metric": "m", "layer": "minutes", "hour": "2024-03-01T10:00:00Z", "hash": None}
    return orjson.dumps({**frame, **key, "points": 1, "delivery_id": 1, "object": obj}).decode()


@pytest.mark.parametrize("field", ["first", "last", "points", "created_by"])
async def test_an_object_number_beyond_sqlite_stops_the_follower_stream_200(
    tmp_path: Path, field: str
) -> None:
    """STREAM-200: WHEN the stream sends an event whose object holds a number past SQLite's
    integers (2**64 - 1, which JSON decoders read as an integer) THEN the follower applies the
    events before it and stops with a FollowError saying the frame is not healthlog's. (Before,
    the replica's write raised OverflowError out of ``follow``: a traceback, found writing
    ``scripts/fuzz/follow.py``.)"""
    stream = {"id": "s", "instance": "i", "head": 3, "oldest_cursor": 0, "public_key": "k"}
    answers: dict[bytes, bytes | Answer] = {
        b"/v1/status": json_answer({"stream": stream}),
        b"/v1/snapshots/key": json_answer({"public_key": "k"}),
    }
    frames = [event(1), changed(2, **{field: 2**64 - 1}), event(3)]
    with Replica(tmp_path / "replica") as replica:
        async with faking(answers=answers, frames=frames) as fake:
            with (
                trio.fail_after(FRAME_LIMIT_S),
                pytest.raises(FollowError, match="a frame that is not healthlog's: ValueError"),
            ):
                await follow(fake.url(), "hl_token", replica)
        assert await cursor_of(replica) == 1


def replace_replica(directory: Path, how: str) -> None:
    """Remove the replica's files, or move its directory away and make another replica where
    it was."""
    if how == "removed":
        for path in directory.glob(f"{REPLICA_FILE}*"):
            path.unlink()
    else:
        directory.rename(directory.with_name("moved"))
        with Replica(directory):
            pass


@pytest.mark.parametrize("how", ["removed", "replaced"])
async def test_a_replica_file_removed_or_replaced_under_follow_stream_75_cli_60(
    tmp_path: Path, how: str
) -> None:
    """STREAM-75, CLI-60: GIVEN `healthlog follow`, a real process following live WHEN its
    replica file is removed (or another replica file moved into its place) and a delivery
    comes THEN it exits 3 with one line saying the replica file was removed or replaced and
    naming it, no traceback, and writes nothing into the file in its place. (Before, it went
    on writing into the removed file, which nobody could read, for as long as it ran.)"""
    directory = tmp_path / "replica"
    async with serving(tmp_path / "server") as service:
        total = await post_small(service, 0, 60)
        async with following_process(service, directory, tmp_path / "stderr", total) as process:
            replace_replica(directory, how)
            await post_small(service, 120)
    assert process.returncode == 3
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert lines == [
        "healthlog: the replica file was removed or replaced while follow ran; start follow"
        f" again ({REPLICA_FILE})"
    ]
    if how == "replaced":
        with Replica(directory) as replaced:
            assert await cursor_of(replaced) == 0


async def test_a_full_disk_under_the_replica_is_a_storage_error_cli_60(tmp_path: Path) -> None:
    """CLI-60: WHEN a write of the replica fails as on a full disk (the file size limit: EFBIG,
    which SQLite reports as it reports ENOSPC) THEN `follow()` raises the StorageError naming
    `replica.sqlite`, which the command reports as a storage error (exit 3, the file named),
    not a refusal (exit 2, before, without the file)."""
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service:
            await post_small(service, 0)
            await follow(service.url, service.token, replica, until_caught_up=True)
            await post(service, hourly(600))
            await post_small(service, 1)
            size = (tmp_path / "replica" / REPLICA_FILE).stat().st_size
            with (
                files_limited_to(size + 2**16),
                pytest.raises(StorageError) as raised,
                trio.fail_after(FRAME_LIMIT_S),
            ):
                await follow(service.url, service.token, replica, until_caught_up=True)
    assert raised.value.file == REPLICA_FILE
    assert not isinstance(raised.value, FollowError)


async def test_a_store_restored_from_a_backup_is_followed_again_stream_76(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-76: GIVEN followers caught up with their service WHEN its data directory is
    restored from a backup taken before the last deliveries (the same stream, its head now
    behind their cursors) THEN `follow --until-caught-up` says so in one WARNING, restores the
    service's snapshot and ends equal to the service at its head; so does one whose first
    status read still shows the stream ahead and whose read once its stream connection is open
    shows it behind; and a live follower whose reads both show it ahead gets `CURSOR_IN_FUTURE`,
    reconnects after its backoff and comes to equal the service. (Before, the first exited 0 at
    once, its replica holding objects the service no longer had, and the last stopped for
    good.)"""
    server, saved = tmp_path / "server", tmp_path / "saved"
    with (
        Replica(tmp_path / "replica") as replica,
        Replica(tmp_path / "racing") as racing,
        Replica(tmp_path / "live") as live_replica,
    ):
        async with serving(server) as service:
            await post_small(service, 0, 60)
        shutil.copytree(server, saved)
        revoke_token(server)
        async with serving(server) as service:
            ahead = await post_small(service, 120, 180, 240)
            await follow(service.url, service.token, replica, until_caught_up=True)
            await follow(service.url, service.token, racing, until_caught_up=True)
            await follow(service.url, service.token, live_replica, until_caught_up=True)
        shutil.rmtree(server)
        shutil.copytree(saved, server)
        revoke_token(server)
        async with serving(server) as service:
            back = (await service.status())["stream"]
            assert back["head"] < ahead
            assert back["id"] == (await trio.to_thread.run_sync(replica.binding)).stream
            with caplog.at_level(logging.WARNING, "healthlog.follow"), trio.fail_after(15):
                await follow(service.url, service.token, replica, until_caught_up=True)
            assert [r.getMessage() for r in caplog.records if r.name == "healthlog.follow"] == [
                f"follow: the service's stream went back from seq {ahead} to {back['head']} (its"
                " store restored from a backup?); restoring its snapshot"
            ]
            assert await cursor_of(replica) == back["head"]
            assert await replica_export(replica) == await server_export(service)

            # The status it reads first still shows the stream ahead, as before the restore.
            ahead_status = json_answer({"stream": {**back, "head": ahead}})
            key = json_answer({"public_key": back["public_key"]})
            async with faking(service.port) as fake:

                async def once(client: trio.abc.Stream) -> None:
                    del fake.answers[b"/v1/status"]
                    await client.send_all(ahead_status)

                # Read again once the stream connection is open, it is behind.
                fake.answers[b"/v1/status"] = once
                racing_follower = Follower(
                    Endpoints.parse(fake.url()),
                    service.token,
                    racing,
                    subscriber="racing",
                    until_caught_up=True,
                )
                with caplog.at_level(logging.INFO, "healthlog.follow"), trio.fail_after(15):
                    await racing_follower.run()
                    assert "the service's stream went back while connecting" in caplog.text
                    assert fake.upgrades == 2
                    assert await cursor_of(racing) == back["head"]
                    assert await replica_export(racing) == await server_export(service)

                # Both reads show it ahead: the connection gets CURSOR_IN_FUTURE.
                caplog.clear()
                fake.answers.update({b"/v1/status": ahead_status, b"/v1/snapshots/key": key})
                live = Follower(Endpoints.parse(fake.url()), service.token, live_replica)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(live.run)
                    with caplog.at_level(logging.INFO, "healthlog.follow"), trio.fail_after(15):
                        while "CURSOR_IN_FUTURE" not in caplog.text:
                            await trio.sleep(POLL_S)
                        fake.answers.clear()
                        while await replica_export(live_replica) != await server_export(service):
                            await trio.sleep(POLL_S)
                    nursery.cancel_scope.cancel()
                assert (
                    "connection lost (ConnectionLost: the server closed the stream:"
                    " CURSOR_IN_FUTURE)" in caplog.text
                )
                assert await cursor_of(live_replica) == back["head"]


DIVERGED = (
    "follow: the service's stream holds other changes than the replica's at seq {} (its store"
    " restored from a backup, or a copy of its data directory?); restoring its snapshot"
)


async def follow_process(run_cli: RunCli, service: Service, replica: Path) -> CliRun:
    """``healthlog follow --until-caught-up`` of ``service`` into ``replica``, a real process."""
    return await trio.to_thread.run_sync(
        functools.partial(
            run_cli,
            *("follow", "--url", service.url, "--token", service.token),
            *("--replica", replica, "--until-caught-up"),
        )
    )


def warnings_of(run: CliRun) -> list[str]:
    """The messages of the records at WARNING or above that a command wrote on stderr."""
    return [
        line.split(' msg="', 1)[1].rstrip('"').replace('\\"', '"')
        for line in run.err.splitlines()
        if " level=WARNING " in line or " level=ERROR " in line
    ]


@pytest.mark.parametrize(
    "later",
    [
        pytest.param((300, 360, 420, 480), id="past_the_cursor_stream_111"),
        pytest.param((300, 360, 420), id="to_the_cursor_stream_112"),
    ],
)
async def test_a_store_restored_then_written_again_is_followed_again_stream_111_stream_112(
    tmp_path: Path, run_cli: RunCli, later: tuple[int, ...]
) -> None:
    """STREAM-111, STREAM-112: GIVEN a `healthlog serve` whose data directory is restored from
    a backup taken (the service stopped) before its last 3 deliveries, its head back from 10
    to 4, WHEN it folds new deliveries whose events reach past the cursor of a follower caught
    up before the restore (head 12), or exactly to it (head 10), THEN `healthlog follow
    --until-caught-up` logs one WARNING saying so, restores the snapshot, exits 0, and `export
    --replica` writes what `export` writes on the service; a follower caught up at 4, before
    the backup, resumes with no WARNING and ends equal too. (Before, both
    diverged followers exited 0 at once or after the events past their cursor, holding three
    objects the service no longer had and lacking those it now had, for good.)"""
    server, saved = tmp_path / "server", tmp_path / "saved"
    replica, common = tmp_path / "replica", tmp_path / "common"
    async with serving_process(server) as service:
        before = await post_small(service, 0, 60)
        assert (await follow_process(run_cli, service, common)).code == 0
    shutil.copytree(server, saved)
    revoke_token(server)
    async with serving_process(server) as service:
        ahead = await post_small(service, 120, 180, 240)
        assert (await follow_process(run_cli, service, replica)).code == 0
    shutil.rmtree(server)
    shutil.copytree(saved, server)
    revoke_token(server)
    async with serving_process(server) as service:
        again = await post_small(service, *later)
        assert (before, ahead, again) == (4, 10, 4 + 2 * len(later))
        diverged = await follow_process(run_cli, service, replica)
        kept = await follow_process(run_cli, service, common)
    exported = run_cli("export", "--data", server)
    assert exported.code == 0
    assert exported.out.count(b"\n") == 2 + len(later)
    assert diverged.code == 0, diverged.err
    assert warnings_of(diverged) == [DIVERGED.format(ahead)]
    assert diverged.err.splitlines()[-1] == f"follow: replica at seq {again}"
    assert run_cli("export", "--replica", replica).out == exported.out
    assert kept.code == 0, kept.err
    assert warnings_of(kept) == []
    assert kept.err.splitlines()[-1] == f"follow: replica at seq {again}"
    assert run_cli("export", "--replica", common).out == exported.out


async def _two_copies(tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of one data directory with two deliveries folded (the same instance, key and
    stream), each with its own token: ``first`` and ``second`` under ``tmp_path``."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    async with serving(first_dir) as service:
        await post_small(service, 0, 60)
    shutil.copytree(first_dir, second_dir)
    revoke_token(first_dir)
    revoke_token(second_dir)
    return first_dir, second_dir


async def _warnings_of_follow(
    caplog: pytest.LogCaptureFixture, service: Service, replica: Replica
) -> list[str]:
    """The WARNING and worse records logged so far, once ``follow --until-caught-up`` of
    ``service`` into ``replica`` has ended (within 15 s)."""
    with caplog.at_level(logging.INFO, "healthlog.follow"), trio.fail_after(15):
        await follow(service.url, service.token, replica, until_caught_up=True)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_follower_switched_between_two_copies_of_a_directory_stream_113(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-113: GIVEN two services on two copies of one data directory (the same instance,
    key and stream), each folding deliveries of its own after the copy, and a follower caught
    up with the first WHEN it is pointed at the second, whose head is past its cursor THEN it
    logs one WARNING, restores the second's snapshot and ends equal to the second; WHEN, having
    applied an event of the second, it is pointed back at the first, now past its cursor too,
    THEN the same, and it ends equal to the first. (Before, it took the other copy's events as
    the continuation of its own and ended equal to neither, with no word.)"""
    first_dir, second_dir = await _two_copies(tmp_path)
    with Replica(tmp_path / "replica") as replica:
        async with serving(first_dir) as first, serving(second_dir) as second:
            assert (await first.status())["stream"] == (await second.status())["stream"]
            on_first = await post_small(first, 120, 180)
            await post_small(second, 300, 360, 420)
            await follow(first.url, first.token, replica, until_caught_up=True)
            assert await cursor_of(replica) == on_first

            warnings = await _warnings_of_follow(caplog, second, replica)
            assert warnings == [DIVERGED.format(on_first)]
            assert await replica_export(replica) == await server_export(second)

            # An event of the second applied: the replica holds its tag.
            on_second = await post_small(second, 480)
            await follow(second.url, second.token, replica, until_caught_up=True)
            assert await cursor_of(replica) == on_second
            assert await post_small(first, 540, 600) >= on_second
            caplog.clear()
            warnings = await _warnings_of_follow(caplog, first, replica)
            assert warnings == [DIVERGED.format(on_second)]
            assert await replica_export(replica) == await server_export(first)
            assert await replica_export(replica) != await server_export(second)


async def test_a_replica_just_restored_knows_the_tag_at_its_cursor_stream_116(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-116: GIVEN two services on two copies of one data directory, each past the copy
    with deliveries of its own, and a follower that has just restored the second's snapshot
    (pointed at it from the first) and applied no event since WHEN it is pointed back at the
    first, whose head is at or past its cursor THEN it holds the tag of the event at the
    snapshot's sequence (from the snapshot file's header), is refused ``diverged``, logs one
    WARNING and ends equal to the first. (Before, it knew no tag after a restore: it took the
    first's events past its cursor as its own and ended equal to neither, with no word.)"""
    first_dir, second_dir = await _two_copies(tmp_path)
    with Replica(tmp_path / "replica") as replica:
        async with serving(first_dir) as first, serving(second_dir) as second:
            on_first = await post_small(first, 120, 180)
            on_second = await post_small(second, 300, 360, 420)
            await follow(first.url, first.token, replica, until_caught_up=True)
            await follow(second.url, second.token, replica, until_caught_up=True)
            restored = await trio.to_thread.run_sync(replica.binding)
            assert (restored.cursor, restored.tag) == (
                on_second,
                event_tag(second.data, on_second),
            )
            assert await post_small(first, 480, 540) > on_second > on_first
            warnings = await _warnings_of_follow(caplog, first, replica)
            assert warnings == [
                DIVERGED.format(on_first),
                DIVERGED.format(on_second),
            ]
            assert await replica_export(replica) == await server_export(first)


async def test_a_cursor_at_the_prune_horizon_is_still_checked_stream_123(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-123: GIVEN two services on two copies of one data directory, a follower caught up
    with the first at seq 8, and each service past it with deliveries of its own, its window
    pruned to exactly that cursor (event 8 gone, 9 and after held) WHEN the follower resumes
    from the first THEN it gets the events after its cursor, restores no snapshot and logs no
    WARNING; WHEN a second follower caught up at 8 with the first is pointed at the second THEN
    it is refused ``diverged`` (the store kept the tag of the event it pruned last), logs the one
    WARNING and ends equal to the second. (Before, the event at the cursor being pruned, its tag
    was not checked: the diverged follower applied the second's events 9 and 10 without a word,
    ending equal to neither service.)"""
    first_dir, second_dir = await _two_copies(tmp_path)
    with Replica(tmp_path / "same") as same, Replica(tmp_path / "other") as other:
        async with serving(first_dir) as first, serving(second_dir) as second:
            cursor = await post_small(first, 120, 180)
            await follow(first.url, first.token, same, until_caught_up=True)
            await follow(first.url, first.token, other, until_caught_up=True)
            assert (await cursor_of(same), await cursor_of(other)) == (cursor, cursor)
            on_first = await post_small(first, 240, 300)
            on_second = await post_small(second, 360, 420, 480)
            await prune(first.data, keep=on_first - cursor)
            await prune(second.data, keep=on_second - cursor)
            for service in (first, second):
                status = await service.status()
                assert status["stream"]["oldest_cursor"] == cursor

            with caplog.at_level(logging.INFO, "healthlog.follow"), trio.fail_after(15):
                await follow(first.url, first.token, same, until_caught_up=True)
            messages = [r.getMessage() for r in caplog.records if r.name == "healthlog.follow"]
            assert [m for m in messages if "snapshot" in m] == []
            assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
            assert await cursor_of(same) == on_first
            assert await replica_export(same) == await server_export(first)

            caplog.clear()
            warnings = await _warnings_of_follow(caplog, second, other)
            assert warnings == [DIVERGED.format(cursor)]
            assert await cursor_of(other) == on_second
            assert await replica_export(other) == await server_export(second)


def _noisy_day(day: int) -> bytes:
    """Ten hourly objects on day ``day`` of 2024, each of 60 points with 100 random bytes (as
    hex) in their note: some 130 KB that compress badly, written to the replica's -wal."""
    date = datetime.date(2024, 1, 1) + datetime.timedelta(days=day)
    points = [
        point(f"{date} {hour:02d}:{minute:02d}:00 +0000", qty=minute, note=os.urandom(100).hex())
        for hour in range(10)
        for minute in range(60)
    ]
    return body(metric("noise", "count", *points))


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    """Wait until a record holding ``text`` was logged (within ``FRAME_LIMIT_S``)."""
    with trio.fail_after(FRAME_LIMIT_S):
        while not any(text in message for message in caplog.messages):
            await trio.sleep(POLL_S)


async def test_a_replica_wal_a_reader_keeps_from_being_checkpointed_is_said_stream_124(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-124: GIVEN `follow` following a real service live, and another program holding a
    read transaction open on `replica.sqlite` (a database browser) WHEN deliveries are applied
    until its `-wal` is past `WAL_SIZE_LIMIT` (16 MiB) THEN `follow` logs one WARNING naming the
    file and its size, once while it lasts; once the reader ends its transaction and events
    come, one INFO says it is checkpointed again, and the `-wal` is back at the limit. (Before,
    nothing was said while the -wal grew with every batch: 71,653,768 bytes after 1,000
    deliveries of 24 objects, against 16,522,888 without the reader.)"""
    caplog.set_level(logging.INFO, "healthlog.follow")
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service, trio.open_nursery() as nursery:
            nursery.start_soon(follow, service.url, service.token, replica)
            day = 0

            async def deliver() -> None:
                nonlocal day
                await post(service, _noisy_day(day), SECONDS)
                day += 1
                await until_cursor(replica, int((await service.wait_folded())["stream"]["head"]))

            await deliver()
            wal = Path(f"{replica.path}-wal")
            with contextlib.closing(sqlite3.connect(replica.path, isolation_level=None)) as reader:
                reader.execute("BEGIN")
                reader.execute("SELECT count(*) FROM objects").fetchone()
                while wal.stat().st_size <= WAL_SIZE_LIMIT:
                    await deliver()
                await _logged(caplog, "cannot be checkpointed")
                await deliver()
                reader.execute("COMMIT")
            while not any("checkpointed again" in message for message in caplog.messages):
                await deliver()
            assert wal.stat().st_size <= WAL_SIZE_LIMIT
            nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage()]
    assert len(said) == 2, said
    match = re.fullmatch(
        rf"follow: {re.escape(replica.path)}-wal is (\d+) bytes and cannot be checkpointed: a"
        rf" read transaction is kept open on {re.escape(replica.path)} \(by another program,"
        r" such as a database browser, a script or a backup through SQLite\), and every event"
        r" applied is added to the -wal until it ends",
        said[0],
    )
    assert match is not None, said[0]
    assert int(match[1]) > WAL_SIZE_LIMIT
    assert said[1] == f"follow: {replica.path}-wal is checkpointed again"
    assert [r.levelno for r in caplog.records if "checkpoint" in r.getMessage()] == [
        logging.WARNING,
        logging.INFO,
    ]


async def test_a_second_follower_of_a_replica_is_refused_stream_77(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STREAM-77: GIVEN a follower following live into a replica WHEN a second `follow()`, or a
    `healthlog follow` process, is pointed at the same replica directory THEN it is refused: a
    FollowError, and the command exits 2 with one line naming the directory, before it
    connects; the first follows on, and once it has stopped a follower of that replica runs.
    (Before, both wrote the replica, and one's long snapshot restore held the other's writes
    past their busy timeout.)"""
    directory = tmp_path / "replica"
    message = f"another follow is running on the replica in {directory}"
    with Replica(directory) as replica:
        async with serving(tmp_path / "server") as service, faking(service.port) as fake:
            before = await post_small(service, 0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, service.url, service.token, replica)
                await until_cursor(replica, before)
                with pytest.raises(FollowError, match=message):
                    await follow(fake.url(), service.token, replica)
                run = await trio.to_thread.run_sync(
                    functools.partial(
                        run_cli,
                        *("follow", "--url", fake.url(), "--token", service.token),
                        *("--replica", directory, "--until-caught-up"),
                    )
                )
                assert (run.code, run.err.splitlines()) == (2, [f"healthlog: {message}"])
                assert fake.paths == []
                total = await post_small(service, 60)
                await until_cursor(replica, total)
                nursery.cancel_scope.cancel()
            total = await post_small(service, 120)
            await follow(fake.url(), service.token, replica, until_caught_up=True)
            assert await cursor_of(replica) == total


async def test_a_replica_path_that_is_no_directory_is_refused_cli_61(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """CLI-61: WHEN `follow --replica` names a file, or a symbolic link to a path that does not
    exist (a disk not mounted) THEN it exits 2 with one line saying so, connects to nothing and
    makes nothing. (Before: exit 3 with `[Errno 17] File exists: 'PATH'`.)"""
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "dangling").symlink_to(tmp_path / "unmounted" / "replica")
    async with faking() as fake:
        for name, says in (
            ("file", "is not a directory"),
            (
                "dangling",
                f"is a symbolic link to {tmp_path / 'unmounted' / 'replica'}, which does not exist",
            ),
        ):
            run = await trio.to_thread.run_sync(
                functools.partial(
                    run_cli,
                    *("follow", "--url", fake.url(), "--token", "hl_token"),
                    *("--replica", tmp_path / name),
                )
            )
            assert run.code == 2, run.err
            assert run.err.splitlines() == [f"healthlog: {tmp_path / name} {says}"]
    assert fake.paths == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file"]


async def test_a_close_4401_alone_stops_the_follower_stream_85(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STREAM-85: WHEN the stream is closed with 4401 (unauthorized) without an `UNAUTHORIZED`
    frame before it, after an event THEN the follower applies that event and stops for good with
    a FollowError saying the token was refused, having connected once, and `healthlog follow`
    exits 2 with one line saying so. (Before, it took the close for a lost connection and
    reconnected forever.)"""
    stream = {"id": "s", "instance": "i", "head": 3, "oldest_cursor": 0, "public_key": "k"}
    answers: dict[bytes, bytes | Answer] = {
        b"/v1/status": json_answer({"stream": stream}),
        b"/v1/snapshots/key": json_answer({"public_key": "k"}),
    }
    async with faking(answers=answers, frames=[event(1)], close=4401) as fake:
        with Replica(tmp_path / "replica") as replica:
            with (
                trio.fail_after(FRAME_LIMIT_S),
                pytest.raises(FollowError) as refused,
            ):
                await follow(fake.url(), "hl_token", replica)
            assert str(refused.value) == TOKEN_REFUSED
            assert fake.upgrades == 1
            assert await cursor_of(replica) == 1
        run = await trio.to_thread.run_sync(
            functools.partial(
                run_cli,
                *("follow", "--url", fake.url(), "--token", "hl_token"),
                *("--replica", tmp_path / "cli"),
            )
        )
    assert (run.code, run.err.splitlines()) == (
        2,
        [f"healthlog: {TOKEN_REFUSED}"],
    )
    assert fake.upgrades == 2


async def test_a_snapshot_download_refused_401_is_a_refused_token_stream_122(
    tmp_path: Path,
) -> None:
    """STREAM-122: a 401 to the snapshot download (the token revoked after the reference was
    read) stops the follower with the words of every other refused token, fetched once."""
    async with serving(tmp_path / "server") as service:
        _, path, _, answers = await restored_only(service)
        answers[path.encode()] = (
            b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        )
        async with faking(answers=answers) as fake:
            with (
                Replica(tmp_path / "replica") as replica,
                trio.fail_after(FRAME_LIMIT_S),
                pytest.raises(FollowError) as refused,
            ):
                await follow(fake.url(), service.token, replica)
    assert str(refused.value) == TOKEN_REFUSED
    assert fake.paths.count(path.encode()) == 1


async def paced(content: bytes, piece: int, every_s: float, client: trio.abc.Stream) -> None:
    """A 200 with ``content``, sent ``piece`` bytes every ``every_s`` seconds."""
    await client.send_all(
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(content)
    )
    for start in range(0, len(content), piece):
        await trio.sleep(every_s)
        await client.send_all(content[start : start + piece])


async def test_a_snapshot_download_stalled_or_trickled_is_given_up_stream_86(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-86: GIVEN a fresh replica of a service whose window was pruned, so that it must
    restore the snapshot, and a download window of 0.5 s for each 1 KiB WHEN the snapshot file
    trickles in a byte every 50 ms THEN the download is given up as a lost connection (`the
    snapshot download brought less than 1 KiB within 0.5 s`) and asked again after the
    backoff, the replica unchanged; WHEN it comes 1 KiB every 0.1 s, in all several windows
    long THEN it is restored and the replica equals the service. (Before, a trickled snapshot
    held the follower for as long as the server pleased.)"""
    monkeypatch.setattr(transport.follow, "SNAPSHOT_PACE_BYTES", 2**10)
    window_s = 0.5
    async with serving(tmp_path / "server") as service:
        total, path, content, answers = await restored_only(service)
        assert len(content) > 4 * 2**10
        with Replica(tmp_path / "trickled") as replica:
            trickled = functools.partial(paced, content, 1, 0.05)
            async with faking(answers={**answers, path.encode(): trickled}) as fake:
                follower = Follower(
                    Endpoints.parse(fake.url()),
                    service.token,
                    replica,
                    snapshot_window_s=window_s,
                )
                with caplog.at_level(logging.INFO, "healthlog.follow"):
                    limit_s = 2 * window_s + transport.follow.BACKOFF_START_S + window_s / 2
                    with trio.move_on_after(limit_s):
                        await follower.run()
            assert fake.paths.count(path.encode()) == 2
            assert "the snapshot download brought less than 1 KiB within 0.5 s" in caplog.text
            assert await cursor_of(replica) == 0
        with Replica(tmp_path / "slow") as replica:
            slow = functools.partial(paced, content, 2**10, window_s / 5)
            async with faking(answers={**answers, path.encode(): slow}) as fake:
                follower = Follower(
                    Endpoints.parse(fake.url()),
                    service.token,
                    replica,
                    until_caught_up=True,
                    snapshot_window_s=window_s,
                )
                with trio.fail_after(FRAME_LIMIT_S):
                    await follower.run()
            assert fake.paths.count(path.encode()) == 1
            assert await cursor_of(replica) == total
            assert await replica_export(replica) == await server_export(service)


async def test_a_download_left_by_a_killed_follower_is_removed_at_once_stream_101(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STREAM-101: GIVEN a `healthlog follow` process restoring a snapshot that trickles in
    WHEN it is killed (SIGKILL) with part of the file downloaded THEN that download file is left
    beside the replica; WHEN `follow --until-caught-up` runs again on the replica at once THEN
    it exits 0 equal to the service and no download file is left in the directory. (Before, a
    dead follower's file stayed until a restore an hour later removed it: each kill left one
    more, every one counted against the room a snapshot download may take.)"""
    directory = tmp_path / "replica"
    async with serving(tmp_path / "server") as service:
        total, path, content, answers = await restored_only(service)
        answers[path.encode()] = functools.partial(paced, content, 64, 0.05)
        async with faking(answers=answers) as fake, trio.open_nursery() as nursery:
            command = [
                *(sys.executable, "-m", "healthlog.cli", "follow", "--url", fake.url()),
                *("--token", service.token, "--replica", str(directory)),
            ]
            process: trio.Process = await nursery.start(
                functools.partial(trio.run_process, command, stderr=subprocess.DEVNULL, check=False)
            )
            with trio.fail_after(FRAME_LIMIT_S):
                while not any(f.stat().st_size > 2**10 for f in directory.glob("snapshot-*.tmp")):
                    await trio.sleep(POLL_S)
            process.send_signal(signal.SIGKILL)
        [left] = directory.glob("snapshot-*.tmp")
        assert 2**10 < left.stat().st_size < len(content)

        run = await trio.to_thread.run_sync(
            functools.partial(
                run_cli,
                *("follow", "--url", service.url, "--token", service.token),
                *("--replica", directory, "--until-caught-up"),
            )
        )
        assert run.code == 0, run.err
        assert sorted(f.name for f in directory.iterdir() if f.suffix == ".tmp") == []
        with Replica(directory) as replica:
            assert replica.binding().cursor == total
            assert await replica_export(replica) == await server_export(service)


def pruned_offline(path: Path) -> tuple[Manifest, bytes, dict[bytes, bytes | Answer]]:
    """A data directory at ``path`` with 500 hourly objects whose events were pruned to the
    last one, made without a service, so that a test on a MockClock can serve it from a fake
    front: the snapshot's manifest and file content, and the front's answers for the status,
    the snapshot key and the manifest."""
    data = DataDir(path)
    fold_metrics(data, 1)
    key = data.signing_key()
    with data.open_journal() as journal, data.open_store() as store:
        store.prune_events(keep=1, older_than_us=time.time_ns() // 1000 + 1)
        manifest = snapshot_files.build(data.snapshot_dir, journal, store, key, "/v1/snapshots")
        oldest, _ = store.event_window()
    [file] = data.snapshot_dir.glob(f"snapshot-*-{manifest.seq}.*")
    public_key = snapshots.public_key_text(key)
    stream = {
        "id": manifest.stream,
        "instance": manifest.instance,
        "head": manifest.seq,
        "oldest_cursor": oldest,
        "public_key": public_key,
    }
    answers: dict[bytes, bytes | Answer] = {
        b"/v1/status": json_answer({"stream": stream}),
        b"/v1/snapshots/key": json_answer({"public_key": public_key}),
        b"/v1/snapshots": json_answer(converter.unstructure(manifest)),
    }
    return manifest, file.read_bytes(), answers


async def paused(answer: bytes, after: int, pause_s: float, client: trio.abc.Stream) -> None:
    """``answer`` (a whole HTTP answer), its first ``after`` bytes, then nothing for
    ``pause_s`` seconds, then the rest."""
    await client.send_all(answer[:after])
    await trio.sleep(pause_s)
    await client.send_all(answer[after:])


async def test_answers_that_pause_within_their_bounds_are_waited_for_stream_136(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-136: GIVEN a fresh replica of a service whose window was pruned WHEN the status
    answer comes 10 s after its request (a NAS's disk spinning up) and the snapshot file's
    answer stops for 20 s after its first bytes (a mobile link's handover), both within the
    follower's bounds (30 s for a status, 256 KiB a minute for a download) THEN each is asked
    once, the snapshot is restored and the replica holds the server's objects, with no lost
    connection logged. (Before, the HTTP client's own read timeout of 5 s gave up both: the
    download was asked again and again, 6 times in 55 s against a real `serve` behind a front
    pausing 6 s, and never restored.)"""
    # The clock jumps only once nothing has run for 0.5 s: the front answers in the same run.
    autojump_clock.autojump_threshold = 0.5
    manifest, content, answers = pruned_offline(tmp_path / "server")
    path = urllib.parse.urlsplit(manifest.url).path.encode()
    status = answers[b"/v1/status"]
    assert isinstance(status, bytes)
    file_answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        len(content),
        content,
    )
    answers[b"/v1/status"] = functools.partial(paused, status, 0, 10.0)
    answers[path] = functools.partial(paused, file_answer, 1000, 20.0)
    async with faking(answers=answers) as fake:
        with (
            Replica(tmp_path / "replica") as replica,
            caplog.at_level(logging.INFO, "healthlog.follow"),
        ):
            follower = Follower(
                Endpoints.parse(fake.url()), "hl_token", replica, until_caught_up=True
            )
            with trio.move_on_after(300):
                await follower.run()
            assert await cursor_of(replica) == manifest.seq
            stored = await trio.to_thread.run_sync(lambda: len(list(replica.iter_objects())))
    assert "connection lost" not in caplog.text
    assert (fake.paths.count(b"/v1/status"), fake.paths.count(path)) == (1, 1)
    assert stored == HOURS


async def test_a_download_its_disk_refuses_stops_the_follower_stream_138(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, run_cli: RunCli
) -> None:
    """STREAM-138: GIVEN a fresh replica of a service whose window was pruned, on a disk that
    refuses to take the snapshot's 180 KB download though its free space is more (a quota, a
    file size limit: here 128 KiB, EFBIG) WHEN the follower downloads it THEN it stops with
    the replica's StorageError naming the directory and the system's reason, having fetched the
    snapshot once, no download file left, and `healthlog follow` exits 3 with that one line.
    (Before, the write's OSError was taken for a lost connection: the snapshot was fetched
    again after each backoff, for good, 7 times in 33 s and every 30 s after, 20 MB each
    against a real `serve` under `ulimit -f 20000`, with one WARNING calling it a connection
    lost.)"""
    autojump_clock.autojump_threshold = 0.5
    manifest, content, answers = pruned_offline(tmp_path / "server")
    path = urllib.parse.urlsplit(manifest.url).path.encode()
    answers[path] = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        len(content),
        content,
    )
    limit = 128 * 2**10
    assert len(content) > limit
    directory = tmp_path / "replica"
    says = f"the snapshot cannot be downloaded into {directory}: File too large"
    async with faking(answers=answers) as fake:
        with Replica(directory) as replica:
            follower = Follower(Endpoints.parse(fake.url()), "hl_token", replica)
            with (
                trio.move_on_after(300),
                files_limited_to(limit),
                pytest.raises(StorageError) as stopped,
            ):
                await follower.run()
            assert fake.paths.count(path) == 1
            assert str(stopped.value) == says
            assert await cursor_of(replica) == 0
        assert list(directory.glob("snapshot-*")) == []
        with files_limited_to(limit):
            run = await trio.to_thread.run_sync(
                functools.partial(
                    run_cli,
                    *("follow", "--url", fake.url(), "--token", "hl_token"),
                    *("--replica", directory),
                )
            )
    assert (run.code, run.err.splitlines()) == (3, [f"healthlog: {says}"])
    assert fake.paths.count(path) == 2


LIMITED = (
    b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 5\r\ncontent-length: 0\r\n"
    b"connection: close\r\n\r\n"
)
"""A front's rate limit (Traefik's RateLimit, Caddy's rate_limit): come back in 5 s."""


async def test_a_front_s_rate_limit_is_waited_out_stream_139(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-139: GIVEN a front with a rate limit in front of a service whose window was
    pruned WHEN it answers 429 Too Many Requests with `Retry-After: 5` to a fresh follower's
    first status request and to its first snapshot download THEN the follower asks each again
    no sooner than 5 s later, as it does after a 503, restores the snapshot and catches up;
    WHEN, the replica restored, it answers its first stream upgrade so THEN the upgrade is
    asked again no sooner than 5 s later. (Before, the first 429 stopped `follow` for good,
    exit 2, `healthlog: /v1/status answered 429`, against a real `serve` behind such a
    front.)"""
    autojump_clock.autojump_threshold = 0.5
    manifest, content, answers = pruned_offline(tmp_path / "server")
    path = urllib.parse.urlsplit(manifest.url).path.encode()
    file_answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        len(content),
        content,
    )
    asked: dict[bytes, list[float]] = {}

    def limited_once(path: bytes, then: Answer) -> Answer:
        async def answer(client: trio.abc.Stream) -> None:
            asked.setdefault(path, []).append(trio.current_time())
            if len(asked[path]) == 1:
                await client.send_all(LIMITED)
            else:
                await then(client)

        return answer

    def sending(answer: bytes) -> Answer:
        async def send(client: trio.abc.Stream) -> None:
            await client.send_all(answer)

        return send

    status = answers[b"/v1/status"]
    assert isinstance(status, bytes)
    answers[b"/v1/status"] = limited_once(b"/v1/status", sending(status))
    answers[path] = limited_once(path, sending(file_answer))
    with (
        Replica(tmp_path / "replica") as replica,
        caplog.at_level(logging.INFO, "healthlog.follow"),
    ):
        async with faking(answers=answers) as fake:
            follower = Follower(
                Endpoints.parse(fake.url()), "hl_token", replica, until_caught_up=True
            )
            with trio.fail_after(300):
                await follower.run()
            assert await cursor_of(replica) == manifest.seq
            with trio.CancelScope() as upgraded:

                async def stop(_: trio.abc.Stream) -> None:
                    upgraded.cancel()

                answers[b"/v1/stream"] = limited_once(b"/v1/stream", stop)
                with trio.fail_after(300):
                    await Follower(Endpoints.parse(fake.url()), "hl_token", replica).run()
    assert sorted(asked) == sorted([b"/v1/status", path, b"/v1/stream"])
    for times in asked.values():
        assert times[1] - times[0] >= 5
    retried = "follow: retrying in 5.0 s, as the server asks (Retry-After: 5 s)"
    assert caplog.text.count(retried) == 3


async def test_the_chmod_said_of_a_shared_replica_directory_with_a_space_runs_as_given_stream_190(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STREAM-190: `healthlog follow` on a replica directory every user may write in (STREAM-132)
    whose path holds a space (`Health Replica`) names a `chmod go-w` that, run by a shell as
    given, mends that directory: the next run says nothing of it. (Before, the path stood
    unquoted: the shell read `.../Health` and `Replica`, `chmod` said `cannot access`, and the
    directory stayed open to every user.)"""
    replica = tmp_path / "Health Replica"
    replica.mkdir()
    replica.chmod(0o777)
    async with serving(tmp_path / "server") as service:
        await post_small(service, 0)
        warned = await follow_process(run_cli, service, replica)
        [said] = warnings_of(warned)
        found = re.search(r"`(chmod go-w [^`]+)`", said)
        assert found is not None, said
        mending = subprocess.run(["sh", "-c", found.group(1)], capture_output=True, text=True)
        assert mending.returncode == 0, mending.stderr
        mended = await follow_process(run_cli, service, replica)
    assert warned.code == 0, warned.err
    assert mended.code == 0, mended.err
    assert warnings_of(mended) == []
