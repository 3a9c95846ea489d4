"""Helpers for the runtime tests (test_actors.py, test_folding_actor.py; specs/runtime.md).

Tiny Health Auto Export bodies and deliveries, a test configuration of the runtime, polling
on its statistics, raw reads of the two SQLite files through connections of their own, and
:func:`run_in_child` for the scenarios whose failure mode is a runtime that never exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import closing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio.testing

from actors.folding import Executor
from actors.runtime import Runtime, RuntimeConfig, open_runtime
from healthlog import faults
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal, NewDelivery

HOLDER = "test-holder"
CLIENT = "phone"
FIRST_POINT = datetime(2024, 2, 6, 7, tzinfo=timezone(timedelta(hours=-8)))
HISTORY_US = 1_707_000_000_000_000
"""A historical ``received_at`` (2024-02-03), earlier than any live stamp."""
HOUR_US = 3600 * 1_000_000
EVERY_HIT = frozenset(range(1, 10_000))
STUCK_S = 5.0
"""How long a child process or a held worker thread may take before it counts as stuck."""
RESULT_FILE = "result.json"


def hae_body(n: int = 0) -> bytes:
    """A body with one step_count point, ``n`` hours after 2024-02-06 07:00 -08:00."""
    date = (FIRST_POINT + timedelta(hours=n)).strftime("%Y-%m-%d %H:%M:%S %z")
    entry = {"name": "step_count", "units": "count", "data": [{"date": date, "qty": 1.5}]}
    return orjson.dumps({"data": {"metrics": [entry]}})


def new_delivery(
    n: int = 0, *, received_at: int | None = None, aggregation: str | None = "minutes"
) -> NewDelivery:
    """Delivery number ``n`` of automation A: its point has an hour of its own, so the delivery
    creates exactly one object. ``received_at`` set makes it a backfill."""
    return NewDelivery(
        hae_body(n),
        CLIENT,
        content_type="application/json",
        automation_id="A",
        automation_aggregation=aggregation,
        received_at=received_at,
    )


def sha256(delivery: NewDelivery) -> str:
    return hashlib.sha256(delivery.body).hexdigest()


def config(data_dir: Path | str, **overrides: Any) -> RuntimeConfig:
    """A runtime on ``data_dir`` folding in worker threads under lease holder HOLDER."""
    settings: dict[str, Any] = {"holder": HOLDER, "executor": Executor.THREAD, **overrides}
    return RuntimeConfig(data_dir, **settings)


def journal_directly(data_dir: Path, deliveries: Iterable[NewDelivery]) -> list[int]:
    """Journal deliveries before any runtime runs (visible to its first pass); their ids."""
    with DataDir(data_dir).open_journal() as journal:
        return [journal.append(delivery).delivery_id for delivery in deliveries]


def action(hits: Iterable[int], run: Callable[[str], None]) -> faults.Action:
    return faults.Action(frozenset(hits), run)


def hold_at(entered: trio.Event, release: threading.Event) -> faults.Action:
    """An action for hit 1: tell the test the worker thread got there, then wait for release."""

    def hold(_: str) -> None:
        trio.from_thread.run_sync(entered.set)
        release.wait(STUCK_S)

    return action({1}, hold)


def logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The messages logged at exactly ``level``, leaving out the fault harness's own records
    (it logs a WARNING for every fault it injects)."""
    return [
        r.getMessage() for r in caplog.records if r.levelno == level and r.name != faults.log.name
    ]


async def until(predicate: Callable[[], bool], *, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds of real time.

    Real time, not trio time: on an autojumping MockClock, virtual time races ahead while a
    worker thread works, so a trio deadline would expire without the runtime being slow.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"still false after {timeout} s")
        await trio.sleep(0.01)


async def wait_folded(data_dir: Path, ids: Iterable[int], *, timeout: float = 10.0) -> None:
    """Wait until every delivery in ``ids`` has an outcome in store.sqlite."""
    wanted = set(ids)
    await until(lambda: wanted <= folded_ids(data_dir), timeout=timeout)


async def passes_ended(runtime: Runtime, n: int, *, timeout: float = 10.0) -> None:
    """Wait until at least ``n`` passes have ended completely (lag mark included)."""

    def ended() -> bool:
        folding = runtime.statistics().folding
        return folding.passes >= n and not folding.running

    await until(ended, timeout=timeout)


def table(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of a query against an SQLite file, through a read-only connection of its own."""
    uri = path.resolve().as_uri() + "?mode=ro"
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


def journaled(data_dir: Path) -> dict[int, str]:
    """Delivery id -> sha256 of every row of the journal file."""
    rows = table(DataDir(data_dir).journal_path, "SELECT id, sha256 FROM deliveries")
    return {delivery_id: bytes(digest).hex() for delivery_id, digest in rows}


def folded_ids(data_dir: Path) -> set[int]:
    rows = table(DataDir(data_dir).store_path, "SELECT delivery_id FROM outcomes")
    return {delivery_id for (delivery_id,) in rows}


def folded_in_order(data_dir: Path) -> list[int]:
    """Delivery ids in the order of their ``delivery.folded`` events in store.sqlite."""
    rows = table(
        DataDir(data_dir).store_path,
        "SELECT payload FROM events WHERE kind = 'delivery.folded' ORDER BY seq",
    )
    return [orjson.loads(payload)["delivery_id"] for (payload,) in rows]


def outcome_epochs(data_dir: Path) -> dict[int, int]:
    """Delivery id -> the lease epoch its outcome was written under."""
    rows = table(DataDir(data_dir).store_path, "SELECT delivery_id, epoch FROM outcomes")
    return dict(rows)


def mark(data_dir: Path, key: str) -> Any:
    """A mark of store.sqlite (None when it was never written)."""
    rows = table(DataDir(data_dir).store_path, "SELECT value FROM marks WHERE key = ?", key)
    return orjson.loads(rows[0][0]) if rows else None


def lease_row(data_dir: Path) -> tuple[str | None, int]:
    """(holder, epoch) of the fold lease."""
    ((holder, epoch),) = table(
        DataDir(data_dir).store_path, "SELECT holder, epoch FROM lease WHERE name = 'fold'"
    )
    return holder, epoch


# -- scenarios run in a child process ---------------------------------------------------------


def run_in_child(scenario: str, data_dir: Path) -> Any:
    """``trio.run(<scenario of this module>, data_dir)`` in a child process; its result.

    A runtime whose shutdown hangs inside a shielded scope cannot be stopped from within its
    own process, so these scenarios run in a child that is killed after STUCK_S seconds.
    """
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    code = "import sys, trio, _runtime_helpers as h; trio.run(getattr(h, sys.argv[1]), sys.argv[2])"
    try:
        child = subprocess.run(
            [sys.executable, "-c", code, scenario, str(data_dir)],
            env=env,
            timeout=STUCK_S,
            check=False,
            capture_output=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: the runtime did not exit within {STUCK_S} s")
    assert child.returncode == 0, child.stderr.decode()
    return orjson.loads((data_dir / RESULT_FILE).read_bytes())


SHUTDOWN_SUBMITS = 20


async def shutdown_with_submits_queued(data_dir: str) -> None:
    """Leave the runtime while SHUTDOWN_SUBMITS submits are in flight, some of them queued
    behind a journal commit; record what each submit got (a delivery id or what it raised)."""
    entered, release = trio.Event(), threading.Event()
    got: dict[int, int | str] = {}

    async def submit(runtime: Runtime, n: int) -> None:
        got[n] = "Cancelled"
        try:
            got[n] = (await runtime.submit(new_delivery(n))).delivery_id
        except Exception as exc:
            got[n] = type(exc).__name__

    plan = faults.Plan(actions={"journal.append": hold_at(entered, release)})
    with faults.loaded(plan), trio.CancelScope() as scope:
        async with open_runtime(config(data_dir)) as runtime, trio.open_nursery() as nursery:
            # The first alone: submits made together would all join its group (JOURNAL-56).
            nursery.start_soon(submit, runtime, 0)
            await entered.wait()
            for n in range(1, SHUTDOWN_SUBMITS):
                nursery.start_soon(submit, runtime, n)
            await until(lambda: runtime.statistics().journal.queued > 0)
            scope.cancel()
            release.set()
    Path(data_dir, RESULT_FILE).write_bytes(orjson.dumps({str(n): v for n, v in got.items()}))


async def submit_in_flight_at_shutdown(data_dir: str) -> None:
    """Leave the runtime while a submit's group commit is in flight; record what the submit
    got (a delivery id, or what it raised)."""
    entered, release = trio.Event(), threading.Event()
    got: list[int | str] = ["Cancelled"]

    async def submit(runtime: Runtime) -> None:
        try:
            got[0] = (await runtime.submit(new_delivery())).delivery_id
        except Exception as exc:
            got[0] = type(exc).__name__

    plan = faults.Plan(actions={"journal.append": hold_at(entered, release)})
    with faults.loaded(plan), trio.CancelScope() as scope:
        async with open_runtime(config(data_dir)) as runtime, trio.open_nursery() as nursery:
            nursery.start_soon(submit, runtime)
            await entered.wait()
            scope.cancel()
            release.set()
    [result] = got
    Path(data_dir, RESULT_FILE).write_bytes(orjson.dumps(result))


async def submit_behind_a_read_at_shutdown(data_dir: str) -> None:
    """Leave the runtime while a submit's group waits for the journal's connection, busy with a
    read in its worker thread; record what the submit got (a delivery id or what it raised)."""
    reading, release = trio.Event(), threading.Event()
    got: list[int | str] = []

    def read(_: Journal) -> None:
        trio.from_thread.run_sync(reading.set)
        release.wait(STUCK_S)

    async def submit(runtime: Runtime) -> None:
        try:
            got.append((await runtime.submit(new_delivery())).delivery_id)
        except Exception as exc:
            got.append(type(exc).__name__)

    with trio.CancelScope() as scope:
        async with open_runtime(config(data_dir)) as runtime, trio.open_nursery() as nursery:
            nursery.start_soon(runtime.read_journal, read)
            await reading.wait()
            nursery.start_soon(submit, runtime)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            release.set()
    Path(data_dir, RESULT_FILE).write_bytes(orjson.dumps(got))


async def journal_actor_crash(data_dir: str) -> None:
    """A submit whose group commit crashes the journal actor, then another submit: record
    what each caller got."""
    plan = faults.Plan(actions={"journal.append": action({1}, faults.raise_fault())})
    got: list[str] = []
    with faults.loaded(plan):
        async with open_runtime(config(data_dir)) as runtime:
            for n in range(2):
                try:
                    with trio.fail_after(2):
                        await runtime.submit(new_delivery(n))
                    got.append("receipt")
                except trio.TooSlowError:
                    got.append("no answer")
                except Exception as exc:
                    got.append(type(exc).__name__)
    Path(data_dir, RESULT_FILE).write_bytes(orjson.dumps(got))


def children_of(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            if f"\nPPid:\t{pid}\n" in status.read_text():
                found.add(int(status.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has ended)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
