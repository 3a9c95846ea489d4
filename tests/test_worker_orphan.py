"""A fold worker orphaned by a killed service stops its run (specs/runtime.md, RUN-31).

Real processes: a stand-in service forks a worker that calls ``fold_run``; the test kills the
service with SIGKILL in the middle of the run and watches what the orphan does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from _runtime_helpers import HOLDER, folded_ids, journal_directly, new_delivery

from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV

RUN = 6
DELAY_S = 1.0
"""How long each delivery's fold waits before its commit, so the run takes RUN * DELAY_S."""
DEADLINE_S = 30.0

SERVICE = """
import os, sys, time
data_dir, ids, epoch = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], int(sys.argv[3])
pid = os.fork()
if pid == 0:
    from healthlog.storage.passes import Budget
    from healthlog.storage.worker import CODE, fold_run
    fold_run(CODE, data_dir, ids, epoch, Budget(), 5000)
    os._exit(0)
print(pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited: reaped, or a zombie of a parent that has not reaped it."""
    try:
        os.kill(pid, 0)
        status = Path(f"/proc/{pid}/status").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return True
    return "State:\tZ" in status


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S} s"
        time.sleep(0.02)


def test_an_orphaned_worker_stops_its_run_before_the_next_delivery_run_31(
    tmp_path: Path,
) -> None:
    """RUN-31: a worker folding a run of six slow deliveries whose service process is killed
    (SIGKILL) after the first is folded finds its parent changed before the next delivery,
    stops its run and exits, leaving at most the delivery it was folding folded besides the
    first, and logs one warning that names how many it left."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(RUN)])
    with DataDir(tmp_path).open_store() as store:
        epoch = store.acquire_lease(HOLDER, now=time.time_ns() // 1000, ttl=3600 * 10**6)
    assert epoch is not None
    plan = {
        "fold.before_commit": {"hits": list(range(1, RUN + 1)), "do": "delay", "seconds": DELAY_S}
    }
    env = {**os.environ, PLAN_ENV: orjson.dumps(plan).decode()}
    args = [str(tmp_path), ",".join(map(str, ids)), str(epoch)]
    worker = 0
    with (
        (tmp_path / "stderr.log").open("wb") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", SERVICE, *args], env=env, stdout=subprocess.PIPE, stderr=stderr
        ) as service,
    ):
        try:
            assert service.stdout is not None
            worker = int(service.stdout.readline())
            wait_for(lambda: ids[0] in folded_ids(tmp_path), "the first delivery folded")
            service.send_signal(signal.SIGKILL)
            service.wait()
            wait_for(lambda: gone(worker), "the orphaned worker exited")
        finally:
            service.kill()
            if worker:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)

    folded = folded_ids(tmp_path)
    assert folded <= set(ids[:2])
    assert ids[0] in folded
    log = (tmp_path / "stderr.log").read_text()
    warnings = [line for line in log.splitlines() if "level=WARNING" in line]
    assert len(warnings) == 1
    assert f"{RUN - len(folded)} of {RUN} deliveries left unfolded" in warnings[0]
