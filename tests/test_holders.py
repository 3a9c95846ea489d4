"""Fold lease holders whose process has ended (specs/fencing.md FENCE-40 to FENCE-42): the
names are real ones, made by this process and by child processes, and the processes looked
at are real (this test's own, live children, reaped and unreaped ones)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from healthlog.storage.rebuild import reindex_holder, running_reindex
from healthlog.storage.store import Lease, Store, default_holder, serve_holder

TERM = 15_000_000
NOW = 1_000_000_000
NAME = "from healthlog.storage.store import serve_holder; print(serve_holder(), flush=True)"


@contextmanager
def child_holder(*, reap: bool = True) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process that printed its serve holder name and waits: the process and the
    name. Ended at the close (and reaped unless ``reap`` is False)."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"{NAME}; import time; time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        process.kill()
        assert process.stdout is not None
        process.stdout.close()
        if reap:
            process.wait()


def dead_holder() -> str:
    """The serve holder name of a child process that has ended and was reaped."""
    return subprocess.run(
        [sys.executable, "-c", NAME], capture_output=True, text=True, check=True
    ).stdout.strip()


def started_otherwise(holder: str) -> str:
    """``holder`` with another start time: the name a process that had the same id before
    wrote (a restarted container's service often gets the id of its dead self)."""
    *rest, start, space = holder.split(":")
    return ":".join([*rest, str(int(start) + 1), space])


def test_a_holder_whose_process_has_ended_is_taken_over_at_once_fence_41(store: Store) -> None:
    """FENCE-41: the lease of a holder of this machine whose process has ended (exited, or
    killed and not yet reaped by its parent) is taken over at once, at the next epoch, long
    before it expires; the lease of a live child is refused until it expires."""
    assert store.acquire_lease(dead_holder(), now=NOW, ttl=TERM) == 1
    ours = serve_holder()
    assert store.acquire_lease(ours, now=NOW + 1, ttl=TERM) == 2
    assert store.lease() == Lease(ours, 2, NOW + 1 + TERM)

    with child_holder() as (_, live):
        assert store.acquire_lease(live, now=NOW + 2, ttl=TERM, force=True) == 3
        assert store.acquire_lease(ours, now=NOW + 3, ttl=TERM) is None
        assert store.acquire_lease(ours, now=NOW + 2 + TERM, ttl=TERM) == 4

    with child_holder(reap=False) as (zombie, name):
        assert store.acquire_lease(name, now=NOW + 3 + TERM, ttl=TERM, force=True) == 5
        zombie.kill()
        # Ended, and left unreaped: a zombie, which folds nothing.
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
        assert store.acquire_lease(ours, now=NOW + 4 + TERM, ttl=TERM) == 6
    zombie.wait()


def test_a_process_id_that_came_back_is_told_by_its_start_time_fence_40(store: Store) -> None:
    """FENCE-40: a holder named by this process's own id but another start time (a dead
    process whose id this one now has, as a restarted container's service often does) has
    ended: its lease is taken at once, and a reindex of that name is not running; with the
    true start time it is this live process, and another random part of its name does not
    make it another: its lease is refused, and the reindex is running."""
    ours = serve_holder()
    assert store.acquire_lease(started_otherwise(ours), now=NOW, ttl=TERM) == 1
    assert store.acquire_lease(ours, now=NOW + 1, ttl=TERM) == 2

    again = serve_holder()
    assert again.split(":")[:2] == ours.split(":")[:2]
    assert again != ours
    assert store.acquire_lease(again, now=NOW + 2, ttl=TERM) is None

    reindexing = reindex_holder()
    assert running_reindex(reindexing)
    assert not running_reindex(started_otherwise(reindexing))
    assert not running_reindex(started_otherwise(reindexing).replace("reindex:", "serve:"))


def test_a_holder_that_cannot_be_looked_at_keeps_its_lease_until_it_expires_fence_42(
    store: Store,
) -> None:
    """FENCE-42: holders whose process cannot be looked at from here keep their lease until
    it expires, even though no process of this namespace has their id: one of another host
    (a data directory on a network share), of another pid namespace or boot (a container
    started again, or one beside a host install with its host name), and one named by an
    older healthlog (`HOST:PID:RANDOM`, no start time); a reindex of each is running."""
    host, pid, rand, start, space = dead_holder().removeprefix("serve:").split(":")
    others = [
        f"serve:{host}-other:{pid}:{rand}:{start}:{space}",
        f"serve:{host}:{pid}:{rand}:{start}:{'0' * len(space)}",
        f"serve:{host}:{pid}:{rand}",
        f"{host}:{pid}:{rand}",
    ]
    assert host == socket.gethostname()
    ours = default_holder()
    for n, other in enumerate(others):
        now = NOW + n * 2 * TERM
        assert store.acquire_lease(other, now=now, ttl=TERM, force=True) == 2 * n + 1
        assert store.acquire_lease(ours, now=now + TERM - 1, ttl=TERM) is None, other
        assert store.acquire_lease(ours, now=now + TERM, ttl=TERM) == 2 * n + 2
        assert running_reindex("reindex:" + other.removeprefix("serve:"))
