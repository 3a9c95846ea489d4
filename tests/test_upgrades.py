"""A data directory and a follow replica left by the first releases of healthlog, opened by this
one (specs/store.md, STORE-155): the oldest path of every file's migrations, through a real
``healthlog serve`` and ``healthlog follow``."""

from __future__ import annotations

import functools
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from _cli_bodies import body, metric, point, write
from _first_release import OLD_HOLDER, STORE_VERSION, write_first_release
from _stream_helpers import serving_process

from healthlog.storage import replica, store
from healthlog.storage.datadir import DataDir

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
