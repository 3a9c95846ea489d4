"""A data directory and a follow replica left by the first releases of healthlog, opened by this
one (specs/store.md, STORE-155): the oldest path of every file's migrations, through a real
``healthlog serve`` and ``healthlog follow``."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from _cli_bodies import body, metric, point, write
from _first_release import OLD_HOLDER, STORE_VERSION, write_first_release
from _runtime_helpers import new_delivery
from _stream_helpers import serving_process

from actors.runtime import NotFolded, RuntimeConfig, open_runtime
from healthlog.storage import replica, store
from healthlog.storage.datadir import DataDir
from healthlog.storage.replica import Replica

if TYPE_CHECKING:
    from conftest import CliRun, RunCli

TOKEN = "hl_first-release-token"
HR, BPM = "heart_rate", "count/min"


def stamp(minute: int) -> str:
    return f"2024-03-01 10:{minute:02d}:00 +0000"


async def run(run_cli: RunCli, *args: str | os.PathLike[str]) -> CliRun:
    """``healthlog ARGS`` as a process, in a thread so the service keeps serving meanwhile."""
    result: CliRun = await trio.to_thread.run_sync(functools.partial(run_cli, *args))
    return result


def version(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


async def test_a_data_directory_of_the_first_releases_is_served_and_followed_store_155(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STORE-155: a data directory and a replica as the first releases left them (journal,
    tokens and replica at schema version 1, the store at 2; a lease of an older holder name,
    expired; a subscriber without the time of its ACK; events without tags), served by this
    healthlog: ready, every object the first releases folded exported as before, their token
    authenticates a delivery that is folded, their replica resumes from its cursor to equal
    the store, and `verify` exits 0; every file is then at this healthlog's schema."""
    source = DataDir(tmp_path / "source")
    heart = write(
        tmp_path / "heart.json",
        body(metric(HR, BPM, *(point(stamp(n), qty=60 + n) for n in range(5)))),
    )
    steps = write(
        tmp_path / "steps.json",
        body(metric("step_count", "count", *(point(stamp(n), qty=10 * n) for n in range(5)))),
    )
    imported = await run(
        run_cli, "import", "--aggregation", "minutes", "--data", source.path, heart, heart, steps
    )
    assert imported.code == 0, imported.err
    assert (await run(run_cli, "status", "--data", source.path)).code == 0
    before = await run(run_cli, "export", "--data", source.path)
    assert len(before.lines()) == 10
    data, replica_dir = tmp_path / "data", tmp_path / "replica"
    write_first_release(source, data, replica_dir, TOKEN)
    assert [version(data / name) for name in ("journal.sqlite", "store.sqlite")] == [
        1,
        STORE_VERSION,
    ]
    with closing(sqlite3.connect(data / "store.sqlite")) as conn:
        assert conn.execute("SELECT holder FROM lease").fetchone() == (OLD_HOLDER,)

    later = body(metric(HR, BPM, point(stamp(30), qty=90)))
    async with serving_process(data) as service:
        await service.wait_folded()
        assert (await service.client.get("/readyz")).status_code == 200
        assert (await run(run_cli, "export", "--data", data)).out == before.out
        sent = await service.client.post(
            "/v1/deliveries",
            content=later,
            headers={"Authorization": f"Bearer {TOKEN}", "automation-aggregation": "minutes"},
        )
        assert sent.status_code == 200, sent.text
        await service.wait_folded()
        followed = await run(
            run_cli,
            *("follow", "--url", service.url, "--token", TOKEN, "--replica", replica_dir),
            *("--subscriber", "nas", "--until-caught-up"),
        )
        assert followed.code == 0, followed.err
    served = await run(run_cli, "export", "--data", data)
    assert len(served.lines()) == 11
    assert b'"qty":90' in served.out
    assert (await run(run_cli, "export", "--replica", replica_dir)).out == served.out
    verified = await run(run_cli, "verify", "--data", data)
    assert verified.code == 0, verified.err
    assert version(data / "store.sqlite") == len(store.MIGRATIONS)
    assert version(data / "journal.sqlite") == 3
    assert version(replica_dir / replica.REPLICA_FILE) == len(replica.MIGRATIONS)


ROOT = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("healthlog", "actors", "transport")
UPGRADE_LIMIT_S = 60.0
UPGRADE_STEP = """
# A release after this one: its store takes one more migration step.
MIGRATIONS = (*MIGRATIONS, "CREATE TABLE upgraded (step INTEGER);")
Store.MIGRATIONS = MIGRATIONS
"""
UPGRADED = "healthlog was upgraded under this process"


def copy_code(code: Path) -> Path:
    """A copy of healthlog's packages in the directory ``code``."""
    for package in CODE_PACKAGES:
        shutil.copytree(
            ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return code


def upgrade(code: Path) -> None:
    """Make the packages under ``code`` a later release, whose store takes one more step."""
    with (code / "healthlog" / "storage" / "store.py").open("a") as source:
        source.write(UPGRADE_STEP)


@contextlib.asynccontextmanager
async def serving_code(data: Path, code: Path, err: bytearray) -> AsyncIterator[httpx.AsyncClient]:
    """``healthlog serve`` on ``data`` as a process running the packages under ``code`` (as an
    installation there would: its modules imported from that directory), its stderr gathered
    into ``err``; a client of it, then SIGTERM and exit 0 at the block's end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    env["PYTHONPATH"] = os.fspath(code)
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", data]
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                command,
                env=env,
                cwd=code,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                check=False,
            )
        )
        assert process.stdout is not None
        assert process.stderr is not None
        nursery.start_soon(_gather, process.stderr, err)
        announced = b""
        with trio.fail_after(UPGRADE_LIMIT_S):
            while b"\n" not in announced:
                chunk = await process.stdout.receive_some()
                assert chunk, f"serve ended before it announced its address: {err.decode()}"
                announced += chunk
        found = re.search(rb"healthlog serving on (http://127\.0\.0\.1:\d+) ", announced)
        assert found, announced
        try:
            async with httpx.AsyncClient(base_url=found.group(1).decode()) as client:
                yield client
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(UPGRADE_LIMIT_S):
                await process.wait()
    assert process.returncode == 0, err.decode()


async def _gather(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    async for chunk in stream:
        into += chunk


async def _until(done: Callable[[], Awaitable[bool]]) -> None:
    with trio.fail_after(UPGRADE_LIMIT_S):
        while not await done():
            await trio.sleep(0.05)


def _upgrade_setup(tmp_path: Path) -> tuple[Path, DataDir, dict[str, str], list[bytes]]:
    """A copy of healthlog's code to replace under a service, its data directory with a token,
    the headers that token posts with, and two deliveries of one metric."""
    code = copy_code(tmp_path / "code")
    data = DataDir(tmp_path / "data")
    with data.open_tokens() as tokens:
        token = tokens.add("phone")
    auth = {"Authorization": f"Bearer {token}", "automation-aggregation": "minutes"}
    sent = [body(metric("step_count", "count", point(stamp(n), qty=n + 1))) for n in range(2)]
    return code, data, auth, sent


async def test_a_service_upgraded_under_it_folds_nothing_until_restarted_store_157(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STORE-157: healthlog's files replaced under a running service (a `git pull` and an
    editable install before the service is stopped) by a release whose store takes one more
    migration step. The service's next fold worker, a new interpreter importing the new code,
    opens nothing: the store stays at the service's schema version, the delivery is journaled
    and not folded, one WARNING says healthlog was upgraded under the service, and /readyz is
    503 with deliveries going on being journaled. Restarted, the service runs the new code:
    the store is migrated, both deliveries are folded and it is ready."""
    code, data, auth, sent = _upgrade_setup(tmp_path)
    err = bytearray()
    async with serving_code(data.path, code, err) as client:

        async def ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await _until(ready)
        schema = version(data.store_path)
        upgrade(code)
        assert (await client.post("/v1/deliveries", content=sent[0], headers=auth)).is_success

        async def told() -> bool:
            return UPGRADED in err.decode() or version(data.store_path) != schema

        await _until(told)
        assert version(data.store_path) == schema
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.post("/v1/deliveries", content=sent[1], headers=auth)).is_success
        assert (await run(run_cli, "export", "--data", data.path)).out == b""
        with data.open_journal() as journal:
            assert journal.last_id() == 2
        assert (await client.get("/readyz")).status_code == 503
    warnings = [line for line in err.decode().splitlines() if UPGRADED in line]
    assert len(warnings) == 1, err.decode()
    assert "level=WARNING" in warnings[0]

    async with serving_code(data.path, code, bytearray()) as client:
        await _until(ready)
        points = await client.get("/v1/points", params={"metric": "step_count"}, headers=auth)
        assert len(points.text.splitlines()) == 2
    assert version(data.store_path) == schema + 1


async def test_an_import_upgraded_under_it_ends_saying_so_cli_285(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CLI-285: healthlog's files replaced by a later release while `import` (or `seal`) waits
    for its delivery to fold: the fold worker it starts, importing the new code, opens nothing,
    and the wait ends with the delivery journaled and not folded, saying healthlog was upgraded
    under it; the store stays at its schema version. (Here the runtime `import` runs, in this
    process, whose new workers import the copy first on the path.)"""
    code = copy_code(tmp_path / "code")
    upgrade(code)
    monkeypatch.syspath_prepend(os.fspath(code))
    data = DataDir(tmp_path / "data")
    async with open_runtime(RuntimeConfig(data.path)) as runtime:
        receipt = await runtime.submit(new_delivery())
        with trio.fail_after(UPGRADE_LIMIT_S), pytest.raises(NotFolded) as refused:
            await runtime.wait_folded([receipt.delivery_id], give_up=True)
        assert not runtime.ready()
    assert refused.value.delivery_id == receipt.delivery_id
    assert UPGRADED in refused.value.why
    assert version(data.store_path) == len(store.MIGRATIONS)
    with data.open_store() as opened:
        assert opened.unfolded(delivery_ids={receipt.delivery_id}) == {receipt.delivery_id}


def outcomes(store_path: Path) -> int:
    with closing(sqlite3.connect(store_path)) as conn:
        return int(conn.execute("SELECT count(*) FROM outcomes").fetchone()[0])


async def test_a_store_a_newer_healthlog_migrated_under_the_service_stops_its_folds_store_158(
    tmp_path: Path,
) -> None:
    """STORE-158: a service running, one delivery folded (its fold worker still there, of the
    service's code), healthlog's files replaced by a later release, and `healthlog status` run
    from them: status migrates the store to the later schema. The service's next pass finds the
    store of a schema newer than its own and folds nothing more, its worker of the old code
    included: the second delivery is journaled and not folded, one WARNING says healthlog was
    upgraded under it and /readyz is 503."""
    code, data, auth, sent = _upgrade_setup(tmp_path)
    err = bytearray()
    async with serving_code(data.path, code, err) as client:
        assert (await client.post("/v1/deliveries", content=sent[0], headers=auth)).is_success

        async def first_folded() -> bool:
            ready = (await client.get("/readyz")).status_code == 200
            return ready and outcomes(data.store_path) == 1

        await _until(first_folded)
        schema = version(data.store_path)
        upgrade(code)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
        env["PYTHONPATH"] = os.fspath(code)
        status = await trio.run_process(
            [sys.executable, "-m", "healthlog.cli", "status", "--data", data.path],
            cwd=code,
            env=env,
            capture_stdout=True,
            capture_stderr=True,
        )
        assert version(data.store_path) == schema + 1, status.stderr
        assert (await client.post("/v1/deliveries", content=sent[1], headers=auth)).is_success

        async def told() -> bool:
            return UPGRADED in err.decode() or outcomes(data.store_path) == 2

        await _until(told)
        assert outcomes(data.store_path) == 1
        assert (await client.get("/readyz")).status_code == 503
    warnings = [line for line in err.decode().splitlines() if UPGRADED in line]
    assert len(warnings) == 1, err.decode()
    assert "level=WARNING" in warnings[0]
    assert f"version {schema + 1}" in warnings[0]


REPLICA_STEP = """
# A release after this one: its replica takes one more migration step.
MIGRATIONS = (*MIGRATIONS, "CREATE TABLE upgraded (step INTEGER);")
Replica.MIGRATIONS = MIGRATIONS
"""


def test_a_newer_follow_refused_beside_a_running_one_leaves_the_replica_as_it_was_stream_202(
    tmp_path: Path,
) -> None:
    """STREAM-202: a follower running on a replica (holding its directory's lock), and
    healthlog's files replaced by a release whose replica takes one more migration step; a
    second `follow` on the same replica from the new files (a supervisor starting the unit
    again, a user trying it) is refused, exit 2, `another follow is running`, before it
    migrates anything: the replica stays at the running follower's schema version."""
    code = copy_code(tmp_path / "code")
    with (code / "healthlog" / "storage" / "replica.py").open("a") as source:
        source.write(REPLICA_STEP)
    replica_dir = tmp_path / "replica"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    env["PYTHONPATH"] = os.fspath(code)
    command = [sys.executable, "-m", "healthlog.cli", "follow", "--url", "http://127.0.0.1:9"]
    with Replica(replica_dir) as running, running.following():
        schema = version(replica_dir / replica.REPLICA_FILE)
        second = subprocess.run(
            [*command, "--token", TOKEN, "--replica", replica_dir],
            cwd=code,
            env=env,
            capture_output=True,
            check=False,
            timeout=UPGRADE_LIMIT_S,
        )
        assert second.returncode == 2, second.stderr
        assert b"another follow is running" in second.stderr
        assert version(replica_dir / replica.REPLICA_FILE) == schema
