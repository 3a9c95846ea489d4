"""A follower's local replica (``replica.sqlite``): every object of the server, the stream
it follows and its cursor. Applying events and advancing the cursor is one transaction, and
so is restoring a snapshot, read from a temporary file beside the replica."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import attrs

from healthlog.objects import HourlyObject, ObjectKey
from healthlog.storage import _objects
from healthlog.storage._sqlite import (
    ConnectionGuard,
    StorageError,
    connect,
    make_directory,
    mounted_read_only,
    newer_schema,
    no_room_for_shm,
    not_permitted,
    read_once,
    write_transaction,
)

REPLICA_FILE = "replica.sqlite"

MIGRATIONS = (
    """
    CREATE TABLE objects (
        metric TEXT NOT NULL,
        layer TEXT NOT NULL,
        hour INTEGER NOT NULL,
        units TEXT,
        first INTEGER NOT NULL,
        last INTEGER NOT NULL,
        points INTEGER NOT NULL,
        created_by INTEGER NOT NULL,
        hash BLOB NOT NULL,
        sealed INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (metric, layer, hour)
    ) WITHOUT ROWID;
    CREATE TABLE binding (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        instance TEXT,
        stream TEXT,
        public_key TEXT,
        cursor INTEGER NOT NULL
    );
    INSERT INTO binding VALUES (1, NULL, NULL, NULL, 0);
    """,
    # The tag of the event at the cursor, as its frame carried it: the follower resumes with it,
    # and the service tells whether that event is still the one at that seq (STREAM-111).
    """
    ALTER TABLE binding ADD COLUMN tag TEXT;
    """,
)


class ReplicaMismatch(StorageError):
    """The replica is bound to another instance or key than the server it is pointed at."""


class ReplicaInUse(StorageError):
    """Another follower writes the replica."""


class NotAReplica(StorageError):
    """The replica's file holds no replica: empty, or another database."""


@attrs.frozen
class Change:
    """An object change to apply: the object's state, or None when it no longer exists."""

    seq: int
    key: ObjectKey
    state: HourlyObject | None


@attrs.frozen
class Binding:
    instance: str | None
    stream: str | None
    public_key: str | None
    cursor: int
    # The tag of the event at the cursor (None: unknown, after a snapshot or from a service
    # whose events have none).
    tag: str | None = None


class Replica(_objects.ObjectDatabase):
    """The replica database in a directory. Methods may be called from worker threads."""

    MIGRATIONS = MIGRATIONS
    GOING_BACK = (
        "a newer healthlog wrote it; run that one again, or follow into another --replica directory"
    )
    # An object row (a gzip body of a few KB) spills into an overflow page of its own with
    # 4 KiB pages: 16 KiB pages keep it in its leaf, a third of the file and of the writes.
    PAGE_SIZE = 16 * 2**10
    PRIVATE = False
    """As the umask says: ``export --replica`` may read it as another user than ``follow``'s."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        make_directory(directory)
        _refuse_unwritable(Path(directory) / REPLICA_FILE)
        _refuse_another_database(Path(directory) / REPLICA_FILE)
        with _upgraded_alone(Path(directory) / REPLICA_FILE):
            super().__init__(Path(directory) / REPLICA_FILE)
        self._identity = _identity(self.path)

    def _in_place(self) -> None:
        """Under ``_lock``, before a write: refuse (StorageError) when the file at the replica's
        path is no longer the one opened (removed, or another moved there). SQLite would go on
        writing the open file, which nobody can read any more, for as long as ``follow`` runs."""
        if _identity(self.path) != self._identity:
            raise StorageError(
                "the replica file was removed or replaced while follow ran; start follow again"
            )

    def open_mode(self) -> int | None:
        """The mode of the replica's directory when every user of the machine may write in it
        (one made 0777 under umask 000, a shared one), where any of them may remove or replace
        ``replica.sqlite`` between runs, or plant a link at its ``-wal``'s name; else None."""
        mode = stat.S_IMODE(os.stat(Path(self.path).parent).st_mode)
        return mode if mode & stat.S_IWOTH else None

    def binding(self) -> Binding:
        with self._lock:
            row = self._conn.execute(
                "SELECT instance, stream, public_key, cursor, tag FROM binding WHERE id = 1"
            ).fetchone()
        return Binding(*row)

    def bind(self, instance: str, public_key: str, accept_key: str | None = None) -> bool:
        """Pin the instance and its snapshot key on first contact; refuse any other later.
        With ``accept_key`` (the key the server's owner says it has now), the server's key
        must be that one, and it is pinned in place of another; whether it replaced one."""
        with self._lock, write_transaction(self._conn):
            self._in_place()
            bound_instance, bound_key = self._conn.execute(
                "SELECT instance, public_key FROM binding WHERE id = 1"
            ).fetchone()
            if bound_instance not in (None, instance):
                raise ReplicaMismatch(
                    f"the replica follows another healthlog instance ({bound_instance}), not"
                    f" this service's ({instance}): a service set up anew (a new data"
                    " directory, not one restored from a backup) is followed into a new replica"
                    " directory (another --replica DIR); else --url names another service than"
                    " the one the replica followed"
                )
            if accept_key is not None and public_key != accept_key:
                raise ReplicaMismatch(
                    f"the server's snapshot key is {public_key}, not the {accept_key} given to"
                    " accept"
                )
            if bound_key not in (None, public_key) and accept_key is None:
                raise ReplicaMismatch(
                    f"the server's snapshot key changed since first contact (pinned {bound_key},"
                    f" the server's is now {public_key}): if the server made a new signing.key"
                    " (its log says so), check that the key `healthlog status` prints there is"
                    " that one and follow with --accept-key KEY; else this is not the server"
                    " the replica followed"
                )
            self._conn.execute(
                "UPDATE binding SET instance = ?, public_key = ? WHERE id = 1",
                (instance, public_key),
            )
        return bound_key not in (None, public_key)

    def apply(
        self, stream: str, changes: Sequence[Change], through: int, tag: str | None = None
    ) -> None:
        """Apply changes of ``stream`` newer than the cursor and move it to ``through``, whose
        event's tag is ``tag``."""
        with self._lock, write_transaction(self._conn):
            self._in_place()
            bound, cursor = self._conn.execute(
                "SELECT stream, cursor FROM binding WHERE id = 1"
            ).fetchone()
            if bound != stream:
                raise ReplicaMismatch("changes from another stream than the replica follows")
            for change in changes:
                if change.seq > cursor:
                    self._put(change.key, change.state)
            if through > cursor:
                self._conn.execute(
                    "UPDATE binding SET cursor = ?, tag = ? WHERE id = 1", (through, tag)
                )

    def restore(
        self, stream: str, seq: int, objects: Iterable[HourlyObject], tag: str | None = None
    ) -> int:
        """Replace every object with a snapshot's and resume strictly after ``seq``, whose
        event's tag is ``tag``; return how many objects it wrote. ``objects`` is iterated
        inside the one transaction, one at a time: an exception it raises leaves the replica
        as it was."""
        count = 0
        with self._lock, write_transaction(self._conn):
            self._in_place()
            self._conn.execute("DELETE FROM objects")
            for obj in objects:
                self._put(obj.key, obj)
                count += 1
            self._conn.execute(
                "UPDATE binding SET stream = ?, cursor = ?, tag = ? WHERE id = 1",
                (stream, seq, tag),
            )
        return count

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Held by the one follower of the replica while it runs: an exclusive ``flock`` on
        the replica's directory, which the kernel releases when its holder dies. A second
        follower is refused (:class:`ReplicaInUse`) rather than write beside the first, where
        one's long restore holds the other's writes past their busy timeout.

        Once it holds the lock, the snapshot download files in the directory
        (:meth:`snapshot_file`) are those of followers that died (killed, a power cut): only
        the lock's holder downloads, so they are removed then, however recent. Left for an
        hour, each kill added one, all counted against the room of the next download."""
        directory = Path(self.path).parent
        with _followed(directory):
            for left in directory.glob("snapshot-*.tmp"):
                with contextlib.suppress(OSError):
                    left.unlink()
            yield

    def room(self, reserve: int) -> int:
        """The bytes a download beside the replica may take: the free space of its filesystem
        (for an unprivileged user), less ``reserve``."""
        stats = os.statvfs(Path(self.path).parent)
        return max(0, stats.f_bavail * stats.f_frsize - reserve)

    @contextlib.contextmanager
    def snapshot_file(self) -> Iterator[BinaryIO]:
        """A new empty file in the replica's directory (``snapshot-*.tmp``, made with
        ``O_EXCL|O_NOFOLLOW``, mode 0600), open for writing and reading: a snapshot is
        downloaded into it, checked and restored from it through this one descriptor, never
        opened again by name. Whoever else may write in the directory (one of mode 0777, or
        shared) can rename another file over that name or plant a link there, but not change
        the bytes read back, nor have the download written into the file a link names
        (STREAM-129, STREAM-130). Closed and removed when the block ends, however it ends.
        Those a killed follower left there are removed when the next one takes the replica
        (:meth:`following`)."""
        directory = Path(self.path).parent
        fd, name = tempfile.mkstemp(prefix="snapshot-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w+b") as file:
                yield file
        finally:
            Path(name).unlink(missing_ok=True)

    def _put(self, key: ObjectKey, state: HourlyObject | None) -> None:
        if state is None:
            self._conn.execute(
                "DELETE FROM objects WHERE metric = ? AND layer = ? AND hour = ?",
                (key.metric, key.layer, key.hour),
            )
        else:
            _objects.write(self._conn, state)


class ReplicaReader(_objects.ObjectReading):
    """A replica opened for reading only (``export --replica``), through a ``mode=ro`` URI:
    nothing is written to the file, which may be on read-only media or belong to another user,
    and a file that holds no replica (an empty one) is refused (:class:`NotAReplica`) rather
    than given the replica's tables.

    The replica is in WAL mode, whose readers need the ``-shm`` file beside it. On read-only
    media without one, which SQLite cannot create, a file without a ``-wal`` either (its
    follower stopped and checkpointed everything into it, and nobody can write it there) is
    opened ``immutable``: SQLite then reads the file alone, which holds everything. With a
    ``-wal`` and no ``-shm`` there (a follower killed while writing), it cannot be read there:
    the StorageError names the file."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = os.fspath(Path(directory) / REPLICA_FILE)
        self._conn = _connect_readonly(self.path)
        self._lock = ConnectionGuard(self.path)
        try:
            with self._lock:
                (version,) = self._conn.execute("PRAGMA user_version").fetchone()
                # Another healthlog database (a store copied in its place, say) has a schema
                # version too, but not the replica's binding (CLI-74).
                binding = self._conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'binding'"
                ).fetchone()
                if version == 0 or binding is None:
                    raise NotAReplica("is empty, or another database")
                if version > len(MIGRATIONS):
                    raise newer_schema(self.path, version, len(MIGRATIONS), Replica.GOING_BACK)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ReplicaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect_readonly(path: str) -> sqlite3.Connection:
    """``path`` opened ``mode=ro`` and read once; on read-only media (a directory that cannot
    be written) with neither ``-wal`` nor ``-shm`` beside it, where SQLite cannot make the
    ``-shm`` that reading a WAL file needs, ``immutable`` (see :class:`ReplicaReader`); so on a
    disk too full for a ``-shm`` file with no ``-wal``, or an empty one (its follower stopped:
    every change is in the file), where SQLite fails with ``disk I/O error`` and leaves part of a
    ``-shm`` (STORE-101, as CLI-112 reads a data directory there)."""
    if (
        os.path.isfile(path)
        and not _size(path + "-wal")
        and no_room_for_shm(os.path.dirname(path) or ".")
    ):
        return read_once(connect(path, readonly=True, create=False, immutable=True))
    try:
        return read_once(connect(path, readonly=True, create=False))
    except StorageError:
        if (
            not os.path.isfile(path)
            or os.path.exists(path + "-wal")
            or os.path.exists(path + "-shm")
            or os.access(os.path.dirname(path) or ".", os.W_OK)
        ):
            raise
    return read_once(connect(path, readonly=True, create=False, immutable=True))


def _refuse_unwritable(path: Path) -> None:
    """Refuse (StorageError), before SQLite opens it, a replica file, or a ``-wal`` or ``-shm``
    beside it, that this user may not write (a read-only mode, a read-only file system), saying
    why and what to do. SQLite would open such a file read-only, fail the first write without a
    cause, and make the missing ``-wal`` and ``-shm`` with the file's read-only mode: once the
    file's mode was mended, the ``-shm`` still refused every ``follow`` (STREAM-119)."""
    for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if not candidate.exists() or os.access(candidate, os.R_OK | os.W_OK):
            continue
        read_only = mounted_read_only(candidate.parent)
        why = (
            f": {read_only}; `healthlog export --replica` reads it there"
            if read_only
            else not_permitted(candidate)
        )
        error = StorageError(f"the replica cannot be written{why}")
        error.file = candidate.name
        raise error


@contextlib.contextmanager
def _followed(directory: Path) -> Iterator[None]:
    """The exclusive ``flock`` on a replica's ``directory`` that its one follower holds
    (:meth:`Replica.following`), for the block; :class:`ReplicaInUse` when another holds it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ReplicaInUse(f"another follow is running on the replica in {directory}") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _upgraded_alone(path: Path) -> Iterator[None]:
    """For the block that opens ``path``: when that open would migrate a replica of an older
    schema, under the follower's lock (:func:`_followed`), refused (:class:`ReplicaInUse`) while
    a follower runs on it. A second ``follow`` started from files upgraded under a running one
    (a supervisor starting the unit again) migrated the replica and was refused only then: the
    running follower of the older code went on writing into the newer schema (STREAM-202). A
    replica at this healthlog's version, or one whose version cannot be read (left to the open
    to say why), is opened as before: commands that read it beside its follower still may."""
    if _schema_version(path) in (None, len(MIGRATIONS)):
        yield
        return
    with _followed(path.parent):
        yield


def _schema_version(path: Path) -> int | None:
    """The schema version of a replica file there, or None: none there, or not readable."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        conn = _connect_readonly(os.fspath(path))
    except StorageError:
        return None
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _refuse_another_database(path: Path) -> None:
    """Refuse (:class:`NotAReplica`), before it is opened to write, a ``replica.sqlite`` that
    is another database (a store, a journal or tokens copied there, another program's): its
    tables and no replica's ``binding`` (STREAM-133). Opened to write, it was given the
    replica's schema: a store or a journal, whose schema versions are higher, was refused as
    ``database schema is newer than this healthlog``, tokens with ``no such table: binding``,
    and another program's database, of version 0, got the replica's tables added. An empty file
    is no other database (a replica is made in it); one SQLite cannot read is left to the write
    open to say so."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        conn = _connect_readonly(os.fspath(path))
    except StorageError:
        return
    try:
        tables = {
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.Error:
        return
    finally:
        conn.close()
    if tables and "binding" not in tables:
        raise NotAReplica(
            "is another database than a follow replica (a store or a journal copied there?):"
            " follow into another --replica directory, or move that file away"
        )


def _size(path: str) -> int:
    """The size of the file at ``path``, 0 when there is none."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _identity(path: str) -> tuple[int, int] | None:
    """The device and inode of the file at ``path``, or None when there is none."""
    try:
        stats = os.stat(path)
    except FileNotFoundError:
        return None
    return stats.st_dev, stats.st_ino
