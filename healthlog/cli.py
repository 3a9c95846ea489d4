"""The ``healthlog`` command line (see the outside contract in the README)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import math
import os
import pwd
import shlex
import signal
import stat
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import attrs

from healthlog import clock, documents, layers
from healthlog.config import (
    LOG_FORMATS,
    ConfigError,
    ServeConfig,
    load_log_config,
    load_serve_config,
)
from healthlog.export import FORMATS, REPLICA_REMEDY, STORE_REMEDY, chunked, export_lines
from healthlog.fold import FAILED, PARTIAL
from healthlog.hangup import REPEATED_SIGNAL_S, stopping_signals
from healthlog.logs import LEVELS, setup_logging
from healthlog.objects import ObjectCorrupt
from healthlog.seals import SEAL_CLIENT, SEAL_CONTENT_TYPE, Seal
from healthlog.storage import faultplan
from healthlog.storage._sqlite import (
    StorageError,
    free_when_full,
    mounted_read_only,
    not_permitted,
    user_name,
    write_refused,
)
from healthlog.storage.checked import CheckedRecord
from healthlog.storage.datadir import JOURNAL_FILE, STORE_FILE, DataDir, default_data_dir
from healthlog.storage.journal import BodyEncoder, EncodedBody, NewDelivery
from healthlog.storage.passes import check_before_folding, check_same_journal, counted
from healthlog.storage.rebuild import (
    REINDEX_PREFIX,
    Difference,
    OutcomeDifference,
    RebuildError,
    ReindexRunning,
    reindex,
    reindex_holder,
    verify_all,
)
from healthlog.storage.replica import (
    REPLICA_FILE,
    NotAReplica,
    Replica,
    ReplicaInUse,
    ReplicaReader,
)
from healthlog.storage.status import (
    DEFAULT_LISTED,
    MAX_LISTED,
    NO_PASS_YET,
    collect_status,
    list_deliveries,
    reindex_advice,
)
from healthlog.storage.store import (
    OUT_OF_MEMORY,
    OVER_BUDGET,
    WORKER_DIED,
    Store,
    serve_of,
)
from healthlog.storage.tokens import RESERVED_PREFIX, TokenError, Tokens
from healthlog.timestamps import (
    TIMESTAMP_EXAMPLE,
    TimestampError,
    format_instant,
    hour_of,
    parse_instant,
)

if TYPE_CHECKING:
    from actors.runtime import Runtime

log = logging.getLogger("healthlog.cli")
IMPORT_CLIENT = "cli:import"
T = TypeVar("T")
INTERRUPTED = 128 + signal.SIGINT
"""The exit status of a command stopped by Ctrl-C, as a shell reports it."""


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


class OutputFailed(Exception):
    """Standard output could not be written (a full disk behind a redirect, say): printed
    without a traceback, exit status 3, as an error of the data directory's is, but naming
    stdout, so that a full disk there is not taken for one under the data directory."""


class Unfolded(Exception):
    """A delivery the command journaled that it could not fold (a full disk, a store it may
    not write): printed without a traceback, exit status 3, as a storage error is."""


class NotSwitched(Exception):
    """A command run by root could not run as the data directory's owner (:func:`_as_owner`):
    printed without a traceback, exit status 3, before anything in the directory is opened."""


@attrs.frozen
class Owner:
    """The account a command run by root on another account's data directory runs as."""

    name: str
    uid: int
    gid: int
    directory: Path


class Stopped(BaseException):
    """A long command stopped by a signal (:meth:`Progress.stopping`): it exits with 128 plus
    the signal's number, as a shell reports a process the signal ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Progress:
    """Progress on stderr: a rewritten line on a terminal, else at most a line a second.

    It is also where a long command stops on SIGTERM, SIGINT or SIGHUP (:meth:`stopping`; a
    hangup, unless ignored as the command started: ``hangup``): the signal is noted and
    :class:`Stopped` raised at the next report, so ``finally`` blocks (a lease release, the
    removal of a rebuild's scratch store) run. Raising from the signal handler itself could
    interrupt the main thread inside a lock that the rebuild's worker-pool thread needs next
    (the logging lock, say), and the pool's shutdown would then wait forever. One more within
    ``REPEATED_SIGNAL_S`` is the same stop delivered twice (a terminal's hangup, ``timeout``)
    and changes nothing: taken for a second Ctrl-C, it raised from the handler wherever the
    rebuild stood (CLI-194). A later one is someone insisting, and stops at once (CLI-195).
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        # The count last printed: a partitioned rebuild reports its end once for each
        # partition it settles, and `reindex: N/N` came six times over (CLI-123).
        self._shown: tuple[int, int] | None = None
        self._signal: int | None = None
        self._signalled_at = 0.0

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """Stop at the next report on SIGTERM, SIGINT or SIGHUP (each unless ignored as the
        command started: :func:`stopping_signals`) while the block runs. Once a
        signal has stopped it they stay ignored: the command is on its way out, and the same
        stop once more found the default action put back and killed it, exit -1 (CLI-194)."""
        previous = {
            signum: signal.signal(signum, self._request_stop) for signum in stopping_signals()
        }
        try:
            yield
        except Stopped:
            previous = dict.fromkeys(previous, signal.SIG_IGN)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _request_stop(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self._signal is None:
            self._signal, self._signalled_at = signum, now
        elif now - self._signalled_at > REPEATED_SIGNAL_S:
            raise Stopped(signum)

    def check(self) -> None:
        """Raise :class:`Stopped` if a signal came: where the command waits with no progress
        to report (a reindex waiting for the store's write lock)."""
        if self._signal is not None:
            raise Stopped(self._signal)

    def __call__(self, done: int, total: int) -> None:
        self.check()
        now = time.monotonic()
        if (done, total) == self._shown:
            return
        if done < total and now - self._last < (0.1 if self._tty else 1.0):
            return
        self._last = now
        self._shown = (done, total)
        end = "\n" if done >= total or not self._tty else ""
        prefix = "\r" if self._tty else ""
        # Dropped when stderr cannot be written, as :func:`_tell`'s lines are (CLI-94).
        with contextlib.suppress(OSError):
            print(f"{prefix}{self._what}: {done}/{total}", end=end, file=sys.stderr, flush=True)


class _Once(argparse.Action):
    """An option of one value that refuses a second. argparse keeps the last one given:
    `export --metric heart_rate --metric step_count` wrote step_count's points alone and exited
    0 (CLI-177), where `/v1/points` refuses a repeated parameter (SERVE-93). Which options were
    given is kept in the namespace being parsed, so a parser parses many argument lists alike."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: set[str] = vars(namespace).setdefault("_given_once", set())
        if self.dest in given:
            raise argparse.ArgumentError(
                self,
                f"given twice; it takes one value: run {parser.prog.split()[-1]} once for each",
            )
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def _instant(value: str) -> int:
    try:
        return parse_instant(value)
    except TimestampError as exc:
        raise argparse.ArgumentTypeError(
            f"not a timestamp: {exc} (for example {TIMESTAMP_EXAMPLE})"
        ) from None


def _past_instant(value: str) -> int:
    """An instant no later than now: journal stamps never go back (J2), so every live delivery
    after a stamp in the future would carry it until the clock reached it, its lag reading 0
    all that while."""
    instant = _instant(value)
    if instant > clock.now_us():
        raise argparse.ArgumentTypeError(
            f"{format_instant(instant)} is later than now: a backfill takes the past instant"
            " its data was received at"
        )
    return instant


def _ended_instant(value: str) -> int:
    """An instant no later than now, for ``seal --before``: a seal covers what ends by then (an
    hour; a day, week, month or year at its longest: ``seals.SPANS``), and one of hours not
    over yet (a year mistyped, ``date -d tomorrow`` in a nightly job) would mark every later
    write to them a sealed write, for good: the journal keeps the seal and every rebuild folds
    it again (SEAL-20)."""
    instant = _instant(value)
    if instant > clock.now_us():
        raise argparse.ArgumentTypeError(
            f"{format_instant(instant)} is later than now: a seal covers hours that have ended"
        )
    return instant


def _layer(value: str) -> str:
    layer = layers.layer_from_header(value)
    if layer is None:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(layers.LAYERS)}")
    return layer


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value}") from None
    if number < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return number


def _listed(value: str) -> int:
    number = _at_least_one(value)
    if number > MAX_LISTED:
        raise argparse.ArgumentTypeError(f"at most {MAX_LISTED}")
    return number


def _duration(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value}") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError("must be a finite number above zero")
    return number


def _stored_layer(value: str) -> str:
    """A layer objects are stored under: an automation's, or ``records`` (sections)."""
    layer = layers.stored_layer(value)
    if layer is None:
        raise argparse.ArgumentTypeError(f"choose one of {layers.STORED_LAYERS_TEXT}")
    return layer


# -- commands -------------------------------------------------------------------------------


# trio, the runtime (actors) and the web stack (transport) are imported only by the commands
# that run them: a command that only reads or rebuilds (status, export, verify, reindex) would
# otherwise spend a tenth of a second importing trio, which runs ldconfig as a child, and each
# fold worker process, which starts by re-running the console script (multiprocessing's
# spawn), a third of a second of CPU importing quart and hypercorn it never uses.


def _run(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``trio.run(fn, *args)``, trio imported only now."""
    import trio

    return trio.run(fn, *args)


def _run_terminable(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """:func:`_run`, with SIGTERM, Ctrl-C (SIGINT) and a hangup (SIGHUP: its terminal closed)
    stopping ``fn``: it is cancelled, so the runtime it opened closes on the way out (its fold
    lease released, its fold workers stopped), and the command exits 143, 130 or 129 with one
    line. Left to its default, SIGTERM
    ended the process at once, and its lease held off the service's folding for a lease term.
    Ctrl-C left to trio's KeyboardInterrupt broke even a shielded wait, the one for a
    delivery's commit: journaled, it went unsaid (RUN-75). A SIGINT ignored when the command
    started (a shell's background job) stays ignored, as does a SIGHUP (``nohup``).

    The signal receiver is opened with them ignored, which it puts back as it closes, and they
    stay ignored once a signal has stopped ``fn``: the same stop once more while the runtime
    closes (a terminal's hangup signals the foreground job twice, the shell's and the kernel's,
    0.2 ms apart; ``timeout`` signals the command and then its group) found the default action
    back and killed the command, its lease held for its term (CLI-193). Otherwise the handlers
    from before are put back."""
    import trio

    stopping = stopping_signals()
    previous = {signum: signal.getsignal(signum) for signum in stopping}

    async def terminable() -> T:
        # Ignored and watched in one step, before ``fn`` runs a line: ignored before ``trio.run``
        # and watched once a task of its own ran, a signal while the runtime started (its
        # modules loaded, seconds on a loaded NAS) was dropped, and the command ran on (CLI-280).
        for signum in stopping:
            signal.signal(signum, signal.SIG_IGN)
        with trio.open_signal_receiver(*stopping) as signals:

            async def on_signal() -> None:
                async for signum in signals:
                    raise Stopped(signum)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(on_signal)
                result = await fn(*args)
                nursery.cancel_scope.cancel()
        return result

    result = trio.run(terminable)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    return result


def cmd_import(args: argparse.Namespace, data: DataDir) -> int:
    for name in args.files:
        _check_readable(name, args.owner)
    _journal_not_lost(data)
    config = _settings(data)
    return _run_terminable(_import, args, data, config)


def _check_readable(name: str, owner: Owner | None) -> None:
    """Refuse (exit 2, nothing journaled) a file that cannot be opened for reading, or is a
    directory, before any is read: each is read only when its turn comes (CLI-124). Opened
    without blocking, so that a FIFO (``<(command)``) is not waited on here; a named FIFO is
    not opened at all: its writer, waiting for a reader, took that open for its reader, wrote
    into a pipe closed at once, and died of SIGPIPE, while the import then waited on the FIFO
    for good (CLI-130). Run by root as the data directory's ``owner``, a file that account
    may not read says so (CLI-150)."""
    refused = "" if owner is None else f" (read as {owner.name}: {_AS_OWNER_READS})"
    if _given_descriptor(name) is not None:
        return
    try:
        if stat.S_ISFIFO(os.stat(name).st_mode):
            if not os.access(name, os.R_OK):
                raise CliError(f"cannot read {name}: {os.strerror(errno.EACCES)}{refused}")
            return
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except PermissionError as exc:
        raise CliError(f"cannot read {name}: {exc.strerror}{refused}") from None
    except OSError as exc:
        raise CliError(f"cannot read {name}: {exc.strerror}") from None
    try:
        directory = stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if directory:
        raise CliError(f"cannot read {name}: {os.strerror(errno.EISDIR)}")


_AS_OWNER_READS = (
    "run by root, import runs as the data directory's owner, and reads as that user, who could"
    " otherwise have root read for it any file it links there; make the file readable by that"
    " user, or copy it where that user may read it"
)


_DESCRIPTOR_NAMES = ("/dev/fd/", "/proc/self/fd/")
_STDIN_NAMES = ("/dev/stdin", "/proc/self/fd/0")


def _given_descriptor(path: str | os.PathLike[str]) -> int | None:
    """The descriptor this process was given that ``path`` names (``<(command)``'s
    ``/dev/fd/N``, ``/dev/stdin``) when it may not open the name anew, else None. Run by root
    as the data directory's owner (CLI-146), the pipe of root's shell is root's, mode 0600,
    which that user may not open again; what it was given to read it reads (CLI-161). A
    ``Path`` where the names were made absolute (CLI-118)."""
    name = os.fspath(path)
    # ASCII digits alone: `str.isdigit` takes a superscript `²` too, which `int` refuses.
    tail = name.rpartition("/")[2]
    if name in _STDIN_NAMES:
        number = 0
    elif name.startswith(_DESCRIPTOR_NAMES) and tail.isascii() and tail.isdigit():
        number = int(tail)
    else:
        return None
    try:
        os.fstat(number)
    # A number no descriptor can have (`/dev/fd/99999999999999999999`) names nothing, as a
    # descriptor not open does: the name is then opened as any other, and said missing (CLI-162).
    except (OSError, OverflowError):
        return None
    return None if os.access(name, os.R_OK) else number


_READ_CHUNK = 2**20
"""How much of a file ``import`` reads at a time into the journal's encoder."""


def _read_file(name: str, encoder: BodyEncoder) -> EncodedBody:
    """The file ``name`` as the journal stores it, read a chunk at a time into ``encoder``, as
    HTTP intake streams a body: the command holds the compressed body, not the raw one too.
    Read whole and handed over as bytes, the raw body was held twice over while it was
    compressed: 992 MiB at the peak for a file of 399 MiB, three years of minute-level heart
    rate and steps (CLI-185)."""
    given = _given_descriptor(name)
    try:
        with os.fdopen(os.dup(given), "rb") if given is not None else open(name, "rb") as file:
            while chunk := file.read(_READ_CHUNK):
                encoder.feed(chunk)
    except OSError as exc:
        raise CliError(f"cannot read {name}: {exc.strerror}") from None
    return encoder.finish()


def _journaled_before(names: list[str], ids: list[int]) -> str:
    """What an import stopped at a file (one that failed to read in its turn, CLI-132, or to be
    journaled, CLI-133) had journaled, for its error line: importing those files again by hand
    would journal them twice."""
    done = ", ".join(f"{name} as delivery {id_}" for name, id_ in zip(names, ids, strict=False))
    return f"; journaled before it: {done} (do not import those again)"


def _settings(data: DataDir) -> ServeConfig:
    """The data directory's settings (``healthlog.toml``, ``HEALTHLOG_*``), which a command
    that folds without the service folds under, as the service would."""
    try:
        return load_serve_config(data.config_path, {})
    except ConfigError as exc:
        raise CliError(str(exc)) from None


async def _import(args: argparse.Namespace, data: DataDir, config: ServeConfig) -> int:
    """Journal through the runtime's intake, then wait for whichever folder holds the lease.

    Each file is read when its turn comes, in a thread: read all at once, before the first was
    journaled, they were all held until the last was (three files of 62 MiB took 306 MB, one
    took 175 MB; CLI-124)."""
    import trio

    from actors.runtime import configured, open_runtime

    async with open_runtime(configured(data.path, config, fold=not args.no_wait)) as runtime:
        ids: list[int] = []
        try:
            await _journal_and_wait(args, runtime, ids)
            # A signal during the last file's commit, which is waited for shielded, is still
            # an import stopped, and said as one (RUN-75, CLI-186).
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            if ids:
                _tell(_stopped_after(args.files, ids))
            raise
    return 0


async def _journal_and_wait(args: argparse.Namespace, runtime: Runtime, ids: list[int]) -> None:
    """Journal each file of ``args`` in turn, its delivery id appended to ``ids``, then wait
    (unless ``--no-wait``) until they are folded, saying each one's outcome as it is."""
    import trio

    for name in args.files:
        try:
            receipt = await runtime.submit(
                NewDelivery(
                    # Abandoned when cancelled (SIGTERM, Ctrl-C): waited for, a read still
                    # waiting on a FIFO nobody writes kept the command from stopping
                    # (CLI-131).
                    body=await trio.to_thread.run_sync(
                        _read_file, name, runtime.journal.encoder(), abandon_on_cancel=True
                    ),
                    client=IMPORT_CLIENT,
                    content_type="application/json",
                    automation_id=args.automation_id,
                    automation_aggregation=args.aggregation,
                    received_at=args.received_at,
                )
            )
        except Exception as exc:
            if ids:
                # Said at the end of the error's line (CLI-132, CLI-133).
                exc.add_note(_journaled_before(args.files, ids))
            raise
        ids.append(receipt.delivery_id)
        _tell(
            f"journaled {name} as delivery {receipt.delivery_id}"
            f" ({receipt.bytes} bytes, received_at {format_instant(receipt.received_at)})"
        )
    if not args.no_wait:
        await _say_who_folds(runtime, "import")
        # Each outcome once it is folded, in journal order, which is the fold's: said together
        # once all were folded, six files of three years of minute-level points left a user
        # 105 s without a line after the last was journaled (CLI-187).
        for delivery_id in ids:
            await _wait_folded(runtime, delivery_id, "import")
            await _tell_outcomes(runtime, [delivery_id])


async def _wait_folded(runtime: Runtime, delivery_id: int, command: str) -> None:
    """Wait until ``delivery_id`` is folded; raise :class:`Unfolded` once this process cannot
    fold it. On a full disk, or beside a store it may not write, ``import`` waited for good,
    its folder trying again each minute or its lease renewal failing every 5 s (CLI-200,
    CLI-201); a user who stopped it could not tell whether the file was kept."""
    from actors.runtime import NotFolded

    try:
        await runtime.wait_folded([delivery_id], give_up=True)
    except NotFolded as exc:
        importing = command == "import"
        again = ": do not import it again, which would journal it twice" if importing else ""
        raise Unfolded(
            f"{command}: delivery {exc.delivery_id} is journaled but could not be folded:"
            f" {exc.why}; it stays journaled and folds at the next pass of serve or of another"
            f" {'import' if importing else 'import or seal'} once that is mended (on a full"
            f" disk, once there is room){again}"
        ) from None


def _stopped_after(names: list[str], ids: list[int]) -> str:
    """What an import stopped by a signal after it journaled ``ids`` (the first of ``names``)
    says before `healthlog: interrupted`: a user who ran the same command again journaled every
    file twice (the six files of three years of minute-level points, a 79 MB journal, became
    twelve deliveries and 158 MB), and the interrupted line alone told neither that they were
    kept nor who folds them (CLI-186)."""
    count = len(ids)
    which = (
        f"delivery {ids[0]}"
        if count == 1
        else f"deliveries {ids[0]} to {ids[-1]}"
        if ids[-1] - ids[0] == count - 1
        else "deliveries " + ", ".join(map(str, ids))
    )
    one = count == 1
    line = (
        f"import: stopped; {'the file' if one else f'the {count} files'} journaled ({which})"
        f" {'stays' if one else 'stay'} journaled and {'folds' if one else 'fold'} at the next"
        " pass of serve or of another import: do not import"
        f" {'it' if one else 'them'} again, which would journal {'it' if one else 'them'} twice"
    )
    if count < len(names):
        rest = len(names) - count - 1
        after = f" and the {rest} {'file' if rest == 1 else 'files'} after it" if rest else ""
        line += f"; not journaled: {names[count]}{after}"
    return line


def _check_metric(metric: str | None, command: str) -> None:
    """``--metric`` as ``command`` takes it. An empty one (a script's unset variable) is no
    metric's, and printed nothing with exit 0, as if there were no points, where `GET
    /v1/points?metric=` gives every metric's (CLI-136). One with a byte that is not UTF-8 (typed
    in a terminal set to Latin-1) is no metric's either: the app names them in UTF-8, and the
    query, or a seal's body, could not encode it, a traceback, exit 1 (CLI-274)."""
    if metric == "":
        raise CliError(f"--metric names a metric; leave it out to {command} every metric")
    if metric is not None and not metric.isascii():
        try:
            metric.encode("utf-8")
        except UnicodeEncodeError:
            raise CliError(
                f"--metric {metric!r} is not UTF-8, as every metric's name is; {command} takes"
                " it as the app writes it"
            ) from None


def cmd_seal(args: argparse.Namespace, data: DataDir) -> int:
    _check_metric(args.metric, "seal")
    seal = Seal(args.before, args.metric, args.layer)
    _journal_not_lost(data)
    config = _settings(data)
    return _run_terminable(_seal, args, data, config, seal)


async def _seal(args: argparse.Namespace, data: DataDir, config: ServeConfig, seal: Seal) -> int:
    """Journal a seal through the runtime's intake, then wait until it is folded (S9)."""
    from actors.runtime import configured, open_runtime

    async with open_runtime(configured(data.path, config, fold=not args.no_wait)) as runtime:
        receipt = await runtime.submit(
            NewDelivery(body=seal.encode(), client=SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE)
        )
        scope = _scope(seal.metric, seal.layer)
        _tell(
            f"journaled the seal of what ends by {format_instant(seal.before)}"
            f"{' of ' + scope if scope else ''} as delivery {receipt.delivery_id}"
        )
        if not args.no_wait:
            await _say_who_folds(runtime, "seal")
            await _wait_folded(runtime, receipt.delivery_id, "seal")
            await _tell_outcomes(runtime, [receipt.delivery_id])
        if scope and not await runtime.read_store(
            functools.partial(_holds_any, metric=seal.metric, layer=seal.layer)
        ):
            # A metric mistyped (`HeartRate` for `heart_rate`) sealed nothing, and the command
            # said `parsed` as for any seal (SEAL-21).
            _tell(
                f"seal: no object of {scope} is stored, so the seal marks none: names are as"
                " `healthlog export` prints them (heart_rate, minutes)"
            )
    return 0


def _scope(metric: str | None, layer: str | None) -> str:
    """``metric M layer L`` for those given, as a seal's or an export's lines name them."""
    return " ".join(
        f"{name} {value}"
        for name, value in (("metric", metric), ("layer", layer))
        if value is not None
    )


def _holds_any(store: Store | ReplicaReader, *, metric: str | None, layer: str | None) -> bool:
    """Whether ``store`` holds an object of ``metric`` and ``layer`` (None: any)."""
    return next(store.iter_objects(metric=metric, layer=layer), None) is not None


async def _tell_outcomes(runtime: Runtime, ids: list[int]) -> None:
    """One line for each of the folded deliveries ``ids``: its outcome (``delivery 2: parsed``)."""
    for delivery_id in ids:
        outcome = await runtime.read_store(
            functools.partial(Store.outcome, delivery_id=delivery_id)
        )
        assert outcome is not None
        _tell(f"delivery {delivery_id}: {outcome.status}")


async def _say_who_folds(runtime: Runtime, command: str) -> None:
    """One line when another process (a running ``serve``) holds the fold lease: the command
    then waits for that process's next pass, which can be a minute away, and would otherwise
    wait in silence. A reindex holding it is named as such: the line sent the user looking for
    a service where none ran (CLI-216); so is another ``import`` or ``seal``, which folds at
    once, not at a next pass (CLI-240)."""
    ours = runtime.statistics().lease.holder
    lease = await runtime.read_store(Store.lease)
    if lease.holder in (None, ours) or lease.expires_at <= clock.now_us():
        return
    if lease.holder.startswith(REINDEX_PREFIX):
        _tell(
            f"{command}: waiting for the reindex that holds the fold lease to swap in and"
            " release it; what was journaled folds after it (--no-wait does not wait)"
        )
    elif serve_of(lease.holder) is None:
        _tell(
            f"{command}: waiting for another import or seal, which holds the fold lease, to fold"
            " what it journaled and release it; what was journaled folds after it (--no-wait"
            " does not wait)"
        )
    else:
        _tell(
            f"{command}: waiting for the running service, which holds the fold lease, to fold at"
            " its next pass (within its wake_period_s, 60 s unless set; --no-wait does not wait)"
        )


def _tell(line: str) -> None:
    """One of a command's own lines on stderr, for a person. One that cannot be written (a
    reader gone, as after ``2>&1 | head -1``; a full disk behind ``2>> log``) is dropped and
    the command carries on: the write's error ended ``import`` after its first file, exit 1,
    and on a full disk before it journaled any (CLI-93); ``reindex`` and ``verify`` at their
    first progress line, ``verify`` with exit 0 on a projection that differs (CLI-94)."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace, data: DataDir) -> int:
    flags = {
        "host": args.host,
        "port": args.port,
        "max_body_mib": args.max_body_mib,
        "log_format": args.log_format,
        "log_level": args.log_level,
    }
    try:
        config = load_serve_config(data.config_path, flags)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    _journal_not_lost(data)
    setup_logging(config.log_format, config.log_level)
    _say_owner(args.owner)
    try:
        _run(_serve, data, config)
    except BaseException as exc:
        if args.owner is not None:
            _say_why_not_listening(exc, args.owner)
        raise
    # Stopped cleanly. The stopping signal delivered once more (``timeout``, a kill of the
    # process group, a shell hanging up its jobs) must not kill the interpreter on its way out,
    # which restores the default handlers: the exit is 0 whatever arrives now.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    return 0


def _say_why_not_listening(exc: BaseException, owner: Owner) -> None:
    """Add to ``serve``'s error of a port it may not listen on, run by root as the data
    directory's owner (CLI-149), why and what to do: ports below 1024 are root's unless the
    system lets every user listen there."""
    from transport.serve import CannotListen

    error = _user_error(exc)
    if isinstance(error, CannotListen) and error.errno == errno.EACCES:
        error.add_note(
            f"; run by root, serve runs as {owner.name}, the owner of {owner.directory}, who may"
            " not listen on a port below 1024 (`sysctl net.ipv4.ip_unprivileged_port_start`):"
            " choose a port of 1024 or above (a reverse proxy in front of it for 443)"
        )


def _installed_command() -> str:
    """The `healthlog` command beside this Python, by its path: it is installed in a `.venv`,
    on no one's `PATH`, so a bare `healthlog` given to a new owner to copy is `command not
    found`."""
    beside = Path(sys.executable).parent / "healthlog"
    return shlex.quote(os.fspath(beside)) if beside.is_file() else "healthlog"


async def _serve(data: DataDir, config: ServeConfig) -> None:
    import trio

    from transport.serve import StoppedBeforeListening, serve

    async with trio.open_nursery() as nursery:
        try:
            url = await nursery.start(serve, data, config)
        except StoppedBeforeListening:
            return
        _announce(f"healthlog serving on {url} (data in {data.path})")
        with data.open_tokens() as tokens:
            if not tokens.list():
                _announce(
                    f"no client token yet: create one with `{_installed_command()} token add NAME"
                    f" --data {shlex.quote(os.fspath(data.path))}` and send it as"
                    " `Authorization: Bearer TOKEN`"
                )
            reserved = len(tokens.reserved())
        if reserved:
            # Their requests are refused like a mistyped token's: without this line nothing
            # tells why a phone that sent with one before the upgrade gets 401 now. A count,
            # never a name (a name is often a device's); the directory quoted as a shell reads
            # it (SERVE-161).
            log.warning(
                "%d client token(s) named with the reserved prefix %r (which an older healthlog"
                " allowed) authenticate nothing, their requests refused 401: `healthlog token"
                " list --data %s` names them; revoke each and add one under another name",
                reserved,
                RESERVED_PREFIX,
                shlex.quote(os.fspath(data.path)),
            )


def _writable(line: str, stream: TextIO) -> str:
    """``line`` as ``stream`` can write it: a character its encoding refuses written as its
    escape, as stderr writes it. A byte of a path that is not UTF-8 (``donn\\xe9es``) is read
    as a lone surrogate, which a strict UTF-8 stdout (a UTF-8 locale other than C, as systemd
    hands a unit) refused: ``serve`` ended at once, exit 1, with a traceback (CLI-270), and
    ``status`` advising a reindex of that directory printed nothing (CLI-271)."""
    encoding = stream.encoding or "utf-8"
    try:
        line.encode(encoding, stream.errors or "strict")
    except UnicodeEncodeError:
        return line.encode(encoding, "backslashreplace").decode(encoding)
    return line


def _announce(line: str) -> None:
    """One of ``serve``'s own lines on stdout. One that cannot be written (a reader gone, as
    after ``healthlog serve | head -1``; a full disk behind ``>> healthlog.log``) is logged at
    WARNING instead and stdout pointed at /dev/null: the service serves whether or not anyone
    reads it, where the write's error stopped it (exit 3) a second after it began (CLI-92)."""
    try:
        print(_writable(line, sys.stdout), flush=True)
    except OSError as exc:
        _quiet_stdout()
        log.warning(
            "stdout cannot be written (%s), serving on: %s",
            errno.errorcode.get(exc.errno or 0, type(exc).__name__),
            line,
        )


def cmd_token(args: argparse.Namespace, data: DataDir) -> int:
    if args.action != "add" and not data.tokens_path.exists():
        # No token was ever added here (a directory `import` began): none to list or revoke,
        # and no tokens.sqlite made for want of one (CLI-110).
        if args.action == "revoke":
            raise CliError(f"no token named {args.name!r}")
        return 0
    with data.open_tokens(reading=args.action == "list") as tokens:
        try:
            if args.action == "add":
                _show_token(tokens, args.name, tokens.add(args.name))
            elif args.action == "revoke":
                tokens.revoke(args.name)
                print(f"revoked {args.name}", file=sys.stderr)
            else:
                with _writing_stdout():
                    for info in tokens.list():
                        print(info.name)
                # On stderr, so that stdout stays the names alone (CLI-156).
                for name in tokens.reserved():
                    print(
                        f"healthlog: token {name!r} authenticates nothing: names beginning"
                        f" {RESERVED_PREFIX!r} are reserved (an older healthlog allowed them);"
                        f" revoke it (`healthlog token revoke {shlex.quote(name)}`) and add"
                        " one under another name",
                        file=sys.stderr,
                    )
        except TokenError as exc:
            raise CliError(str(exc)) from None
    return 0


def _show_token(tokens: Tokens, name: str, token: str) -> None:
    """Print a new token, the only time it is shown; one that cannot be printed (a full disk
    behind a redirect, a reader gone) is revoked, or it would be kept with nobody knowing it
    and its name taken."""
    try:
        with _writing_stdout():
            print(token)
    except BrokenPipeError:
        _quiet_stdout()
        why = "its reader is gone"
    except OutputFailed as exc:
        why = str(exc)
    else:
        return
    tokens.revoke(name)
    raise OutputFailed(f"token {name!r} not added, since it could not be shown: {why}")


@contextlib.contextmanager
def _writing_stdout() -> Iterator[None]:
    """Writes to stdout, flushed at the end; one that fails, but for a reader gone (which
    :func:`main` and ``verify`` handle), raises :class:`OutputFailed`, as a stdout the command
    was started without (``>&-``), where Python's ``print`` writes nothing and says nothing."""
    if sys.stdout is None:
        raise OutputFailed("cannot write to stdout: it is closed")
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _quiet_stdout()
        raise OutputFailed(f"cannot write to stdout: {exc.strerror or exc}") from None


def _follow_token(args: argparse.Namespace) -> str:
    """``--token``, else ``HEALTHLOG_TOKEN`` (CLI-127): an argument is in the process list,
    which every account of the machine may read (``ps aux``), the environment is its user's."""
    token = args.token if args.token is not None else os.environ.get("HEALTHLOG_TOKEN")
    if token is None:
        raise CliError(
            "follow needs the service's token: set HEALTHLOG_TOKEN (the process list, which"
            " every account of this machine may read, shows --token)"
        )
    return token


def cmd_follow(args: argparse.Namespace, data: DataDir) -> int:
    from transport.follow import FollowError, check_subscriber, check_token, follow

    try:
        token = _follow_token(args)
        # Before the replica is made: a token that cannot be sent, or a subscriber name the
        # service refuses, never gets anywhere.
        check_token(token)
        check_subscriber(args.subscriber)
        _check_directory(args.replica)
        _check_replica_file(args.replica / REPLICA_FILE)
        with Replica(args.replica) as replica:
            following = functools.partial(
                follow,
                args.url,
                token,
                replica,
                subscriber=args.subscriber,
                until_caught_up=args.until_caught_up,
                accept_key=args.accept_key,
            )
            _run(_until_stopped, following)
            cursor = replica.binding().cursor
    except FollowError as exc:
        raise CliError(str(exc)) from None
    except NotAReplica as exc:
        raise CliError(f"{args.replica / REPLICA_FILE} {exc}") from None
    except ReplicaInUse as exc:
        # Met opening a replica of an older schema beside its follower (STREAM-202): exit 2,
        # as when met by the follower itself.
        raise CliError(str(exc)) from None
    # Dropped when stderr cannot be written: a terminal that hung up stopped the follower, which
    # exited 3 as if its replica could not be written (CLI-168).
    _tell(f"follow: replica at seq {cursor}")
    return 0


async def _until_stopped(run: Callable[[], Awaitable[None]]) -> None:
    """``run``, until it returns or SIGINT, SIGTERM or SIGHUP (SIGINT and a hangup unless
    ignored as the command started: ``stopping_signals``) stops it (cancelled: a follower's
    replica is consistent after every event, and it acknowledges what it holds as it stops).
    What ``run`` raises is raised as it is, not in a group.

    The signal receiver is opened with them ignored, which it puts back as it closes, and they
    stay ignored once a signal has stopped ``run``: the same stop once more as the follower
    sends its last ACK (a terminal's hangup signals it twice, ``timeout`` the command and then
    its group) found the default action back and killed it, exit -1 and the ACK unsent
    (CLI-196). The stop waits for the last ACK ``LAST_ACK_S`` at most (and for a batch being
    written to the replica), so there is no second Ctrl-C to heed. Otherwise the handlers from
    before are put back."""
    import trio

    failure: Exception | None = None
    stopping = stopping_signals()
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in stopping}
    stopped = False
    # Watched from here, not from a task of its own: one that came before that task ran, while
    # ``run`` had not yet yielded, was dropped (CLI-281).
    with trio.open_signal_receiver(*stopping) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signals() -> None:
                nonlocal stopped
                async for _ in signals:
                    stopped = True
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signals)
            try:
                await run()
            except Exception as exc:
                failure = exc
            nursery.cancel_scope.cancel()
    if not stopped:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failure is not None:
        raise failure


def cmd_chaos(args: argparse.Namespace, data: DataDir) -> int:
    from transport.chaos import run_chaos

    logging.getLogger("healthlog").setLevel(logging.ERROR)
    # Stopped by a signal, the harness stops the services it started first (CLI-169).
    summary = _run_terminable(run_chaos, args.seed, args.runs, args.minutes, None)
    # The exit status says whether every invariant held, whether or not the table was read
    # (CLI-170), as verify's says whether objects differ.
    try:
        with _writing_stdout():
            print(summary.table())
    except BrokenPipeError:
        _quiet_stdout()
    return 0 if summary.ok else 1


def cmd_export(args: argparse.Namespace, data: DataDir) -> int:
    _check_metric(args.metric, "export")
    if (
        args.start_from is not None
        and args.start_to is not None
        and args.start_from >= args.start_to
    ):
        # Arguments swapped: nothing starts in [from, to), and it printed nothing and exited 0,
        # as if there were no points in the range (CLI-137).
        raise CliError(
            f"--from {format_instant(args.start_from)} is not earlier than --to"
            f" {format_instant(args.start_to)}: export writes the points that start in"
            " [from, to)"
        )
    if args.replica is not None and not (args.replica / REPLICA_FILE).is_file():
        raise CliError(f"no follow replica in {args.replica}")
    if args.replica is None:
        _store_to_read(data, "export")
    try:
        source: Store | ReplicaReader = (
            ReplicaReader(args.replica)
            if args.replica is not None
            else data.open_store(reading=True)
        )
    except NotAReplica as exc:
        raise CliError(f"no follow replica in {args.replica}: {REPLICA_FILE} {exc}") from None
    with source, source.one_state():
        stored = source.iter_objects(
            metric=args.metric,
            layer=args.layer,
            hour_from=None if args.start_from is None else hour_of(args.start_from),
            hour_to=None if args.start_to is None else hour_of(args.start_to),
        )
        with _writing_stdout():
            out = sys.stdout.buffer
            lines = export_lines(
                stored,
                start_from=args.start_from,
                start_to=args.start_to,
                fmt=args.format,
                remedy=STORE_REMEDY if args.replica is None else REPLICA_REMEDY,
            )
            for chunk in chunked(lines):
                out.write(chunk)
        if (args.metric or args.layer) and not _holds_any(
            source, metric=args.metric, layer=args.layer
        ):
            # A metric mistyped printed nothing and exited 0, as a range without points does
            # (CLI-138).
            _tell(
                f"export: no object of {_scope(args.metric, args.layer)} is stored: names are"
                " as `healthlog export` prints them (heart_rate, minutes)"
            )
    return 0


def _rebuild_fault_plan() -> None:
    """Load a fault plan from the environment, as ``serve`` does: a rebuild's fault points
    (``rebuild.scratch``) are hit in this process, not in a fold worker, and a plan given to
    `reindex` or `verify` held nothing (CLI-194)."""
    faultplan.load_environment()


WAIT_SAID_S = 1.0
"""How long `reindex` waits for the store's write lock before it says so: a lease renewal or
an ACK holds it for milliseconds, the service's fold of a large delivery for seconds."""


def cmd_reindex(args: argparse.Namespace, data: DataDir) -> int:
    _journal_not_lost(data)
    _rebuild_fault_plan()
    progress = Progress("reindex")
    said = False

    def waiting(seconds: float) -> None:
        # It exited 3 `database busy` once SQLite's busy timeout (5 s) had passed (FENCE-30).
        nonlocal said
        progress.check()
        if seconds >= WAIT_SAID_S and not said:
            said = True
            _tell(
                f"reindex: waiting for the write lock of {STORE_FILE}, which another process"
                " holds: the service folding a large delivery (for up to its fold budget), or a"
                " program keeping a write open (close it); Ctrl-C stops"
            )

    with progress.stopping(), data.open_journal() as journal, data.open_store() as store:
        check_before_folding(journal, store)
        try:
            changed = reindex(
                journal, store, reindex_holder(data.path), progress=progress, waiting=waiting
            )
        except ReindexRunning as exc:
            # A second reindex took the lease by force, and the first, its rebuild thrown
            # away, exited 3 at its swap (FENCE-31).
            raise CliError(str(exc)) from None
    _tell(f"reindex: done, {changed} objects changed")
    return 0


def _scratch_elsewhere(data: DataDir) -> Path | None:
    """Where ``verify`` rebuilds when this user cannot write the data directory (read-only
    media, a backup user's: CLI-114) or its store (a backup user given the directory's group,
    whose scratch directory the service's user could not remove, were it killed: STORE-84),
    said in one line: the temporary directory (``TMPDIR``); None where it rebuilds beside the
    store as ever."""
    if os.access(data.path, os.W_OK | os.X_OK):
        if os.access(data.store_path, os.W_OK):
            return None
        why = f"user {user_name(os.geteuid())} may not write {data.store_path}"
    else:
        why = (
            mounted_read_only(data.path)
            or f"user {user_name(os.geteuid())} may not write in {data.path}"
        )
    elsewhere = Path(tempfile.gettempdir())
    _tell(
        f"verify: {why}: rebuilding into a scratch directory in {elsewhere} instead, which"
        f" needs room for a second store ({data.store_path.stat().st_size:,} bytes, as"
        f" {STORE_FILE}) until it is done"
    )
    return elsewhere


# What verify says of the deliveries failed for a cause of the machine's (store.GIVEN_UP).
_GIVEN_UP_WHY = {
    OVER_BUDGET: "over their fold's time budget",
    WORKER_DIED: "because their fold worker died",
    OUT_OF_MEMORY: "out of memory",
}


def cmd_verify(args: argparse.Namespace, data: DataDir) -> int:
    _journal_not_lost(data)
    _journal_to_read(data)
    _store_to_read(data, "verify")
    elsewhere = _scratch_elsewhere(data)
    _rebuild_fault_plan()
    progress = Progress("verify")
    # Read as export reads them: opened to write, verify left -wal and -shm files of a user
    # who may not write them beside a stopped service's databases (STORE-84).
    with (
        progress.stopping(),
        data.open_journal(reading=True) as journal,
        data.open_store(reading=True) as store,
    ):
        check_before_folding(journal, store)
        verification = verify_all(journal, store, progress=progress, elsewhere=elsewhere)
        unfolded = counted(journal, store).pending
        given_up = Counter(store.given_up().values())
        advised = store.reindex_advised()
    for reason, why in _GIVEN_UP_WHY.items():
        if given_up[reason]:
            _tell(
                f"verify: {given_up[reason]} deliveries failed {why} and were compared as"
                " failed; `healthlog reindex` folds them"
            )
    if unfolded:
        _tell(
            f"verify: {unfolded} journaled deliveries are not folded yet; only what is folded"
            " was compared"
        )
    _say_outcomes(verification.outcomes, verification.bodies_lost)
    differences = verification.objects
    try:
        with _writing_stdout():
            for diff in differences:
                print(
                    f"{_what_differs(diff)}\t{_one_field(diff.key.metric)}\t{diff.key.layer}"
                    f"\t{format_instant(diff.key.hour)}"
                )
    except BrokenPipeError:
        _quiet_stdout()
    provenance = sum(diff.provenance for diff in differences)
    if provenance:
        _tell(
            f"verify: {provenance} objects (`provenance`) hold the points a rebuild holds but"
            " name another delivery as the one that created them (a backfill folded after a"
            " later delivery); `healthlog reindex` records the rebuild's"
        )
    rebuilt = len(differences) - provenance
    if rebuilt and not verification.bodies_lost:
        # A reindex refuses while bodies are lost (STORE-56), which _say_outcomes says instead.
        _tell(
            f"verify: {rebuilt} objects are not what a rebuild of the journal makes (a"
            " backfill, `import --received-at`, folded after later deliveries; after an"
            " upgrade: folded under a rule that has changed since; otherwise changed outside"
            " healthlog); `healthlog reindex` rebuilds them from the journal"
        )
    if advised:
        # A store holding such sections is advised whether or not its fold lost a record
        # (STORE-127); where nothing differs, this verify has told which.
        nothing = (
            ""
            if differences
            else "; this verify found no object differing: the reindex would change none and"
            " only take this advice away"
        )
        _tell(f"verify: {reindex_advice(advised, data.path)}{nothing}")
    _tell(f"verify: {len(differences)} objects differ")
    return 1 if differences else 0


OUTCOMES_NAMED = 10
"""How many deliveries recorded otherwise than a rebuild records them ``verify`` names."""


def _say_outcomes(outcomes: list[OutcomeDifference], lost: list[int]) -> None:
    """On stderr, the deliveries whose recorded status or reason a rebuild records otherwise
    (an upgrade that changed a rule: a delivery recorded failed that now folds), which the
    object comparison cannot show when they wrote no object; the exit status stays the
    objects'. Those whose bodies the journal lost (``lost``) are told apart: a reindex would
    drop their points and refuses (STORE-56)."""
    for diff in outcomes[:OUTCOMES_NAMED]:
        rebuilt = "with another reason" if diff.rebuilt == diff.live else diff.rebuilt
        _tell(
            f"verify: delivery {diff.delivery_id} is recorded {diff.live}, a rebuild records"
            f" it {rebuilt}"
        )
    others = len(outcomes) - len(lost)
    if others:
        unnamed = len(outcomes) - OUTCOMES_NAMED
        _tell(
            f"verify: {others} deliveries are recorded otherwise than a rebuild records"
            f" them{f' ({unnamed} not named)' if unnamed > 0 else ''}; `healthlog reindex`"
            " records them anew"
        )
    if lost:
        _tell(
            f"verify: {len(lost)} deliveries folded into the store no longer match their"
            f" sha256 in the journal (delivery {', '.join(map(str, lost[:5]))}"
            f"{', ...' if len(lost) > 5 else ''}): the store holds the only copy of their"
            " points, which `healthlog reindex` refuses to drop; restore the journal from a"
            " backup"
        )


# The control characters (C0, DEL, C1) and the line and paragraph separators, which a line
# reader (Python's ``splitlines``) also splits at.
_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))},
    **{code: f"\\u{code:04x}" for code in (0x2028, 0x2029)},
    ord("\n"): "\\n",
    ord("\t"): "\\t",
    ord("\r"): "\\r",
    ord("\\"): "\\\\",
}


def _one_field(name: str) -> str:
    """``name`` (a metric's, as a body sent it) as one field of a tab-separated line: a
    backslash, the control characters and the line separators escaped (``\\n``, ``\\t``,
    ``\\x1b``, ``\\u2028``)."""
    return name.translate(_ESCAPES)


def _what_differs(diff: Difference) -> str:
    if diff.live is None:
        return "missing"
    if diff.rebuilt is None:
        return "extra"
    if diff.corrupt:
        return "corrupt"
    return "provenance" if diff.provenance else "differs"


def cmd_status(args: argparse.Namespace, data: DataDir) -> int:
    statuses = [
        status for status, asked in ((FAILED, args.failed), (PARTIAL, args.partial)) if asked
    ]
    if statuses:
        return _status_list(args, data, statuses)
    if args.limit is not None:
        raise CliError("--limit goes with --failed or --partial")
    _journal_not_lost(data)
    _journal_to_read(data)
    _store_to_read(data, "status")
    public_key = data.public_key()
    # Why nothing folds, when a `serve` running beside found the store unfit: the store's mark
    # said `empty`, its last pass before (SERVE-151).
    unfit = CheckedRecord(data.path).unfit(data.store_path.name)
    with data.open_journal(reading=True) as journal, data.open_store(reading=True) as store:
        check_same_journal(journal, store)
        status = collect_status(journal, store, public_key, stopped_because=unfit)
    with _writing_stdout():
        if args.json:
            sys.stdout.buffer.write(documents.dumps(status) + b"\n")
        else:
            print(_writable(_status_text(status, data.path), sys.stdout))
    free = free_when_full(data.path)
    if status.deliveries.pending and free is not None:
        # The service's folder knows why its last pass stopped (STORE-66), but on a full disk
        # it can record it no more than the folds: the store's mark is an older pass's.
        _tell(
            f"healthlog: the disk is full ({free} bytes free in {data.path}): the"
            f" {status.deliveries.pending} pending deliveries are not folded until there is room,"
            " and why the last pass stopped is that of the last pass the service could record"
            " (its GET /v1/status says why it stopped since); free some space"
        )
    return 0


def _status_text(status: documents.Status, path: Path) -> str:
    d, lag = status.deliveries, status.lag
    pending_text = (
        "nothing pending"
        if lag.oldest_pending_id is None
        else f"oldest pending {lag.oldest_pending_id}, waited {lag.waited_s} s"
    )
    stopped_text = "no pass yet" if lag.stopped_because == NO_PASS_YET else lag.stopped_because
    lines = [
        f"journal     {status.journal.deliveries} deliveries, {status.journal.bytes} bytes",
        f"deliveries  pending {d.pending}, parsed {d.parsed}, partial {d.partial},"
        f" failed {d.failed}",
        f"lag         {pending_text}, last pass stopped: {stopped_text}",
        f"lease       {'free' if status.lease.holder is None else 'holder ' + status.lease.holder},"
        f" epoch {status.lease.epoch}",
        f"first pass  {'completed' if status.first_pass_completed else 'not completed'}",
        f"stream      {status.stream.id} of instance {status.stream.instance},"
        f" head {status.stream.head}, replayable after {status.stream.oldest_cursor}",
        f"snapshot key (Ed25519) {status.stream.public_key}",
        *(
            f"subscriber  {name} acked {seq}, last ACK {status.subscribers_last_ack[name]}"
            for name, seq in status.subscribers.items()
        ),
    ]
    if status.reindex_advised:
        lines.append(f"advice      {reindex_advice(status.reindex_advised, path)}")
    return "\n".join(lines)


def _status_list(args: argparse.Namespace, data: DataDir, statuses: list[str]) -> int:
    """``status --failed`` / ``--partial``: the newest of those deliveries, with their reasons."""
    limit = DEFAULT_LISTED if args.limit is None else args.limit
    _store_to_read(data, "status")
    with data.open_store(reading=True) as store:
        listed = list_deliveries(store, statuses, limit)
    with _writing_stdout():
        if args.json:
            sys.stdout.buffer.write(documents.dumps(listed) + b"\n")
        else:
            _print_listed(listed)
    return 0


def _print_listed(listed: documents.DeliveryList) -> None:
    which = " or ".join(listed.statuses)
    rows = listed.deliveries
    if not rows:
        print(f"no {which} deliveries")
        return
    if len(rows) < listed.total:
        print(
            f"the newest {len(rows)} of {listed.total} {which} deliveries"
            f" (--limit N for more, up to {MAX_LISTED}):"
        )
    else:
        print(
            f"{listed.total} {which} {'delivery' if listed.total == 1 else 'deliveries'},"
            " newest first:"
        )
    table = [("delivery", "received_at", "status", "reason")] + [
        (str(row.delivery_id), row.received_at, row.status, row.reason or "-") for row in rows
    ]
    widths = [max(len(line[column]) for line in table) for column in range(3)]
    for delivery, received_at, status, reason in table:
        print(
            f"{delivery:>{widths[0]}}  {received_at:<{widths[1]}}  {status:<{widths[2]}}  {reason}"
        )


# -- parser ---------------------------------------------------------------------------------

Command = Callable[[argparse.Namespace, DataDir], int]

DATA_HELP = "data directory (default: $HEALTHLOG_DATA, else ./var)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthlog", description="A self-hosted home for Apple Health data."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str,
        func: Command,
        help_text: str,
        *,
        needs_data: bool = False,
        makes_data: bool = False,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--data",
            type=Path,
            default=None,
            help=DATA_HELP,
        )
        p.set_defaults(func=func, needs_data=needs_data, makes_data=makes_data)
        return p

    p = command(
        "import", cmd_import, "journal files as deliveries, then fold them", makes_data=True
    )
    p.add_argument("--automation-id", default=None)
    p.add_argument("--aggregation", type=_layer, default=None, help="the automation's layer")
    p.add_argument("--received-at", type=_past_instant, default=None, help="historical stamp")
    p.add_argument("--no-wait", action="store_true", help="do not wait for the fold")
    p.add_argument("files", nargs="+", metavar="FILE")

    p = command(
        "seal",
        cmd_seal,
        "mark what ended by an instant final (late writes warn)",
        needs_data=True,
    )
    p.add_argument(
        "--before",
        type=_ended_instant,
        required=True,
        help="seal what ends by then (a day as 25 h, a month as 31 days 1 h)",
    )
    p.add_argument("--metric", default=None, help="only this metric (or record section)")
    p.add_argument("--layer", type=_stored_layer, default=None, help="only this layer")
    p.add_argument("--no-wait", action="store_true", help="do not wait for the fold")

    p = command("export", cmd_export, "write stored points to stdout", needs_data=True)
    p.add_argument("--metric", action=_Once, default=None)
    p.add_argument("--layer", action=_Once, type=_stored_layer, default=None)
    p.add_argument("--from", action=_Once, dest="start_from", type=_instant, default=None)
    p.add_argument("--to", action=_Once, dest="start_to", type=_instant, default=None)
    p.add_argument("--format", action=_Once, choices=FORMATS, default="jsonl")
    p.add_argument(
        "--replica", action=_Once, type=Path, default=None, help="read a follow replica instead"
    )

    p = command("follow", cmd_follow, "keep a local replica of every object, from the stream")
    p.add_argument("--url", required=True, help="http://host:8787 or ws://host:8787/v1/stream")
    p.add_argument(
        "--token",
        default=None,
        help="the service's token (default: HEALTHLOG_TOKEN, which the process list, every"
        " account's to read, does not show)",
    )
    p.add_argument("--replica", type=Path, required=True, help="replica directory")
    p.add_argument("--subscriber", default=None, help="name under which ACKs are stored")
    p.add_argument("--until-caught-up", action="store_true", help="exit once at the head")
    p.add_argument(
        "--accept-key",
        default=None,
        metavar="KEY",
        help="the server's new snapshot key (healthlog status prints it), pinned in place of"
        " the old one",
    )

    p = command("serve", cmd_serve, "run the service until SIGINT or SIGTERM", makes_data=True)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8787)")
    p.add_argument(
        "--max-body-mib", type=float, default=None, help="body limit (default 256, or env)"
    )
    p.add_argument("--log-format", type=str.lower, choices=LOG_FORMATS, default=None)
    p.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None)

    token = sub.add_parser("token", help="manage client tokens", description="client tokens")
    token.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    token_sub = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_text in (
        ("add", "create a token and print it (only now)"),
        ("list", "list token names, never secrets"),
        ("revoke", "revoke a token"),
    ):
        p = token_sub.add_parser(action, help=help_text, description=help_text)
        if action != "list":
            p.add_argument("name", metavar="NAME")
        # Absent here, the value given after ``token`` (or None) stands.
        p.add_argument("--data", type=Path, default=argparse.SUPPRESS, help=DATA_HELP)
        # Only ``add`` makes a data directory (before ``serve``, say); ``list`` and ``revoke``
        # of a mistyped one say so instead of making it.
        p.set_defaults(func=cmd_token, needs_data=action != "add", makes_data=action == "add")

    p = command("chaos", cmd_chaos, "the fault-injection harness against real serve processes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--runs", type=_at_least_one, default=20)
    p.add_argument("--minutes", type=_duration, default=None, help="stop starting runs after this")

    command("reindex", cmd_reindex, "rebuild the projection from the journal", needs_data=True)
    command(
        "verify",
        cmd_verify,
        "prove the projection equals a rebuild from the journal",
        needs_data=True,
    )

    p = command(
        "status", cmd_status, "journal size, deliveries by status, lag, lease", needs_data=True
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--failed",
        action="store_true",
        help="instead, list the newest failed deliveries (nothing stored) and why",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="instead, list the newest partial deliveries (points or entries rejected) and why",
    )
    p.add_argument(
        "--limit",
        type=_listed,
        default=None,
        metavar="N",
        help=f"with --failed or --partial: list N (default {DEFAULT_LISTED}, at most {MAX_LISTED})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.data is None:
        args.data = default_data_dir()
    # export --replica reads the replica, not the data directory.
    uses_data = (args.needs_data or args.makes_data) and getattr(args, "replica", None) is None
    # The directory the command opens files in: a replica's for `follow` and `export
    # --replica` (CLI-151), the data directory's for the others that open one.
    replica: Path | None = getattr(args, "replica", None)
    opened = Path(args.data) if uses_data else replica
    try:
        # Before the current directory is judged: the owner may not enter root's.
        args.owner = None if opened is None else _as_owner(opened)
    except NotSwitched as exc:
        _tell(f"healthlog: {exc}")
        return 3
    gone = _leave_an_unusable_directory(args)
    if gone is not None:
        _tell(f"healthlog: {gone}")
        return 2
    data = DataDir(args.data)
    func: Command = args.func
    try:
        _check_directory(data.path)
        if uses_data:
            _enterable(data.path)
        if uses_data and args.needs_data and not data.holds_data():
            raise CliError(f"no healthlog data in {data.path} (give --data DIR)")
        if func is not cmd_serve:
            # serve's own flags come first: it sets its logging up itself.
            _log_as_configured(data if uses_data else None)
            _say_owner(args.owner)
        if args.makes_data and not data.path.exists():
            # A mistyped --data would otherwise start a data directory nobody looks in.
            _tell(f"healthlog: no data directory at {data.path}: making a new one")
        return func(args, data)
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except BaseException as exc:
        stopped = _stopped_by_signal(exc)
        if stopped is not None:
            _tell("healthlog: interrupted")
            return stopped
        error = _user_error(exc)
        if error is None:
            raise
        notes = "".join(getattr(error, "__notes__", ()))
        _tell(f"healthlog: {_naming_its_file(error, data)}{notes}")
        return 2 if isinstance(error, CliError) else 3


RUN_BY_ROOT_ENV = "HEALTHLOG_RUN_BY_ROOT"
"""Set by a command run by root, to the data directory's absolute path, for the process it
starts anew as that directory's owner (:func:`_as_owner`), which says so; no other meaning,
and removed at once."""


def _as_owner(path: Path) -> Owner | None:
    """Start this command anew as the account that owns the data directory at ``path`` when it
    runs as root, unless that is root (CLI-146): the user, that user's primary group (the
    directory's group where the user has no account here, never root's: CLI-158), no
    supplementary group. In the process so started, the Owner it runs as; else None (not root,
    or the directory root's; one not made yet is judged by the nearest directory that is there,
    CLI-160).

    That account may write in the directory: it can plant a link at any name a command opens
    there, racing the command, and root opens what the link names with root's rights (CLI-128,
    STORE-98 and SERVE-88 each closed one such name; CLI-147 is one more). As that account, the
    command opens nothing the account could not open itself, and what it makes there is that
    account's, as when the service makes it. Started anew rather than carried on: this
    interpreter found its modules with root's rights, and those it imports later (trio, for
    `import`, `seal` and `serve`) may lie where only root may read (a Python under /root). A
    :class:`NotSwitched` where the system refuses (a container without CAP_SETUID) or that
    user may not run this Python: running on as root is what it avoids. What it says names the
    directory by its absolute path, given relative or not."""
    started_by_root = os.environ.pop(RUN_BY_ROOT_ENV, None)
    if started_by_root is not None and os.geteuid() != 0:
        return _account(os.geteuid(), os.getegid(), Path(started_by_root))
    if os.geteuid() != 0:
        return None
    try:
        absolute = path.absolute()
    except FileNotFoundError:
        # The current directory was deleted: a relative path names nothing, which the command
        # says next (CLI-119).
        return None
    # A directory not made yet is judged by the nearest one that is there, in which it is made:
    # that one's owner may make it first, racing the command, and plant links in it (CLI-160).
    for there in (path, *absolute.parents):
        try:
            stats = there.stat()
        except FileNotFoundError:
            continue
        except OSError:
            return None
        break
    else:
        return None
    if stats.st_uid == 0:
        return None
    path = absolute
    owner = _account(stats.st_uid, stats.st_gid, path)
    if owner.gid == 0 and not _has_account(owner.uid):
        # The directory's group stands in for a uid without an account, and group root is
        # not that account's to have: a link it planted there would have the command write any
        # file group root may write (CLI-158).
        raise NotSwitched(_no_group_of_its_own(owner.uid, path, there.absolute()))
    try:
        os.setgroups([])
        os.setgid(owner.gid)
        os.setuid(owner.uid)
    except OSError as exc:
        raise NotSwitched(
            f"{path} is {owner.name}'s, and a command run by root on it runs as that user, which"
            f" this process may not become ({exc.strerror}); run it as {owner.name} (`sudo -u"
            f" {owner.name} healthlog ...`, or `setpriv --reuid={owner.uid} --regid={owner.gid}"
            " --clear-groups healthlog ...`); nothing was opened"
        ) from None
    environment = {name: value for name, value in os.environ.items() if _carried(name)}
    environment[RUN_BY_ROOT_ENV] = os.fspath(path)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    except OSError as exc:
        # A .venv made from root's pyenv Python lies where every user may read but links to
        # /root: the link's end is what to look at, and the system's Python what to make it of.
        leads_to = os.path.realpath(sys.executable)
        link = "" if leads_to == sys.executable else f", a link to {leads_to}"
        raise NotSwitched(
            f"{path} is {owner.name}'s, and a command run by root on it runs as that user, who"
            f" may not run {sys.executable}{link} ({exc.strerror}): install healthlog where"
            " every user may read it (the README's /opt/healthlog), its .venv made from a Python"
            " every user may run (`/usr/bin/python3 -m venv .venv`, then install), as the"
            " service's is; nothing was opened"
        ) from None


def _account(uid: int, gid: int, path: Path) -> Owner:
    """The account ``uid``: its name and primary group, else the number and ``gid``."""
    try:
        account = pwd.getpwuid(uid)
    except KeyError:
        return Owner(str(uid), uid, gid, path)
    return Owner(account.pw_name, uid, account.pw_gid, path)


CARRIED_ENV = (
    "PATH",
    "TERM",
    "TZ",
    "LANG",
    "LANGUAGE",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "TMPDIR",
    "TEMP",
    "TMP",
)
"""Variables of root's environment a command started anew as the data directory's owner keeps
(:func:`_as_owner`), besides ``HEALTHLOG_*``, ``LC_*``, ``PYTHON*`` and the proxies that
``follow`` goes through (CLI-159); the temporary directory among them, where ``verify``
rebuilds when it may not write the data directory (CLI-163)."""
_CARRIED_PREFIXES = ("HEALTHLOG_", "LC_", "PYTHON")


def _carried(name: str) -> bool:
    """Whether root's variable ``name`` is carried into the process started anew as the owner:
    that account may read the whole environment of it (/proc/PID/environ), and root's holds
    what a root shell exports, credentials among them (CLI-159)."""
    return (
        name in CARRIED_ENV
        or name.startswith(_CARRIED_PREFIXES)
        or name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
    )


def _no_group_of_its_own(uid: int, path: Path, there: Path) -> str:
    """Why a command run by root on ``path``, of which ``there`` is the nearest directory that
    is there, does not run as ``uid``, which has no account here, with group root (CLI-158).
    Where ``path`` is not made yet, the ``chgrp`` is of ``there`` alone: ``chgrp -R`` of a path
    not made fails, and ``there`` may hold other programs' files (CLI-164)."""
    setpriv = f"`setpriv --reuid={uid} --regid=GID --clear-groups healthlog ...`"
    if there == path:
        return (
            f"{path} is uid {uid}'s, which has no account here, and group root's: a command run"
            " by root on it runs as that uid, and would take group root with it; give the"
            f" directory a group of its own (`chgrp -R GROUP {path}`), or run it as that uid"
            f" ({setpriv}); nothing was opened"
        )
    return (
        f"{there} is uid {uid}'s, which has no account here, and group root's: a command run by"
        f" root on {path} runs as that uid, and would take group root with it; give that"
        f" directory a group of its own (`chgrp GROUP {there}`), or run it as that uid"
        f" ({setpriv}); nothing was opened"
    )


def _has_account(uid: int) -> bool:
    """Whether the passwd database names the user ``uid``."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _say_owner(owner: Owner | None) -> None:
    """The INFO line of a command that runs as the data directory's owner (CLI-146)."""
    if owner is not None:
        log.info(
            "running as user %s (uid %d, gid %d), the owner of %s, not as root: what it makes"
            " there is that user's, and it opens nothing there with root's rights",
            owner.name,
            owner.uid,
            owner.gid,
            owner.directory,
        )


def _journal_not_lost(data: DataDir) -> None:
    """Refuse (StorageError) a data directory holding ``store.sqlite`` but no
    ``journal.sqlite`` to a command that opens the journal (CLI-111): it would make an empty
    one, then refuse the store as folded from another journal and tell the user to move the
    store away, whose points were then nowhere else. A store that has folded nothing yet (a
    process holding its lease before anything was journaled) is no loss: the journal is made."""
    if data.journal_path.exists() or not data.store_path.exists():
        return
    with data.open_store(create=False, reading=True) as store:
        folded = store.checkpoint()[1]
    if folded is not None:
        raise StorageError(
            f"{data.path} holds {STORE_FILE} but no {JOURNAL_FILE}, the deliveries it was folded"
            f" from (moved away, deleted, or on a disk not mounted?): put {JOURNAL_FILE} back,"
            " from a backup if need be, and run the command again; nothing was changed"
        )


def _journal_to_read(data: DataDir) -> None:
    """Refuse (CliError) to a command that reads the journal (``status``, ``verify``) a data
    directory holding a ``store.sqlite`` that folded nothing (else :func:`_journal_not_lost`
    refused it) but no ``journal.sqlite``: reading would begin an empty journal (CLI-117)."""
    if data.store_path.exists() and not data.journal_path.exists():
        raise CliError(
            f"nothing journaled in {data.path} yet (no {JOURNAL_FILE}, and its {STORE_FILE}"
            " has folded nothing): `serve` or `import` begins it"
        )


def _store_to_read(data: DataDir, command: str) -> None:
    """Refuse a command that reads ``store.sqlite`` where there is none (CLI-110), rather than
    make an empty one and read it: a store deleted to be rebuilt (StorageError) is said with
    what rebuilds it, a directory where nothing was journaled yet (CliError: a directory
    `token add` began, or a mistyped ``--data`` holding another of healthlog's files) so."""
    if data.store_path.exists():
        return
    if data.journal_path.exists():
        raise StorageError(
            f"no {STORE_FILE} in {data.path}: `healthlog reindex` rebuilds it from"
            f" {JOURNAL_FILE} (so does `serve` as it starts), and `{command}` reads it then;"
            " nothing was changed"
        )
    raise CliError(
        f"nothing journaled in {data.path} yet (no {JOURNAL_FILE}, no {STORE_FILE}):"
        " `serve` or `import` begins them"
    )


def _leave_an_unusable_directory(args: argparse.Namespace) -> str | None:
    """Work from ``/`` when the current directory is one this user may not enter (CLI-118) or
    is gone (CLI-119), the paths given made absolute first; the error line where a path is
    relative to a directory that is gone. A fold worker is a new process that multiprocessing
    starts in this one's directory: from one this user may not enter (``sudo -u healthlog
    healthlog import ...`` in an admin's home, mode 0700) each worker died on the way and the
    delivery was recorded ``failed``; from a deleted one none could start, the folding actor
    crashed every 30 s and ``import`` waited for good. A relative path in such a directory
    names nothing this process may read either way, and made absolute it still fails alike."""
    try:
        here = os.getcwd()
    except FileNotFoundError:
        here = None
    if here is not None and os.access(here, os.X_OK):
        return None
    names = ["data"] + [name for name in ("files", "replica") if getattr(args, name, None)]
    for name in names:
        given = getattr(args, name)
        paths = given if isinstance(given, list) else [given]
        if here is None and not all(os.path.isabs(path) for path in paths):
            return (
                "the current directory was deleted, and a relative path would be read from"
                " it: run the command from another directory, or give absolute paths"
            )
        absolute = [Path(os.path.abspath(path)) for path in paths]
        setattr(args, name, absolute if isinstance(given, list) else absolute[0])
    os.chdir("/")
    return None


def _enterable(path: Path) -> None:
    """Refuse (StorageError) a data directory this process's user may not enter (CLI-122), in
    one line naming it, its owner and mode, and what to do: the README's ``chmod 700`` keeps
    ``/srv/healthlog`` to the service's user, and another user's ``healthlog status`` there
    ended in ``[Errno 13] Permission denied: '/srv/healthlog/journal.sqlite'`` (or
    ``healthlog.toml``), which said none of it."""
    if not path.is_dir() or os.access(path, os.X_OK):
        return
    stats = path.stat()
    owner = user_name(stats.st_uid)
    raise StorageError(
        f"user {user_name(os.geteuid())} may not enter {path} (it is {owner}'s, mode"
        f" {stat.S_IMODE(stats.st_mode):04o}); run every healthlog command on {path} as the"
        f" user it belongs to (`sudo -u {owner} healthlog ...`)"
    )


def _check_directory(path: Path) -> None:
    """Refuse (CliError) a path to work in that is a file, or a symbolic link to nothing (a
    disk not mounted, say: say where it points rather than make a directory there)."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{path} is not a directory")
    if path.is_symlink() and not path.exists():
        raise CliError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist")


def _check_replica_file(path: Path) -> None:
    """Refuse (CliError) a replica file that is a symbolic link to nothing (one to a disk not
    mounted, say, or planted in a directory others may write in: STREAM-134): SQLite would make
    a new replica where it points, following the whole stream again there."""
    if path.is_symlink() and not path.exists():
        raise CliError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist")


def _log_as_configured(data: DataDir | None) -> None:
    """Log as ``HEALTHLOG_LOG_FORMAT`` and ``HEALTHLOG_LOG_LEVEL`` say, else as the ``[serve]``
    table of the data directory's ``healthlog.toml`` (``data``, None for a command without
    one) does, else in ``kv`` at WARNING; the fold workers of ``import`` and ``seal`` log alike."""
    try:
        config = load_log_config(None if data is None else data.config_path)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    setup_logging(config.log_format, config.log_level)


def _naming_its_file(error: Exception, data: DataDir) -> str:
    """``error`` for its one line: a storage error met once its file was open says which of the
    data directory's files it was (one met opening it names it already), and a write SQLite
    refused for want of permission why, as an opening does (CLI-100)."""
    text = str(error)
    if isinstance(error, StorageError) and error.file and error.file not in text:
        path = data.path / error.file
        cause = not_permitted(path) if write_refused(error) and path.exists() else ""
        return f"{text}{cause} ({error.file})"
    return text


def _quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so that nothing written later (the
    interpreter's flush at exit) fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _stopped_by_signal(exc: BaseException) -> int | None:
    """The exit status of a command that ``exc`` says was stopped by a signal: Ctrl-C
    (SIGINT, also from inside a trio nursery), SIGINT, SIGTERM or SIGHUP noted by
    :class:`Progress`, or SIGTERM or SIGHUP to ``import``, ``seal`` or ``chaos``
    (:func:`_run_terminable`); None for any other exception."""
    if isinstance(exc, Stopped):
        return 128 + exc.signum
    if isinstance(exc, BaseExceptionGroup):
        stopped = exc.split(Stopped)[0]
        if stopped is not None:
            return _stopped_by_signal(stopped.exceptions[0])
        return INTERRUPTED if exc.split(KeyboardInterrupt)[0] is not None else None
    return INTERRUPTED if isinstance(exc, KeyboardInterrupt) else None


def _user_error(exc: BaseException) -> Exception | None:
    """The error to tell the user in one line, also from inside a trio nursery's group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(
        exc,
        CliError | StorageError | RebuildError | OSError | ObjectCorrupt | OutputFailed | Unfolded,
    ):
        return exc
    return None


if __name__ == "__main__":
    sys.exit(main())
