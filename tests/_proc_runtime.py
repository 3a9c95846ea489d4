"""A healthlog runtime in a process of its own, for the process-level tests (test_processes.py).

    python -m tests._proc_runtime DATA_DIR [--holder NAME] [--submit N]
        [--executor thread|process] [--period S] [--ttl S] [--renew S] [--busy-timeout-ms MS]
        [--stop-at-read N] [--budget S]

Opens a runtime on DATA_DIR (wake period, lease TTL and renewal in seconds: short by default,
for tests), journals N small deliveries through its intake, prints ``ready`` on stdout, then
serves (holds or waits for the fold lease, folds) until SIGTERM or SIGINT, when it shuts the
runtime down, releasing the lease, and exits 0. Nothing else goes to stdout; log records at
WARNING and above go to stderr. With ``--stop-at-read N`` the process stops itself (SIGSTOP) once
it has read the body of the N-th delivery it folds, before the fold's transaction: a holder
frozen in the middle of its pass, under the epoch it folds with, until SIGCONT. ``--budget S``
is the fixed part of each fold's time budget, with nothing added per MiB.

:func:`payload` also builds the bodies that the tests journal themselves.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import trio

from actors.folding import Executor
from actors.runtime import RuntimeConfig, open_runtime
from healthlog import faults
from healthlog.storage.journal import Journal, NewDelivery
from healthlog.storage.passes import Budget
from healthlog.storage.store import default_holder

READY = "ready"
CLIENT = "proc-runtime"
AUTOMATION = "proc"
METRICS = ("heart_rate", "step_count", "active_energy")
POINTS = 24
OVERLAP = 2
BASE = datetime(2024, 3, 1, tzinfo=UTC)


def payload(n: int, points: int = POINTS) -> bytes:
    """Body of delivery ``n``: ``points`` minute points for each of three metrics.

    Its first and last ``OVERLAP`` minutes are also sent by deliveries ``n - 1`` and ``n + 1``,
    equally complete but with other values, so the stored objects depend on the fold order and
    ``healthlog verify`` notices a fold out of journal order.
    """
    first = n * (points - OVERLAP)
    data = [
        {"date": (BASE + timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M:%S +0000"), "qty": n + m}
        for m in range(first, first + points)
    ]
    return orjson.dumps(
        {"data": {"metrics": [{"name": name, "units": "count", "data": data} for name in METRICS]}}
    )


def new_delivery(n: int, points: int = POINTS) -> NewDelivery:
    """Delivery ``n`` as intake hands it to the journal."""
    return NewDelivery(
        payload(n, points),
        CLIENT,
        content_type="application/json",
        automation_id=AUTOMATION,
        automation_aggregation="minutes",
    )


def stop_self(_: str) -> None:
    """Freeze this whole process, as a SIGSTOP from outside would."""
    os.kill(os.getpid(), signal.SIGSTOP)


async def serve(config: RuntimeConfig, submit: int, stop_at_read: int | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_runtime(config) as runtime:
            if stop_at_read is not None:
                read = faults.Action(frozenset({stop_at_read}), stop_self)
                faults.install(faults.Plan({"journal.read_body": read}))
            first, _ = await runtime.read_journal(Journal.count)
            for n in range(first, first + submit):
                await runtime.submit(new_delivery(n))
            print(READY, flush=True)
            async for _ in signals:
                break


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests._proc_runtime")
    parser.add_argument("data", type=Path)
    parser.add_argument("--holder", default=None)
    parser.add_argument("--submit", type=int, default=0)
    parser.add_argument("--executor", choices=[e.value for e in Executor], default="process")
    parser.add_argument("--period", type=float, default=0.2)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--renew", type=float, default=0.5)
    parser.add_argument("--busy-timeout-ms", type=int, default=5000)
    parser.add_argument("--stop-at-read", type=int, default=None)
    parser.add_argument("--budget", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    )
    config = RuntimeConfig(
        args.data,
        holder=args.holder or default_holder(),
        wake_period_s=args.period,
        lease_ttl_s=args.ttl,
        lease_renew_s=args.renew,
        executor=Executor(args.executor),
        busy_timeout_ms=args.busy_timeout_ms,
        budget=Budget() if args.budget is None else Budget(args.budget, 0.0),
    )
    trio.run(serve, config, args.submit, args.stop_at_read)
    return 0


if __name__ == "__main__":
    sys.exit(main())
