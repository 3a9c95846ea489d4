"""Kill -9 at every step of the serving path, SQLite style (specs/proof.md, PROOF-1 to PROOF-3,
PROOF-8).

For a fault point and k = 1, 2, ... a real ``python -m healthlog.cli serve`` runs with the plan
``{POINT: {"hits": [k], "do": "kill"}}`` and takes a tiny workload. When the kill fires, the
service is started again without a plan, whatever was not answered 200 is posted again (as the
phone would), and once nothing is pending the data directory must prove its recovery. The first
k whose run completes without the kill firing ends the walk; that clean run is also the
reference every recovered run must export.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from _baseline import severe_lines
from _cli_bodies import body, metric, point

from healthlog import faults
from healthlog.export import export_lines
from healthlog.storage import _sqlite
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV, SERVE_PID_ENV
from healthlog.storage.journal import NewDelivery
from healthlog.storage.store import MIGRATIONS as STORE_MIGRATIONS

# Every fault point but those off the serving path (specs/proof.md): the workload has no
# follower, builds no snapshot and ends before the first pruning of events, so they never fire;
# and ``fold.select``, which fires at every pass, idle ones too, so that no step number is ever
# the last (a kill there is one between two folds, as at ``fold.begin``'s first hit).
# A new point is walked unless listed here.
NOT_WALKED = frozenset(
    {
        "fold.select",
        "retention.prune",
        "stream.head",
        "stream.send",
        "stream.page",
        "stream.ack",
        "snapshot.build",
        "snapshot.open",
        "snapshot.write",
        "rebuild.scratch",
        "tokens.read",
        "follow.download",
        "follow.restore",
        "follow.restore_object",
    }
)
assert NOT_WALKED.issubset(faults.POINTS), "an excluded fault point no longer exists"
KILL_POINTS = tuple(name for name in faults.POINTS if name not in NOT_WALKED)
MAX_STEP = 13
# Short lease and wake periods, so a restart takes the lease over and folds within a second or
# two; a renewal every 0.5 s keeps the hits of ``lease.renew`` in one run well under MAX_STEP.
SERVE_ENV = {
    "HEALTHLOG_WAKE_PERIOD_S": "0.2",
    "HEALTHLOG_LEASE_TTL_S": "1.5",
    "HEALTHLOG_LEASE_RENEW_S": "0.5",
    "HEALTHLOG_GRACEFUL_TIMEOUT_S": "2",
}
START_LIMIT_S = 30.0
STOP_LIMIT_S = 30.0
QUIET_LIMIT_S = 60.0
POLL_S = 0.05
IDLE_STOP_LIMIT_S = 3.0
MINUTES = {"automation-aggregation": "minutes"}
# The store's schema version in the data directory a walk of ``schema.migrate`` starts from
# (before the index of the failed and partial outcomes).
OLDER_STORE_VERSION = 4

# Three deliveries with overlapping windows: the second conflicts with the first and adds an
# hour, the third is richer than both in their shared minutes.
WORKLOAD = (
    body(
        metric(
            "heart_rate",
            "count/min",
            *(point(f"2024-03-01 10:{m:02d}:00 +0000", qty=60 + m % 7) for m in range(57, 60)),
            *(point(f"2024-03-01 11:{m:02d}:00 +0000", qty=61) for m in range(3)),
        )
    ),
    body(
        metric(
            "heart_rate",
            "count/min",
            *(point(f"2024-03-01 11:{m:02d}:00 +0000", qty=70) for m in range(2)),
            *(point(f"2024-03-01 12:{m:02d}:00 +0000", qty=72) for m in range(2)),
        )
    ),
    body(
        metric(
            "heart_rate",
            "count/min",
            point("2024-03-01 10:59:00 +0000", qty=62, source="Watch"),
            point("2024-03-01 11:00:00 +0000", qty=70, source="Watch"),
        )
    ),
)
WORKLOAD_SHA256 = {hashlib.sha256(content).hexdigest() for content in WORKLOAD}


@attrs.define
class Serve:
    """One ``healthlog serve`` process and a client holding the token; ``url`` is None when
    the process died before it listened."""

    process: trio.Process
    url: str | None
    client: httpx.AsyncClient

    @property
    def killed(self) -> bool:
        return self.process.returncode == -signal.SIGKILL


def serve_env(plan: dict[str, Any] | None, settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (PLAN_ENV, SERVE_PID_ENV)}
    env.update(SERVE_ENV)
    env.update(settings)
    if plan is not None:
        env[PLAN_ENV] = json.dumps(plan)
    return env


def cli(command: str, data: DataDir, *args: str) -> list[str]:
    return [sys.executable, "-m", "healthlog.cli", command, "--data", str(data.path), *args]


@asynccontextmanager
async def serving(
    data: DataDir,
    log: Path,
    token: str,
    plan: dict[str, Any] | None,
    settings: dict[str, str] | None = None,
) -> AsyncIterator[Serve]:
    """Run serve (with ``HEALTHLOG_*`` ``settings`` over SERVE_ENV) until the block ends, then
    close the client, SIGTERM the process (if still alive) and wait for it."""
    with log.open("ab") as stderr:
        process = await trio.lowlevel.open_process(
            cli("serve", data, "--port", "0"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=serve_env(plan, settings or {}),
        )
    assert process.stdout is not None
    try:
        line = await first_line(process.stdout)
        url = line.split()[3].decode() if line.startswith(b"healthlog serving on ") else None
        async with httpx.AsyncClient(
            base_url=url or "",
            headers={"Authorization": f"Bearer {token}"},
            timeout=QUIET_LIMIT_S,
        ) as client:
            yield Serve(process, url, client)
    finally:
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.terminate()
            with trio.move_on_after(STOP_LIMIT_S):
                await process.wait()
            if process.poll() is None:
                process.kill()
                await process.wait()
            await process.stdout.aclose()


async def first_line(stream: trio.abc.ReceiveStream) -> bytes:
    """The first line the process writes (b"" if it exits first)."""
    line = b""
    with trio.fail_after(START_LIMIT_S):
        while not line.endswith(b"\n"):
            chunk = await stream.receive_some(1)
            if not chunk:
                break
            line += chunk
    return line


@attrs.define
class Step:
    """What one kill step left behind."""

    fired: bool
    data: DataDir
    log: Path
    receipts: dict[int, dict[str, Any]]


async def post(service: Serve, n: int) -> dict[str, Any] | None:
    """Post delivery ``n``: its receipt, or None when the connection broke."""
    if service.url is None:
        return None
    try:
        response = await service.client.post("/v1/deliveries", content=WORKLOAD[n], headers=MINUTES)
    except httpx.TransportError:
        return None
    assert response.status_code == 200, response.text
    receipt: dict[str, Any] = response.json()
    return receipt


async def quiesce(service: Serve) -> None:
    """Return once nothing is pending, or once the process has died."""
    with trio.fail_after(QUIET_LIMIT_S):
        while service.url is not None and service.process.poll() is None:
            try:
                response = await service.client.get("/v1/status")
            except httpx.TransportError:
                pass  # dying: the next poll() says so
            else:
                assert response.status_code == 200, response.text
                if response.json()["deliveries"]["pending"] == 0:
                    return
            await trio.sleep(POLL_S)


async def kill_step(root: Path, fault_point: str, k: int) -> Step:
    """Run the workload under a kill at hit ``k`` of ``fault_point``; recover if it fired."""
    data = DataDir(root / f"{fault_point}-{k}")
    log = root / f"{fault_point}-{k}.log"
    with data.open_tokens() as tokens:
        token = tokens.add("phone")
    if fault_point == "schema.migrate":
        make_older(data)
    receipts: dict[int, dict[str, Any]] = {}
    plan = {fault_point: {"hits": [k], "do": "kill"}}
    async with serving(data, log, token, plan) as first:
        for n in range(len(WORKLOAD)):
            if (receipt := await post(first, n)) is not None:
                receipts[n] = receipt
        await quiesce(first)
    if not first.killed:
        assert first.process.returncode == 0
        return Step(False, data, log, receipts)
    async with serving(data, log, token, None) as second:
        assert second.url is not None
        for n in range(len(WORKLOAD)):
            if n not in receipts:
                receipt = await post(second, n)
                assert receipt is not None
                receipts[n] = receipt
        await quiesce(second)
        assert second.process.poll() is None, "the restarted service died"
    assert second.process.returncode == 0
    return Step(True, data, log, receipts)


def make_older(data: DataDir) -> None:
    """Make ``data`` the data directory of an older healthlog, whose start migrates it (STORE-67):
    a journal from before ``journaled_at`` (schema version 1) holding the first delivery of the
    workload, not folded yet, beside an empty store of schema version OLDER_STORE_VERSION. A
    ``serve`` starting on it hits ``schema.migrate`` once per step, before it listens."""
    with data.open_journal() as journal:
        journal.append(NewDelivery(WORKLOAD[0], "phone", automation_aggregation="minutes"))
    with closing(sqlite3.connect(data.journal_path, isolation_level=None)) as conn:
        conn.execute("DROP TABLE unstamped_backfills")
        conn.execute("ALTER TABLE deliveries DROP COLUMN journaled_at")
        conn.execute("PRAGMA user_version = 1")
    with closing(sqlite3.connect(data.store_path, isolation_level=None)) as conn:
        _sqlite.migrate(conn, STORE_MIGRATIONS[:OLDER_STORE_VERSION])


def exported(data: DataDir) -> list[bytes]:
    with data.open_store() as store:
        return list(export_lines(store.iter_objects()))


async def run_cli(
    done: dict[str, subprocess.CompletedProcess[bytes]], command: str, data: DataDir, *args: str
) -> None:
    done[command] = await trio.run_process(
        cli(command, data, *args), capture_stdout=True, capture_stderr=True, check=False
    )


async def prove_recovery(step: Step, fault_point: str, k: int) -> list[bytes]:
    """``verify`` exits 0, ``status --json`` shows nothing pending, every 200 is journaled with
    its sha256, every journaled delivery has exactly one outcome, no ERROR was logged, the log
    says whether the kill fired; returns the export."""
    done: dict[str, subprocess.CompletedProcess[bytes]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_cli, done, "verify", step.data)
        nursery.start_soon(run_cli, done, "status", step.data, "--json")
    assert done["verify"].returncode == 0, done["verify"].stdout
    status = json.loads(done["status"].stdout)
    assert status["deliveries"]["pending"] == 0
    with step.data.open_journal() as journal, step.data.open_store() as store:
        metas = {meta.id: meta for meta in journal.iter_order()}
        folded = Counter(
            event.payload["delivery_id"]
            for event in store.events_after(0, 10_000)
            if event.kind == "delivery.folded"
        )
        assert store.folded_ids() == set(metas)
    assert status["journal"]["deliveries"] == len(metas)
    assert sorted(step.receipts) == list(range(len(WORKLOAD)))
    for receipt in step.receipts.values():
        assert metas[receipt["delivery_id"]].sha256 == receipt["sha256"]
    assert {meta.sha256 for meta in metas.values()} <= WORKLOAD_SHA256
    assert folded == dict.fromkeys(metas, 1)
    logged = step.log.read_text()
    assert severe_lines(logged) == []
    assert (f"fault injected at {fault_point} (hit {k})" in logged) is step.fired
    return exported(step.data)


@pytest.mark.parametrize("fault_point", KILL_POINTS)
async def test_kill_at_every_step_recovers(tmp_path: Path, fault_point: str) -> None:
    """PROOF-1, PROOF-2: a SIGKILL at each hit of the point, then a restart without the plan,
    leaves a journal and projection that verify; the walk ends when a run completes unkilled.
    STORE-67: ``schema.migrate`` is walked from an older data directory (:func:`make_older`)."""
    recovered = []
    for k in range(1, MAX_STEP + 1):
        step = await kill_step(tmp_path, fault_point, k)
        lines = await prove_recovery(step, fault_point, k)
        if not step.fired:
            break
        recovered.append(lines)
    else:
        pytest.fail(f"{fault_point} still killed the service at hit {MAX_STEP}")
    print(f"{fault_point}: killed at hits 1..{k - 1}, completed at step {k}")
    assert k > 1, f"{fault_point} never fired: no kill was proven"
    assert recovered == [lines] * (k - 1)


async def test_sigterm_closes_idle_connections(tmp_path: Path) -> None:
    """PROOF-8: with a 10 s graceful timeout and a client that keeps its connection open after
    a complete request, SIGTERM stops the service within 3 s, with exit status 0."""
    data = DataDir(tmp_path / "data")
    with data.open_tokens() as tokens:
        token = tokens.add("phone")
    settings = {"HEALTHLOG_GRACEFUL_TIMEOUT_S": "10"}
    async with serving(data, tmp_path / "serve.log", token, None, settings) as service:
        assert (await service.client.get("/healthz")).status_code == 200
        service.process.terminate()
        with trio.move_on_after(IDLE_STOP_LIMIT_S) as waiting:
            await service.process.wait()
        await service.client.aclose()
        await service.process.wait()
    assert service.process.returncode == 0
    assert not waiting.cancelled_caught, "SIGTERM waited for an idle keep-alive connection"


def test_fault_points_are_inert_without_a_plan() -> None:
    """PROOF-3: with no plan loaded a fault point does nothing, not even count its hits (a plan
    loaded afterwards starts from hit 1). What a call costs is a benchmark's
    (``scripts/bench/faults.py``)."""
    plan = faults.Plan(actions={"fold.begin": faults.Action(frozenset({1}), faults.raise_fault())})
    for name in faults.POINTS:
        faults.point(name)
    with faults.loaded(plan), pytest.raises(faults.InjectedFault):
        faults.point("fold.begin")
    faults.point("fold.begin")
    assert plan.hits == {"fold.begin": 1}
