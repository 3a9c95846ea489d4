"""The data directory: ``journal.sqlite`` (authoritative, back it up), ``store.sqlite`` (the
projection, rebuildable from the journal), ``tokens.sqlite`` (client token hashes) and the
optional ``healthlog.toml``."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shlex
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import attrs
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from healthlog.snapshots import public_key_text
from healthlog.storage._sqlite import (
    StorageError,
    describe,
    give_to_directory_owner,
    group_name,
    make_directory,
    no_room_for_shm,
    not_permitted,
    root_s_in_another_s,
    shared_with_others,
    user_name,
)
from healthlog.storage.journal import Journal
from healthlog.storage.store import Store
from healthlog.storage.tokens import Tokens

JOURNAL_FILE = "journal.sqlite"
STORE_FILE = "store.sqlite"
TOKENS_FILE = "tokens.sqlite"
CONFIG_FILE = "healthlog.toml"
SIGNING_KEY_FILE = "signing.key"
SIGNING_TEMPORARY_PREFIX = ".signing-"
SNAPSHOT_DIR = "snapshots"

log = logging.getLogger("healthlog.datadir")


class KeyOutOfReach(StorageError):
    """``signing.key`` cannot be read or made by this process: another user's, or on read-only
    media."""


def _absolute(path: str | os.PathLike[str]) -> Path:
    """Absolute, so that worker processes find the same files whatever their directory."""
    return Path(path).absolute()


@attrs.frozen
class DataDir:
    """Where one healthlog instance keeps its files."""

    path: Path = attrs.field(converter=_absolute)

    @property
    def journal_path(self) -> Path:
        return self.path / JOURNAL_FILE

    @property
    def store_path(self) -> Path:
        return self.path / STORE_FILE

    @property
    def tokens_path(self) -> Path:
        return self.path / TOKENS_FILE

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def snapshot_dir(self) -> Path:
        return self.path / SNAPSHOT_DIR

    def holds_data(self) -> bool:
        """Whether one of healthlog's files is here (a database, the signing key, the settings):
        a directory without them (empty, or holding other files) is not a data directory."""
        names = (JOURNAL_FILE, STORE_FILE, TOKENS_FILE, SIGNING_KEY_FILE, CONFIG_FILE)
        return any((self.path / name).exists() for name in names)

    def warn_of_open_modes(self) -> None:
        """:meth:`warn_if_readable_by_all`, and one WARNING naming the data directory and its
        ``snapshots/`` where every user of the machine may write in them (STORE-97), in which
        any account may remove or replace ``journal.sqlite``, ``tokens.sqlite`` or
        ``signing.key``; with the command that mends them. An older healthlog made them so under
        umask 000, and so do a restore or a ``chmod``: no cause is said (STORE-100). Only the
        names and modes."""
        self.warn_if_readable_by_all()
        names = []
        for path in (self.path, self.snapshot_dir):
            try:
                mode = stat.S_IMODE(path.stat().st_mode)
            except OSError:
                continue
            if mode & stat.S_IWOTH:
                names.append((path, mode))
        if names:
            log.warning(
                "directories every user of the machine may write in: %s; any of them may remove"
                " or replace the journal and the tokens there; `chmod go-w %s` makes them"
                " writable by their owner alone",
                ", ".join(f"{path} (mode {mode:04o})" for path, mode in names),
                _shell_words(path for path, _ in names),
            )
        self._warn_if_the_group_may_write()

    def _warn_if_the_group_may_write(self) -> None:
        """One WARNING naming the data directory, its ``snapshots/`` and healthlog's files here
        where the accounts of their group may write (STORE-108), with their group and the
        ``chmod g-w`` that mends them: any of those accounts may remove or replace the journal,
        the tokens or the signing key, or rewrite the journal. A directory every user may write
        in is named by :meth:`warn_of_open_modes` alone (STORE-109). Group read is left unsaid
        (a backup job's, on purpose)."""
        writable = []
        for path in (self.path, self.snapshot_dir):
            try:
                stats = path.stat()
            except OSError:
                continue
            mode = stat.S_IMODE(stats.st_mode)
            if mode & stat.S_IWGRP and not mode & stat.S_IWOTH:
                writable.append((path, mode, stats))
        for path, mode in self._modes():
            if mode & stat.S_IWGRP:
                try:
                    writable.append((path, mode, path.stat()))
                except OSError:
                    continue
        # A group of the owner alone gives no other account a write (STORE-110): a user private
        # group under umask 002 would otherwise be named at every start.
        named = [
            (path, mode, stats.st_gid)
            for path, mode, stats in writable
            if shared_with_others(stats.st_gid, stats.st_uid)
        ]
        if named:
            log.warning(
                "healthlog's directories and files the accounts of their group may write: %s;"
                " any of them may remove, replace or rewrite the journal and the tokens;"
                " `chmod g-w %s` makes them writable by their owner alone",
                ", ".join(
                    f"{path} (mode {mode:04o}, group {group_name(gid)})"
                    for path, mode, gid in named
                ),
                _files_as_globbed(path for path, _, _ in named),
            )

    def warn_if_readable_by_all(self) -> None:
        """One WARNING naming healthlog's files here that every user of the machine may read
        (STORE-79): an older healthlog made them 0644 under the usual umask, and so do a restore
        or a ``chmod`` (SQLite gives a database's ``-wal`` and ``-shm`` files its mode), so only
        what is known is said, the modes, with the command that mends them, not a cause
        (STORE-99). Only the file names and modes, never what they hold. Group permissions are
        left unsaid: a group may be given read on purpose (a backup job's)."""
        names = [
            f"{path.relative_to(self.path)} (mode {mode:04o})"
            for path, mode in self._modes()
            if mode & stat.S_IROTH
        ]
        if names:
            log.warning(
                "health data readable by every user of the machine in %s: %s;"
                " `chmod -R o-rwx %s` makes them unreadable to others",
                self.path,
                ", ".join(names),
                _shell_words([self.path]),
            )

    def _modes(self) -> list[tuple[Path, int]]:
        """healthlog's files here (the databases with their ``-wal`` and ``-shm`` files, the
        signing key, the snapshots) and their permission bits."""
        candidates = [
            self.path / f"{name}{suffix}"
            for name in (JOURNAL_FILE, STORE_FILE, TOKENS_FILE)
            for suffix in ("", "-wal", "-shm")
        ]
        candidates.append(self.path / SIGNING_KEY_FILE)
        if self.snapshot_dir.is_dir():
            candidates.extend(sorted(self.snapshot_dir.iterdir()))
        modes = []
        for path in candidates:
            try:
                modes.append((path, stat.S_IMODE(path.stat().st_mode)))
            except OSError:
                continue
        return modes

    def signing_key(self) -> Ed25519PrivateKey:
        """The snapshot signing key, created (mode 0600) on first use.

        Processes starting together on a new directory all end up with the one key on disk:
        each writes a key of its own to a file of its own and links it into place only if no
        key is there yet (the first wins), then reads the key that is. A key that cannot be
        read is a StorageError: it names the file, and a new key would not do (followers pin
        the public key); so is one that cannot be made (a full disk).

        Its public half is recorded in the journal: a key found other than the one recorded
        (``signing.key`` lost and made anew, or replaced) is one followers that pinned the old
        one refuse, and the process that finds it says so in a WARNING, with what to do."""
        path = self.path / SIGNING_KEY_FILE
        if not path.exists() and self._journal_not_ours():
            raise self._not_ours_to_make(path)
        try:
            made = not path.exists() and self._create_signing_key(path)
            pem = path.read_bytes()
        except PermissionError as exc:
            raise KeyOutOfReach(
                f"cannot {'read' if path.exists() else 'make'} {path}: {exc.strerror}"
                f"{not_permitted(path)}"
            ) from None
        except OSError as exc:
            # A write's error names no file (a full disk: ``[Errno 28] No space left on
            # device``), a temporary file's names that file: say which key it was.
            reason = exc.strerror or type(exc).__name__
            doing = "read" if path.exists() else "make"
            error = KeyOutOfReach if exc.errno == errno.EROFS else StorageError
            raise error(f"cannot {doing} the snapshot signing key: {reason} ({path})") from None
        try:
            key = load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise StorageError(
                f"{path} is not a readable private key ({type(exc).__name__}): restore it from"
                " a backup (a new key would be refused by followers that pinned this one)"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise StorageError(f"{path} is not an Ed25519 key: restore it from a backup")
        self._check_recorded(public_key_text(key), made=made)
        return key

    def _journal_not_ours(self) -> bool:
        """Whether ``journal.sqlite`` is another user's, which this process may not write: the
        data directory is theirs (a backup user's group read), whose files this process makes
        none of (STORE-85). Not so for root, nor on read-only media (CLI-106 says that)."""
        try:
            owner = self.journal_path.stat().st_uid
        except OSError:
            return False
        uid = os.geteuid()
        return uid not in (0, owner) and not os.access(self.journal_path, os.W_OK)

    def _not_ours_to_make(self, path: Path) -> KeyOutOfReach:
        """The error of a process that would make ``signing.key`` in another user's data
        directory (STORE-85): made so, it would be this user's, mode 0600, which the service
        could not read, and the service would not start."""
        user = user_name(os.geteuid())
        try:
            stats = self.journal_path.stat()
        except OSError:
            owner = "its owner"
        else:
            if root_s_in_another_s(stats, self.path):
                # Root's command runs as the directory's owner (CLI-146): only a chown mends
                # a journal root copied in (CLI-166).
                return KeyOutOfReach(
                    f"no {path} yet, and user {user} may not make it"
                    f"{not_permitted(self.journal_path)}"
                )
            owner = user_name(stats.st_uid)
        return KeyOutOfReach(
            f"no {path} yet, and user {user} may not make it: {self.path} is {owner}'s, whose"
            f" service makes it as it starts (one of {user}'s would stop the service); run it as"
            f" {owner} (`sudo -u {owner} healthlog ...`)"
        )

    def public_key(self) -> str:
        """The public half of the snapshot signing key, as ``status`` prints it: that of
        :meth:`signing_key`, else, where this process may not read ``signing.key`` nor make
        one (the service's key, 0600, read by another user; read-only media: CLI-106), the one
        recorded in the journal, which every process that reads the key records there."""
        try:
            return public_key_text(self.signing_key())
        except KeyOutOfReach as exc:
            try:
                with self.open_journal(create=False, reading=True) as journal:
                    recorded = journal.snapshot_key()
            except StorageError as error:
                log.debug("snapshot key not read from the journal: %s", describe(error))
                recorded = None
            if recorded is None:
                raise exc from None
            return recorded

    def _check_recorded(self, public_key: str, *, made: bool) -> None:
        """Record ``public_key`` in the journal (when there is one) and warn when another key
        was recorded there before."""
        if not self.journal_path.exists():
            return
        try:
            # On a disk too full for a -shm file it can be read, not written, and opening it to
            # write would leave part of one beside it (CLI-112).
            # Nor, in another user's directory, left -wal and -shm files of this user's,
            # which the service could not write (STORE-85).
            cramped = no_room_for_shm(self.path) or self._journal_not_ours()
            with self.open_journal(create=False, reading=cramped) as journal:
                recorded = journal.snapshot_key()
                if recorded == public_key:
                    return
                try:
                    journal.record_snapshot_key(public_key)
                except StorageError as exc:
                    # A journal this process may not write (a read-only `status`): said below
                    # all the same, and recorded by the next process that can.
                    log.debug("snapshot key not recorded: %s", describe(exc))
        except StorageError as exc:
            # The command at hand meets the journal's trouble itself, and says so.
            log.debug("snapshot key not checked against the journal: %s", describe(exc))
            return
        if recorded is None:
            return
        log.warning(
            "%s in %s: the snapshot signing key is now %s, not %s as before (%s)."
            " Followers that pinned the old one refuse every snapshot ('the server's snapshot"
            " key changed'): put the old %s back from a backup (and restart), or give them"
            " the new public key, which `healthlog status --data %s` prints as 'snapshot"
            " key': `healthlog follow --accept-key KEY`",
            SIGNING_KEY_FILE,
            self.path,
            public_key,
            recorded,
            "it was missing: made a new one" if made else "the file was replaced",
            SIGNING_KEY_FILE,
            _shell_words([self.path]),
        )

    def _create_signing_key(self, path: Path) -> bool:
        """Make a key at ``path`` unless one is there; whether this call's key is the one."""
        make_directory(self.path)
        pem = Ed25519PrivateKey.generate().private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        )
        fd, tmp, lock = _locked_temporary(self.path, SIGNING_TEMPORARY_PREFIX)
        try:
            give_to_directory_owner(fd, self.path)
            _write_synced(fd, pem)
            try:
                os.link(tmp, path)
                made = True
            except FileExistsError:
                made = False
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                made = _create_exclusive(path, pem)
        finally:
            os.unlink(tmp)
            os.close(lock)
        directory = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return made

    def remove_left_over_keys(self) -> None:
        """Remove the temporary files (``.signing-*``, a private key each) of processes killed
        while making ``signing.key``, unless a process making one holds its lock (STORE-92):
        otherwise such a file, mode 0600, stayed in the data directory for good."""
        for stale in self.path.glob(f"{SIGNING_TEMPORARY_PREFIX}*"):
            try:
                fd = os.open(stale, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                stale.unlink()
            except OSError as exc:
                # Being made (BlockingIOError), or not this user's to remove: kept.
                log.debug("kept %s: %s", stale.name, exc)
                continue
            finally:
                os.close(fd)
            log.info("removed %s, left by a process stopped making the key", stale.name)

    def open_tokens(self, *, reading: bool = False) -> Tokens:
        """The tokens, as :meth:`open_journal` opens the journal."""
        make_directory(self.path)
        return Tokens(self.tokens_path, reading=reading)

    def open_journal(
        self, busy_timeout_ms: int = 5000, *, create: bool = True, reading: bool = False
    ) -> Journal:
        """The journal, the directory and file created if need be; without ``create`` only
        the file that is there (a StorageError if it is not). With ``reading``, for a command
        that only reads, a file that cannot be written is read where it is (CLI-105)."""
        if create:
            make_directory(self.path)
        return Journal(
            self.journal_path, busy_timeout_ms=busy_timeout_ms, create=create, reading=reading
        )

    def open_store(
        self, busy_timeout_ms: int = 5000, *, create: bool = True, reading: bool = False
    ) -> Store:
        """The store, as :meth:`open_journal` opens the journal."""
        if create:
            make_directory(self.path)
        return Store(
            self.store_path, busy_timeout_ms=busy_timeout_ms, create=create, reading=reading
        )


# What link() fails with on a filesystem without hard links (FAT, exFAT, CIFS without its Unix
# extensions), where a key is created in place instead.
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP})


def _shell_words(paths: Iterable[Path]) -> str:
    """``paths`` as a shell reads them in a command said to be run as given, each quoted: a
    path with a space (a NAS share's ``Health Data``) was two words, on which ``chmod`` said
    ``cannot access`` and changed nothing (STORE-152, STORE-153)."""
    return " ".join(shlex.quote(os.fspath(path)) for path in paths)


def _files_as_globbed(paths: Iterable[Path]) -> str:
    """``paths`` as :func:`_shell_words` says them, a database's ``-wal`` and ``-shm`` files
    said as the database's path and a ``*``: SQLite removes them as the last connection closes,
    so a ``chmod`` naming them, run once the process that named them had exited, said ``cannot
    access`` for each and exited 1 (STORE-154); the glob names those there, and the database."""
    words: dict[Path, str] = {}
    for path in paths:
        database = path.with_name(path.name.removesuffix("-wal").removesuffix("-shm"))
        if database == path:
            words.setdefault(path, shlex.quote(os.fspath(path)))
        else:
            words[database] = f"{shlex.quote(os.fspath(database))}*"
    return " ".join(words.values())


def _create_exclusive(path: Path, pem: bytes) -> bool:
    """Create ``path`` holding ``pem`` unless it exists (the first wins, as with a link); a
    process reading it in the instant before the bytes are in may find it empty and fail with
    a StorageError, on such filesystems only. Whether it was created here."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    give_to_directory_owner(fd, path.parent)
    _write_synced(fd, pem)
    return True


def _locked_temporary(directory: Path, prefix: str) -> tuple[int, str, int]:
    """A new temporary file in ``directory``: its descriptor, its path and a second descriptor
    holding an exclusive ``flock`` on it, which :meth:`DataDir.remove_left_over_keys` leaves
    alone (close it once the file is gone). One removed in the instant before the lock was
    taken is made anew."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
        lock = os.dup(fd)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd, tmp, lock
        except FileNotFoundError:
            log.debug("%s was removed as it was made: making another", tmp)
        os.close(lock)
        os.close(fd)


def _write_synced(fd: int, data: bytes) -> None:
    """Write ``data`` to the new file open at ``fd``, on disk before this returns; closes it."""
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def default_data_dir() -> Path:
    """``HEALTHLOG_DATA``, else ``./var``; set but empty (``HEALTHLOG_DATA=``, a unit's
    ``Environment=`` left blank) is unset, not the current directory."""
    return Path(os.environ.get("HEALTHLOG_DATA") or "var")
