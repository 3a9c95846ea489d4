"""Fold lease holders whose process has ended (specs/fencing.md FENCE-40 to FENCE-45): the
names are real ones, made by this process and by child processes, some of them process 1 of
a pid namespace of their own, as a container's service is, and the processes looked at are
real (this test's own, live children, reaped and unreaped ones)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from _namespaces import in_pid_namespace, kill_namespace

from healthlog.storage.holders import LOCK_FILE, SLOTS
from healthlog.storage.rebuild import reindex_holder, running_reindex
from healthlog.storage.store import Lease, Store, default_holder, serve_holder

TERM = 15_000_000
NOW = 1_000_000_000
NAME = "from healthlog.storage.store import serve_holder; print(serve_holder(), flush=True)"
NAMED_IN = (
    "import sys; from pathlib import Path; from healthlog.storage.store import serve_holder;"
    " print(serve_holder(Path(sys.argv[1])), flush=True)"
)


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


@contextmanager
def holder_in(
    within: Sequence[str], directory: Path
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process run by the words ``within`` (a pid namespace of its own) that printed
    its serve holder name for the data directory ``directory`` and waits: the process and the
    name. Killed, with its namespace, and reaped at the close."""
    process = subprocess.Popen(
        [*within, sys.executable, "-c", f"{NAMED_IN}; import time; time.sleep(600)", directory],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        assert process.stdout is not None
        process.stdout.close()
        process.wait()


def dead_holder_in(within: Sequence[str], directory: Path) -> str:
    """The serve holder name for ``directory`` of a child process run by ``within`` that has
    ended."""
    return subprocess.run(
        [*within, sys.executable, "-c", NAMED_IN, directory],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def lock_part(holder: str) -> str:
    """``FILE.SLOT``, the end of ``holder``: its lock in ``lease.lock``."""
    part = holder.rpartition(":")[2]
    assert "." in part, holder
    return part


def with_lock_part(holder: str, part: str) -> str:
    return f"{holder.rpartition(':')[0]}:{part}"


def test_a_holder_of_another_pid_namespace_is_told_by_its_lock_fence_43(store: Store) -> None:
    """FENCE-43: a holder of this boot in another pid namespace (process 1 of its own, as a
    container's service is) whose process has ended holds nothing: its lease is taken over at
    once, at the next epoch, and a reindex of that name is not running; while it lives, running
    or stopped by SIGSTOP (`docker pause`), its lease is refused until it expires and the
    reindex is running, and once it is killed it is taken at once. The names are another
    namespace's (SPACE not ours), so only the lock in `lease.lock` tells."""
    within = in_pid_namespace()
    directory = Path(store.path).parent
    ours = serve_holder(directory)
    space = ours.split(":")[5]

    dead = dead_holder_in(within, directory)
    assert dead.split(":")[5] != space
    assert store.acquire_lease(dead, now=NOW, ttl=TERM) == 1
    assert not running_reindex(dead.replace("serve:", "reindex:"), directory)
    assert store.acquire_lease(ours, now=NOW + 1, ttl=TERM) == 2

    with holder_in(within, directory) as (process, live):
        assert live.split(":")[5] != space
        reindexing = live.replace("serve:", "reindex:")
        assert store.acquire_lease(live, now=NOW + 2, ttl=TERM, force=True) == 3
        assert store.acquire_lease(ours, now=NOW + 3, ttl=TERM) is None
        assert running_reindex(reindexing, directory)
        os.killpg(process.pid, signal.SIGSTOP)
        assert store.acquire_lease(ours, now=NOW + 4, ttl=TERM) is None
        assert running_reindex(reindexing, directory)
        kill_namespace(process)
        assert not running_reindex(reindexing, directory)
        assert store.acquire_lease(ours, now=NOW + 5, ttl=TERM) == 4
    assert store.lease() == Lease(ours, 4, NOW + 5 + TERM)


def test_a_lock_that_cannot_be_told_keeps_the_lease_until_it_expires_fence_44(
    store: Store, tmp_path: Path
) -> None:
    """FENCE-44: a holder of another pid namespace that has ended, but whose lock the lease's
    data directory cannot tell about, keeps its lease until it expires, and a reindex of that
    name is running: its lock part naming another boot or file (the digest changed), a byte
    beyond those a holder locks or none, a lock taken in another data directory than the
    lease's, and a `lease.lock` removed and made again since the holder took its lock (another
    file, without it: the one it locked is still there under another name)."""
    within = in_pid_namespace()
    directory = Path(store.path).parent
    dead = dead_holder_in(within, directory)
    file, slot = lock_part(dead).split(".")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    others = [
        with_lock_part(dead, f"{'0' * len(file)}.{slot}"),
        with_lock_part(dead, f"{file}.{SLOTS + int(slot)}"),
        with_lock_part(dead, f"{file}.x"),
        dead_holder_in(within, elsewhere),
    ]
    ours = serve_holder(directory)
    for n, other in enumerate(others):
        now = NOW + n * 2 * TERM
        assert store.acquire_lease(other, now=now, ttl=TERM, force=True) == 2 * n + 1
        assert store.acquire_lease(ours, now=now + TERM - 1, ttl=TERM) is None, other
        assert store.acquire_lease(ours, now=now + TERM, ttl=TERM) == 2 * n + 2
        assert running_reindex(other.replace("serve:", "reindex:"), directory)

    now = NOW + len(others) * 2 * TERM
    assert store.acquire_lease(dead, now=now, ttl=TERM, force=True) == 2 * len(others) + 1
    (directory / LOCK_FILE).rename(directory / "replaced")
    (directory / LOCK_FILE).touch()
    assert store.acquire_lease(ours, now=now + TERM - 1, ttl=TERM) is None
    assert running_reindex(dead.replace("serve:", "reindex:"), directory)


def test_a_holder_that_cannot_lock_names_no_lock_fence_45(tmp_path: Path) -> None:
    """FENCE-45: a process whose data directory's `lease.lock` it cannot lock writes no lock
    part in its names (they end at SPACE, and keep their lease until it expires): `lease.lock`
    a directory, or a symbolic link, never followed (a command run as root would otherwise
    make a file where the link points and give it to the directory's owner), and a data
    directory not there yet. One that can lock it takes one lock for all its names there:
    made mode 0600, empty."""
    as_directory = tmp_path / "directory"
    (as_directory / LOCK_FILE).mkdir(parents=True)
    as_link = tmp_path / "link"
    as_link.mkdir()
    (as_link / LOCK_FILE).symlink_to(tmp_path / "pointed")
    for directory in (as_directory, as_link, tmp_path / "missing"):
        name = default_holder(directory)
        assert len(name.split(":")) == 5, name
        assert "." not in name, name
    assert not (tmp_path / "pointed").exists()

    locked = tmp_path / "locked"
    locked.mkdir()
    first, second = serve_holder(locked), reindex_holder(locked)
    assert len(first.split(":")) == 7
    assert lock_part(first) == lock_part(second)
    made = (locked / LOCK_FILE).stat()
    assert (made.st_mode & 0o777, made.st_size) == (0o600, 0)
