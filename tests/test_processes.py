"""Leases and fencing across real processes (specs/fencing.md, scenarios FENCE-n).

Every actor here is a real process on real SQLite files: runtimes (``python -m
tests._proc_runtime``), the command line (``python -m healthlog.cli``), a lock holder (``python -c``
with ``sqlite3``), stopped with real signals, SIGKILL included. The tests read the data directory
through read-only connections of their own: the journal order, each outcome's lease epoch, the
``delivery.folded`` events and the lease row.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
import trio
from _baseline import severe_lines
from _proc_runtime import READY, new_delivery, payload

from actors.folding import Executor
from actors.runtime import Runtime, RuntimeConfig, open_runtime
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal

if TYPE_CHECKING:
    from conftest import RunCli

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 30.0
POLL_S = 0.02
HEAVY = 1500
"""Points per metric of a delivery whose fold takes tens of milliseconds."""

LOCKED = "locked"
LOCKER = f"""\
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print({LOCKED!r}, flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
conn.close()
"""
"""``python -c LOCKER DB``: hold the write lock of DB until stdin is closed, then let go."""
HOLD_S = 1.5
"""How long a lock holder holds the store at least: longer than a lease renewal interval."""


# -- reading a data directory ---------------------------------------------------------------


@attrs.frozen
class State:
    """What a data directory holds, read by this test process."""

    order: tuple[int, ...]
    """Journaled delivery ids in journal order."""
    epochs: dict[int, int]
    """Delivery id -> the lease epoch its outcome was written under."""
    folded_events: tuple[int, ...]
    """The delivery ids of the ``delivery.folded`` events, in sequence order."""
    folded_live: int
    """How many of those a runtime wrote (the others come from a reindex's swap)."""
    holder: str | None
    epoch: int
    expires_at: int

    @property
    def pending(self) -> list[int]:
        return [i for i in self.order if i not in self.epochs]

    def describe(self) -> str:
        return (
            f"{len(self.order)} journaled, {len(self.pending)} pending,"
            f" lease {self.holder!r} at epoch {self.epoch}"
        )


def read_only(path: Path) -> closing[sqlite3.Connection]:
    uri = path.resolve().as_uri() + "?mode=ro"
    return closing(sqlite3.connect(uri, uri=True, timeout=WAIT_S, isolation_level=None))


def state(data: Path) -> State:
    """The projection in one read transaction, then the journal (a superset of what folded)."""
    directory = DataDir(data)
    with read_only(directory.store_path) as store:
        store.execute("BEGIN")
        epochs = dict(store.execute("SELECT delivery_id, epoch FROM outcomes"))
        rows = store.execute(
            "SELECT json_extract(payload, '$.delivery_id'), id FROM events"
            " WHERE kind = 'delivery.folded' ORDER BY seq"
        ).fetchall()
        events = tuple(delivery_id for delivery_id, _ in rows)
        live = sum(1 for _, event_id in rows if not event_id.startswith("reindex."))
        holder, epoch, expires_at = store.execute(
            "SELECT holder, epoch, expires_at FROM lease WHERE name = 'fold'"
        ).fetchone()
        store.execute("COMMIT")
    with read_only(directory.journal_path) as journal:
        order = tuple(
            i for (i,) in journal.execute("SELECT id FROM deliveries ORDER BY received_at, id")
        )
    return State(order, epochs, events, live, holder, epoch, expires_at)


def wait_state(
    data: Path,
    what: str,
    done: Callable[[State], bool],
    *,
    timeout: float = WAIT_S,
    watch: Sequence[Child] = (),
) -> State:
    """Poll until ``done``; fail at the timeout, or as soon as a watched process has failed."""
    deadline = time.monotonic() + timeout
    while not done(current := state(data)):
        for child in watch:
            code = child.proc.poll()
            assert code in (None, 0), f"{child.name} exited {code}:\n{child.stderr()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}: {current.describe()}"
        time.sleep(POLL_S)
    return current


def quiescent(s: State) -> bool:
    return bool(s.order) and not s.pending


def folded_more_than(count: int, *, under_epoch_above: int = 0) -> Callable[[State], bool]:
    """More than ``count`` outcomes, one of them under an epoch above ``under_epoch_above``."""
    return lambda s: len(s.epochs) > count and max(s.epochs.values()) > under_epoch_above


def reindexing(s: State) -> bool:
    return s.holder is not None and s.holder.startswith("reindex:")


def wall_us() -> int:
    return time.time_ns() // 1000


def assert_folded_once_in_journal_order(s: State) -> None:
    """Each ``delivery.folded`` event names a journaled delivery once, in journal order."""
    assert len(set(s.folded_events)) == len(s.folded_events), "a delivery folded twice"
    position = {delivery_id: n for n, delivery_id in enumerate(s.order)}
    positions = [position[delivery_id] for delivery_id in s.folded_events]
    assert positions == sorted(positions), "deliveries folded out of journal order"


def journal(data: Path, count: int, points: int = HEAVY) -> list[int]:
    """Journal ``count`` deliveries straight into the journal file (as intake would)."""
    with DataDir(data).open_journal() as opened:
        return append(opened, count, points)


def append(opened: Journal, count: int, points: int) -> list[int]:
    first, _ = opened.count()
    return [opened.append(new_delivery(n, points)).delivery_id for n in range(first, first + count)]


# -- processes ------------------------------------------------------------------------------


@attrs.frozen
class Child:
    """A started process: stdin and stdout are pipes, stderr goes to a file."""

    name: str
    proc: subprocess.Popen[str]
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def expect(self, line: str) -> None:
        """Wait for the next stdout line; it must be ``line``."""
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], WAIT_S)
        got = self.proc.stdout.readline() if readable else "<nothing>"
        assert got == line + "\n", f"{self.name} said {got!r}:\n{self.stderr()[-3000:]}"

    def finish(self, timeout: float = WAIT_S) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM: a runtime shuts down cleanly, exits 0 and logs no ERROR."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.finish() == 0, self.stderr()[-3000:]
        assert severe_lines(self.stderr()) == []

    def crash(self) -> None:
        """SIGKILL: no cleanup of any kind."""
        self.proc.kill()
        self.finish()

    def release(self) -> None:
        """Close stdin: a lock holder lets go of its lock and exits 0."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.finish() == 0, self.stderr()


class Children:
    """The processes a test starts; at teardown whatever still runs is killed and reaped."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self._started: list[Child] = []

    def start(self, name: str, *args: str | os.PathLike[str]) -> Child:
        log = self._logs / f"{len(self._started)}-{name}.log"
        with log.open("w") as err:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        child = Child(name, proc, log)
        self._started.append(child)
        return child

    def runtime(self, data: Path, holder: str, *options: str) -> Child:
        """A runtime process holding (or waiting for) the lease as ``holder``, once ready."""
        child = self.start(holder, "-m", "tests._proc_runtime", data, "--holder", holder, *options)
        child.expect(READY)
        return child

    def cli(self, *args: str | os.PathLike[str]) -> Child:
        return self.start(str(args[0]), "-m", "healthlog.cli", *args)

    def locker(self, db: Path) -> Child:
        """A process holding ``BEGIN EXCLUSIVE`` on ``db`` (see LOCKER), once it holds it."""
        child = self.start("locker", "-c", LOCKER, db)
        child.expect(LOCKED)
        return child

    def close(self) -> None:
        for child in self._started:
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait(WAIT_S)
            for pipe in (child.proc.stdin, child.proc.stdout):
                assert pipe is not None
                pipe.close()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    logs = tmp_path / "logs"
    logs.mkdir()
    started = Children(logs)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A data directory with an empty journal and an empty store."""
    directory = DataDir(tmp_path / "data")
    with directory.open_journal(), directory.open_store():
        return directory.path


def bodies(tmp_path: Path, numbers: range) -> list[Path]:
    """One body file per delivery number, for ``healthlog import``."""
    files = []
    for n in numbers:
        path = tmp_path / f"delivery-{n}.json"
        path.write_bytes(payload(n))
        files.append(path)
    return files


# -- two runtimes ---------------------------------------------------------------------------


def test_two_runtimes_one_folds_and_the_other_takes_over_after_a_crash_fence_1_fence_2(
    children: Children, run_cli: RunCli, data: Path, tmp_path: Path
) -> None:
    """FENCE-1: of two runtime processes on one data directory exactly one folds, under its
    epoch, in journal order. FENCE-2: SIGKILL it; the other takes over only once the dead
    holder's lease has expired, at the next epoch, and folds what was journaled meanwhile."""
    alpha = children.runtime(data, "alpha")
    held = wait_state(data, "alpha holds the lease", lambda s: s.holder == "alpha", watch=[alpha])
    beta = children.runtime(data, "beta")
    run = run_cli("import", "--no-wait", "--data", data, *bodies(tmp_path, range(8)))
    assert run.code == 0, run.err

    folded = wait_state(data, "the imports are folded", quiescent, watch=[alpha, beta])
    assert len(folded.order) == 8
    assert (folded.holder, folded.epoch) == ("alpha", held.epoch)
    assert set(folded.epochs.values()) == {held.epoch}
    assert sorted(folded.folded_events) == sorted(folded.order)
    assert_folded_once_in_journal_order(folded)

    alpha.crash()
    dead = state(data)
    assert (dead.holder, dead.epoch) == ("alpha", held.epoch), "a SIGKILL releases nothing"
    later = journal(data, 4, points=24)
    deadline = time.monotonic() + WAIT_S
    while (sample := state(data)).holder != "beta":
        if wall_us() < dead.expires_at:
            assert sample.holder == "alpha", "taken over before the lease expired"
            assert not set(later) & sample.epochs.keys(), "folded with nobody holding the lease"
        assert time.monotonic() < deadline, sample.describe()
        time.sleep(POLL_S)
    # The takeover came before this moment: if it is before the expiry, so was the takeover.
    assert wall_us() >= dead.expires_at, "taken over before the lease expired"
    assert sample.epoch == held.epoch + 1

    final = wait_state(data, "beta folds what was journaled meanwhile", quiescent, watch=[beta])
    assert {final.epochs[i] for i in later} == {held.epoch + 1}
    assert sorted(final.folded_events) == sorted(final.order)
    assert_folded_once_in_journal_order(final)
    beta.stop()


def test_a_stopped_runtime_releases_the_lease_at_once_fence_3(
    children: Children, data: Path
) -> None:
    """FENCE-3: SIGTERM stops the holder cleanly and releases the lease: the waiting runtime
    takes over long before the 30 s TTL, at the next epoch; stopped in turn, it releases too."""
    lease = ("--executor", "thread", "--ttl", "30", "--renew", "0.2")
    alpha = children.runtime(data, "alpha", "--submit", "3", *lease)
    held = wait_state(
        data, "alpha folds", lambda s: quiescent(s) and s.holder == "alpha", watch=[alpha]
    )
    beta = children.runtime(data, "beta", *lease)

    alpha.stop()
    took = wait_state(
        data, "beta takes over", lambda s: s.holder == "beta", timeout=5, watch=[beta]
    )
    assert took.epoch == held.epoch + 1
    later = journal(data, 3, points=24)
    final = wait_state(data, "beta folds", quiescent, watch=[beta])
    assert {final.epochs[i] for i in later} == {held.epoch + 1}

    beta.stop()
    released = state(data)
    assert (released.holder, released.epoch) == (None, held.epoch + 1)


# -- reindex while serving ------------------------------------------------------------------


def test_reindex_fences_a_live_runtime_which_resumes_after_it_fence_4(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-4: `healthlog reindex` in another process while a runtime folds: it takes the
    lease at a higher epoch, the runtime loses it and folds nothing until the reindex has
    released it, then takes it back and folds what was journaled during and after; `verify`
    run while the runtime serves exits 0."""
    journal(data, 30)
    live = children.runtime(data, "live", "--executor", "thread", "--renew", "0.2")
    before = wait_state(data, "the runtime folds", folded_more_than(2), watch=[live])
    assert before.holder == "live"

    samples = []
    reindex = children.cli("reindex", "--data", data)
    deadline = time.monotonic() + WAIT_S
    with DataDir(data).open_journal() as opened:
        while reindex.proc.poll() is None:
            append(opened, 1, points=24)
            samples.append(state(data))
            assert time.monotonic() < deadline, "reindex does not end"
            time.sleep(POLL_S)
    assert reindex.finish() == 0, reindex.stderr()[-3000:]

    fenced = [s for s in samples if reindexing(s)]
    assert len(fenced) >= 2, "the reindex was never seen holding the lease"
    assert {s.epoch for s in fenced} == {before.epoch + 1}
    for earlier, later in itertools.pairwise(samples):
        if reindexing(earlier) and reindexing(later):
            assert later.folded_live == earlier.folded_live, "a fenced runtime folded"

    after = journal(data, 3, points=24)
    final = wait_state(data, "the runtime folds again", quiescent, watch=[live])
    assert (final.holder, final.epoch) == ("live", before.epoch + 2)
    assert {final.epochs[i] for i in after} == {before.epoch + 2}
    assert_folded_once_in_journal_order(final)
    assert f"fold lease lost (epoch {before.epoch})" in live.stderr()

    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]
    live.stop()


def test_a_reindex_stopped_with_sigterm_releases_the_lease_fence_5(
    children: Children, data: Path
) -> None:
    """FENCE-5: a reindex stopped with SIGTERM in the middle releases the lease, and the live
    runtime takes it back and folds again well within its TTL."""
    journal(data, 30)
    live = children.runtime(data, "live", "--executor", "thread", "--renew", "0.2")
    before = wait_state(data, "the runtime folds", folded_more_than(2), watch=[live])
    reindex = children.cli("reindex", "--data", data)
    wait_state(data, "the reindex holds the lease", reindexing, watch=[reindex])
    reindex.proc.send_signal(signal.SIGTERM)
    reindex.finish()
    later = journal(data, 1, points=24)
    final = wait_state(data, "the runtime folds again", quiescent, timeout=10, watch=[live])
    assert final.holder == "live"
    assert final.epochs[later[0]] > before.epoch + 1


def test_an_import_during_a_reindex_says_it_waits_for_the_reindex_cli_216(
    children: Children, data: Path, tmp_path: Path
) -> None:
    """CLI-216: `import` while a reindex holds the lease says it waits for that reindex, not
    for a running service (none runs), and once the reindex has swapped in and released the
    lease it folds its delivery itself and exits 0."""
    journal(data, 30)
    reindex = children.cli("reindex", "--data", data)
    wait_state(data, "the reindex holds the lease", reindexing, watch=[reindex])
    reindex.proc.send_signal(signal.SIGSTOP)
    try:
        importer = children.cli("import", "--data", data, *bodies(tmp_path, range(30, 31)))
        deadline = time.monotonic() + WAIT_S
        while "import: waiting" not in importer.stderr():
            assert importer.proc.poll() is None, importer.stderr()
            assert time.monotonic() < deadline, "import never said what it waits for"
            time.sleep(POLL_S)
    finally:
        reindex.proc.send_signal(signal.SIGCONT)
    assert reindex.finish() == 0, reindex.stderr()[-3000:]
    assert importer.finish() == 0, importer.stderr()[-3000:]
    said = [line for line in importer.stderr().splitlines() if line.startswith("import: ")]
    assert said == [
        "import: waiting for the reindex that holds the fold lease to swap in and release it;"
        " what was journaled folds after it (--no-wait does not wait)"
    ]
    assert quiescent(state(data))


def test_an_import_during_another_import_says_it_waits_for_that_import_cli_240(
    children: Children, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CLI-240: `import` while another `import` holds the fold lease (its first fold held 10 s
    at `fold.begin`; two run at once: cron and a hand) says it waits for that command, not for
    a running service (none runs, and a service's next pass, a minute away, is not what it
    waits for), and once the other has folded and released the lease it folds its delivery
    itself and exits 0. (Before, it said `import: waiting for the running service, which holds
    the fold lease, to fold at its next pass (within its wake_period_s, ...)`.)"""
    plan = {"fold.begin": {"hits": [1], "do": "delay", "seconds": 10}}
    monkeypatch.setenv("HEALTHLOG_FAULT_PLAN", json.dumps(plan))
    first = children.cli("import", "--data", data, *bodies(tmp_path, range(1)))
    monkeypatch.delenv("HEALTHLOG_FAULT_PLAN")
    wait_state(data, "the first import holds the lease", lambda s: s.order != (), watch=[first])
    second = children.cli("import", "--data", data, *bodies(tmp_path, range(1, 2)))
    deadline = time.monotonic() + WAIT_S
    while "import: waiting" not in second.stderr():
        assert second.proc.poll() is None, second.stderr()
        assert time.monotonic() < deadline, "import never said what it waits for"
        time.sleep(POLL_S)
    assert first.finish() == 0, first.stderr()[-3000:]
    assert second.finish() == 0, second.stderr()[-3000:]
    said = [line for line in second.stderr().splitlines() if line.startswith("import: ")]
    assert said == [
        "import: waiting for another import or seal, which holds the fold lease, to fold what"
        " it journaled and release it; what was journaled folds after it (--no-wait does not"
        " wait)"
    ]
    assert quiescent(state(data))


# -- a busy store ---------------------------------------------------------------------------


def test_a_reindex_waits_for_a_store_another_process_writes_fence_30(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-30: another process holds the store's write lock, as the service's fold of a
    large delivery does for seconds: `healthlog reindex` run meanwhile says it waits for it,
    rather than exit 3 `database busy` once SQLite's busy timeout (5 s) has passed, and once
    the lock is released it rebuilds, swaps in and exits 0; `verify` exits 0."""
    order = journal(data, 3, points=24)
    locker = children.locker(DataDir(data).store_path)
    reindex = children.cli("reindex", "--data", data)
    deadline = time.monotonic() + WAIT_S
    while "reindex: waiting for the write lock of store.sqlite" not in reindex.stderr():
        code = reindex.proc.poll()
        assert code is None, f"reindex exited {code} with the store locked:\n{reindex.stderr()}"
        assert time.monotonic() < deadline, "reindex never said it waits"
        time.sleep(POLL_S)
    assert state(data).epochs == {}, "folded while another process held the write lock"

    locker.release()
    assert reindex.finish() == 0, reindex.stderr()[-3000:]
    final = state(data)
    assert sorted(final.epochs) == sorted(order)
    assert final.holder is None
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


def test_a_second_reindex_leaves_the_running_one_its_lease_fence_31(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-31: `healthlog reindex` while another reindex holds the lease (a second terminal,
    a cron job) exits 2 with one line naming it and changes nothing; the running one goes on
    and swaps in, exit 0. Before, the second took the lease by force and the first, minutes of
    rebuilding lost, exited 3 `the fold lease was lost during the reindex`."""
    journal(data, 30)
    first = children.cli("reindex", "--data", data)
    held = wait_state(data, "the first reindex holds the lease", reindexing, watch=[first])
    # Stopped where it stands: however fast it rebuilds, it holds the lease meanwhile.
    first.proc.send_signal(signal.SIGSTOP)
    try:
        second = run_cli("reindex", "--data", data)
        during = state(data)
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert second.code == 2, second.err
    assert f"another reindex holds the fold lease ({held.holder}" in second.err
    assert (during.holder, during.epoch) == (held.holder, held.epoch)

    assert first.finish() == 0, first.stderr()[-3000:]
    final = state(data)
    assert sorted(final.epochs) == sorted(final.order)
    assert set(final.epochs.values()) == {held.epoch}
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


def test_a_reindex_takes_over_at_once_from_one_that_was_killed_fence_32(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-32: a reindex killed with SIGKILL leaves its five-minute lease; a reindex run on
    the same machine after it finds its process gone and takes the lease over at once, at the
    next epoch, and exits 0 (FENCE-31 leaves only a running reindex its lease)."""
    journal(data, 30)
    killed = children.cli("reindex", "--data", data)
    held = wait_state(data, "the reindex holds the lease", reindexing, watch=[killed])
    killed.crash()
    assert state(data).holder == held.holder, "a SIGKILL releases nothing"

    run = run_cli("reindex", "--data", data)
    assert run.code == 0, run.err[-3000:]
    final = state(data)
    assert final.holder is None
    assert set(final.epochs.values()) == {held.epoch + 1}


def test_deliveries_journaled_while_another_process_locks_the_store_fold_after_fence_6(
    children: Children, run_cli: RunCli, data: Path, tmp_path: Path
) -> None:
    """FENCE-6: another process holds the store's write lock; `import --no-wait` run meanwhile
    journals its deliveries, nothing folds while the lock is held (the runtime's lease renewals
    are deferred as busy, with no WARNING for a lock held less than a term, and no ERROR); after
    the release the import exits 0 and every delivery folds,
    once, in journal order; `verify` exits 0."""
    busy = ("--ttl", "3", "--busy-timeout-ms", "250")
    live = children.runtime(data, "live", "--executor", "thread", "--submit", "3", *busy)
    wait_state(
        data, "the runtime folds", lambda s: quiescent(s) and len(s.order) == 3, watch=[live]
    )

    locker = children.locker(DataDir(data).store_path)
    locked_at = time.monotonic()
    importer = children.cli("import", "--no-wait", "--data", data, *bodies(tmp_path, range(6)))
    wait_state(data, "the imports are journaled", lambda s: len(s.order) == 9, watch=[importer])
    time.sleep(max(0.0, locked_at + HOLD_S - time.monotonic()))
    assert len(state(data).pending) == 6

    locker.release()
    assert importer.finish() == 0, importer.stderr()[-3000:]
    final = wait_state(data, "everything folds", quiescent, watch=[live])
    assert sorted(final.folded_events) == sorted(final.order)
    assert_folded_once_in_journal_order(final)
    # Busy for less than a term: the deferred renewals are INFO, below the child's stderr.
    assert "lease renewal" not in live.stderr()
    assert "fold lease lost" not in live.stderr(), "a busy store cost the epoch"
    assert set(final.epochs.values()) == {final.epoch}
    live.stop()
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


def test_import_no_wait_returns_while_the_store_is_locked_fence_7(
    children: Children, data: Path, tmp_path: Path
) -> None:
    """FENCE-7: `import --no-wait` exits 0 as soon as its deliveries are journaled, even while
    another process holds the store's write lock (specs/cli.md: "returns as soon as they are
    journaled")."""
    locker = children.locker(DataDir(data).store_path)
    importer = children.cli("import", "--no-wait", "--data", data, *bodies(tmp_path, range(2)))
    wait_state(data, "the imports are journaled", lambda s: len(s.order) == 2, watch=[importer])
    assert importer.finish(timeout=2.0) == 0
    locker.release()


# -- kill -9 --------------------------------------------------------------------------------

KILLS = ((1, "thread"), (4, "process"), (9, "thread"))
"""(folds of the round seen before it, executor) of each SIGKILL of FENCE-8: counted rather
than timed, so that a faster fold cannot finish the round's 30 deliveries first."""


def test_kill_9_while_folding_loses_nothing_and_folds_nothing_twice_fence_8(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-8: three times, journal 30 deliveries, start a runtime, SIGKILL it while it folds;
    each new runtime takes the lease over at the next epoch. At
    quiescence every journaled delivery has exactly one outcome and one `delivery.folded`
    event, in journal order, epochs never decrease along journal order, and `verify` exits 0."""
    lease = ("--ttl", "1", "--renew", "0.25")
    epochs = []
    for round_, (folds, executor) in enumerate(KILLS):
        journal(data, 30)
        before = state(data)
        victim = children.runtime(data, f"victim-{round_}", "--executor", executor, *lease)
        # The killed runtime's fold worker may outlive it and finish its run under the old
        # epoch (fenced once the lease moves on): folding resumes with a fold under a newer one.
        newer = epochs[-1] if epochs else 0
        resumed = wait_state(
            data,
            "folding resumes",
            folded_more_than(len(before.epochs), under_epoch_above=newer),
            watch=[victim],
        )
        wait_state(
            data,
            "the round folds",
            folded_more_than(len(before.epochs) + folds - 1),
            watch=[victim],
        )
        victim.crash()
        killed = state(data)
        assert killed.pending, "the queue was done before the kill"
        assert killed.holder == f"victim-{round_}"
        epochs.append(resumed.epoch)

    survivor = children.runtime(data, "survivor", "--executor", "thread", *lease)
    final = wait_state(data, "the survivor folds the rest", quiescent, watch=[survivor])
    survivor.stop()
    first = epochs[0]
    assert [*epochs, final.epoch] == list(range(first, first + len(KILLS) + 1))
    assert final.holder == "survivor"
    assert len(final.order) == 30 * len(KILLS)
    assert sorted(final.epochs) == sorted(final.order)
    assert sorted(final.folded_events) == sorted(final.order)
    assert_folded_once_in_journal_order(final)
    along = [final.epochs[i] for i in final.order]
    assert along == sorted(along)
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


# -- all of it at once ----------------------------------------------------------------------


def cli_argv(*args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "healthlog.cli", *args]


async def test_fifty_deliveries_through_a_locked_store_and_a_reindex_fence_9(
    tmp_path: Path,
) -> None:
    """FENCE-9: five tasks submit 50 deliveries to an in-process runtime: 20, then 15 while
    another process holds the store's write lock, then 15 once `healthlog reindex` runs in a
    second process. Every delivery folds, journal order holds, no actor crashes, and `verify`,
    run while the runtime serves, exits 0."""
    data = tmp_path / "data"
    config = RuntimeConfig(
        data,
        holder="service",
        wake_period_s=0.2,
        lease_ttl_s=3.0,
        lease_renew_s=0.5,
        executor=Executor.THREAD,
        busy_timeout_ms=250,
    )
    ids: list[int] = []
    locked, reindex_began = trio.Event(), trio.Event()

    async def deliver(runtime: Runtime, task: int) -> None:
        for n in range(10):
            if n == 4:
                await locked.wait()
            if n == 7:
                await reindex_began.wait()
            ids.append((await runtime.submit(new_delivery(task * 10 + n))).delivery_id)
            await trio.sleep(0.05)

    async def journaled(count: int) -> None:
        while len(ids) < count:
            await trio.sleep(POLL_S)

    async def reindex(done: trio.Event) -> None:
        result = await trio.run_process(
            cli_argv("reindex", "--data", data), capture_stderr=True, check=False
        )
        done.set()
        assert result.returncode == 0, result.stderr.decode()[-3000:]

    async def disturb() -> None:
        await journaled(20)
        async with trio.open_nursery() as nursery:
            locker = await nursery.start(
                functools.partial(
                    trio.run_process,
                    [sys.executable, "-c", LOCKER, DataDir(data).store_path],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
            said = b""
            while not said.endswith(b"\n"):
                chunk = await locker.stdout.receive_some()
                assert chunk, "the lock holder ended before it held the lock"
                said += chunk
            assert said == f"{LOCKED}\n".encode()
            locked_at = trio.current_time()
            locked.set()
            await journaled(35)
            await trio.sleep_until(locked_at + HOLD_S)
            await locker.stdin.aclose()
        async with trio.open_nursery() as nursery:
            reindexed = trio.Event()
            nursery.start_soon(reindex, reindexed)
            while not (
                reindexed.is_set() or reindexing(await trio.to_thread.run_sync(state, data))
            ):
                await trio.sleep(POLL_S)
            reindex_began.set()

    with trio.fail_after(WAIT_S):
        async with open_runtime(config) as runtime:
            async with trio.open_nursery() as nursery:
                for task in range(5):
                    nursery.start_soon(deliver, runtime, task)
                nursery.start_soon(disturb)
            await runtime.wait_folded(ids)
            verify = await trio.run_process(
                cli_argv("verify", "--data", data), capture_stderr=True, check=False
            )
            crashes = runtime.statistics().crashes
    assert verify.returncode == 0, verify.stderr.decode()[-3000:]
    assert crashes == {}
    assert len(ids) == 50
    final = state(data)
    assert sorted(final.order) == sorted(ids)
    assert not final.pending
    assert_folded_once_in_journal_order(final)


# -- a frozen holder ------------------------------------------------------------------------


def pause(children: Children, data: Path, child: Child) -> None:
    """SIGSTOP ``child`` while another process holds the store's write lock: so it cannot be
    stopped inside a write transaction of its own, which would block every other writer."""
    locker = children.locker(DataDir(data).store_path)
    child.proc.send_signal(signal.SIGSTOP)
    locker.release()


def wait_lost(child: Child, epoch: int) -> None:
    """Wait until ``child`` has logged that it lost the fold lease of ``epoch``."""
    deadline = time.monotonic() + WAIT_S
    while f"fold lease lost (epoch {epoch})" not in child.stderr():
        assert time.monotonic() < deadline, "the holder never said it lost the lease"
        time.sleep(POLL_S)


def test_a_paused_holder_resumes_fenced_and_writes_nothing_fence_10(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-10: the holder is paused (SIGSTOP) past its 1 s TTL and the other runtime takes
    over at the next epoch; that one is paused in turn, deliveries are journaled, and the stale
    holder resumes (SIGCONT): it writes nothing and logs the loss. Once the new holder resumes,
    they fold under its epoch, once each, in journal order; `verify` exits 0."""
    alpha = children.runtime(
        data, "alpha", "--executor", "thread", "--submit", "3", "--ttl", "1", "--renew", "0.25"
    )
    held = wait_state(
        data, "alpha folds", lambda s: quiescent(s) and s.holder == "alpha", watch=[alpha]
    )
    beta = children.runtime(data, "beta", "--executor", "thread", "--ttl", "30", "--renew", "0.2")
    pause(children, data, alpha)
    took = wait_state(data, "beta takes over", lambda s: s.holder == "beta", watch=[beta])
    assert took.epoch == held.epoch + 1

    pause(children, data, beta)
    later = journal(data, 4, points=24)
    alpha.proc.send_signal(signal.SIGCONT)
    wait_lost(alpha, held.epoch)
    time.sleep(1.0)
    stale = state(data)
    assert set(later) <= set(stale.pending), "a stale holder folded"
    assert (stale.holder, stale.epoch) == ("beta", held.epoch + 1)

    beta.proc.send_signal(signal.SIGCONT)
    final = wait_state(data, "beta folds", quiescent, watch=[beta])
    assert {final.epochs[i] for i in later} == {held.epoch + 1}
    assert sorted(final.folded_events) == sorted(final.order)
    assert_folded_once_in_journal_order(final)
    alpha.stop()
    beta.stop()
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


def stopped(child: Child) -> bool:
    """Whether ``child`` is stopped (SIGSTOP), as the kernel reports its state."""
    stat = Path(f"/proc/{child.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def wait_stopped(child: Child) -> None:
    deadline = time.monotonic() + WAIT_S
    while not stopped(child):
        code = child.proc.poll()
        assert code is None, f"{child.name} exited {code}:\n{child.stderr()[-3000:]}"
        assert time.monotonic() < deadline, f"{child.name} never stopped itself"
        time.sleep(POLL_S)


def test_a_holder_frozen_inside_its_pass_resumes_fenced_fence_10(
    children: Children, run_cli: RunCli, data: Path
) -> None:
    """FENCE-10, with the holder frozen in the middle of its pass: it stops itself once it has
    read the body of a delivery it is folding under its epoch, before the fold's transaction,
    and the lease is taken over meanwhile. Resumed, it goes on with that fold, and only the
    epoch checked inside the fold transaction stands in its way: it writes nothing and logs the
    loss. Once the lease is free again it takes it at a new epoch and folds everything, once
    each, in journal order; `verify` exits 0."""
    alpha = children.runtime(
        data,
        "alpha",
        "--executor",
        "thread",
        "--submit",
        "3",
        "--busy-timeout-ms",
        "250",
        "--stop-at-read",
        "4",
    )
    held = wait_state(
        data, "alpha folds", lambda s: quiescent(s) and s.holder == "alpha", watch=[alpha]
    )
    # alpha stops itself while another process holds the store's write lock, as in pause().
    locker = children.locker(DataDir(data).store_path)
    [frozen] = journal(data, 1, points=24)
    wait_stopped(alpha)
    locker.release()
    with DataDir(data).open_store() as store:
        taken = store.acquire_lease("other", now=wall_us(), ttl=30_000_000, force=True)
        assert taken == held.epoch + 1
        later = journal(data, 3, points=24)

        alpha.proc.send_signal(signal.SIGCONT)
        wait_lost(alpha, held.epoch)
        stale = state(data)
        assert {frozen, *later} <= set(stale.pending), "a stale holder folded"
        assert (stale.holder, stale.epoch) == ("other", taken)
        assert f"delivery {frozen}: fold fenced, lease epoch {held.epoch} lost" in alpha.stderr()
        store.release_lease("other", taken)

    final = wait_state(data, "alpha folds again", quiescent, watch=[alpha])
    assert (final.holder, final.epoch) == ("alpha", taken + 1)
    assert {final.epochs[i] for i in (frozen, *later)} == {taken + 1}
    assert sorted(final.folded_events) == sorted(final.order)
    assert_folded_once_in_journal_order(final)
    alpha.stop()
    run = run_cli("verify", "--data", data)
    assert run.code == 0, run.err[-3000:]


def test_a_fold_frozen_past_its_budget_is_not_failed_for_it_fold_18(
    children: Children, data: Path
) -> None:
    """FOLD-18: a holder frozen in the middle of a fold (SIGSTOP, as `docker pause` or a
    cgroup freezer does to the whole service) for longer than the fold's time budget folds the
    delivery when it resumes: the budget counts the work the fold does, not the time it stood
    still, and the delivery is not recorded failed over its budget with its points unstored."""
    budget_s = 0.5
    alpha = children.runtime(
        data, "alpha", "--executor", "thread", "--budget", str(budget_s), "--stop-at-read", "1"
    )
    [frozen] = journal(data, 1, points=24)
    wait_stopped(alpha)
    # Frozen for four budgets of wall time, in which the fold does nothing.
    time.sleep(4 * budget_s)
    alpha.proc.send_signal(signal.SIGCONT)
    final = wait_state(data, "alpha folds", quiescent, watch=[alpha])
    assert final.pending == []
    with read_only(DataDir(data).store_path) as store:
        outcome = store.execute(
            "SELECT status, reason FROM outcomes WHERE delivery_id = ?", (frozen,)
        ).fetchone()
        (objects,) = store.execute("SELECT count(*) FROM objects").fetchone()
    assert outcome == ("parsed", None)
    assert objects > 0
    alpha.stop()
