"""Whether the process a fold lease holder's name points at has ended.

A holder's name ends in ``HOST:PID:RANDOM:START:SPACE``, then ``:FILE.SLOT`` when its process
holds a lock in the data directory's ``lease.lock``: START is the process's start time (clock
ticks after boot, field 22 of ``/proc/PID/stat``) and SPACE a digest of the machine's boot and
the process's pid namespace. A holder killed outright (SIGKILL, the out-of-memory killer, a
power cut of the process tree) releases nothing, and its lease kept a service started again
from folding, and from being ready, for the lease's term (14.4 to 14.5 s at the defaults).

Its process can be looked at in ``/proc`` only from the same pid namespace of the same boot
(SPACE equal to ours): there the process id names the same process only while it has the same
start time, since an id comes back (the restarted service itself under a supervisor that keeps
the namespace, or any process on a busy machine).

A container started again has a pid namespace of its own, as has a container beside a host
install; the holder's process id means nothing there, but the kernel is the same one (the
containers of a machine share its boot id; a sandbox kernel such as gVisor, which keeps locks
of its own, shows one of its own). There the lock tells: before its name exists, the
holder takes an open-file-description read lock (``F_OFD_SETLK``) on byte SLOT of ``lease.lock``
and keeps that file open until it ends; FILE is a digest of the boot id and the file's device
and inode, which on one boot name one file for as long as any process keeps it open, the
holder among them (an inode that came back to a ``lease.lock`` made again means that the
holder has ended). The kernel drops such a lock only when the last descriptor of that open file is
closed: when the holder (and any child that shares the descriptor) has ended, killed or not,
since nothing here unlocks or closes it. A candidate whose own digest of ``lease.lock`` is FILE
runs on the same kernel and opens the same file, whose locks that kernel keeps (also on a
network share mounted ``nolock``, or a FUSE file system that leaves locks to the kernel), and
asks it with ``F_OFD_GETLK`` whether any lock stands on byte SLOT: none means that the holder
has ended. The test takes nothing, so a live holder keeps its lock whoever looks; a lock at
SLOT of another live process (two picked the same byte) only makes the answer "running". A
holder whose lock a second open of the file does not see (a file system that takes locks
without keeping them) writes no ``FILE.SLOT``.

Anywhere the answer is not certain, the holder keeps its lease until it expires: one of
another boot or host (a data directory on a network share), one whose ``lease.lock`` is gone or
was replaced, one the lock test cannot be asked about, and one named by an older healthlog (no
``FILE.SLOT``, or ``HOST:PID:RANDOM``, no start time); an older healthlog reads a name with
``FILE.SLOT`` as one of another host (its last five parts) and waits as before. A live holder
must never lose the lease to a look-up that misses it; the epoch checked in every fold
transaction still fences a holder that did.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import secrets
import socket
import stat
import struct
from pathlib import Path

from healthlog.storage._sqlite import give_to_directory_owner

log = logging.getLogger("healthlog.holders")

PROC = Path("/proc")
LOCK_FILE = "lease.lock"
SLOTS = 2**31
"""Bytes of ``lease.lock`` a holder may lock: offsets that fit a 32-bit ``off_t``."""
_FLOCK = "hhqqi"
"""``struct flock`` (``flock64`` where ``off_t`` is 32 bits): type, whence, start, length,
pid, natively aligned."""

_locks: dict[Path, str | None] = {}
"""``FILE.SLOT`` of the lock this process holds in each data directory's ``lease.lock``, or
None where it could not take one; the descriptors stay open until the process ends."""


def _stat(pid: int) -> tuple[str, str] | None:
    """The state and start time of process ``pid`` (fields 3 and 22 of its stat), or None
    when this process cannot read them (none has that id, or ``hidepid`` hides it)."""
    try:
        line = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses.
    fields = line.rpartition(b")")[2].split()
    return fields[0].decode(), fields[19].decode()


@functools.cache
def _boot() -> str | None:
    """This machine's boot id, shared by its containers, or None where there is no ``/proc``."""
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@functools.cache
def _space() -> str | None:
    """The digest of this machine's boot and this process's pid namespace, or None where there
    is no ``/proc`` to read them from."""
    try:
        namespace = os.readlink(PROC / "self/ns/pid")
    except OSError:
        return None
    boot = _boot()
    if boot is None:
        return None
    return hashlib.sha256(f"{boot} {namespace}".encode()).hexdigest()[:12]


def _file(fd: int) -> str | None:
    """The digest of this boot and the file open at ``fd`` (its device and inode), or None
    when it is not a regular file or the boot is unknown."""
    found = os.fstat(fd)
    boot = _boot()
    if boot is None or not stat.S_ISREG(found.st_mode):
        return None
    return hashlib.sha256(f"{boot} {found.st_dev} {found.st_ino}".encode()).hexdigest()[:12]


def _open(path: Path, *, create: bool) -> int:
    """``path`` opened for reading, never through a link, and never blocking on a FIFO; made
    (mode 0600, given to the directory's owner when this process runs as root) if missing and
    ``create``. Made with ``O_EXCL``, so only a file this process made is given away."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return os.open(path, flags)
    give_to_directory_owner(fd, path.parent)
    return fd


def _lock(fd: int, command: int, kind: int, slot: int) -> int:
    """``fcntl(fd, command)`` for one byte at ``slot``: the lock type it answers."""
    asked = struct.pack(_FLOCK, kind, os.SEEK_SET, slot, 1, 0)
    return int(struct.unpack(_FLOCK, fcntl.fcntl(fd, command, asked))[0])


def _standing(directory: Path, file: str, slot: int) -> bool | None:
    """Whether a lock stands on byte ``slot`` of ``directory``'s ``lease.lock``, asked through
    an open of its own; None unless that file's digest is ``file`` (the same file on the same
    boot) and the kernel answers."""
    try:
        fd = _open(directory / LOCK_FILE, create=False)
    except OSError:
        return None
    try:
        if _file(fd) != file:
            return None
        return _lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, slot) != fcntl.F_UNLCK
    except OSError:
        return None
    finally:
        os.close(fd)


def _take(directory: Path) -> str | None:
    """Take a read lock on a random byte of ``directory``'s ``lease.lock`` for the rest of
    this process, and say which (``FILE.SLOT``); None where it cannot be taken, or where a
    second open of the file does not see it."""
    try:
        fd = _open(directory / LOCK_FILE, create=True)
    except OSError as exc:
        log.debug("%s not opened (errno %s): holder names without a lock", LOCK_FILE, exc.errno)
        return None
    slot = secrets.randbelow(SLOTS)
    why = "not a regular file"
    try:
        file = _file(fd)
        if file is not None:
            _lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, slot)
            if _standing(directory, file, slot):
                return f"{file}.{slot}"
            why = "the lock is not seen by a second open"
    except OSError as exc:
        why = f"errno {exc.errno}"
    os.close(fd)
    log.debug("%s not locked (%s): holder names without a lock", LOCK_FILE, why)
    return None


def _released(directory: Path, token: str) -> bool:
    """Whether the lock that the holder which wrote ``token`` (``FILE.SLOT``) took in
    ``directory``'s ``lease.lock`` is known to stand no longer."""
    file, _, slot = token.partition(".")
    if not slot.isdigit() or int(slot) >= SLOTS:
        return False
    return _standing(directory, file, int(slot)) is False


def mark(directory: Path | None = None) -> str | None:
    """``START:SPACE`` for this process, the end of its holder names, then ``:FILE.SLOT``
    where it holds a lock in ``directory``'s ``lease.lock`` (taken at the first call for that
    directory and held until the process ends); None where it cannot be told (no ``/proc``):
    a name without it keeps its lease until it expires."""
    space = _space()
    ours = _stat(os.getpid())
    if space is None or ours is None:
        return None
    if directory is None:
        return f"{ours[1]}:{space}"
    key = Path(directory).absolute()
    if key not in _locks:
        _locks[key] = _take(key)
    token = _locks[key]
    return f"{ours[1]}:{space}" if token is None else f"{ours[1]}:{space}:{token}"


def ended(holder: str, directory: Path | None = None) -> bool:
    """Whether ``holder`` is known to name a process that has ended: one of this machine's boot
    and this pid namespace that no process is now, or whose id another process (or a zombie
    that folds nothing) has since; or, where ``directory`` is the data directory of its lease,
    one of this boot whose lock in ``lease.lock`` no longer stands. False whenever that cannot
    be told."""
    parts = holder.split(":")
    token = parts.pop() if len(parts) >= 6 and "." in parts[-1] else None
    if len(parts) < 5:
        return False
    host, pid, _, start, space = parts[-5:]
    if space == _space() and host == socket.gethostname():
        return _gone(pid, start)
    return token is not None and directory is not None and _released(directory, token)


def _gone(pid: str, start: str) -> bool:
    """Whether process ``pid`` of this pid namespace, started at ``start``, has ended."""
    if not pid.isdigit() or int(pid) < 1:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        # A process of another account has that id: its stat tells which process it is.
        pass
    found = _stat(int(pid))
    if found is None:
        return False
    state, started = found
    return started != start or state in ("Z", "X")
