"""The fault-injection harness as users run it (specs/chaos.md)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import trio
from _bodies import body, point

from healthlog import faults, objects, workload
from healthlog.logs import KeyValueFormatter
from healthlog.storage import faultplan
from healthlog.storage._sqlite import Deferred
from healthlog.storage.journal import DeliveryMeta, NewDelivery
from healthlog.storage.passes import run_pass
from healthlog.storage.replica import REPLICA_FILE, Replica
from healthlog.workload import LEAK_MARKER
from transport.chaos import _OUT_OF_ORDER, CLIENT, KINDS, Run, _Accepted, _plan

SUMMARY = re.compile(
    r"^chaos: runs (\d+), faults injected (\d+), crashes (\d+), deliveries (\d+),"
    r" lost (\d+), mismatched (\d+)$"
)


def test_short_run_holds_every_invariant_chaos_1() -> None:
    """CHAOS-1: twenty seeded runs against real serve processes, 0 lost, 0 mismatched."""
    done = subprocess.run(
        [sys.executable, "-m", "healthlog.cli", "chaos", "--seed", "11", "--runs", "20"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    match = SUMMARY.match(done.stdout.strip().splitlines()[-1])
    assert match is not None
    runs, injected, _crashes, deliveries, lost, mismatched = map(int, match.groups())
    assert runs == 20
    assert injected > 0
    assert deliveries > 0
    assert (lost, mismatched) == (0, 0)
    sealed = re.search(r"^runs with a seal: (\d+)$", done.stdout, re.MULTILINE)
    assert sealed is not None
    assert int(sealed.group(1)) > 0
    by_kind = re.search(r"^faults by kind: (.*)$", done.stdout, re.MULTILINE)
    assert by_kind is not None
    counts = dict(item.rsplit(" ", 1) for item in by_kind.group(1).split(", "))
    assert list(counts) == list(KINDS)
    assert sum(map(int, counts.values())) == injected


@pytest.mark.parametrize(
    "line",
    [
        f'time=x level=WARNING logger=healthlog.fold msg="source {LEAK_MARKER}"',
        # The device name escaped by json.dumps, then its backslashes by the log formatter.
        'time=x level=INFO logger=healthlog.store msg="source \\"Chaos\\\\u2019s Watch'
        ' \\\\u231a\\""',
        f"time=x level=INFO logger=healthlog.store msg={LEAK_MARKER.encode()!r}",
        'time=x level=ERROR logger=healthlog.supervisor msg="actor folding crashed"',
        'time=x level=CRITICAL logger=healthlog.intake msg="the client went away"',
    ],
)
def test_leaks_and_errors_break_the_run_chaos_2(tmp_path: Path, line: str) -> None:
    """CHAOS-2: a device name in a log record (as it is, JSON-escaped or as bytes), or an
    ERROR or CRITICAL record, breaks the run."""
    run = Run(5, tmp_path)
    run.log.write_text(line + "\n")
    run._check_logs()
    assert run.result.broken


def test_point_values_and_the_tools_output_are_checked_chaos_2(tmp_path: Path) -> None:
    """CHAOS-2: a point value of a posted body in the service's log above DEBUG, or an ERROR in
    the concurrent reindex's output, breaks the run; a number that is no point value, or a
    value logged at DEBUG, does not."""
    body = b'{"data":{"metrics":[{"name":"step_count","data":[{"qty":75.48654,"date":"x"}]}]}}'
    quiet = [
        'time=x level=INFO logger=healthlog.lease msg="fold lease expires 12.3456 s ahead"',
        'time=x level=DEBUG logger=healthlog.fold msg="qty 75.48654"',
    ]
    loud = 'time=x level=WARNING logger=healthlog.fold msg="first point 75.48654"'
    cases = [
        (quiet, [], False),
        ([*quiet, loud], [], True),
        (quiet, ["2025 level=ERROR logger=healthlog.rebuild boom"], True),
    ]
    for n, (lines, tools, broken) in enumerate(cases):
        run = Run(5, tmp_path / str(n))
        run.bodies = [body]
        run.tool_output = tools
        run.log.write_text("\n".join(lines) + "\n")
        run._check_logs()
        assert bool(run.result.broken) == broken, (lines, tools, run.result.broken)


def test_plan_from_the_environment_fires_and_logs_chaos_3(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CHAOS-3: a JSON plan fires on the named hits, logs the point, and refuses unknowns; a
    busy fault raises SQLITE_BUSY's error, an I/O error the storage error, a delay sleeps."""
    plan = {"fold.begin": {"hits": [2], "do": "busy"}}
    monkeypatch.setenv(faultplan.PLAN_ENV, orjson.dumps(plan).decode())
    caplog.set_level(logging.INFO, logger="healthlog.faults")
    loaded = faultplan.load_environment()
    assert loaded is not None
    try:
        faults.point("fold.begin")
        with pytest.raises(Deferred):
            faults.point("fold.begin")
        faults.point("fold.begin")
    finally:
        faults.install(None)
    assert loaded.fired["fold.begin"] == 1
    assert [r.getMessage() for r in caplog.records] == ["fault injected at fold.begin (hit 2)"]
    kinds = faultplan.from_spec(
        {
            "fold.object_write": {"hits": [1], "do": "ioerror"},
            "journal.append": {"hits": [1], "do": "delay", "seconds": 0.2},
        }
    )
    with faults.loaded(kinds):
        with pytest.raises(faultplan.InjectedIOError):
            faults.point("fold.object_write")
        started = time.monotonic()
        faults.point("journal.append")
        assert time.monotonic() - started >= 0.2
    with pytest.raises(ValueError, match="unknown fault points"):
        faults.install(faultplan.from_spec({"nowhere": {"hits": [1], "do": "busy"}}))
    with pytest.raises(ValueError, match="unknown fault kind"):
        faultplan.from_spec({"fold.begin": {"hits": [1], "do": "explode"}})


def test_a_plan_in_the_environment_fires_in_another_process_chaos_3() -> None:
    """CHAOS-3: a plan handed to a child process in ``HEALTHLOG_FAULT_PLAN`` fires there, on
    the named hit only, and the child logs it."""
    plan = {"fold.begin": {"hits": [2], "do": "delay", "seconds": 0}}
    script = (
        "import logging, sys\n"
        "from healthlog import faults\n"
        "from healthlog.storage import faultplan\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "assert faultplan.load_environment() is not None\n"
        "for _ in range(3):\n"
        "    faults.point('fold.begin')\n"
    )
    env = {**os.environ, faultplan.PLAN_ENV: orjson.dumps(plan).decode()}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert re.findall(r"fault injected at \S+ \(hit \d+\)", done.stderr) == [
        "fault injected at fold.begin (hit 2)"
    ]


def test_two_hundred_runs_plan_every_kind_chaos_5(tmp_path: Path) -> None:
    """CHAOS-5: the runs of ``--seed 7 --runs 200`` choose every kind of fault, each in several
    runs (what fired is counted by the 200-run itself)."""
    chosen: Counter[str] = Counter()
    for n in range(200):
        chosen.update(Run(7 * 100_000 + n, tmp_path).kinds)
    assert set(chosen) == set(KINDS)
    assert min(chosen.values()) >= 10


def test_every_kind_chosen_is_planned_chaos_7(tmp_path: Path) -> None:
    """CHAOS-7: in each run of ``--seed 7 --runs 200``, every kind chosen that a plan carries
    (busy, ioerror, delay, kill, clock) is in the plan, each at a point of its own."""
    planned_kinds = {"busy", "ioerror", "delay", "kill", "clock"}
    for n in range(200):
        run = Run(7 * 100_000 + n, tmp_path)
        plan = _plan(run.rng, run.kinds)
        assert sorted(entry["do"] for entry in plan.values()) == sorted(run.kinds & planned_kinds)


async def test_a_planned_fault_counts_once_it_fired_chaos_13(tmp_path: Path) -> None:
    """CHAOS-13: a service started with `busy`, `ioerror`, `delay` and `clock` planned, which
    journals and folds nothing, fires only the clock jump at `lease.renew`; the run counts that
    one and none of the faults that never fired."""
    run = Run(5, tmp_path)
    run.kinds = {"busy", "ioerror", "delay", "clock"}
    await run.start_service(with_faults=True)
    assert run.service is not None
    try:
        with trio.fail_after(15):
            while "fault injected at lease.renew" not in run.log.read_text(errors="replace"):
                await trio.sleep(0.1)
    finally:
        await run.service.stop()
    assert sorted(run.planned.values()) == sorted(run.kinds)

    run._check_logs()

    assert run.result.faults == Counter({"clock": 1})


def test_the_journal_is_checked_against_what_was_posted_chaos_8(tmp_path: Path) -> None:
    """CHAOS-8: a receipt whose journal row holds other bytes than those posted, or that names
    no journal row, counts as lost; an idempotency key journaled twice, or at another id than
    its receipts name, breaks the run, and so does a journal stamp earlier than the one before
    it; a receipt naming the row of the bytes posted is neither."""
    run = Run(5, tmp_path)
    posted = [b'{"n":1}', b'{"n":2}', b'{"n":3}']
    with run.data.open_journal() as journal:
        ids = [
            journal.append(NewDelivery(body=body, client=CLIENT, idempotency_key=key)).delivery_id
            for body, key in zip(posted, ["a", None, "b"], strict=True)
        ]
        journal.append(NewDelivery(body=b'{"n":4}', client=CLIENT, idempotency_key="b2"))
    sha = [hashlib.sha256(body).hexdigest() for body in posted]
    run.accepted = [_Accepted(sha[0], ids[0], "a"), _Accepted(sha[1], ids[1], None)]
    run.check_journal()
    assert (run.result.lost, run.result.broken) == (0, [])

    run.accepted.append(_Accepted(sha[0], ids[2], None))
    run.check_journal()
    assert run.result.lost == 1

    run.accepted = [_Accepted(sha[1], ids[-1] + 10, None)]
    run.result.broken = []
    run.check_journal()
    assert run.result.lost == 1
    assert run.result.broken == ["1 accepted deliveries not journaled"]

    run.accepted = [_Accepted(sha[2], ids[2], "a")]
    run.result.broken = []
    run.check_journal()
    assert run.result.lost == 0
    assert run.result.broken == [
        f"idempotency key a journaled [{ids[0]}] for a receipt naming {ids[2]}"
    ]

    run.accepted = []
    run.result.broken = []
    with run.data.open_journal() as journal:
        stamp = journal.iter_order()[-1].received_at - 1
        journal.append(NewDelivery(body=b'{"n":5}', client=CLIENT, received_at=stamp))
    run.check_journal()
    assert run.result.broken == ["journal stamps went back in append order"]

    run = Run(6, tmp_path)
    with run.data.open_journal() as journal:
        first = journal.append(NewDelivery(body=posted[0], client=CLIENT, idempotency_key="k"))
    with sqlite3.connect(run.data.journal_path) as conn:
        conn.execute("DROP TABLE receipts")
        conn.execute(
            "CREATE TABLE receipts (client TEXT, idempotency_key TEXT, delivery_id INTEGER,"
            " content_digest BLOB, PRIMARY KEY (client, idempotency_key))"
        )
    with run.data.open_journal() as journal:
        journal.append(NewDelivery(body=posted[0], client=CLIENT, idempotency_key="k"))
    run.accepted = [_Accepted(sha[0], first.delivery_id, "k")]
    run.check_journal()
    assert run.result.lost == 0
    assert any("idempotency key k journaled" in broken for broken in run.result.broken)


def test_a_third_of_the_runs_seal_chaos_6(tmp_path: Path) -> None:
    """CHAOS-6: about a third of the runs of ``--seed 7 --runs 200`` also seal the first hours
    of their window while the workload is posted."""
    sealed = sum(Run(7 * 100_000 + n, tmp_path).result.sealed for n in range(200))
    assert 50 <= sealed <= 85


def test_the_replica_is_compared_whole_rows_chaos_9(tmp_path: Path) -> None:
    """CHAOS-9: a replica holding the server's objects row for row breaks nothing; one whose
    row differs in its body alone, its hash intact (the hash is copied from the server's
    frames), breaks the run."""
    run = Run(5, tmp_path)
    with run.data.open_journal() as journal, run.data.open_store() as store:
        body = workload.encode(workload.window(5, first_minute=0, minutes=90), 5)
        journal.append(NewDelivery(body=body, client=CLIENT, automation_aggregation="minutes"))
        epoch = store.acquire_lease("chaos-test", now=0, ttl=10**12)
        assert epoch is not None
        run_pass(journal, store, epoch)
        live = list(store.iter_objects())
    assert live
    replica = tmp_path / "replica"
    with Replica(replica) as copy:
        copy.restore("stream", 1, live)
    run.check_replica(replica)
    assert run.result.broken == []

    other = objects.compress(objects.decompress(live[0].body) + b"0\t0\t{}\n")
    with sqlite3.connect(replica / REPLICA_FILE) as conn:
        conn.execute(
            "UPDATE objects SET body = ? WHERE metric = ? AND layer = ? AND hour = ?",
            (other, live[0].key.metric, live[0].key.layer, live[0].key.hour),
        )
    run.check_replica(replica)
    assert run.result.broken == ["the follower's replica differs from the server"]


HEART = body({"hr": [point(1, 60), point(2, 61)]})
# The same minute as HEART with another value: the projection depends on which folds last.
HEART_AGAIN = body({"hr": [point(1, 70)]})
STEPS = body({"steps": [point(1, 5)]})


def journaled(run: Run, *bodies: bytes) -> list[DeliveryMeta]:
    """Journal ``bodies`` for ``run``; the journal in order."""
    with run.data.open_journal() as journal:
        for payload in bodies:
            journal.append(
                NewDelivery(body=payload, client=CLIENT, automation_aggregation="minutes")
            )
        return journal.iter_order()


def fold_in(run: Run, metas: list[DeliveryMeta]) -> None:
    """Fold ``metas`` into the run's store one by one, in the order given, as a live folder."""
    with run.data.open_journal() as journal, run.data.open_store() as store:
        epoch = store.acquire_lease("chaos-test", now=0, ttl=10**12)
        assert epoch is not None
        for meta in metas:
            store.fold(journal, meta, epoch)
        store.release_lease("chaos-test", epoch)


def spoil(run: Run, metric: str) -> None:
    """Give the live object of ``metric`` another hash than its content's, behind the checks."""
    with sqlite3.connect(run.data.store_path) as conn:
        conn.execute("UPDATE objects SET hash = zeroblob(32) WHERE metric = ?", (metric,))


async def test_folds_and_the_projection_are_checked_chaos_10(tmp_path: Path) -> None:
    """CHAOS-10: a journaled delivery left unfolded breaks the run; folds out of journal order
    count as reordered and, without the service's warning, break it; a live object that differs
    from a rebuild counts as mismatched and breaks it; folds in order to a faithful projection
    break nothing."""
    run = Run(5, tmp_path / "ordered")
    run.log.write_text("")
    metas = journaled(run, HEART, STEPS)
    fold_in(run, metas[:1])
    run.check_folds(metas)
    assert run.result.broken == ["journaled deliveries left unfolded"]

    run.result.broken = []
    fold_in(run, metas[1:])
    run.check_folds(metas)
    await run._compare_projection()
    assert (run.result.reordered, run.result.mismatched, run.result.broken) == (0, 0, [])

    spoil(run, "steps")
    await run._compare_projection()
    assert run.result.mismatched == 1
    assert run.result.broken == ["1 objects differ from a rebuild"]

    run = Run(6, tmp_path / "reordered")
    run.log.write_text("")
    metas = journaled(run, HEART, HEART_AGAIN)
    fold_in(run, metas[::-1])
    run.check_folds(metas)
    assert (run.result.reordered, run.result.broken) == (1, [])
    await run._compare_projection()
    assert run.result.broken == [
        "folds left journal order without a warning",
        "1 objects differ from a rebuild",
    ]


def test_only_delivery_folded_events_are_folds_chaos_14(tmp_path: Path) -> None:
    """CHAOS-14: a delivery folded late that writes nothing (an identical re-send) has only its
    `delivery.folded` event, and still counts as reordered; an `object.changed` event naming an
    earlier delivery after a later fold is no fold, and reorders nothing."""
    run = Run(5, tmp_path / "unwritten")
    metas = journaled(run, HEART, HEART)
    fold_in(run, metas[::-1])
    run.check_folds(metas)
    assert run.result.reordered == 1

    run = Run(6, tmp_path / "interleaved")
    metas = journaled(run, HEART, STEPS)
    fold_in(run, metas)
    with sqlite3.connect(run.data.store_path) as conn:
        conn.execute(
            "INSERT INTO events (id, kind, payload, at) VALUES (?, 'object.changed', ?, 0)",
            ("late.1", orjson.dumps({"delivery_id": metas[0].id}).decode()),
        )
    run.check_folds(metas)
    assert (run.result.reordered, run.result.broken) == (0, [])


def test_an_out_of_order_warning_excuses_only_what_it_names_chaos_11(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CHAOS-11: the store's out-of-order warning, as the service logs it, names the delivery
    folded late; objects differing from a rebuild where that delivery writes are excused until
    the reindex, one differing elsewhere is not."""
    run = Run(5, tmp_path)
    metas = journaled(run, HEART, HEART_AGAIN, STEPS)
    with caplog.at_level(logging.WARNING, logger="healthlog.store"):
        fold_in(run, [metas[1], metas[0], metas[2]])
    lines = [KeyValueFormatter().format(record) for record in caplog.records]
    assert [int(m.group(1)) for m in map(_OUT_OF_ORDER.search, lines) if m] == [metas[0].id]
    assert run._unexplained([]) == 1
    assert run._unexplained([metas[0].id]) == 0

    spoil(run, "steps")
    assert run._unexplained([metas[0].id]) == 1


def test_a_token_in_a_record_breaks_the_run_chaos_2(tmp_path: Path) -> None:
    """CHAOS-2: the run's token in a record above DEBUG breaks the run; at DEBUG it does not."""
    for n, (level, broken) in enumerate([("DEBUG", False), ("INFO", True)]):
        run = Run(5, tmp_path / str(n))
        run.log.write_text(f'time=x level={level} logger=healthlog.auth msg="{run.token}"\n')
        run._check_logs()
        assert bool(run.result.broken) == broken, (level, run.result.broken)


def test_a_failed_concurrent_reindex_breaks_the_run_chaos_12(tmp_path: Path) -> None:
    """CHAOS-12: a concurrent reindex that failed breaks the run, unless the service's clock
    jumped and the reindex failed for having lost its lease."""
    lost = "reindex: the fold lease was lost during the reindex (epoch 3)"
    fired = 'time=x level=INFO logger=healthlog.faults msg="fault injected at lease.renew (hit 1)"'
    cases = [
        ("", lost, True),
        (fired, "reindex: the journal cannot be read", True),
        (fired, lost, False),
    ]
    for n, (logged, failure, broken) in enumerate(cases):
        run = Run(5, tmp_path / str(n))
        run.planned = {"lease.renew": "clock"}
        run.log.write_text(logged + "\n")
        run.reindex_failure = failure
        run._check_logs()
        assert bool(run.result.broken) == broken, (logged, failure, run.result.broken)
