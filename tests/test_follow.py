"""``healthlog follow`` and its replica against a real service (specs/stream.md, STREAM-19 to
STREAM-24), its websocket client against a scripted server (STREAM-26) and the replica file's
pages (STREAM-27).

The command runs as a real process where its exit code and output matter; elsewhere
:func:`transport.follow.follow` runs in the test's trio run, so it can be cancelled at any
moment and pointed at a restarted service.
"""

from __future__ import annotations

import functools
import os
import random
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import trio
from _service_helpers import POLL_S, TOKEN_NAME, Service, serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    acked,
    hourly,
    post,
    post_small,
    prune,
    replica_export,
    server_export,
    small,
)
from conftest import CliRun, RunCli
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from healthlog.storage import snapshot_files
from healthlog.storage.datadir import SIGNING_KEY_FILE, DataDir
from healthlog.storage.replica import Binding, Replica
from transport.follow import ConnectionLost, FollowError, StreamSocket, follow

GRACE_S = 1.0
ACK_WAIT_S = 3.0


async def cli(run_cli: RunCli, *args: str | os.PathLike[str]) -> CliRun:
    """``healthlog ARGS`` as a process, in a thread so the service keeps serving meanwhile."""
    return await trio.to_thread.run_sync(functools.partial(run_cli, *args))


async def follow_process(
    run_cli: RunCli, service: Service, tmp_path: Path, url: str | None = None
) -> CliRun:
    """``healthlog follow --until-caught-up`` into ``tmp_path/replica`` as subscriber ``nas``."""
    return await cli(
        run_cli,
        "follow",
        "--url",
        url or service.url,
        "--token",
        service.token,
        "--replica",
        tmp_path / "replica",
        "--subscriber",
        "nas",
        "--until-caught-up",
        "--data",
        tmp_path / "client",
    )


async def exports(run_cli: RunCli, service: Service, tmp_path: Path) -> tuple[bytes, bytes]:
    """``healthlog export`` of the service's data directory and of the replica."""
    server = await cli(run_cli, "export", "--data", service.data.path)
    replica = await cli(
        run_cli, "export", "--replica", tmp_path / "replica", "--data", tmp_path / "client"
    )
    assert (server.code, replica.code) == (0, 0), server.err + replica.err
    return server.out, replica.out


async def binding(replica: Replica) -> Binding:
    return await trio.to_thread.run_sync(replica.binding)


async def until_cursor(replica: Replica, seq: int) -> None:
    with trio.fail_after(FRAME_LIMIT_S):
        while (await binding(replica)).cursor < seq:
            await trio.sleep(POLL_S)


def revoke_token(path: Path) -> None:
    """Let ``serving`` create its token again on the same data directory."""
    with DataDir(path).open_tokens() as tokens:
        tokens.revoke(TOKEN_NAME)


async def test_follow_until_caught_up(tmp_path: Path, run_cli: RunCli) -> None:
    """STREAM-19: the follow process makes a replica whose export equals the server's."""
    async with serving(tmp_path / "server") as service:
        await post(service, hourly(30))
        total = await post_small(service, 0, 1, 61)
        run = await follow_process(run_cli, service, tmp_path)
        assert run.code == 0, run.err
        assert f"follow: replica at seq {total}" in run.err
        server, replica = await exports(run_cli, service, tmp_path)
        assert server == replica
        assert server.count(b"\n") == 33
        await acked(service, "nas", total)

        total = await post_small(service, 2, 120)
        run = await follow_process(
            run_cli, service, tmp_path, f"ws://127.0.0.1:{service.port}/v1/stream"
        )
        assert run.code == 0, run.err
        server, replica = await exports(run_cli, service, tmp_path)
        assert server == replica
        assert server.count(b"\n") == 35
        await acked(service, "nas", total)


async def follow_live(
    service: Service, replica: Replica, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    """Follow without end (retrying when the service goes) until the scope is cancelled."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await follow(service.url, service.token, replica, subscriber="nas")


async def test_follow_resumes_after_server_restart(tmp_path: Path) -> None:
    """STREAM-20: after a restart on the same data directory the follower resumes from its
    cursor, without a snapshot."""
    server_dir = tmp_path / "server"
    with Replica(tmp_path / "replica") as replica:
        async with trio.open_nursery() as nursery:
            async with serving(server_dir, graceful_timeout_s=GRACE_S) as first:
                before = await post_small(first, 0, 60, 120)
                follower = await nursery.start(follow_live, first, replica)
                await until_cursor(replica, before)
                stream = (await first.status())["stream"]["id"]
            # The follower saw its connection end and now retries against a closed port.
            await trio.sleep(GRACE_S)
            follower.cancel()
        revoke_token(server_dir)
        async with serving(server_dir) as second:
            total = await post_small(second, 180, 240)
            assert total > before
            await follow(second.url, second.token, replica, subscriber="nas", until_caught_up=True)
            assert await binding(replica) == Binding(
                (await second.status())["stream"]["instance"],
                stream,
                (await second.status())["stream"]["public_key"],
                total,
            )
            assert await replica_export(replica) == await server_export(second)
            assert snapshot_files.latest(second.data.snapshot_dir, stream) is None
            await acked(second, "nas", total)


async def test_follow_restores_from_snapshot_out_of_window(tmp_path: Path) -> None:
    """STREAM-21: a cursor fallen out of the online window is restored from the snapshot."""
    with Replica(tmp_path / "replica") as replica, Replica(tmp_path / "fresh") as fresh:
        async with serving(tmp_path / "server") as service:
            before = await post_small(service, 0, 60)
            await follow(service.url, service.token, replica, until_caught_up=True)
            assert (await binding(replica)).cursor == before
            total = await post_small(service, 61, 180, 240)
            assert await prune(service.data, keep=2) == total - 2

            await follow(service.url, service.token, replica, until_caught_up=True)
            stream = (await service.status())["stream"]["id"]
            assert snapshot_files.latest(service.data.snapshot_dir, stream) == total
            assert (await binding(replica)).cursor == total
            assert await replica_export(replica) == await server_export(service)

            await follow(service.url, service.token, fresh, until_caught_up=True)
            assert (await binding(fresh)).cursor == total
            assert await replica_export(fresh) == await server_export(service)

            total = await post_small(service, 300)
            await follow(service.url, service.token, replica, until_caught_up=True)
            assert (await binding(replica)).cursor == total
            assert await replica_export(replica) == await server_export(service)


async def test_follow_survives_random_disconnects(tmp_path: Path) -> None:
    """STREAM-22: cancelled and restarted at random moments while deliveries arrive, the
    follower still ends equal to the server."""
    rng = random.Random(22)
    deliveries = 60
    posted = trio.Event()
    cuts = 0
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service:
            async with trio.open_nursery() as nursery:

                async def post_all() -> None:
                    for n in range(deliveries):
                        # A few hours, each changed several times.
                        await post(service, small(n * 37 % 300))
                        await trio.sleep(rng.uniform(0, 0.05))
                    posted.set()

                nursery.start_soon(post_all)
                while not posted.is_set():
                    with trio.move_on_after(rng.uniform(0.05, 0.4)):
                        await follow(service.url, service.token, replica, subscriber="chaos")
                    cuts += 1
                    await trio.sleep(rng.uniform(0, 0.1))
            assert (await binding(replica)).cursor > 0
            # One more event, so the final run has something to acknowledge (STREAM-24).
            total = await post_small(service, 1000)
            await follow(
                service.url, service.token, replica, subscriber="chaos", until_caught_up=True
            )
            assert (await binding(replica)).cursor == total
            assert await replica_export(replica) == await server_export(service)
            await acked(service, "chaos", total)
    assert total == 2 * deliveries + 2
    assert cuts >= 3


async def test_follow_refuses_another_instance(tmp_path: Path, run_cli: RunCli) -> None:
    """STREAM-23: a replica bound to one instance refuses another (exit 2) and is untouched."""
    async with serving(tmp_path / "a") as first, serving(tmp_path / "b") as second:
        await post_small(first, 0)
        await post_small(second, 60)
        assert (await follow_process(run_cli, first, tmp_path)).code == 0
        refused = await follow_process(run_cli, second, tmp_path)
        assert refused.code == 2
        assert "another healthlog instance" in refused.err
        server, replica = await exports(run_cli, first, tmp_path)
        assert server == replica


async def test_follow_refuses_changed_snapshot_key(tmp_path: Path) -> None:
    """STREAM-23: a server whose snapshot key changed since first contact is refused."""
    server_dir = tmp_path / "server"
    with Replica(tmp_path / "replica") as replica:
        async with serving(server_dir) as service:
            await post_small(service, 0)
            await follow(service.url, service.token, replica, until_caught_up=True)
        (server_dir / SIGNING_KEY_FILE).unlink()
        revoke_token(server_dir)
        async with serving(server_dir) as service:
            with pytest.raises(FollowError, match="snapshot key changed"):
                await follow(service.url, service.token, replica, until_caught_up=True)


async def test_caught_up_follower_still_acknowledges(tmp_path: Path) -> None:
    """STREAM-24: a follower already at the head still reports its cursor."""
    with Replica(tmp_path / "replica") as replica:
        async with serving(tmp_path / "server") as service:
            total = await post_small(service, 0, 60)
            await follow(service.url, service.token, replica, until_caught_up=True)
            assert (await binding(replica)).cursor == total
            await follow(
                service.url, service.token, replica, subscriber="nas", until_caught_up=True
            )
            await acked(service, "nas", total, limit_s=ACK_WAIT_S)


LONG = "three" * 20_000


async def server_events(stream: trio.SocketStream, ws: WSConnection) -> list[Event]:
    """The events of the next read of a scripted server's socket."""
    ws.receive_data(await stream.receive_some(2**16) or None)
    return list(ws.events())


async def scripted_server(stream: trio.SocketStream, answers: list[Event]) -> None:
    """Frames with the handshake answer, a fragmented message, one split over socket writes,
    then a ping and a close; collects the client's answers to those two."""
    ws = WSConnection(ConnectionType.SERVER)
    while not any(isinstance(e, Request) for e in await server_events(stream, ws)):
        pass
    await stream.send_all(ws.send(AcceptConnection()) + ws.send(TextMessage("one")))
    await stream.send_all(ws.send(TextMessage("tw", message_finished=False)))
    await stream.send_all(ws.send(TextMessage("o", message_finished=True)))
    data = ws.send(TextMessage(LONG))
    for piece in (data[:1], data[1:3], data[3:1000], data[1000:]):
        await stream.send_all(piece)
        await trio.sleep(0)
    await stream.send_all(ws.send(Ping(b"there?")))
    while not any(isinstance(e, Pong) for e in answers):
        answers.extend(await server_events(stream, ws))
    await stream.send_all(ws.send(CloseConnection(code=1001)))
    while not any(isinstance(e, CloseConnection) for e in answers):
        answers.extend(await server_events(stream, ws))


async def refusing_server(stream: trio.SocketStream) -> None:
    ws = WSConnection(ConnectionType.SERVER)
    while not any(isinstance(e, Request) for e in await server_events(stream, ws)):
        pass
    await stream.send_all(ws.send(RejectConnection(status_code=403)))


async def test_stream_socket_against_a_scripted_server() -> None:
    """STREAM-26: every message whole and in order (with the handshake answer, in fragments,
    split over writes), the ping and the close answered, the close reported as lost."""
    answers: list[Event] = []
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(
                trio.serve_tcp,
                functools.partial(scripted_server, answers=answers),
                0,
                host="127.0.0.1",
            )
        )
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(FRAME_LIMIT_S):
            async with await trio.open_tcp_stream("127.0.0.1", port) as tcp:
                ws = StreamSocket(tcp)
                await ws.open("127.0.0.1", "/v1/stream?after=0", [(b"authorization", b"T")])
                messages: list[str] = []
                while len(messages) < 3:
                    messages += await ws.receive(64)
                assert messages == ["one", "two", LONG]
                with pytest.raises(ConnectionLost):
                    await ws.receive(64)
            assert [type(e) for e in answers] == [Pong, CloseConnection]
            assert isinstance(answers[1], CloseConnection)
            assert answers[1].code == 1001
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, refusing_server, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(FRAME_LIMIT_S):
            async with await trio.open_tcp_stream("127.0.0.1", port) as tcp:
                with pytest.raises(ConnectionLost, match="403"):
                    await StreamSocket(tcp).open("127.0.0.1", "/v1/stream", [])
        nursery.cancel_scope.cancel()


def page_size(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])


def test_replica_file_pages(tmp_path: Path) -> None:
    """STREAM-27: a new replica file has 16 KiB pages; an existing one keeps its own pages and
    its state."""
    with Replica(tmp_path / "new"):
        pass
    assert page_size(tmp_path / "new" / "replica.sqlite") == 16 * 2**10

    older = tmp_path / "older"
    older.mkdir()
    with closing(sqlite3.connect(older / "replica.sqlite")) as conn:
        conn.execute("PRAGMA page_size = 4096")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE kept (n INTEGER)")
    with Replica(older) as replica:
        replica.restore("stream", 7, [])
    assert page_size(older / "replica.sqlite") == 4096
    with Replica(older) as replica:
        assert replica.binding().cursor == 7
