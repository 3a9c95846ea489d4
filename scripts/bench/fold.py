"""Fold of the 62 MiB delivery until its outcome is written, against the floor pipeline.

The delivery is journaled once (``Journal.append``). Each repetition runs in a child process
of its own, which opens the journal and a fresh store, takes the fold lease, records its
baseline RSS, runs one folding pass (``run_pass``: the delivery's fold transaction, outcome,
checkpoint and events) and reports the seconds and its peak RSS (``VmHWM``). The floor
(``floor.fold``) runs the same way on the same bytes, in a child process too. Best of
``REPEATS`` for the times; the peak is the highest seen. Bounds: at most 2.5 times the floor
(goal 1.5); peak RSS of the folding process at most 3 times the body (goal 2), nothing
subtracted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import floor

from healthlog.storage.journal import Journal, NewDelivery
from healthlog.storage.passes import run_pass
from healthlog.storage.store import Store

REPEATS = 2
TIME_BOUND = 2.5
TIME_GOAL = 1.5
RSS_BOUND = 3.0
RSS_GOAL = 2.0
CHILD_LIMIT_S = 300.0
LEASE_TTL_US = 3600 * 1_000_000


def child_fold(journal_path: str, store_path: str) -> dict[str, Any]:
    with Journal(journal_path) as journal, Store(store_path) as store:
        epoch = store.acquire_lease("bench", now=time.time_ns() // 1000, ttl=LEASE_TTL_US)
        assert epoch is not None
        baseline = common.memory()["VmRSS"]
        started = time.perf_counter()
        folding = run_pass(journal, store, epoch)
        seconds = time.perf_counter() - started
        (meta,) = journal.iter_order()
        outcome = store.outcome(meta.id)
        assert outcome is not None, folding.stopped_because
        return {
            "seconds": seconds,
            "baseline": baseline,
            "peak": common.memory()["VmHWM"],
            "status": outcome.status,
            "points": outcome.counters["points"],
            "objects": outcome.counters["objects_written"],
        }


def child_floor(body_path: str, db_path: str) -> dict[str, Any]:
    body = Path(body_path).read_bytes()
    conn = floor.open_db(Path(db_path))
    baseline = common.memory()["VmRSS"]
    started = time.perf_counter()
    points = floor.fold(body, conn)
    seconds = time.perf_counter() - started
    conn.close()
    return {
        "seconds": seconds,
        "baseline": baseline,
        "peak": common.memory()["VmHWM"],
        "points": points,
    }


def in_child(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, timeout=CHILD_LIMIT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{done.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    body = common.large_body()
    size = len(body)
    print(f"fold: body {common.mib(size)} ({size} bytes), best of {REPEATS}")
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp:
        work = Path(tmp)
        (work / "body.json").write_bytes(body)
        with Journal(work / "journal.sqlite") as journal:
            journal.append(NewDelivery(body=body, client="bench"))
        del body
        folds, floors = [], []
        for n in range(REPEATS):
            folds.append(in_child("fold", str(work / "journal.sqlite"), str(work / f"s{n}.sqlite")))
            floors.append(in_child("floor", str(work / "body.json"), str(work / f"f{n}.sqlite")))
            fold_run, floor_run = folds[-1], floors[-1]
            print(
                f"  run {n}: fold {fold_run['seconds']:.2f} s ({fold_run['status']},"
                f" {fold_run['points']} points, {fold_run['objects']} objects), baseline RSS"
                f" {common.mib(fold_run['baseline'])}, peak RSS {common.mib(fold_run['peak'])};"
                f" floor {floor_run['seconds']:.2f} s ({floor_run['points']} points), baseline"
                f" {common.mib(floor_run['baseline'])}, peak {common.mib(floor_run['peak'])}"
            )
    figure = min(run["seconds"] for run in folds)
    floor_s = min(run["seconds"] for run in floors)
    peak = max(run["peak"] for run in folds)
    baseline = max(run["baseline"] for run in folds)
    floor_peak = max(run["peak"] for run in floors)
    common.print_rows(
        [
            common.Row(
                "fold 62 MiB until outcome",
                f"{figure:.2f} s",
                f"{floor_s:.2f} s (floor pipeline)",
                f"{figure / floor_s:.2f}x",
                f"<= {TIME_BOUND}x (goal {TIME_GOAL}x)",
                common.judge(figure / floor_s, bound=TIME_BOUND, goal=TIME_GOAL),
            ),
            common.Row(
                "fold peak RSS",
                f"{common.mib(peak)} (baseline {common.mib(baseline)})",
                f"body {common.mib(size)} (floor peak {common.mib(floor_peak)})",
                f"{peak / size:.2f}x body",
                f"<= {RSS_BOUND}x body (goal {RSS_GOAL}x)",
                common.judge(peak / size, bound=RSS_BOUND, goal=RSS_GOAL),
            ),
        ]
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        role, *paths = sys.argv[1:]
        child = {"fold": child_fold, "floor": child_floor}[role]
        print(json.dumps(child(*paths)))
    else:
        main()
