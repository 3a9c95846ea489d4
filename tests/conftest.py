"""Shared fixtures: the ``healthlog`` command line, as a real process or in-process.

Both ``run_cli`` (a subprocess) and ``cli`` (``healthlog.cli.main`` with captured output) take
the arguments after ``healthlog`` and return a :class:`CliRun`, so a test can use either.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import hypothesis
import pytest
from _bodies import NOW, TTL

from healthlog.cli import main
from healthlog.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal
from healthlog.storage.store import Store

# Under HEALTHLOG_NO_SKIPS (CI) a test that would be skipped fails, naming what it lacked.
pytest_plugins = ["_no_skips"]

PROCESS_TIMEOUT_S = 60

STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Property tests check what is computed, not how fast: on a loaded machine one example can take
# longer than hypothesis's default 200 ms deadline without anything being wrong.
hypothesis.settings.register_profile("healthlog", deadline=None)
hypothesis.settings.load_profile("healthlog")

# A suite started as a script's background job (a CI runner's `cmd &`) begins with SIGINT
# ignored, and every process it starts would inherit that; a service started so keeps an
# ignored SIGINT ignored (RUN-175), so the tests that stop one with SIGINT, as Ctrl-C at a
# terminal does, would wait for nothing. The suite takes a terminal's SIGINT: its children start
# with the default action, as from a shell's prompt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _stopping_signals_as_the_suite_had_them() -> Iterator[None]:
    """Each test starts with the suite's handling of the stopping signals: a command run
    in-process (``cli``) that a signal stopped, or a ``serve`` that stopped cleanly, leaves them
    ignored on its way out (CLI-194), as its process is then ending; the services and followers
    that later tests start would inherit that, and keep an ignored SIGINT ignored (RUN-175)."""
    saved = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    yield
    for signum, handler in saved.items():
        if handler is not None:
            signal.signal(signum, handler)


@attrs.frozen
class CliRun:
    """Exit code, stdout (bytes, as written) and stderr (text) of one command."""

    code: int
    out: bytes
    err: str

    def lines(self) -> list[bytes]:
        return self.out.splitlines(keepends=True)

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines()]


class Cli(Protocol):
    def __call__(self, *args: str | os.PathLike[str]) -> CliRun: ...


Outcomes = Callable[[Path], dict[int, str]]


class RunCli(Protocol):
    def __call__(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> CliRun: ...


@pytest.fixture
def run_cli() -> RunCli:
    """Run ``python -m healthlog.cli ARGS`` as a real process, in ``cwd`` if given.

    The child gets this environment without ``HEALTHLOG_DATA``, plus ``env``.
    """

    def run(
        *args: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> CliRun:
        child_env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        child_env.update(env or {})
        proc = subprocess.run(
            [sys.executable, "-m", "healthlog.cli", *(os.fspath(a) for a in args)],
            capture_output=True,
            env=child_env,
            cwd=cwd,
            timeout=PROCESS_TIMEOUT_S,
            check=False,
        )
        return CliRun(proc.returncode, proc.stdout, proc.stderr.decode())

    return run


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """Put back the root logger's handlers and level and the log settings of the environment,
    which ``main`` sets up as a command does (its handler writes to this test's captured
    stderr, and the variables would reach every later test's subprocesses)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    environ = {name: os.environ.get(name) for name in (LOG_FORMAT_ENV, LOG_LEVEL_ENV)}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, value in environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def cli(capsysbinary: pytest.CaptureFixture[bytes]) -> Cli:
    """Run ``healthlog.cli.main(ARGS)`` in this process; argparse exits become exit codes."""

    def run(*args: str | os.PathLike[str]) -> CliRun:
        capsysbinary.readouterr()
        with logging_kept():
            try:
                code = main([os.fspath(a) for a in args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsysbinary.readouterr()
        return CliRun(code, out, err.decode())

    return run


@pytest.fixture
def outcomes() -> Outcomes:
    """Delivery id -> fold status (``pending`` when not folded yet), in journal order."""

    def read(data: Path) -> dict[int, str]:
        directory = DataDir(data)
        with directory.open_journal() as journal, directory.open_store() as store:
            result = {}
            for meta in journal.iter_order():
                row = store.outcome(meta.id)
                result[meta.id] = "pending" if row is None else row.status
            return result

    return read


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    """A journal file in the test's directory."""
    with Journal(tmp_path / "journal.sqlite") as journal:
        yield journal


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A projection file in the test's directory."""
    with Store(tmp_path / "store.sqlite") as store:
        yield store


@pytest.fixture
def epoch(store: Store) -> int:
    """The fold lease, held by "folder"."""
    held = store.acquire_lease("folder", now=NOW, ttl=TTL)
    assert held is not None
    return held
