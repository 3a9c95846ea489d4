"""What a ``healthlog follow`` run for months meets (specs/stream.md, STREAM-117 to STREAM-124):
refusals asking it to wait longer than its backoff, said as waited (STREAM-117); a stream
closed because no snapshot could be built, which says when to come back (STREAM-118); a replica
its user may not write (STREAM-119); a service set up anew, met by a replica of the old one
(STREAM-120).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
from _disk import in_full_file_system, reachable_home
from _service_helpers import Service, serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    listen,
    post_small,
    prune,
    read_head,
    replica_export,
    server_export,
    serving_process,
    stamped,
    step_until,
    subscribe,
)
from conftest import CliRun, RunCli
from trio_websocket import ConnectionClosed

from healthlog.storage.replica import REPLICA_FILE, Replica
from transport.follow import Endpoints, Follower, close_retry_after_s, follow


def unavailable(retry_after_s: int) -> bytes:
    """A whole HTTP answer 503 asking to come back in ``retry_after_s`` (a front's, or the
    service's for a snapshot it cannot build)."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: %d\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}" % retry_after_s
    )


@pytest.mark.parametrize(
    ("met", "asked", "warning"),
    [
        pytest.param(
            False,
            120,
            "follow: the service cannot be reached (ConnectionLost: /v1/status answered 503);"
            " retrying in 120 s, as the server asks",
            id="new",
        ),
        pytest.param(
            True,
            60,
            "follow: no progress for a while, the last connection lost (ConnectionLost:"
            " /v1/status answered 503); retrying in 60 s, as the server asks",
            id="met",
        ),
    ],
)
async def test_the_warning_says_the_wait_a_retry_after_asks_stream_117(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    met: bool,
    asked: int,
    warning: str,
) -> None:
    """STREAM-117: a follower every request of which is answered 503 with a ``Retry-After``
    longer than its backoff's cap (a front's, or a service that cannot build the snapshot) waits
    what it asks, and its one WARNING says that wait, not the backoff's 30 s: at its first
    failure for a replica that never met its service, once the backoff has reached its cap for
    one that has."""
    # The clock jumps only once nothing has run for 0.2 s: the front answers in the same run.
    autojump_clock.autojump_threshold = 0.2
    answer = unavailable(asked)

    async def refuse(client: trio.SocketStream) -> None:
        async with client:
            await read_head(client)
            await client.send_all(answer)

    with (
        Replica(tmp_path / "replica") as replica,
        caplog.at_level(logging.INFO, "healthlog.follow"),
    ):
        if met:
            replica.bind("a1b2c3", "S2V5")
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, refuse)
            follower = Follower(Endpoints.parse(f"http://127.0.0.1:{port}"), "hl_x", replica)
            with trio.move_on_after(10 * asked):
                await follower.run()
            nursery.cancel_scope.cancel()
    said = [r for r in caplog.records if r.name == "healthlog.follow"]
    assert [r.getMessage() for r in said if r.levelno >= logging.WARNING] == [warning]
    retries = {r.getMessage() for r in said if r.getMessage().startswith("follow: retrying")}
    assert retries == {
        f"follow: retrying in {asked:.1f} s, as the server asks (Retry-After: {asked} s)"
    }


SNAPSHOT_CLOSED = "follow: connection lost (ConnectionLost: the stream ended)"
SNAPSHOT_RETRY = "follow: retrying in 60.0 s, as the server asks (Retry-After: 60 s)"


async def test_a_stream_without_a_snapshot_says_when_to_come_back_stream_118(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """STREAM-118: a replica whose cursor fell out of the window of a service that cannot build
    a snapshot (its data directory moved away, RUN-45) is closed 1011 with the reason
    ``SNAPSHOT_UNAVAILABLE; retry-after=60``, no frame; ``follow`` waits those 60 s (in trio's
    time, a MockClock moved on a second at a time, the service in a process of its own), and
    with the directory back restores the snapshot and ends equal to the service."""
    mock_clock.rate = 1.0
    data, moved = tmp_path / "server", tmp_path / "moved"
    async with serving_process(data) as service:
        await post_small(service, 0)
        with Replica(tmp_path / "replica") as replica, stamped("healthlog.follow") as follower:
            with trio.fail_after(60):
                await follow(service.url, service.token, replica, until_caught_up=True)
            total = await post_small(service, 60, 120, 180)
            await prune(service.data, keep=2)
            data.rename(moved)
            frames: list[str | bytes] = []
            async with subscribe(service, after=2) as ws:
                with trio.fail_after(60), contextlib.suppress(ConnectionClosed):
                    frames.append(await ws.get_message())
                assert ws.closed is not None
                assert (ws.closed.code, ws.closed.reason) == (
                    1011,
                    "SNAPSHOT_UNAVAILABLE; retry-after=60",
                )
            followed = trio.Event()

            async def following() -> None:
                await follow(service.url, service.token, replica, until_caught_up=True)
                followed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(following)
                await step_until(mock_clock, lambda: bool(follower.at(SNAPSHOT_CLOSED)))
                moved.rename(data)
                await step_until(mock_clock, followed.is_set)
            assert replica.binding().cursor == total
            assert await replica_export(replica) == await server_export(service)
    assert frames == []
    (closed,) = follower.at(SNAPSHOT_CLOSED)
    (restored,) = follower.at("follow: restored snapshot at seq ")
    assert restored - closed >= 60
    assert follower.messages("follow: retrying") == [SNAPSHOT_RETRY]
    assert follower.messages(level=logging.WARNING) == []


@pytest.mark.parametrize(
    ("reason", "seconds"),
    [
        ("SNAPSHOT_UNAVAILABLE; retry-after=60", 60.0),
        ("SNAPSHOT_UNAVAILABLE;Retry-After= 30 ", 30.0),
        ("SNAPSHOT_UNAVAILABLE", None),
        ("STORE_ERROR", None),
        ("", None),
        ("SNAPSHOT_UNAVAILABLE; retry-after=soon", None),
        ("SNAPSHOT_UNAVAILABLE; retry-after=-5", None),
        ("retry-after=60", None),
    ],
)
def test_what_a_close_reason_asks_stream_118(reason: str, seconds: float | None) -> None:
    """STREAM-118: a close reason asks to wait by a ``retry-after`` parameter after its code,
    read as a ``Retry-After`` is; a reason without one, or with one that is neither a whole
    number of seconds nor an HTTP date, asks for nothing (the backoff applies)."""
    assert close_retry_after_s(reason) == seconds


# The user the replica belongs to in STREAM-119: another one when the tests run as root, whom
# modes do not stop.
OTHER_UID = 65534
PROCESS_LIMIT_S = 120.0


def as_its_user() -> list[str]:
    """The command prefix that runs a command as the replica's user (empty: this one)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root is stopped by no mode, and setpriv is missing")
    return [setpriv, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]


async def test_a_replica_its_user_may_not_write_says_why_stream_119(tmp_path: Path) -> None:
    """STREAM-119: ``healthlog follow`` on a replica whose file its user may not write (mode
    0444), or whose ``-shm`` left by a killed follower it may not, exits 3 with one line naming
    that file, its owner and mode and what to do, and makes no ``-wal`` or ``-shm`` file; once
    the mode is mended it catches up, its replica exporting what the service does."""
    prefix = as_its_user()
    user = pwd.getpwuid(OTHER_UID if prefix else os.geteuid()).pw_name
    with reachable_home("healthlog-stream-119-") as home:
        replica = home / "replica"
        replica.mkdir()
        if prefix:
            os.chown(replica, OTHER_UID, OTHER_UID)
        async with serving(tmp_path / "server") as service:

            def healthlog(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
                command = [*prefix, sys.executable, "-m", "healthlog.cli", *map(str, args)]
                return subprocess.run(
                    command, capture_output=True, text=True, cwd=home, timeout=PROCESS_LIMIT_S
                )

            following = ("follow", "--url", service.url, "--token", service.token)
            caught_up = (*following, "--replica", replica, "--until-caught-up")

            async def follow_once() -> subprocess.CompletedProcess[str]:
                return await trio.to_thread.run_sync(lambda: healthlog(*caught_up))

            await post_small(service, 0)
            assert (await follow_once()).returncode == 0
            file = replica / REPLICA_FILE
            file.chmod(0o444)
            total = await post_small(service, 60)
            refused = await follow_once()
            file.chmod(0o644)
            files_after_refusal = sorted(os.listdir(replica))
            assert (await follow_once()).returncode == 0

            # A follower killed while it ran leaves its -wal and -shm files.
            live = await trio.lowlevel.open_process(
                [*prefix, sys.executable, "-m", "healthlog.cli", *following, "--replica", replica],
                cwd=home,
                stderr=subprocess.DEVNULL,
            )
            shm = replica / f"{REPLICA_FILE}-shm"
            with trio.fail_after(FRAME_LIMIT_S):
                while not shm.exists():
                    await trio.sleep(0.05)
            live.send_signal(signal.SIGKILL)
            await live.wait()
            shm.chmod(0o444)
            refused_shm = await follow_once()
            shm.chmod(0o644)
            total = await post_small(service, 120)
            done = await follow_once()
            exported = await trio.to_thread.run_sync(
                lambda: healthlog("export", "--replica", replica, "--data", home / "none")
            )
            assert exported.stdout.encode() == await server_export(service)
    for run, name in ((refused, REPLICA_FILE), (refused_shm, shm.name)):
        assert run.returncode == 3, run.stderr
        assert run.stderr.splitlines() == [
            "healthlog: the replica cannot be written: user"
            f" {user} may not read and write {replica / name} (it is {user}'s, mode 0444); run"
            f" every healthlog command on {replica} as the user it belongs to (`sudo -u {user}"
            f" healthlog ...`), or make it {user}'s to read and write (`chown -R {user}:"
            f" {replica} && chmod -R u+rwX {replica}`)"
        ]
    assert files_after_refusal == [REPLICA_FILE]
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"follow: replica at seq {total}"]


REMOUNTED = (
    '"$PY" -m healthlog.cli follow --url "$2" --token "$3" --replica "$1/replica"'
    " --until-caught-up 2> /dev/null || exit 98\n"
    'mount -o remount,ro "$1" || exit 96\n'
    '"$PY" -m healthlog.cli follow --url "$2" --token "$3" --replica "$1/replica"'
    " --until-caught-up\n"
    'echo "follow exit $?" >&2\n'
)


async def test_a_replica_on_a_read_only_mount_says_so_stream_119(tmp_path: Path) -> None:
    """STREAM-119: ``healthlog follow`` on a replica whose file system was remounted read-only
    (a real tmpfs, as the kernel remounts one after disk errors) exits 3 with one line saying
    so and that ``export --replica`` reads the replica there."""
    point = tmp_path / "mnt"
    point.mkdir()
    async with serving(tmp_path / "server") as service:
        await post_small(service, 0)
        err = await trio.to_thread.run_sync(
            lambda: in_full_file_system(REMOUNTED, point, service.url, service.token)
        )
    assert err.splitlines() == [
        "healthlog: the replica cannot be written: the file system of"
        f" {point / 'replica'} is mounted read-only (as the kernel remounts one after disk"
        " errors: see `dmesg`); `healthlog export --replica` reads it there (replica.sqlite)",
        "follow exit 3",
    ]


async def test_a_service_set_up_anew_says_what_to_do_stream_120(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STREAM-120: a replica that followed one service, pointed at a service set up anew (a new
    data directory: another instance) exits 2 with one line naming both instances and what to
    do, its replica untouched; following that service into a new replica directory works."""
    async with serving(tmp_path / "old") as old, serving(tmp_path / "new") as new:
        await post_small(old, 0)
        total = await post_small(new, 60, 120)

        async def follow_into(service: Service, replica: Path) -> CliRun:
            args = ("follow", "--url", service.url, "--token", service.token)
            return await trio.to_thread.run_sync(
                lambda: run_cli(*args, "--replica", replica, "--until-caught-up")
            )

        assert (await follow_into(old, tmp_path / "replica")).code == 0
        before = (tmp_path / "replica" / REPLICA_FILE).read_bytes()
        refused = await follow_into(new, tmp_path / "replica")
        after = (tmp_path / "replica" / REPLICA_FILE).read_bytes()
        anew = await follow_into(new, tmp_path / "anew")
        ours, theirs = await old.status(), await new.status()
    assert refused.code == 2
    assert refused.err.splitlines() == [
        "healthlog: the replica follows another healthlog instance"
        f" ({ours['stream']['instance']}), not this service's ({theirs['stream']['instance']}):"
        " a service set up anew (a new data directory, not one restored from a backup) is"
        " followed into a new replica directory (another --replica DIR); else --url names"
        " another service than the one the replica followed"
    ]
    assert after == before
    assert (anew.code, anew.err) == (0, f"follow: replica at seq {total}\n")
