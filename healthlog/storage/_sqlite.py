"""Helpers shared by every SQLite file of healthlog: connections, errors, transactions, schema.

Every connection is opened in autocommit mode (``isolation_level=None``): transactions are begun
explicitly, writers with ``BEGIN IMMEDIATE`` through :func:`write_transaction`, so the write lock is
taken up front and a busy database shows up at ``BEGIN`` rather than half way through a write.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import shlex
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Self

from healthlog import clock, faults

__all__ = [
    "WAL_SIZE_LIMIT",
    "ConnectionGuard",
    "Database",
    "Deferred",
    "StorageError",
    "classify",
    "connect",
    "connect_reading",
    "describe",
    "file_size",
    "give_to_directory_owner",
    "group_name",
    "migrate",
    "no_room_for_shm",
    "read_once",
    "reopened",
    "shared_with_others",
    "user_name",
    "wal_held_back",
    "write_transaction",
]

_log = logging.getLogger(__name__)

WAL_SIZE_LIMIT = 16 * 2**20
"""What a writer's WAL file is cut back to when a write restarts it after a checkpoint
(``journal_size_limit``): without it a WAL keeps the size of the largest transaction it ever held
(a large fold, a reindex) until the last connection closes. It is no less than the WAL at which
SQLite checkpoints by itself (1000 pages: 4 MiB at 4 KiB pages, 16 MiB at the replica's 16 KiB),
so ordinary writing never cuts and regrows it."""

_SQLITE_PERM = 3
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
# Extended code 8 alone: the connection is read-only. Not its other forms (a file moved or
# deleted under the connection, a lock or a recovery that cannot be had), which reopening does
# not mend.
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26
_NOT_PERMITTED = frozenset({_SQLITE_PERM, _SQLITE_READONLY, _SQLITE_CANTOPEN})
"""What SQLite says when the file, or the directory where its ``-wal`` and ``-shm`` files go,
is one this user may not write: a file another user made, or a read-only mode."""
FULL_BELOW_BYTES = 1 << 20
"""A file that cannot be opened for a disk error (SQLite says ``disk I/O error`` when it cannot
size the ``-shm`` file beside a database, SQLITE_IOERR_SHMSIZE) while its file system has less
free space than this: the disk is full, and the error says so."""
# What SQLite's primary result codes mean (sqlite3_errstr), for those a storage failure has.
_MEANINGS = {
    3: "access permission denied",
    5: "database is locked",
    6: "database table is locked",
    7: "out of memory",
    8: "attempt to write a readonly database",
    10: "disk I/O error",
    11: "database disk image is malformed",
    13: "database or disk is full",
    14: "unable to open database file",
    15: "locking protocol",
    26: "file is not a database",
}


class StorageError(Exception):
    """A storage operation failed.

    ``kind`` is SQLite's error name and what it means (``SQLITE_FULL: database or disk is full``)
    and ``code`` its extended result code when SQLite raised it (:func:`classify`), and ``file``
    the name of the database file once a connection's guard has seen it pass; :func:`describe`
    puts both in a log line.
    """

    kind: str | None = None
    code: int | None = None
    file: str | None = None


class Deferred(StorageError):
    """The database was busy or locked (SQLITE_BUSY=5 / SQLITE_LOCKED=6): try again later."""


def connect(
    path: str | os.PathLike[str],
    *,
    readonly: bool = False,
    create: bool = True,
    busy_timeout_ms: int = 5000,
    page_size: int | None = None,
    journal_mode: str = "WAL",
    immutable: bool = False,
    private: bool = True,
) -> sqlite3.Connection:
    """Open ``path`` with healthlog's settings.

    Autocommit mode, WAL, ``synchronous=FULL`` (every commit is fsync'd), foreign keys on, a busy
    timeout, and a writer's WAL cut back to :data:`WAL_SIZE_LIMIT` once it has been checkpointed.
    ``readonly`` opens the file through a ``mode=ro`` URI; a read-only connection leaves the
    journal mode alone (WAL is a property of the file, set by its writers). ``immutable``
    (with ``readonly``) adds ``immutable=1``: SQLite then takes no lock and reads no ``-wal`` or
    ``-shm``, which only a file nobody can change may be opened with. Without ``create``
    a file that does not exist is an error rather than a new database. Another
    ``journal_mode`` is only for a file thrown away when anything fails (a rebuild's scratch
    file). The connection may be used from any thread (``check_same_thread=False``): callers
    guard it with a lock. SQL on it may call ``now_us()``, healthlog's wall clock
    (:func:`healthlog.clock.now_us`), which a migration stamps rows with. A file it creates is
    ``private`` (:func:`_create_private`) unless told otherwise.
    """
    if busy_timeout_ms < 0:
        raise ValueError("busy_timeout_ms must not be negative")
    if private and create and not readonly:
        _create_private(path)
    if not readonly:
        _prepare_companions(path)
    unlocked = readonly and immutable
    seen = _identity(path) if unlocked else None
    try:
        if readonly or not create:
            uri = Path(path).resolve().as_uri() + ("?mode=ro" if readonly else "?mode=rw")
            if unlocked:
                uri += "&immutable=1"
            conn = sqlite3.connect(
                uri,
                uri=True,
                timeout=busy_timeout_ms / 1000,
                isolation_level=None,
                check_same_thread=False,
                factory=_Unlocked if unlocked else sqlite3.Connection,
            )
        else:
            conn = sqlite3.connect(
                path,
                timeout=busy_timeout_ms / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
    except sqlite3.Error as exc:
        raise _opening(classify(exc), path) from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if not readonly and page_size is not None:
            # Only a new file takes it (before WAL is set); an existing file keeps its own.
            conn.execute(f"PRAGMA page_size = {int(page_size)}")
        if not readonly:
            mode = conn.execute(f"PRAGMA journal_mode = {journal_mode}").fetchone()[0]
            if str(mode).lower() != journal_mode.lower():
                raise StorageError(
                    f"cannot switch the database to {journal_mode} (journal_mode={mode})"
                )
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.create_function("now_us", 0, clock.now_us)
    except BaseException as exc:
        conn.close()
        if isinstance(exc, sqlite3.Error):
            raise _opening(classify(exc), path) from exc
        raise
    if isinstance(conn, _Unlocked) and seen is not None:
        conn.watched = (os.fspath(path), seen)
    return conn


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """The inode, size and modification time of the file at ``path``; None when there is
    none."""
    try:
        stats = os.stat(path)
    except OSError:
        return None
    return stats.st_ino, stats.st_size, stats.st_mtime_ns


class _Unlocked(sqlite3.Connection):
    """A connection opened ``immutable``, through which SQLite takes no lock and trusts the
    file not to change. Closing it raises a :class:`StorageError` when the file did change
    since it was opened (a process that opened it meanwhile, once space was freed on a full
    disk or the service started, checkpointed into it): what was read through it may be
    torn (CLI-112)."""

    watched: tuple[str, tuple[int, int, int]] | None = None

    def close(self) -> None:
        super().close()
        if self.watched is None:
            return
        path, seen = self.watched
        self.watched = None
        if _identity(path) != seen:
            error = StorageError(
                f"{path} changed while it was read (a healthlog process opened it meanwhile:"
                " the service starting, or one started once space was freed), so what was"
                " read may be torn: run the command again"
            )
            error.file = os.path.basename(path)
            raise error


def connect_reading(
    path: str | os.PathLike[str], *, create: bool = True, busy_timeout_ms: int = 5000
) -> sqlite3.Connection:
    """``path`` opened for a command that only reads it (``export``, ``status``, ``token
    list``: CLI-105): as :func:`connect` opens it where it can be written, else, where SQLite
    refuses that for want of permission (read-only media such as a file system snapshot,
    another user's file), through a ``mode=ro`` URI, which reads a ``-wal`` and ``-shm`` that
    are there (those of a service running, or of a snapshot taken while it ran). On read-only
    media with no ``-shm`` beside the file and no ``-wal``, or an empty one (it was closed
    cleanly, every change in the file), where SQLite cannot make the ``-shm`` file a WAL reader
    needs, ``immutable``: nothing can change such a file; so on a disk too full for a ``-shm``
    file (:func:`no_room_for_shm`: CLI-112) and in a directory this user may not write (a
    backup user's, the service stopped: CLI-113), where one that changes all the same (a
    process started meanwhile) is said on closing (:class:`_Unlocked`). A ``-wal`` holding
    changes without its ``-shm`` there (a copy that left the ``-shm`` files out) cannot be
    read, and the error says so. A file this user may not write in a directory it may write,
    while no process has it open, is read alone too where no ``-wal`` holds changes
    (CLI-115); where one does, it is refused, as SQLite would leave ``-wal`` and ``-shm``
    files of this user's beside it. Where the file cannot be read otherwise, the write
    open's error is raised, which says why (:func:`not_permitted`)."""
    name = os.fspath(path)
    if (
        os.geteuid() != 0
        and os.path.exists(name)
        and not os.access(name, os.W_OK)
        and not os.path.exists(name + "-shm")
        and os.access(os.path.dirname(name) or ".", os.W_OK)
    ):
        # SQLite would open it read-only without a word and make the two files (as root, it
        # gives them to the file's owner). With no -wal, or an empty one, every change is in
        # the file, which is read alone, making nothing (CLI-115).
        if file_size(name + "-wal"):
            raise _would_leave_files(Path(name))
        return read_once(connect(path, readonly=True, create=False, immutable=True))
    if (
        os.path.exists(name)
        and not file_size(name + "-wal")
        and no_room_for_shm(os.path.dirname(name) or ".")
    ):
        # On a full disk SQLite fails to size the -shm file a WAL reader needs where there is
        # none or only part of one (a process that failed there), and leaves what it made;
        # with no -wal, or an empty one, every change is in the file: read it alone (CLI-112).
        return read_once(connect(path, readonly=True, create=False, immutable=True))
    try:
        return connect(path, create=create, busy_timeout_ms=busy_timeout_ms)
    except StorageError as exc:
        if not write_refused(exc):
            raise
        refused = exc
    try:
        return read_once(connect(path, readonly=True, create=False))
    except StorageError:
        where = _where_no_shm_is_made(name)
        if os.path.exists(name + "-shm") or where is None:
            raise refused from None
        if file_size(name + "-wal"):
            raise _wal_without_shm(refused, Path(name), where) from None
    try:
        return read_once(connect(path, readonly=True, create=False, immutable=True))
    except StorageError:
        raise refused from None


def read_once(conn: sqlite3.Connection) -> sqlite3.Connection:
    """``conn``, once a read went through it (a WAL file's reader opens its ``-shm`` then)."""
    try:
        conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        conn.close()
        raise classify(exc) from exc
    return conn


def _where_no_shm_is_made(path: str) -> str | None:
    """Why no ``-shm`` file can be made beside the database at ``path``, as a clause (``on
    read-only media``; ``in DIR, which user U may not write``: CLI-113); None when one can."""
    if _on_read_only_media(path):
        return "on read-only media"
    directory = os.path.dirname(path) or "."
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    return f"in {directory}, which user {user_name(os.geteuid())} may not write"


def _on_read_only_media(path: str) -> bool:
    """Whether the file at ``path`` is on read-only media (``EROFS``: a read-only mount, a
    snapshot)."""
    try:
        os.close(os.open(path, os.O_RDWR))
    except OSError as exc:
        return exc.errno == errno.EROFS
    return False


def file_size(path: str) -> int:
    """The size of the file at ``path``, 0 when there is none: a look at the file alone, which
    takes no lock (``/metrics`` looks while a fold writes)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def wal_held_back(conn: sqlite3.Connection, path: str) -> int:
    """The size of the ``-wal`` of the file at ``path`` (``conn``'s) where a reader keeps it
    from being checkpointed (RUN-63): a passive checkpoint (which waits for nobody) leaves
    frames of it behind, and it has grown past :data:`WAL_SIZE_LIMIT`; else 0. A connection
    that keeps a read transaction open (a database browser, a script) stops every checkpoint
    past the snapshot it reads, and SQLite then adds every later write to the ``-wal``."""
    _, frames, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    if frames <= done:
        return 0
    size = file_size(path + "-wal")
    return size if size > WAL_SIZE_LIMIT else 0


def _would_leave_files(path: Path) -> StorageError:
    """The error of a reading command that may not write ``path`` but may write its directory,
    where no process has the file open (no ``-shm`` beside it): SQLite would make ``-wal`` and
    ``-shm`` files this user owns, with the file's mode, and leave them (a reader cannot remove
    them), and the service's user, who may not write them, could then write the database no
    more (CLI-105)."""
    user = user_name(os.geteuid())
    try:
        owner = user_name(path.stat().st_uid)
    except OSError:
        owner = "its owner"
    error = StorageError(
        f"user {user} may not write {path}, and reading it while no healthlog process has it"
        f" open would leave {path.name}-wal and {path.name}-shm files of {user}'s beside it,"
        f" which {owner}'s service could not write: read it while the service runs, or as"
        f" {owner} (`sudo -u {owner} healthlog ...`)"
    )
    error.code, error.file = _SQLITE_READONLY, path.name
    error.kind = f"SQLITE_READONLY: {_MEANINGS[_SQLITE_READONLY]}"
    return error


def _wal_without_shm(refused: StorageError, path: Path, where: str) -> StorageError:
    """The error of a reading command where ``path`` has a ``-wal`` file holding changes and
    no ``-shm``, and none can be made (``where``: on read-only media, CLI-105; in a directory
    this user may not write, CLI-113)."""
    error = StorageError(
        f"{path} cannot be read where it is: its {path.name}-wal holds changes that may not be"
        f" in it yet, which SQLite reads only through a {path.name}-shm file, and there is none"
        f" beside it (a copy that left the -shm files out?) nor can one be made {where};"
        f" read a copy where it can be written (`cp -a {path.parent} COPY`)"
    )
    error.code, error.kind, error.file = refused.code, refused.kind, path.name
    return error


def _create_private(path: str | os.PathLike[str]) -> None:
    """Make ``path`` an empty file of mode 0600 unless something is there, for SQLite to take as
    a new database: SQLite creates one readable by every user under the usual umask 022, and
    gives its ``-wal`` and ``-shm`` files the database file's mode, so health data would be
    readable by every account of the machine (STORE-62). A file that cannot be made here is
    left to SQLite, which says why as it always did."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    try:
        give_to_directory_owner(fd, Path(path).parent)
    finally:
        os.close(fd)


COMPANIONS = ("-wal", "-shm")
"""The files SQLite keeps beside a database of WAL mode, which every write goes through."""


def _prepare_companions(path: str | os.PathLike[str]) -> None:
    """Before SQLite opens ``path`` to write, as a user other than root (whom modes do not
    stop), where this user may read and write the file: a ``-wal`` or ``-shm`` of this user's
    beside it that this user may not read and write is given the file's mode (with read and
    write for its owner), and an INFO line says so; one of another user's is refused
    (:func:`_companion_not_ours`).

    SQLite makes those files with the database file's mode, and gives an empty one that mode
    again as it opens it, but never a ``-shm`` of some size: one made while the file was
    read-only (mode 0444; RUN-38) stayed 0444 once the file's mode was mended. Through it SQLite
    opens the database read-only and fails every write with ``attempt to write a readonly
    database``, naming the file, whose mode is right: the service took the lease again, but its
    fold worker, another process, wrote nothing, nor did the next start, until the ``-shm`` was
    removed or its mode mended too (RUN-64)."""
    if os.geteuid() == 0:
        return
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode) | stat.S_IRUSR | stat.S_IWUSR
    except OSError:
        return
    if not os.access(path, os.R_OK | os.W_OK):
        return
    for suffix in COMPANIONS:
        companion = Path(f"{os.fspath(path)}{suffix}")
        try:
            stats = companion.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(stats.st_mode) or os.access(companion, os.R_OK | os.W_OK):
            continue
        if stats.st_uid != os.geteuid():
            raise _companion_not_ours(Path(path), companion, stats)
        with contextlib.suppress(OSError):
            companion.chmod(mode)
            _log.info(
                "%s was mode %04o, which no write goes through: made mode %04o, as %s is",
                companion,
                stat.S_IMODE(stats.st_mode),
                mode,
                os.path.basename(path),
            )


def _companion_not_ours(path: Path, companion: Path, stats: os.stat_result) -> StorageError:
    """The error of a ``-wal`` or ``-shm`` of another user's beside a database this user may
    write, which this user may not read and write (RUN-65): SQLite would open the database
    through it read-only and fail every write with ``attempt to write a readonly database``,
    naming the database file, whose mode is right."""
    user = user_name(os.geteuid())
    error = StorageError(
        f"{path.name} cannot be written: user {user} may not read and write {companion} (it is"
        f" {user_name(stats.st_uid)}'s, mode {stat.S_IMODE(stats.st_mode):04o}), which every"
        f" write to {path.name} goes through; make it {user}'s to read and write"
        f" ({_mending(user, path.parent)})"
    )
    error.code = _SQLITE_READONLY
    error.kind = f"SQLITE_READONLY: {_MEANINGS[_SQLITE_READONLY]}"
    error.file = path.name
    return error


# The mode of a directory healthlog makes, less the umask: no user but its owner may add,
# remove or rename files in it, whatever the umask (STORE-96).
DIRECTORY_MODE = 0o755


def make_directory(path: str | os.PathLike[str]) -> None:
    """Make the directory ``path`` and the missing ones above it, mode ``DIRECTORY_MODE`` less
    the umask (STORE-96): under umask 000 (a container's or a NAS share's) each was 0777, in
    which any account of the machine could remove or replace ``journal.sqlite``,
    ``tokens.sqlite`` or ``signing.key``, or plant a link where a snapshot is written. Those
    already there are left as they are. On a file system mounted read-only that is a
    :class:`StorageError` naming the directory and saying so (STORE-103), not Python's
    ``[Errno 30] Read-only file system: 'PATH'``."""
    try:
        _make_directories(Path(path))
    except OSError as exc:
        where = Path(exc.filename or path).parent
        if exc.errno == errno.EACCES:
            raise StorageError(f"{path} cannot be made{_not_yours_to_make(path, where)}") from None
        if exc.errno != errno.EROFS:
            raise
        read_only = mounted_read_only(where) or f"the file system of {where} is read-only"
        raise StorageError(f"{path} cannot be made: {read_only}") from None


def _not_yours_to_make(path: str | os.PathLike[str], where: Path) -> str:
    """Why this process's user may not make the directory ``path`` in ``where``, with the
    ``install -d`` that makes it that user's (STORE-116): a service account made without its
    home (`useradd --system` alone) met Python's ``[Errno 13] Permission denied: 'DIR'``."""
    uid = os.geteuid()
    user = user_name(uid)
    try:
        group = group_name(pwd.getpwuid(uid).pw_gid)
    except KeyError:
        group = str(os.getegid())
    try:
        stats = where.stat()
    except OSError:
        whose = ""
    else:
        whose = f" (it is {user_name(stats.st_uid)}'s, mode {stat.S_IMODE(stats.st_mode):04o})"
    return (
        f": user {user} may not make files in {where}{whose}; make it for {user} as root:"
        f" `sudo install -d -o {user} -g {group} -m 700 {path}`"
    )


def _make_directories(directory: Path) -> None:
    try:
        directory.mkdir(mode=DIRECTORY_MODE, exist_ok=True)
    except FileNotFoundError:
        if directory.parent == directory:
            raise
        _make_directories(directory.parent)
        directory.mkdir(mode=DIRECTORY_MODE, exist_ok=True)


def give_to_directory_owner(
    made: int | str | os.PathLike[str], directory: str | os.PathLike[str]
) -> None:
    """Make the new file open at ``made`` (a file descriptor), or the new directory at that
    path, the owner's of ``directory`` (user and group) when this process runs as root
    (STORE-78), as SQLite makes a root process's ``-wal`` and ``-shm`` files the database file
    owner's: a backup job or an administrator running `status` or `token add` as root on the
    directory of a service running as another user made ``signing.key`` or ``tokens.sqlite``
    root's, mode 0600, and the service could no longer start; a `reindex` killed there left a
    scratch directory the service could not remove (CLI-108). One that cannot be given is left
    as it is (a file system without owners)."""
    if os.geteuid() != 0:
        return
    try:
        owner = os.stat(directory)
        os.chown(made, owner.st_uid, owner.st_gid)
    except OSError as exc:
        _log.debug("new file not given to the owner of its directory (errno %s)", exc.errno)


def check_intact(conn: sqlite3.Connection, path: str | os.PathLike[str], remedy: str) -> None:
    """Raise :func:`damaged` unless SQLite's ``quick_check`` finds the database of ``conn``
    whole (JOURNAL-39, STORE-53).

    A copy of a running service's directory (``cp -a``, ``rsync -a``) takes a database and its
    ``-wal`` file at different instants; when SQLite checkpointed in between, the copy's pages
    no longer agree. Such a file may open, count its rows and take new ones, while some of them
    are gone or unreadable: said at once, before anything is written into it. The check reads
    every page once (31 ms for a 52 MB journal, 66 ms for a 110 MB store, pages cached)."""
    try:
        found = str(conn.execute("PRAGMA quick_check(1)").fetchone()[0])
    except sqlite3.Error as exc:
        error = classify(exc)
        if not is_damage(error):
            raise error from exc
        raise damaged(path, str(exc), remedy) from exc
    if found != "ok":
        raise damaged(path, found, remedy)


_damage: list[int] = []
"""The result codes of SQLite's damage findings met by this process (:func:`classify`)."""


def damage_met() -> bool:
    """Whether SQLite found a file damaged in this process: its files are not recorded as found
    whole (:class:`healthlog.storage.checked.CheckedRecord`), a failing disk's damage met while
    running is read for again at the next start."""
    return bool(_damage)


def is_full(error: StorageError) -> bool:
    """Whether SQLite found the disk full (SQLITE_FULL)."""
    return error.code is not None and error.code & 0xFF == _SQLITE_FULL


def is_damage(error: StorageError) -> bool:
    """Whether SQLite found the file damaged (SQLITE_CORRUPT, SQLITE_NOTADB)."""
    return error.code is not None and error.code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def write_refused(error: StorageError) -> bool:
    """Whether SQLite refused a write for want of permission (a connection it opened read-only,
    on a file this user may not write or a file system mounted read-only): see
    :func:`not_permitted` for why."""
    return error.code is not None and error.code & 0xFF in _NOT_PERMITTED


def damaged(path: str | os.PathLike[str], finding: str, remedy: str) -> StorageError:
    """The error of a damaged database file: its name, SQLite's first ``finding`` and
    ``remedy``, what the user can do."""
    first = finding.removeprefix("*** in database main ***").strip().splitlines()[0]
    name = os.path.basename(path)
    error = StorageError(f"{name} is damaged (SQLite: {first}): {remedy}")
    _damage.append(_SQLITE_CORRUPT)
    error.code = _SQLITE_CORRUPT
    error.kind = f"SQLITE_CORRUPT: {_MEANINGS[_SQLITE_CORRUPT]}"
    error.file = name
    return error


def _disk_error(error: StorageError) -> bool:
    """Whether SQLite failed for a disk error (SQLITE_IOERR, SQLITE_FULL)."""
    return error.code is not None and error.code & 0xFF in (_SQLITE_IOERR, _SQLITE_FULL)


def disk_error(error: StorageError) -> bool:
    """Whether SQLite failed for a disk error (SQLITE_IOERR, SQLITE_FULL): a full disk, or a
    failing one."""
    return _disk_error(error)


def opening_failed(error: StorageError, path: str | os.PathLike[str]) -> StorageError:
    """``error``, met reading the schema of the database at ``path`` as it is opened: a disk
    error (a new file on a disk too full for its ``-shm``, which its first read sizes) named
    with its file and a full disk said, as a failed open's (STORE-102); any other as it is."""
    return _opening(error, path) if _disk_error(error) else error


def _opening(error: StorageError, path: str | os.PathLike[str]) -> StorageError:
    """``error``, naming the file that could not be opened (a data directory has several),
    and saying that the disk is full when a disk error met a full one, or naming a ``-wal`` or
    ``-shm`` beside it that is a symbolic link, which SQLite opens no database with (it said
    ``unable to open database file`` of the database: STREAM-135)."""
    cause = ""
    if write_refused(error):
        cause = not_permitted(path)
    if error.code is not None and error.code & 0xFF == _SQLITE_CANTOPEN:
        cause = _linked_companion(path) or cause
    if _disk_error(error):
        free = free_when_full(Path(path).parent)
        if free is not None:
            cause = f": the disk is full ({free} bytes free), free some space"
    opening = type(error)(f"{error}{cause} ({os.fspath(path)})")
    opening.code = error.code
    opening.kind = error.kind
    opening.file = os.path.basename(path)
    return opening


def _linked_companion(path: str | os.PathLike[str]) -> str:
    """``: DB-wal is a symbolic link to TARGET, ...; remove it``, as a clause for an error line,
    when a companion of the database at ``path`` (:data:`COMPANIONS`) is a symbolic link;
    empty when none is."""
    for suffix in COMPANIONS:
        companion = f"{os.fspath(path)}{suffix}"
        with contextlib.suppress(OSError):
            target = os.readlink(companion)
            return (
                f": {companion} is a symbolic link to {target}, through which SQLite opens no"
                " database; remove it"
            )
    return ""


def free_bytes(directory: str | os.PathLike[str]) -> int | None:
    """The bytes this user may still write on the file system of ``directory``; None when
    that cannot be read."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def bytes_in_use(path: str | os.PathLike[str]) -> int:
    """The bytes of the database at ``path`` that its pages in use take, free pages left out
    (a store never shrinks by itself: 325 MB of a 606 MB one were free), as its header gives
    them; the file's size where the header cannot be read."""
    with open(path, "rb") as file:
        header = file.read(100)
    size = os.stat(path).st_size
    if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
        return size
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    free_pages = int.from_bytes(header[36:40], "big")
    return max(0, size - free_pages * page)


def free_when_full(directory: str | os.PathLike[str]) -> int | None:
    """The bytes this user may still write on the file system of ``directory`` when it is
    full (under :data:`FULL_BELOW_BYTES`); None when it is not, or cannot be read."""
    free = free_bytes(directory)
    return free if free is not None and free < FULL_BELOW_BYTES else None


SHM_ROOM_BYTES = 64 * 1024
"""The free space SQLite needs to open a database of WAL mode beside which there is no
``-shm`` file, or part of one: its first region (32 KiB), with room to spare."""


def no_room_for_shm(directory: str | os.PathLike[str]) -> bool:
    """Whether the file system of ``directory`` has less room than a ``-shm`` file needs
    (:data:`SHM_ROOM_BYTES`): opening a database there fails with ``disk I/O error``, having
    made part of one; False when that cannot be read."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < SHM_ROOM_BYTES


def mounted_read_only(directory: Path) -> str | None:
    """``the file system of DIRECTORY is mounted read-only (...)``, as a clause for an error
    line, when it is (as the kernel remounts one after disk errors); None when it is not, or
    cannot be read."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return None
    if not read_only and not _taken_read_only(directory):
        return None
    return (
        f"the file system of {directory} is mounted read-only (as the kernel remounts one after"
        " disk errors: see `dmesg`)"
    )


MOUNTS = Path("/proc/self/mountinfo")
"""This process's mounts, with each file system's own options (Linux)."""


def _taken_read_only(directory: Path) -> bool:
    """Whether the file system of ``directory`` is one the kernel took read-only after an error
    without the read-only flag ``statvfs`` reports: ext4 from Linux 6.15 on marks it
    ``emergency_ro`` among its options and refuses every write with ``EROFS``, while it still
    shows ``rw``. Every command then named only SQLite's error (``unable to open database
    file``, ``attempt to write a readonly database``), which reads as a file of the wrong owner
    (CLI-202). False when the mounts cannot be read."""
    try:
        device = os.stat(directory).st_dev
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        # ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER_OPTIONS
        if "-" not in fields[6:] or len(fields) < 10:
            continue
        major, _, minor = fields[2].partition(":")
        if not (major.isdigit() and minor.isdigit()):
            continue
        if os.makedev(int(major), int(minor)) != device:
            continue
        options = fields[fields.index("-", 6) + 3].split(",")
        if "emergency_ro" in options:
            return True
    return False


def not_permitted(path: str | os.PathLike[str]) -> str:
    """Why this process's user may not use the data directory's file ``path`` (read and write
    it, or make the ``-wal`` and ``-shm`` files beside it), as a clause for an error line, with
    what to do; empty when nothing stops it.

    Every healthlog command opens its databases to write (SQLite makes a reader's ``-shm``
    file too; only ``export``, ``status`` and ``token list`` then read what they cannot write,
    :func:`connect_reading`), so a data directory belongs to one user, the service's: another
    user met ``unable to open database file``, or for a mere ``export`` ``attempt to write a
    readonly database``, which named no cause (CLI-90)."""
    file = Path(path)
    read_only = mounted_read_only(file.parent)
    if read_only is not None:
        # Where no user may write, whose the files are is beside the point (CLI-91).
        return (
            f": {read_only}; of the commands, only export, status and token list read a data"
            " directory that cannot be written"
        )
    for what, candidate, needed in (
        ("read and write", file, os.R_OK | os.W_OK),
        ("make files in", file.parent, os.W_OK | os.X_OK),
    ):
        if os.access(candidate, needed):
            continue
        try:
            stats = candidate.stat()
        except OSError:
            continue
        user, owner = user_name(os.geteuid()), user_name(stats.st_uid)
        run_as = (
            ""
            if root_s_in_another_s(stats, file.parent)
            else f" run every healthlog command on {file.parent} as the user it belongs to"
            f" (`sudo -u {owner} healthlog ...`), or"
        )
        return (
            f": user {user} may not {what} {candidate} (it is {owner}'s, mode"
            f" {stat.S_IMODE(stats.st_mode):04o});{run_as} make it {user}'s to read and write"
            f" ({_mending(user, file.parent)})"
        )
    return ""


def _mending(user: str, directory: Path) -> str:
    """The commands that make ``directory`` ``user``'s to read and write, the directory quoted
    as a shell reads it: a path with a space (a NAS share's) was two words to ``chown`` and
    ``chmod``, which changed nothing (STORE-151)."""
    quoted = shlex.quote(os.fspath(directory))
    return f"`chown -R {user}: {quoted} && chmod -R u+rwX {quoted}`"


def root_s_in_another_s(stats: os.stat_result, directory: Path) -> bool:
    """Whether a file root owns lies in a directory another account owns (root copied it in,
    or an older healthlog run as root made it): a command run as root there runs as that
    account (CLI-146) and meets the same file, so only the ``chown`` mends it (CLI-166)."""
    try:
        return stats.st_uid == 0 and directory.stat().st_uid != 0
    except OSError:
        return False


def user_name(uid: int) -> str:
    """The name of the user ``uid``, else the number."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    """The name of the group ``gid``, else the number."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def shared_with_others(gid: int, uid: int) -> bool:
    """Whether an account other than ``uid`` belongs to the group ``gid``, as its primary group
    or as a member; a group the system does not know is taken as shared. A user private group
    (each user's own, as Debian, Ubuntu and Fedora make them, with a umask of 002) is not. A
    member is told by the group's own list, which a directory service (LDAP, SSSD) gives whole
    where it does not list every account."""
    try:
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        return True
    owner = user_name(uid)
    if any(member != owner for member in members):
        return True
    return any(account.pw_uid != uid and account.pw_gid == gid for account in pwd.getpwall())


def classify(exc: sqlite3.Error) -> StorageError:
    """Map an SQLite error to :class:`Deferred` (busy or locked) or :class:`StorageError`.

    The decision uses only the primary result code (``sqlite_errorcode & 0xFF``), never the message
    text, so extended codes such as SQLITE_BUSY_RECOVERY (261) count as busy.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    error = (
        Deferred(f"database busy: {exc}")
        if isinstance(code, int) and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
        else StorageError(f"database error: {exc}")
    )
    name = getattr(exc, "sqlite_errorname", None)
    if isinstance(code, int):
        error.code = code
        if is_damage(error):
            _damage.append(code)
    if isinstance(name, str) and isinstance(code, int):
        meaning = _MEANINGS.get(code & 0xFF)
        error.kind = f"{name}: {meaning}" if meaning else name
    return error


def describe(exc: BaseException) -> str:
    """``exc`` for a log line: its type and, for a :class:`StorageError`, SQLite's error name
    and meaning and the file when known (``StorageError: SQLITE_FULL: database or disk is full
    (store.sqlite)``). Never the exception's message, which may quote what it was given."""
    parts = [type(exc).__name__]
    if isinstance(exc, StorageError):
        if exc.kind:
            parts.append(exc.kind)
        if exc.file:
            return f"{': '.join(parts)} ({exc.file})"
    return ": ".join(parts)


class ConnectionGuard:
    """The lock of a connection to the file ``path`` shared by worker threads.

    SQLite errors raised inside it come out classified (:func:`classify`), so no caller
    ever sees a raw ``sqlite3.Error``, and every :class:`StorageError` leaving it names the
    file (``file``) unless it named one already.

    A write refused because the connection is read-only (``SQLITE_READONLY``: SQLite opens a
    file it may not write, one created by another user say, for reading only, and keeps it so)
    has ``reopen`` called at the next use of the connection, so that a write goes through once
    the file's owner or mode has been mended, without a restart.
    """

    def __init__(
        self, path: str | os.PathLike[str], reopen: Callable[[], None] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._file = os.path.basename(path)
        self._reopen = reopen
        self._read_only = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._read_only and self._reopen is not None:
            try:
                self._reopen()
            except BaseException:
                self._lock.release()
                raise
            self._read_only = False

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        error = classify(exc) if isinstance(exc, sqlite3.Error) else exc
        if isinstance(error, StorageError) and error.code == _SQLITE_READONLY:
            self._read_only = True
        self._lock.release()
        if isinstance(exc, sqlite3.Error):
            assert isinstance(error, StorageError)
            error.file = self._file
            raise error from exc
        if isinstance(exc, StorageError) and exc.file is None:
            exc.file = self._file


def reopened(
    conn: sqlite3.Connection, path: str, opening: Callable[[], sqlite3.Connection]
) -> sqlite3.Connection:
    """A connection from ``opening`` in place of ``conn``, which a write found read-only (see
    :class:`ConnectionGuard`), or ``conn`` itself while the file at ``path`` cannot be
    opened."""
    try:
        fresh = opening()
    except StorageError as exc:
        _log.debug("%s not reopened: %s", os.path.basename(path), describe(exc))
        return conn
    conn.close()
    _log.debug("%s reopened after a write found it read-only", os.path.basename(path))
    return fresh


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Run the block inside ``BEGIN IMMEDIATE`` ... ``COMMIT``.

    Any exception, including a ``BaseException`` such as a cancellation, rolls the transaction back
    and propagates; SQLite errors propagate classified (:func:`classify`).
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        raise classify(exc) from exc
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException as exc:
        _rollback(conn)
        if isinstance(exc, sqlite3.Error):
            raise classify(exc) from exc
        raise


@contextlib.contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Run the block's reads inside one deferred ``BEGIN`` ... ``COMMIT``, so they see one
    snapshot of the file; SQLite errors propagate classified (:func:`classify`)."""
    try:
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            _rollback(conn)
    except sqlite3.Error as exc:
        raise classify(exc) from exc


def _rollback(conn: sqlite3.Connection) -> None:
    if not conn.in_transaction:
        return
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error as exc:
        _log.debug("rollback failed (code %s)", getattr(exc, "sqlite_errorcode", None))


def migrate(
    conn: sqlite3.Connection, migrations: Sequence[str], going_back: str | None = None
) -> None:
    """Bring the schema up to ``len(migrations)`` (the version kept in ``PRAGMA user_version``).

    ``migrations[v]`` is the SQL script that moves the schema from version ``v`` to ``v + 1``. Each
    one runs in its own write transaction together with the version bump; the version is re-read
    under the write lock, so two processes opening a new file at once apply each step once. A
    file of a later version is refused (:func:`newer_schema`, saying ``going_back``).
    """
    target = len(migrations)
    while True:
        try:
            version = _user_version(conn)
        except sqlite3.Error as exc:
            raise classify(exc) from exc
        _refuse_newer(conn, version, target, going_back)
        if version == target:
            return
        try:
            with write_transaction(conn):
                version = _user_version(conn)
                _refuse_newer(conn, version, target, going_back)
                if version == target:
                    return
                # A step that moves a table frees every page of the old one, and SQLite built
                # with SECURE_DELETE (Debian's) zeroes each through the -wal: moving the objects
                # of a 492 MB store wrote 630 MB of -wal in 7 to 11 s, 165 MB in 0.8 s without
                # (STORE-91). Nothing is deleted: the freed pages hold copies of what moved.
                kept = int(conn.execute("PRAGMA secure_delete").fetchone()[0])
                conn.execute("PRAGMA secure_delete = FAST")
                try:
                    for statement in _statements(migrations[version]):
                        conn.execute(statement)
                finally:
                    conn.execute(f"PRAGMA secure_delete = {kept}")
                faults.point("schema.migrate")
                conn.execute(f"PRAGMA user_version = {version + 1}")
        except StorageError as exc:
            if not write_refused(exc):
                raise
            raise _not_upgradable(conn, exc, version, target) from exc
        _log.debug("schema migrated to version %d", version + 1)


def _not_upgradable(
    conn: sqlite3.Connection, refused: StorageError, version: int, target: int
) -> StorageError:
    """The error of a file of an older schema that this process may not write, and so not
    upgrade (a command that only reads it on read-only media, or as another user: CLI-107);
    SQLite's own line named neither the file nor why a read wrote."""
    path = Path(conn.execute("PRAGMA database_list").fetchone()[2])
    read_only = mounted_read_only(path.parent)
    why = f": {read_only}" if read_only else not_permitted(path) or ": it cannot be written"
    error = StorageError(
        f"{path} was written by an older healthlog (schema version {version}, this one's is"
        f" {target}) and is upgraded before it is read, which cannot be done here{why}; a"
        " command run where it can be written upgrades it (as the user it belongs to, or on a"
        f" copy: `cp -a {path.parent} COPY`)"
    )
    error.code, error.kind, error.file = refused.code, refused.kind, path.name
    return error


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def newer_version(conn: sqlite3.Connection, migrations: Sequence[str]) -> int | None:
    """The schema version of ``conn``'s file when it is later than ``len(migrations)``, else
    None: a file this process opened at its own version, which a newer healthlog's command
    (``status`` or ``reindex`` run from files upgraded under a running service) migrated since
    (STORE-158)."""
    try:
        version = _user_version(conn)
    except sqlite3.Error as exc:
        raise classify(exc) from exc
    return version if version > len(migrations) else None


def _refuse_newer(
    conn: sqlite3.Connection, version: int, target: int, going_back: str | None
) -> None:
    if version > target:
        path = conn.execute("PRAGMA database_list").fetchone()[2]
        raise newer_schema(path, version, target, going_back)


def newer_schema(
    path: str | os.PathLike[str], version: int, target: int, going_back: str | None
) -> StorageError:
    """The error of a file whose schema ``version`` is later than this healthlog's ``target``:
    a newer healthlog upgraded it, and this one (a downgrade) cannot read it. ``going_back``
    says what brings this one back without losing what the newer one journaled: the line alone
    sent users to the backup taken before the upgrade, which lacks every delivery journaled
    since, where moving a store away loses none (CLI-284)."""
    said = (
        f"database schema is newer than this healthlog ({os.fspath(path)}: version {version},"
        f" this one's is {target})"
    )
    error = StorageError(f"{said}: {going_back}" if going_back else said)
    error.file = os.path.basename(path)
    return error


def _statements(script: str) -> Iterator[str]:
    """Split an SQL script into single statements (``executescript`` would commit on its own).

    Semicolons inside strings, comments and trigger bodies do not split; an incomplete tail is
    handed to SQLite as it is, which rejects it.
    """
    *pieces, tail = script.split(";")
    pending = ""
    for piece in pieces:
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                yield pending
            pending = ""
    pending += tail
    if pending.strip():
        yield pending


class Database:
    """One SQLite file of healthlog with its schema, shared by worker threads.

    Subclasses name their ``MIGRATIONS``; every use of ``_conn`` happens under ``_lock``.
    Without ``create``, a file that is not there is a :class:`StorageError`, not a new database.
    ``reading`` opens it for a command that only reads (:func:`connect_reading`).
    """

    MIGRATIONS: Sequence[str] = ()
    PAGE_SIZE: int | None = None
    JOURNAL_MODE = "WAL"
    PRIVATE = True
    """Whether a file this makes is its user's alone (:func:`connect`)."""
    DAMAGED: str | None = None
    """What the user can do about a damaged file, for a subclass whose damage :meth:`check_intact`
    (and a damaged file met opening it) says so of."""
    GOING_BACK: str | None = None
    """How to go back to this healthlog from a file a newer one upgraded (:func:`newer_schema`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_ms: int = 5000,
        durable: bool = True,
        create: bool = True,
        reading: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._durable = durable
        self._conn = (
            connect_reading(path, create=create, busy_timeout_ms=busy_timeout_ms)
            if reading
            else self._open(create=create)
        )
        # A reading connection is not reopened to write: on a full disk that leaves part of a
        # -shm file beside the database (CLI-112).
        self._lock = ConnectionGuard(path, None if reading else self._reopen)
        try:
            migrate(self._conn, self.MIGRATIONS, self.GOING_BACK)
        except BaseException as exc:
            self._conn.close()
            if isinstance(exc, StorageError) and is_damage(exc) and self.DAMAGED is not None:
                raise damaged(self.path, str(exc), self.DAMAGED) from exc
            if isinstance(exc, StorageError) and _disk_error(exc):
                raise opening_failed(exc, self.path) from exc
            raise

    def reading_uri(self) -> str:
        """The URI through which another connection reads this file as this one does: with
        ``immutable=1`` where this one was opened so (:func:`connect_reading`)."""
        uri = Path(self.path).resolve().as_uri() + "?mode=ro"
        return uri + "&immutable=1" if isinstance(self._conn, _Unlocked) else uri

    def check_intact(self) -> None:
        """Raise a :class:`StorageError` if the file is damaged (:func:`check_intact`)."""
        assert self.DAMAGED is not None
        with self._lock:
            check_intact(self._conn, self.path, self.DAMAGED)

    def interrupt(self) -> None:
        """Make SQLite give up, at once, the statement that another thread runs through this
        connection (a :class:`StorageError` there); nothing if none runs. The one call made
        without the connection's lock, which that thread holds: SQLite allows it from any
        thread. A ``quick_check`` of a store of gigabytes read from the disk gives up within
        milliseconds, where a progress handler, called between statements' steps alone, was not
        called for 9.6 s of it (RUN-162)."""
        self._conn.interrupt()

    def wal_held_back(self) -> int:
        """:func:`wal_held_back` of this file."""
        with self._lock:
            return wal_held_back(self._conn, self.path)

    def newer_version(self) -> int | None:
        """:func:`newer_version` of this file."""
        with self._lock:
            return newer_version(self._conn, self.MIGRATIONS)

    def _open(self, *, create: bool) -> sqlite3.Connection:
        conn = connect(
            self.path,
            create=create,
            busy_timeout_ms=self._busy_timeout_ms,
            page_size=self.PAGE_SIZE,
            journal_mode=self.JOURNAL_MODE,
            private=self.PRIVATE,
        )
        if not self._durable:
            try:
                conn.execute("PRAGMA synchronous = OFF")
            except BaseException as exc:
                conn.close()
                if isinstance(exc, sqlite3.Error):
                    raise classify(exc) from exc
                raise
        return conn

    def _reopen(self) -> None:
        self._conn = reopened(self._conn, self.path, lambda: self._open(create=False))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _waiting_at_most(self, busy_timeout_ms: int) -> Iterator[None]:
        """Under ``_lock``: a write lock held elsewhere is :class:`Deferred` after
        ``busy_timeout_ms`` rather than the connection's busy timeout, for a write whose caller
        would rather try again than hold the connection (and every read waiting for it)."""
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        try:
            yield
        finally:
            self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
