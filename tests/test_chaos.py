"""The fault-injection harness as users run it (specs/chaos.md)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from healthlog import faults
from healthlog.storage import faultplan
from healthlog.storage._sqlite import Deferred
from healthlog.workload import LEAK_MARKER
from transport.chaos import KINDS, Run

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


@pytest.mark.parametrize(
    "line",
    [
        f'time=x level=WARNING logger=healthlog.fold msg="source {LEAK_MARKER}"',
        'time=x level=ERROR logger=healthlog.supervisor msg="actor folding crashed"',
    ],
)
def test_leaks_and_errors_break_the_run_chaos_2(tmp_path: Path, line: str) -> None:
    """CHAOS-2: a value in a log record, or an ERROR record, breaks the run."""
    run = Run(5, tmp_path)
    run.log.write_text(line + "\n")
    run._check_logs()
    assert run.result.broken


def test_plan_from_the_environment_fires_and_logs_chaos_3(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CHAOS-3: a JSON plan fires on the named hits, logs the point, and refuses unknowns."""
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
    with pytest.raises(ValueError, match="unknown fault points"):
        faults.install(faultplan.from_spec({"nowhere": {"hits": [1], "do": "busy"}}))
    with pytest.raises(ValueError, match="unknown fault kind"):
        faultplan.from_spec({"fold.begin": {"hits": [1], "do": "explode"}})


def test_two_hundred_runs_plan_every_kind_chaos_5(tmp_path: Path) -> None:
    """CHAOS-5: the runs of ``--seed 7 --runs 200`` choose every kind of fault, each in several
    runs (what fired is counted by the 200-run itself)."""
    chosen: Counter[str] = Counter()
    for n in range(200):
        chosen.update(Run(7 * 100_000 + n, tmp_path).kinds)
    assert set(chosen) == set(KINDS)
    assert min(chosen.values()) >= 10


def test_a_third_of_the_runs_seal_chaos_6(tmp_path: Path) -> None:
    """CHAOS-6: about a third of the runs of ``--seed 7 --runs 200`` also seal the first hours
    of their window while the workload is posted."""
    sealed = sum(Run(7 * 100_000 + n, tmp_path).result.sealed for n in range(200))
    assert 50 <= sealed <= 85
