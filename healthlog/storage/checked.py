"""The record of the database files found whole (``checked.json``), which spares a start the
reading of every page (JOURNAL-50, STORE-140, RUN-161).

SQLite's ``quick_check`` (JOURNAL-39, STORE-53) finds a torn copy: a database and its ``-wal``
file copied at different instants. It reads every page, which after a reboot is every page from
the disk: 16 s of the 17.6 s that ``serve`` took to answer on 4 years of data (272 MB of
journal, 466 MB of store), about 4 s more each year, and as much for each ``import`` and
``seal`` (a nightly ``seal`` read both files each night).

A file only healthlog has written since it was found whole is whole: SQLite's writes keep it
so, through a crash as through a clean exit. What tears it is a copy put in its place, or bytes
written into it by another program. So a process that found the files whole records two things:

- while it holds them open, their device and inode under its own name (boot, host, process id
  and start time): a process started meanwhile (a nightly ``seal`` beside the service) that
  finds the same files held by a live process takes them as found whole;
- as it closes them, each file's and its ``-wal``'s device, inode, size, modification and
  change times: the next start that finds all of them unchanged takes the file as found whole.

A ``serve`` that found its store unfit (damaged, STORE-142) notes it too, under its own name
while it runs, so that a ``healthlog status`` beside it says why nothing folds (SERVE-151).

A copy is another inode, or the same inode written, whose change time (``ctime``) the kernel
sets to the clock's reading and no program can set back. Whatever else healthlog writes while no
process records (a ``serve`` killed, a ``reindex``) changes the times too: the next start reads
that file as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from healthlog.storage._sqlite import give_to_directory_owner

RECORD_FILE = "checked.json"

log = logging.getLogger("healthlog.checked")

Fingerprint = list[int]


def fingerprint(path: Path) -> Fingerprint | None:
    """What changes whenever anything writes, replaces or moves the database at ``path`` or its
    ``-wal`` file, or makes or removes the ``-wal``: None when the database is not there. Its
    first two numbers, the device and inode, name the file."""
    try:
        main = os.stat(path)
    except FileNotFoundError:
        return None
    found = [main.st_dev, main.st_ino, main.st_size, main.st_mtime_ns, main.st_ctime_ns]
    try:
        wal = os.stat(f"{path}-wal")
    except FileNotFoundError:
        return found
    return [*found, wal.st_dev, wal.st_ino, wal.st_size, wal.st_mtime_ns, wal.st_ctime_ns]


def process_name(pid: int | str = "self") -> str | None:
    """A name of the process ``pid`` that no other process has, before or after it, on any
    machine: the boot's random id, the host, the process id and its start time since boot (a
    process id comes back, after a reboot even with the same start time). None where
    ``/proc`` does not say (no process is then taken as alive)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    number = os.getpid() if pid == "self" else pid
    return f"{boot}:{socket.gethostname()}:{number}:{fields[19]}"


def _alive(name: str) -> bool:
    """Whether the process ``name`` (:func:`process_name`) runs on this machine now."""
    pid = name.split(":")[-2]
    return pid.isdigit() and process_name(pid) == name


class CheckedRecord:
    """``checked.json`` in ``directory``: ``closed``, for each database file, its
    :func:`fingerprint` as the last process that found it whole closed it; ``held``, for each
    live process that found files whole and holds them open, their device and inode."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / RECORD_FILE
        self._directory = directory
        self._name = process_name()
        self._held: dict[str, list[int]] = {}
        self._unfit: dict[str, list[int | str]] = {}

    def unchanged(self, names: Iterable[str]) -> frozenset[str]:
        """Of the database files ``names``, those found whole and written by healthlog alone
        since: as the last process to close them left them, or held by a live process that
        found them whole. Read before the files are opened (opening one makes its ``-wal``)."""
        with self._locked() as record:
            held = [files for holder, files in record["held"].items() if holder != self._name]
            same = set()
            for name in names:
                now = fingerprint(self._directory / name)
                if now is None:
                    continue
                if record["closed"].get(name) == now or any(
                    files.get(name) == now[:2] for files in held
                ):
                    same.add(name)
            return frozenset(same)

    def hold(self, names: Iterable[str]) -> None:
        """Record the files ``names``, open in this process and found whole (checked, or
        :meth:`unchanged`), as held by it until :meth:`record`."""
        for name in names:
            if (now := fingerprint(self._directory / name)) is not None:
                self._held[name] = now[:2]
        if self._name is None or not self._held:
            return
        with self._locked() as record:
            record["held"][self._name] = self._held
            self._write(record)

    def found_unfit(self, name: str, why: str) -> None:
        """Record the file ``name``, open in this process, as found unfit to fold into
        (``why``) while this process runs: ``serve`` journals beside a damaged store
        (STORE-142), and a ``healthlog status`` beside it says why nothing folds, which the
        store's own mark cannot (SERVE-151)."""
        now = fingerprint(self._directory / name)
        if self._name is None or now is None:
            return
        self._unfit[name] = [*now[:2], why]
        with self._locked() as record:
            record["unfit"][self._name] = self._unfit
            self._write(record)

    def unfit(self, name: str) -> str | None:
        """Why a live process found the file ``name``, as it is now, unfit to fold into
        (:meth:`found_unfit`); None if none did."""
        now = fingerprint(self._directory / name)
        if now is None:
            return None
        with self._locked() as record:
            for files in record["unfit"].values():
                found = files.get(name)
                if isinstance(found, list) and found[:2] == now[:2] and len(found) == 3:
                    return str(found[2])
        return None

    def record(self) -> None:
        """Record the files :meth:`hold` noted as this process leaves them, once closed: each
        that is still the file it was then (not moved away or replaced meanwhile), and no
        longer held by it, nor said unfit by it."""
        if not self._held and not self._unfit:
            return
        with self._locked() as record:
            record["held"].pop(self._name, None)
            record["unfit"].pop(self._name, None)
            for name, held in self._held.items():
                now = fingerprint(self._directory / name)
                if now is not None and now[:2] == held:
                    record["closed"][name] = now
            self._write(record)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The record, read under a lock on the directory that every process reading or
        writing it takes, without the entries of processes no longer running."""
        directory = os.open(self._directory, os.O_RDONLY)
        try:
            try:
                fcntl.flock(directory, fcntl.LOCK_EX)
            except OSError as exc:
                # A file system without locks (some network shares): the record is still
                # put in place whole; two processes writing it at once may drop a note of the
                # other's, and the next start then reads those files whole.
                log.debug("%s not locked (errno %s)", RECORD_FILE, exc.errno)
            try:
                read = json.loads(self.path.read_text())
            except (OSError, ValueError) as exc:
                log.debug("no record of files found whole: %s", type(exc).__name__)
                read = {}
            if not isinstance(read, dict):
                read = {}
            closed = read.get("closed")
            yield {
                "closed": closed if isinstance(closed, dict) else {},
                "held": _of_live(read.get("held")),
                "unfit": _of_live(read.get("unfit")),
            }
        finally:
            os.close(directory)

    def _write(self, record: dict[str, Any]) -> None:
        """Put ``record`` in place whole or not at all; one not written is said, and the next
        start reads the files again."""
        temporary = self._directory / f".{RECORD_FILE}.{os.getpid()}"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            give_to_directory_owner(fd, self._directory)
            with os.fdopen(fd, "w") as out:
                json.dump(record, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning(
                "%s not written (errno %s): the next start reads every page of %s again",
                RECORD_FILE,
                exc.errno,
                " and ".join(sorted(self._held)),
            )
            temporary.unlink(missing_ok=True)


def _of_live(entries: object) -> dict[str, Any]:
    """Of a record's entries by process, those of processes still running."""
    if not isinstance(entries, dict):
        return {}
    return {
        holder: files
        for holder, files in entries.items()
        if isinstance(files, dict) and _alive(holder)
    }
