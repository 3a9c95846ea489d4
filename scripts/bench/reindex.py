"""Reindex throughput in points per second, against the floor pipeline on both cores.

The journal holds ``DAYS`` one-day deliveries of minute-level points, then re-sends of
``RESENDS`` of those days (identical, poorer, richer and conflicting in turn), so that the
rebuild merges into stored objects as well as creating them. It is folded once (the live
store), then ``healthlog.storage.rebuild.reindex`` is timed in this process: the rebuild into a
scratch store and the swap. A reindex keeps the live body of an object whose content did not
change (it compresses only what changed), so a second row times the reindex of the same
journal into an empty store, where every object is new (a store lost or deleted). The floor
runs ``floor.fold`` over the same bodies split into two halves, one per worker process (two
cores), each into its own SQLite file; its time is the wall time of both. The floor on one
process is printed too. Best of ``REPEATS``. Log records go to a file, as the CLI's go to
stderr; the point collision warnings are counted. Bound: reindex points per second at least
0.7 times the two-core floor's, in both rows.
"""

from __future__ import annotations

import logging
import multiprocessing
import tempfile
import time
from pathlib import Path

import common
import floor
import orjson

from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery
from healthlog.storage.passes import run_pass
from healthlog.storage.rebuild import reindex
from healthlog.workload import VARIANTS, encode, variant

DAYS = 60
RESENDS = 20
REPEATS = 3
BOUND = 0.7
LEASE_TTL_US = 3600 * 1_000_000
FLOOR_LIMIT_S = 300.0


def bodies() -> list[bytes]:
    days = [common.day_body(n) for n in range(DAYS)]
    resends = [
        encode(variant(orjson.loads(days[n]), VARIANTS[n % len(VARIANTS)], n), DAYS + n)
        for n in range(RESENDS)
    ]
    return days + resends


def prepare(data: DataDir, deliveries: list[bytes]) -> None:
    """Journal the deliveries and fold them into the live store."""
    with data.open_journal() as journal, data.open_store() as store:
        journal.append_many([NewDelivery(body=body, client="bench") for body in deliveries])
        epoch = store.acquire_lease("bench", now=time.time_ns() // 1000, ttl=LEASE_TTL_US)
        assert epoch is not None
        folding = run_pass(journal, store, epoch)
        store.release_lease("bench", epoch)
        if not folding.reached_end:
            raise RuntimeError(f"folding stopped: {folding.stopped_because}")


def time_reindex(data: DataDir) -> tuple[int, float]:
    """(points folded, seconds) of one reindex of the data directory."""
    with data.open_journal() as journal, data.open_store() as store:
        started = time.perf_counter()
        reindex(journal, store, "bench-reindex")
        seconds = time.perf_counter() - started
        return store.counter_totals(["points"])["points"], seconds


def time_empty(data: DataDir) -> tuple[int, float]:
    """(points folded, seconds) of one reindex of the data directory's journal into an empty
    store (any store there is deleted first)."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{data.store_path}{suffix}").unlink(missing_ok=True)
    return time_reindex(data)


def halves(paths: list[Path]) -> list[list[Path]]:
    """Two lists of about the same number of bytes, each in journal order."""
    parts: list[list[Path]] = [[], []]
    sizes = [0, 0]
    for path in paths:
        smaller = sizes.index(min(sizes))
        parts[smaller].append(path)
        sizes[smaller] += path.stat().st_size
    return parts


def time_floor(pool: multiprocessing.pool.Pool, paths: list[Path], work: Path) -> tuple[int, float]:
    """(points, wall seconds) of the floor over ``paths`` split over the pool's two workers."""
    jobs = [
        (part, work / f"floor-{n}-{time.perf_counter_ns()}.sqlite")
        for n, part in enumerate(halves(paths))
    ]
    started = time.perf_counter()
    results = pool.starmap_async(floor.fold_files, jobs).get(FLOOR_LIMIT_S)
    return sum(points for points, _ in results), time.perf_counter() - started


def main() -> None:
    deliveries = bodies()
    size = sum(map(len, deliveries))
    print(
        f"reindex: {len(deliveries)} deliveries ({DAYS} days, {RESENDS} re-sends),"
        f" {common.mib(size)}, best of {REPEATS}"
    )
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp, ctx.Pool(2) as pool:
        work = Path(tmp)
        logging.basicConfig(filename=work / "bench.log", level=logging.INFO)
        paths = []
        for n, body in enumerate(deliveries):
            paths.append(work / f"body{n:04d}.json")
            paths[-1].write_bytes(body)
        data = DataDir(work / "data")
        prepare(data, deliveries)
        empty = DataDir(work / "empty")
        with empty.open_journal() as journal:
            journal.append_many([NewDelivery(body=body, client="bench") for body in deliveries])
        del deliveries
        pool.starmap(time.sleep, [(0.2,), (0.2,)], chunksize=1)
        rebuilt, emptied, floors, singles = [], [], [], []
        for n in range(REPEATS):
            points, seconds = time_reindex(data)
            empty_points, empty_seconds = time_empty(empty)
            floor_points, floor_seconds = time_floor(pool, paths, work)
            single_points, single_seconds = floor.fold_files(paths, work / f"single-{n}.sqlite")
            if not points == empty_points == floor_points == single_points:
                raise RuntimeError(
                    f"points differ: {points}, {empty_points}, {floor_points}, {single_points}"
                )
            rebuilt.append(points / seconds)
            emptied.append(points / empty_seconds)
            floors.append(points / floor_seconds)
            singles.append(points / single_seconds)
            print(
                f"  run {n}: reindex {seconds:.2f} s ({rebuilt[-1]:.0f} points/s), into an empty"
                f" store {empty_seconds:.2f} s ({emptied[-1]:.0f} points/s), floor on two"
                f" processes {floor_seconds:.2f} s ({floors[-1]:.0f} points/s), floor on one"
                f" {single_seconds:.2f} s ({singles[-1]:.0f} points/s); {points} points"
            )
        logged = (work / "bench.log").read_text(errors="replace").count("point collision")
    print(f"  point collision warnings logged (live fold and reindexes): {logged}")
    floor_pps = max(floors)
    floor_text = f"{floor_pps:.0f} points/s (floor, 2 processes; 1 process {max(singles):.0f})"
    common.print_rows(
        [
            common.Row(
                name,
                f"{figure:.0f} points/s",
                floor_text,
                f"{figure / floor_pps:.2f}",
                f">= {BOUND}",
                common.judge(figure / floor_pps, bound=BOUND, higher=True),
            )
            for name, figure in (
                ("reindex throughput", max(rebuilt)),
                ("reindex throughput, empty store", max(emptied)),
            )
        ]
    )


if __name__ == "__main__":
    main()
