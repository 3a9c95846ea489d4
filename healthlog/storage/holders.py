"""Whether the process a fold lease holder's name points at has ended.

A holder's name ends in ``HOST:PID:RANDOM:START:SPACE``: START is the process's start time
(clock ticks after boot, field 22 of ``/proc/PID/stat``) and SPACE a digest of the machine's
boot and the process's pid namespace. A holder killed outright (SIGKILL, the out-of-memory
killer, a power cut of the process tree) releases nothing, and its lease kept a service
started again from folding, and from being ready, for the lease's term (14.4 to 14.5 s at the
defaults). Its process can be looked at only from the same pid namespace of the same boot
(SPACE equal to ours): there the process id names the same process only while it has the same
start time, since an id comes back (the restarted service itself under a supervisor that keeps
the namespace, or any process on a busy machine). A container started again has a pid
namespace of its own, as has a container beside a host install that shares its host name
(``network_mode: host``): the holder's process id means nothing there, and a live holder must
never lose the lease to a look-up that misses it, so such a holder, one of another host (a
data directory on a network share), and one named by an older healthlog (``HOST:PID:RANDOM``,
no start time) keep their lease until it expires.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, str] | None:
    """The state and start time of process ``pid`` (fields 3 and 22 of its stat), or None
    when this process cannot read them (none has that id, or ``hidepid`` hides it)."""
    try:
        stat = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses.
    fields = stat.rpartition(b")")[2].split()
    return fields[0].decode(), fields[19].decode()


@functools.cache
def _space() -> str | None:
    """The digest of this machine's boot and this process's pid namespace, or None where there
    is no ``/proc`` to read them from."""
    try:
        boot = (PROC / "sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink(PROC / "self/ns/pid")
    except OSError:
        return None
    return hashlib.sha256(f"{boot} {namespace}".encode()).hexdigest()[:12]


def mark() -> str | None:
    """``START:SPACE`` for this process, the end of its holder names, or None where it cannot
    be told (no ``/proc``): a name without it keeps its lease until it expires."""
    space = _space()
    stat = _stat(os.getpid())
    if space is None or stat is None:
        return None
    return f"{stat[1]}:{space}"


def ended(holder: str) -> bool:
    """Whether ``holder`` is known to name a process that has ended: one of this machine's boot
    and this pid namespace that no process is now, or whose id another process (or a zombie
    that folds nothing) has since. False whenever that cannot be told."""
    parts = holder.split(":")
    if len(parts) < 5:
        return False
    host, pid, _, start, space = parts[-5:]
    if host != socket.gethostname() or space != _space() or not pid.isdigit() or int(pid) < 1:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        # A process of another account has that id: its stat tells which process it is.
        pass
    stat = _stat(int(pid))
    if stat is None:
        return False
    state, started = stat
    return started != start or state in ("Z", "X")
