"""The command line at its edges: a closed pipe, Ctrl-C, settings out of range, a data
directory that does not exist, timestamps or layers it cannot read, another process holding
the lease, the log settings and storage errors (specs/cli.md, CLI-25 to CLI-40, CLI-46, CLI-48,
CLI-49, CLI-51 to CLI-54, CLI-57, CLI-58). Most commands run as a real process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import grp
import json
import os
import pwd
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import httpx
import pytest
from _bodies import ONE_MOMENT_RECORDS, fold_as_before_merge_35
from _cli_bodies import body, metric, point, write
from _disk import (
    DISK_ERROR,
    KILLED_HOLDER,
    ext4_after_errors,
    files_limited_to,
    in_full_file_system,
    on_remounted_read_only,
    python_for_all,
    reachable_home,
    unwritable,
)
from _runtime_helpers import alive, children_of, lease_row
from _service_helpers import write_minute_body

from healthlog.cli import build_parser
from healthlog.config import load_serve_config
from healthlog.storage import snapshot_files
from healthlog.storage._partition import available_cores
from healthlog.storage.datadir import DataDir
from healthlog.storage.rebuild import PARALLEL_MIN_BYTES
from healthlog.storage.replica import Replica
from healthlog.storage.store import MIGRATIONS as STORE_MIGRATIONS

if TYPE_CHECKING:
    from conftest import Cli, CliRun, RunCli

HR = "heart_rate"
BPM = "count/min"
LIMIT_S = 60.0


def healthlog(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "healthlog.cli", *map(os.fspath, args)]


def one_line_error(err: str, says: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert says in lines[0], err


def differing(run_cli: RunCli, tmp_path: Path) -> Path:
    """A data directory that `verify` finds one object differing in: a point, then a backfill
    of the same point with other content, folded after it though it comes first in journal
    order."""
    data = tmp_path / "data"
    at = "2024-02-06 07:00:00 -0800"
    live = write(tmp_path / "live.json", body(metric(HR, BPM, point(at, qty=1.5, source="a"))))
    backfill = write(
        tmp_path / "backfill.json", body(metric(HR, BPM, point(at, qty=99.5, source="b")))
    )
    args = ("import", "--aggregation", "minutes", "--data", data)
    assert run_cli(*args, live).code == 0
    assert run_cli(*args, "--received-at", "2024-01-01T00:00:00Z", backfill).code == 0
    return data


def test_verify_with_differences_exits_1_when_its_reader_goes_cli_25(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-25: `verify` whose stdout reader closed before the differences are printed still
    exits 1 (objects differ), with no traceback."""
    data = differing(run_cli, tmp_path)
    assert run_cli("verify", "--data", data).code == 1

    read_end, write_end = os.pipe()
    os.close(read_end)
    with subprocess.Popen(
        healthlog("verify", "--data", data), stdout=write_end, stderr=subprocess.PIPE
    ) as verify:
        os.close(write_end)
        _, err = verify.communicate(timeout=LIMIT_S)
    assert verify.returncode == 1
    assert "Traceback" not in err.decode()
    assert "verify: 1 objects differ" in err.decode()


def signalled_after(
    process: subprocess.Popen[bytes], signum: int, enough: Callable[[list[str]], bool]
) -> tuple[list[str], str]:
    """Read ``process``'s stderr line by line until what it said is ``enough``, then send it
    ``signum`` and wait for it to end: the lines read, and the rest of its stderr. It is killed
    if that fails.

    The pipe is read with ``os.read`` into a buffer of this function's own: the file object's
    ``readline`` buffers whatever one read brings, and two lines written together (as a loaded
    machine schedules them) left the second in that buffer, where ``select`` does not see it,
    so the wait for it ran out."""
    assert process.stderr is not None
    fd = process.stderr.fileno()
    pending = bytearray()
    try:
        deadline = time.monotonic() + LIMIT_S
        said: list[str] = []
        while not said or not enough(said):
            while b"\n" not in pending:
                left = deadline - time.monotonic()
                assert left > 0, said
                assert select.select([fd], [], [], left)[0], said
                chunk = os.read(fd, 65536)
                assert chunk, f"stderr ended after {said}"
                pending += chunk
            line, _, rest = bytes(pending).partition(b"\n")
            pending[:] = rest
            said.append(line.decode())
        process.send_signal(signum)
        _, rest = process.communicate(timeout=LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
    return said, (bytes(pending) + rest).decode()


# A log record as a command other than ``serve`` writes it to stderr.
LOG_RECORD = re.compile(r"time=\S+ level=")


@pytest.mark.parametrize("command", ["import", "seal"])
def test_ctrl_c_stops_a_waiting_import_with_130_and_keeps_what_it_journaled_cli_26(
    tmp_path: Path, command: str
) -> None:
    """CLI-26, CLI-46: while another process holds the fold lease, `import` (or `seal`) says
    after the line that names the journaled delivery that it waits for the running service's
    next pass; Ctrl-C (SIGINT) then: exit 130, one line saying so (after `import`'s line that
    the delivery stays journaled, CLI-186), and no traceback; the delivery stays journaled."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    args, journaled = {
        "import": (["--aggregation", "minutes", file], f"journaled {file} as delivery 1"),
        "seal": (
            ["--before", "2024-02-06T00:00:00Z"],
            "journaled the seal of what ends by 2024-02-06T00:00:00Z as delivery 1",
        ),
    }[command]
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease(
            "serve:elsewhere:1:aa", now=time.time_ns() // 1000, ttl=3600 * 10**6
        )
        assert epoch is not None
    # SIGINT as a terminal delivers it, even when the suite runs with it ignored (a shell's
    # background job), which the command would inherit; killed if the test fails.
    with subprocess.Popen(
        healthlog(command, "--data", data, *args),
        stderr=subprocess.PIPE,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    ) as importing:
        said, err = signalled_after(
            importing, signal.SIGINT, lambda said: said[-1].startswith(f"{command}: waiting")
        )
    assert importing.returncode == 130
    # The command's own lines; a log record (a busy store on a loaded machine) is not one.
    lines = [line for line in said + err.splitlines() if not LOG_RECORD.match(line)]
    assert "Traceback" not in err
    assert lines[0].startswith(journaled)
    assert lines[1:] == [
        f"{command}: waiting for the running service, which holds the fold lease, to fold at its"
        " next pass (within its wake_period_s, 60 s unless set; --no-wait does not wait)",
        *(
            [
                "import: stopped; the file journaled (delivery 1) stays journaled and folds at"
                " the next pass of serve or of another import: do not import it again, which"
                " would journal it twice"
            ]
            if command == "import"
            else []
        ),
        "healthlog: interrupted",
    ]
    with DataDir(data).open_journal() as journal:
        assert journal.count()[0] == 1


@pytest.mark.parametrize("command", ["import", "seal"])
def test_sigterm_stops_import_and_seal_releasing_the_lease_cli_56(
    tmp_path: Path, command: str
) -> None:
    """CLI-56: SIGTERM to `import` (or `seal`) while it holds the fold lease and its fold
    worker folds (held there by a delay at the fault point `fold.begin`): exit 143, the last
    line `healthlog: interrupted`, no traceback; the lease is released, the delivery stays
    journaled and unfolded, and no fold worker is left."""
    data = DataDir(tmp_path / "data")
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    args = {
        "import": ["--aggregation", "minutes", file],
        "seal": ["--before", "2024-02-06T00:00:00Z"],
    }[command]
    data.path.mkdir()
    data.open_journal().close()
    plan = {"fold.begin": {"hits": [1], "do": "delay", "seconds": 60}}
    env = {**os.environ, "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    workers: set[int] = set()
    with subprocess.Popen(
        healthlog(command, "--data", data.path, *args), stderr=subprocess.PIPE, env=env
    ) as importing:

        def folding(said: list[str]) -> bool:
            if not said[-1].startswith("journaled "):
                return False
            deadline = time.monotonic() + LIMIT_S
            while not workers or lease_holder(data) is None:
                assert time.monotonic() < deadline, "the command never held the lease"
                workers.update(children_of(importing.pid))
                time.sleep(0.01)
            return True

        _, err = signalled_after(importing, signal.SIGTERM, folding)
    assert importing.returncode == 143, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "healthlog: interrupted"
    assert lease_holder(data) is None
    with data.open_journal() as journal, data.open_store() as store:
        assert journal.count()[0] == 1
        assert store.outcome(1) is None
    deadline = time.monotonic() + LIMIT_S
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a fold worker outlived the stopped command"
        time.sleep(0.05)


def lease_holder(data: DataDir) -> str | None:
    """The fold lease's holder (None before the store exists)."""
    return lease_row(data.path)[0] if data.store_path.exists() else None


@pytest.mark.parametrize(
    ("flags", "toml", "says"),
    [
        ([], '[serve]\nlog_level = "loud"\n', "invalid log_level"),
        (["--port", "99999"], None, "invalid port"),
        (["--port", "65536"], None, "invalid port"),
        (["--port", "-1"], None, "invalid port"),
        (["--max-body-mib", "-3"], None, "invalid max_body_mib"),
        (["--max-body-mib", "nan"], None, "invalid max_body_mib"),
        (["--max-body-mib", "inf"], None, "invalid max_body_mib"),
        ([], "serve = 1\n", "serve must be a table"),
        ([], "port = 8788\n", "unknown settings ['port'] (outside [serve])"),
        ([], "[serve]\nwake_period_s = 0\n", "invalid wake_period_s"),
        (
            [],
            "[serve]\nlease_ttl_s = 4\n",
            "lease_renew_s must be shorter than lease_ttl_s: lease_renew_s 5.0 (the default),"
            " lease_ttl_s 4 (from ",
        ),
    ],
)
def test_serve_refuses_settings_out_of_range_with_exit_2_cli_27(
    run_cli: RunCli, tmp_path: Path, flags: list[str], toml: str | None, says: str
) -> None:
    """CLI-27: `serve` with a port outside 0 to 65535, a size or duration that is not a finite
    number above zero, a renewal not shorter than the lease, or a `serve` that is not a table
    in `healthlog.toml`, or a setting outside its `[serve]` table: exit 2 with one line naming
    the setting, before it listens."""
    data = tmp_path / "data"
    data.mkdir()
    if toml is not None:
        (data / "healthlog.toml").write_text(toml)
    run = run_cli("serve", "--data", data, *flags)
    assert run.code == 2
    one_line_error(run.err, says)
    assert b"serving" not in run.out


def test_serve_takes_log_level_and_format_in_any_case_cli_27(tmp_path: Path) -> None:
    """CLI-27: `HEALTHLOG_LOG_LEVEL=INFO` and `HEALTHLOG_LOG_FORMAT=JSON`, and the flags
    `--log-level DEBUG --log-format Json`, are the settings in lower case, not errors."""
    environ = {"HEALTHLOG_LOG_LEVEL": "INFO", "HEALTHLOG_LOG_FORMAT": "JSON"}
    config = load_serve_config(tmp_path / "absent.toml", {}, environ)
    assert (config.log_level, config.log_format) == ("info", "json")
    flags = build_parser().parse_args(["serve", "--log-level", "DEBUG", "--log-format", "Json"])
    assert (flags.log_level, flags.log_format) == ("debug", "json")


def test_export_from_a_directory_without_a_replica_exits_2_cli_28(cli: Cli, tmp_path: Path) -> None:
    """CLI-28: `export --replica DIR` where DIR holds no replica exits 2 and creates nothing."""
    missing = tmp_path / "typo"
    run = cli("export", "--replica", missing)
    assert run.code == 2
    one_line_error(run.err, f"no follow replica in {missing}")
    assert not missing.exists()


@pytest.mark.parametrize(
    "flags", [["--runs", "0"], ["--runs", "-5"], ["--minutes", "-1"], ["--minutes", "nan"]]
)
def test_chaos_refuses_runs_or_minutes_that_would_check_nothing_cli_29(
    cli: Cli, flags: list[str]
) -> None:
    """CLI-29: `chaos` with fewer than one run or minutes that are not a finite number above
    zero is a usage error (exit 2): it never reports a proof that checked nothing."""
    run = cli("chaos", *flags)
    assert run.code == 2
    assert "chaos: runs" not in run.out.decode()


def test_follow_with_a_port_out_of_range_exits_2_cli_30(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-30: `follow --url` with a port outside 0 to 65535 exits 2 with one line (a real
    process: one that took the URL would try to connect until its time limit)."""
    url = "http://127.0.0.1:99999"
    run = run_cli("follow", "--url", url, "--token", "t", "--replica", tmp_path / "replica")
    assert run.code == 2
    one_line_error(run.err, f"not a service or stream URL: {url}")


@pytest.mark.parametrize(
    "url", ["http://nas..local:8787", "http://.nas:8787", f"ws://{'n' * 64}.local/v1/stream"]
)
def test_follow_with_a_host_no_resolver_can_be_asked_for_exits_2_cli_273(
    run_cli: RunCli, tmp_path: Path, url: str
) -> None:
    """CLI-273: `follow --url` whose host has an empty label (a typo's `..`, a leading dot) or
    one longer than 63 characters, which no resolver can be asked for, exits 2 with CLI-30's one
    line and makes no replica. (Before, the first look-up ended `follow` with a traceback
    ending `UnicodeError: encoding with 'idna' codec failed (UnicodeError: label empty or too
    long)`, exit 1.)"""
    replica = tmp_path / "replica"
    run = run_cli("follow", "--url", url, "--token", "t", "--replica", replica)
    assert run.code == 2, run.err
    one_line_error(run.err, f"not a service or stream URL: {url}")


def test_verify_says_what_is_not_folded_yet_cli_32(cli: Cli, tmp_path: Path) -> None:
    """CLI-32: `verify` on a data directory with journaled deliveries not folded yet (another
    process holds the fold lease) exits 0 for what is folded and says how many are not."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease(
            "serve:elsewhere:1:aa", now=time.time_ns() // 1000, ttl=3600 * 10**6
        )
        assert epoch is not None
    assert cli("import", "--no-wait", "--aggregation", "minutes", "--data", data, file).code == 0
    run = cli("verify", "--data", data)
    assert run.code == 0
    assert "verify: 1 journaled deliveries are not folded yet" in run.err
    assert run.err.splitlines()[-1] == "verify: 0 objects differ"


def test_verify_names_deliveries_a_rebuild_records_otherwise_cli_62(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-62: a delivery whose recorded outcome is not the one a rebuild records (as an older
    healthlog recorded it: `failed`, an internal error, for a metric with no points) is named
    on stderr by `verify`, which still exits 0, its objects being equal; `reindex` records it
    anew, after which `verify` names nothing. (Before, `verify` said only `0 objects differ`,
    and the stale `failed` stayed until a reindex nobody was told to run.)"""
    data = tmp_path / "data"
    points = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    empty = write(tmp_path / "b.json", body(metric("step_count", "count")))
    for sent in (points, empty):
        assert cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    with sqlite3.connect(data / "store.sqlite") as conn:
        conn.execute(
            "UPDATE outcomes SET status = 'failed', reason = 'internal error: AssertionError'"
            " WHERE delivery_id = 2"
        )
        conn.execute("UPDATE outcomes SET reason = 'an older wording' WHERE delivery_id = 1")
    conn.close()
    run = cli("verify", "--data", data)
    assert run.code == 0
    assert run.err.splitlines()[-4:] == [
        "verify: delivery 1 is recorded parsed, a rebuild records it with another reason",
        "verify: delivery 2 is recorded failed, a rebuild records it parsed",
        "verify: 2 deliveries are recorded otherwise than a rebuild records them;"
        " `healthlog reindex` records them anew",
        "verify: 0 objects differ",
    ]
    assert cli("reindex", "--data", data).code == 0
    again = cli("verify", "--data", data)
    assert again.code == 0
    assert "recorded" not in again.err
    assert again.err.splitlines()[-1] == "verify: 0 objects differ"


@pytest.mark.parametrize("before", [True, False])
def test_token_takes_data_after_its_own_name_and_lists_names_alone_cli_33(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: bool
) -> None:
    """CLI-33: `token` takes `--data DIR` after its own name and after the action alike, and
    `token list` prints one name per line and nothing else (never a secret)."""
    data = tmp_path / "data"
    # Where a `--data` that was not taken would lead: $HEALTHLOG_DATA, else ./var.
    monkeypatch.delenv("HEALTHLOG_DATA", raising=False)
    monkeypatch.chdir(tmp_path)

    def token(action: str, *args: str) -> CliRun:
        if before:
            return cli("token", "--data", data, action, *args)
        return cli("token", action, *args, "--data", data)

    added = [token("add", name) for name in ("phone", "watch")]
    assert [run.code for run in added] == [0, 0]
    listed = token("list")
    assert listed.code == 0, listed.err
    assert listed.out.decode().splitlines() == ["phone", "watch"]
    assert not any(run.out.strip() in listed.out for run in added)
    assert token("revoke", "phone").code == 0
    assert token("list").out.decode().splitlines() == ["watch"]
    with DataDir(data).open_tokens() as tokens:
        assert [info.name for info in tokens.list()] == ["watch"]
    assert not (tmp_path / "var").exists()


TOML = "healthlog.toml"


def test_settings_an_earlier_healthlog_took_are_still_taken_cli_37(tmp_path: Path) -> None:
    """CLI-37: settings written as earlier versions took them still load: whole numbers as TOML
    floats (`port = 8787.0`, `stream_window_events = 1e5`), numbers as strings, a level in
    capitals, whole numbers for seconds and MiB."""
    (tmp_path / TOML).write_text(
        "[serve]\nport = 8787.0\nstream_window_events = 1e5\nmax_body_mib = 256\n"
        'lease_ttl_s = 15\nwake_period_s = "30"\nlog_level = "WARNING"\n'
    )
    config = load_serve_config(tmp_path / TOML, {}, {"HEALTHLOG_PORT": " 8788\n"})
    assert (config.port, config.stream_window_events) == (8788, 100_000)
    assert (config.max_body_mib, config.lease_ttl_s, config.wake_period_s) == (256.0, 15.0, 30.0)
    assert config.log_level == "warning"
    assert load_serve_config(tmp_path / TOML, {}, {}).port == 8787


@pytest.mark.parametrize(
    ("toml", "env", "flags", "says"),
    [
        (
            "port = 70000",
            {},
            [],
            "invalid port: 70000 (from {toml}); it must be a whole number from 0 to 65535",
        ),
        ("port = 8080.5", {}, [], "invalid port: 8080.5 (from {toml})"),
        ("port = true", {}, [], "invalid port: True (from {toml})"),
        (None, {"HEALTHLOG_PORT": "70000"}, [], "invalid port: '70000' (from HEALTHLOG_PORT)"),
        (None, {}, ["--port", "70000"], "invalid port: 70000 (from --port)"),
        (None, {}, ["--host", ""], "invalid host: '' (from --host); it must be a host name"),
        (
            'log_level = "loud"',
            {},
            [],
            "invalid log_level: 'loud' (from {toml}); it must be debug, info, warning or error",
        ),
        ("max_body_mib = true", {}, [], "invalid max_body_mib: True (from {toml})"),
        ("stream_window_events = 1.5", {}, [], "invalid stream_window_events: 1.5"),
        (
            "stream_window_events = 10000000000000000000000",
            {},
            [],
            "invalid stream_window_events: 10000000000000000000000 (from {toml}); it must be a"
            " whole number from 1 to 9223372036854775807",
        ),
        (
            "lease_ttl_s = 1e17",
            {},
            [],
            "invalid lease_ttl_s: 1e+17 (from {toml}); it must be a"
            " number of seconds above zero, at most 1,000,000,000",
        ),
        (
            "stream_send_timeout_s = 1e7",
            {},
            [],
            "invalid stream_send_timeout_s: 10000000.0"
            " (from {toml}); it must be a number of seconds above zero, at most 2,147,483",
        ),
        (
            "stream_window_days = 1e300",
            {},
            [],
            "invalid stream_window_days: 1e+300 (from {toml});"
            " it must be a number of days above zero, at most 1,000,000",
        ),
        ('log_format = "' + "x" * 500 + '"', {}, [], "invalid log_format: 'xxxx"),
        (
            "stream_max_subscribers = 0",
            {},
            [],
            "invalid stream_max_subscribers: 0 (from {toml}); it must be a whole number of 1 or"
            " more",
        ),
    ],
    ids=[
        "port-range",
        "port-fraction",
        "port-bool",
        "port-env",
        "port-flag",
        "host-empty",
        "log-level",
        "body-bool",
        "events-fraction",
        "events-beyond-sqlite",
        "lease-beyond-sqlite",
        "send-timeout-beyond-kernel",
        "window-days-beyond-sqlite",
        "long-value",
        "max-subscribers-zero",
    ],
)
def test_serve_refuses_a_setting_of_the_wrong_kind_or_beyond_what_works_cli_37(
    run_cli: RunCli,
    tmp_path: Path,
    toml: str | None,
    env: dict[str, str],
    flags: list[str],
    says: str,
) -> None:
    """CLI-37: a setting of the wrong kind (a port with a fraction, `true` for a number, an
    empty host) or beyond what healthlog can use (a lease, window or send timeout that would
    overflow later, while serving) stops `serve` with exit 2 and one short line naming the
    setting, where it came from and what it accepts, before anything starts."""
    data = tmp_path / "data"
    data.mkdir()
    if toml is not None:
        (data / TOML).write_text(f"[serve]\n{toml}\n")
    run = run_cli("serve", "--data", data, *flags, env=env)
    assert run.code == 2
    one_line_error(run.err, says.format(toml=data / TOML))
    assert run.err.startswith("healthlog: invalid ")
    # Every line names the setting, the value, where it came from and what it accepts.
    assert re.fullmatch(r"healthlog: invalid \w+: .+ \(from [^()]+\); it must be .+\n", run.err)
    assert len(run.err) < 300
    assert b"serving" not in run.out
    assert sorted(path.name for path in data.iterdir()) == ([TOML] if toml is not None else [])


@pytest.mark.parametrize("host", ["nasé..local", ".nasé", "é" * 64 + ".local"])
def test_serve_refuses_a_host_no_resolver_can_be_asked_for_cli_272(
    run_cli: RunCli, tmp_path: Path, host: str
) -> None:
    """CLI-272: a `host` that is not ASCII and that IDNA cannot encode (an empty label, as a
    typo's `..` or a leading dot makes, or a label longer than 63 characters) stops `serve` with
    exit 2 and one line naming the setting, as any other setting it cannot use (CLI-37), having
    made nothing in the data directory; one it can encode (`nasé.local`) is asked of the
    resolver, which says it cannot listen there (CLI-38). (Before, such a host ended `serve`
    with a traceback ending `TypeError: encoding of hostname failed`, exit 1.)"""
    data = tmp_path / "data"
    data.mkdir()
    run = run_cli("serve", "--port", "0", "--host", host, "--data", data)
    assert (run.code, run.out) == (2, b""), run.err
    one_line_error(run.err, " (from --host); it must be a host name or IP address")
    assert run.err.startswith(f"healthlog: invalid host: {host[:20]!r}"[:-1]), run.err
    assert list(data.iterdir()) == []
    named = run_cli("serve", "--port", "0", "--host", "nasé.invalid", "--data", data)
    assert named.code == 3, named.err
    assert "Traceback" not in named.err
    assert "healthlog: [Errno -2] cannot listen on nasé.invalid:0" in named.err, named.err


def test_serve_that_cannot_listen_names_the_address_cli_38(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-38: `serve` on a port another process listens on exits 3 with one line naming the
    address it could not listen on, and no traceback, having opened nothing in its data
    directory (no fold lease taken, no file created)."""
    (tmp_path / "data").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_cli("serve", "--port", str(port), "--data", tmp_path / "data")
    assert run.code == 3
    assert "Traceback" not in run.err
    (line,) = [line for line in run.err.splitlines() if line.startswith("healthlog:")]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
    assert b"serving" not in run.out
    assert list((tmp_path / "data").iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["token", "list"],
        ["token", "revoke", "phone"],
        ["status"],
        ["status", "--json"],
        ["export"],
        ["verify"],
        ["reindex"],
        ["seal", "--before", "2024-02-06T15:00:00Z"],
    ],
    ids=lambda args: "-".join(args[:2]),
)
def test_a_command_on_a_data_directory_that_does_not_exist_makes_none_cli_39(
    cli: Cli, tmp_path: Path, args: list[str]
) -> None:
    """CLI-39: a command that reads a data directory (or seals what it holds), given one that
    does not exist (a typo), exits 2 with one line saying so and creates nothing."""
    missing = tmp_path / "typo" / "data"
    run = cli(*args, "--data", missing)
    assert run.code == 2
    one_line_error(run.err, f"healthlog: no healthlog data in {missing} (give --data DIR)")
    assert run.out == b""
    assert not (tmp_path / "typo").exists()


def test_token_add_makes_the_data_directory_cli_39(cli: Cli, tmp_path: Path) -> None:
    """CLI-39: `token add` is how a data directory is begun before `serve` (README), so it
    makes one that does not exist; `token list` then reads it."""
    data = tmp_path / "new" / "data"
    assert cli("token", "add", "phone", "--data", data).code == 0
    assert cli("token", "list", "--data", data).out == b"phone\n"


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["export"],
        ["verify"],
        ["reindex"],
        ["seal", "--before", "2024-01-01T00:00:00Z"],
        ["token", "list"],
        ["token", "revoke", "phone"],
    ],
)
@pytest.mark.parametrize("held", [[], ["notes.txt"]])
def test_a_command_on_a_directory_without_healthlog_data_makes_none_cli_53(
    cli: Cli, tmp_path: Path, args: list[str], held: list[str]
) -> None:
    """CLI-53: a command that reads a data directory (or seals what it holds), given a
    directory that exists but holds none of healthlog's files (an empty one, the parent of the
    data directory, a share of other files), exits 2 with one line saying so, as for one that
    does not exist, and leaves the directory as it was. (Before, it made `journal.sqlite`,
    `store.sqlite` and `signing.key` there and reported an empty instance.)"""
    other = tmp_path / "share"
    other.mkdir()
    for name in held:
        (other / name).write_text("not healthlog's\n")
    run = cli(*args, "--data", other)
    assert run.code == 2
    one_line_error(run.err, f"healthlog: no healthlog data in {other} (give --data DIR)")
    assert run.out == b""
    assert sorted(path.name for path in other.iterdir()) == held


def files_of(directory: Path) -> dict[str, bytes]:
    """The name and bytes of every file in ``directory``."""
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def journaled(cli: Cli, tmp_path: Path) -> Path:
    """A data directory one delivery was imported into and folded (closed: no -wal, -shm)."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    return data


@pytest.mark.parametrize(
    "args",
    [["status"], ["status", "--json"], ["status", "--failed"], ["export"], ["verify"]],
    ids=lambda args: "-".join(args),
)
def test_a_reading_command_makes_no_store_where_there_is_none_cli_110(
    cli: Cli, tmp_path: Path, args: list[str]
) -> None:
    """CLI-110: `status`, `export` and `verify` on a data directory whose `store.sqlite` was
    deleted to be rebuilt (the journal alone left) exit 3 with one line saying so and what
    rebuilds it, and make no file; on one where nothing was journaled yet (`token add` began
    it) they exit 2 with one line; `reindex` then rebuilds the store and the command reads it.
    (Before, each made an empty `store.sqlite`, `status` a `signing.key` too, and exited 0:
    `status` with every delivery pending and no pass yet, `export` with nothing, `verify` with
    `0 objects differ`.)"""
    data = journaled(cli, tmp_path)
    for name in ("store.sqlite", "signing.key"):
        (data / name).unlink(missing_ok=True)
    left = files_of(data)
    run = cli(*args, "--data", data)
    assert run.code == 3
    command = args[0]
    one_line_error(
        run.err,
        f"healthlog: no store.sqlite in {data}: `healthlog reindex` rebuilds it from"
        f" journal.sqlite (so does `serve` as it starts), and `{command}` reads it then;"
        " nothing was changed",
    )
    assert run.out == b""
    assert files_of(data) == left
    assert cli("reindex", "--data", data).code == 0
    assert cli(*args, "--data", data).code == 0

    begun = tmp_path / "begun"
    assert cli("token", "add", "phone", "--data", begun).code == 0
    left = files_of(begun)
    run = cli(*args, "--data", begun)
    assert run.code == 2
    one_line_error(
        run.err,
        f"healthlog: nothing journaled in {begun} yet (no journal.sqlite, no store.sqlite):"
        " `serve` or `import` begins them",
    )
    assert files_of(begun) == left


def test_token_list_and_revoke_make_no_tokens_file_cli_110(cli: Cli, tmp_path: Path) -> None:
    """CLI-110: on a data directory no token was ever added to (`import` began it), `token
    list` prints nothing and exits 0, and `token revoke` exits 2 with `no token named`, and
    neither makes `tokens.sqlite` (before, each made it)."""
    data = journaled(cli, tmp_path)
    left = files_of(data)
    listed = cli("token", "list", "--data", data)
    assert (listed.code, listed.out, listed.err) == (0, b"", "")
    revoked = cli("token", "revoke", "phone", "--data", data)
    assert revoked.code == 2
    one_line_error(revoked.err, "healthlog: no token named 'phone'")
    assert files_of(data) == left


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["verify"],
        ["reindex"],
        ["seal", "--before", "2024-01-01T00:00:00Z"],
        ["import", "--no-wait", "a.json"],
        ["serve", "--port", "0"],
    ],
    ids=lambda args: args[0],
)
def test_a_store_without_its_journal_is_said_and_no_journal_made_cli_111(
    cli: Cli, tmp_path: Path, args: list[str]
) -> None:
    """CLI-111: a command that opens the journal, on a data directory holding `store.sqlite`
    but no `journal.sqlite` (moved away, on a disk not mounted), exits 3 with one line saying
    the journal is missing and to put it back, and makes no file; with the journal put back
    `status` reads both. (Before, each made an empty `journal.sqlite`, then refused the store
    as `folded from another journal` and told the user to move it away and reindex: a
    store with no other copy of its points.)"""
    data = journaled(cli, tmp_path)
    (data / "journal.sqlite").rename(tmp_path / "journal.sqlite")
    left = files_of(data)
    run = cli(*[tmp_path / arg if arg == "a.json" else arg for arg in args], "--data", data)
    assert run.code == 3
    one_line_error(
        run.err,
        f"healthlog: {data} holds store.sqlite but no journal.sqlite, the deliveries it was"
        " folded from (moved away, deleted, or on a disk not mounted?): put journal.sqlite"
        " back, from a backup if need be, and run the command again; nothing was changed",
    )
    assert run.out == b""
    assert files_of(data) == left
    (tmp_path / "journal.sqlite").rename(data / "journal.sqlite")
    assert b"journal     1 deliveries" in cli("status", "--data", data).out


@pytest.mark.parametrize(
    "args", [["token", "add", "phone"], ["import", "--no-wait", "a.json"], ["serve", "--port", "0"]]
)
def test_a_data_directory_that_is_a_dangling_link_is_refused_cli_54(
    cli: Cli, tmp_path: Path, args: list[str]
) -> None:
    """CLI-54: `token add`, `import` or `serve` given a `--data` that is a symbolic link to
    nothing (a disk not mounted under the link) exits 2 with one line naming the link and where
    it points, makes nothing there and says nothing of making a directory. (Before: `healthlog:
    no data directory at DIR: making a new one`, then `healthlog: [Errno 17] File exists: DIR`
    and exit 3.)"""
    write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    target = tmp_path / "unmounted" / "healthlog"
    link = tmp_path / "data"
    link.symlink_to(target)
    run = cli(*[str(tmp_path / arg) if arg == "a.json" else arg for arg in args], "--data", link)
    assert run.code == 2
    one_line_error(
        run.err, f"healthlog: {link} is a symbolic link to {target}, which does not exist"
    )
    assert run.out == b""
    assert not (tmp_path / "unmounted").exists()


@pytest.mark.parametrize("command", ["token add", "import"])
def test_a_command_that_makes_a_data_directory_says_so_cli_48(
    cli: Cli, tmp_path: Path, command: str
) -> None:
    """CLI-48: `token add` or `import` given a data directory that does not exist (the first
    one, or a typo) says on stderr that it makes a new one there, and nothing more on stdout
    than before (`token add`: the token alone); given it again, it says nothing of the kind."""
    data = tmp_path / "new" / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    commands = {
        "token add": [["token", "add", "phone"], ["token", "add", "laptop"]],
        "import": [["import", "--no-wait", file]] * 2,
    }
    runs = [cli(*args, "--data", data) for args in commands[command]]
    assert [run.code for run in runs] == [0, 0]
    said = f"healthlog: no data directory at {data}: making a new one"
    assert runs[0].err.splitlines()[0] == said
    assert said not in runs[1].err
    assert data.is_dir()
    if command == "token add":
        assert [len(run.out.splitlines()) for run in runs] == [1, 1]
        assert all(run.out.startswith(b"hl_") for run in runs)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["export", "--from", "garbage"], "--from"),
        (["export", "--to", "2024-02-30T00:00:00Z"], "--to"),
        (["import", "--received-at", "yesterday", "x.json"], "--received-at"),
        (["seal", "--before", "soon"], "--before"),
    ],
    ids=["from", "to", "received-at", "before"],
)
def test_an_unreadable_timestamp_is_answered_with_an_example_cli_40(
    cli: Cli, tmp_path: Path, args: list[str], flag: str
) -> None:
    """CLI-40: a flag's timestamp that cannot be read exits 2 with a last line naming the flag,
    why, and an example of an accepted instant."""
    data = tmp_path / "data"
    assert cli("token", "add", "phone", "--data", data).code == 0
    run = cli(args[0], "--data", data, *args[1:])
    assert run.code == 2
    last = run.err.splitlines()[-1]
    assert f"argument {flag}: not a timestamp: " in last
    assert last.endswith("(for example 2024-02-06T15:00:00Z)")


def test_export_layer_names_a_stored_layer_in_any_case_cli_40(cli: Cli, tmp_path: Path) -> None:
    """CLI-40: `export --layer` that names no layer exits 2 listing the layers (it printed
    nothing and exited 0, as if there were no points); a layer in another case is that layer."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    run = cli("export", "--layer", "minuets", "--data", data)
    assert run.code == 2
    assert run.out == b""
    assert run.err.splitlines()[-1].endswith(
        "argument --layer: choose one of seconds, minutes, hours, days, weeks, months, years,"
        " default, records"
    )
    exported = cli("export", "--layer", "minutes", "--data", data)
    assert len(exported.out.splitlines()) == 1
    assert cli("export", "--layer", "MINUTES", "--data", data).out == exported.out
    assert cli("export", "--layer", "records", "--data", data).out == b""


def test_export_of_an_empty_metric_exits_2_cli_136(cli: Cli, tmp_path: Path) -> None:
    """CLI-136: `export --metric ''` (a script's unset variable) exits 2 naming `--metric` and
    writes nothing; it printed nothing and exited 0, as if there were no points, where
    `GET /v1/points?metric=` gives every metric's."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    run = cli("export", "--metric", "", "--data", data)
    assert run.code == 2
    assert run.out == b""
    assert run.err.splitlines() == [
        "healthlog: --metric names a metric; leave it out to export every metric"
    ]
    assert len(cli("export", "--metric", HR, "--data", data).out.splitlines()) == 1


@pytest.mark.parametrize("command", ["export", "seal"])
def test_a_metric_that_is_not_utf8_exits_2_cli_274(
    run_cli: RunCli, tmp_path: Path, command: str
) -> None:
    """CLI-274: `export --metric` or `seal --metric` given a name with a byte that is not UTF-8
    (`st\xe9p`, typed in a terminal set to Latin-1), which no metric the app sends is named,
    exits 2 with one line naming `--metric`, and journals nothing; the name in UTF-8 is taken.
    (Before, the query or the seal's body could not encode it: a traceback ending
    `UnicodeEncodeError: ... surrogates not allowed`, exit 1.)"""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert run_cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    flags = {"export": [], "seal": ["--before", "2024-02-01T00:00:00Z", "--no-wait"]}[command]
    named = os.fsdecode(b"st\xe9p")
    run = run_cli(command, "--metric", named, *flags, "--data", data)
    assert (run.code, run.out) == (2, b""), run.err
    one_line_error(
        run.err,
        f"healthlog: --metric 'st\\udce9p' is not UTF-8, as every metric's name is; {command}"
        " takes it as the app writes it",
    )
    with DataDir(data).open_journal() as journal:
        assert len(journal.iter_order()) == 1
    assert run_cli(command, "--metric", "stép", *flags, "--data", data).code == 0


def test_export_of_a_range_that_ends_before_it_starts_exits_2_cli_137(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-137: `export --from A --to B` with B not later than A (the two swapped) exits 2
    saying so and writes nothing; it printed nothing and exited 0, as if the range held no
    points. The same range the right way round exports its point."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    swapped = ["--from", "2024-02-07", "--to", "2024-02-06"]
    run = cli("export", *swapped, "--data", data)
    same = cli("export", "--from", "2024-02-06", "--to", "2024-02-06", "--data", data)
    ordered = cli("export", "--from", "2024-02-06", "--to", "2024-02-07", "--data", data)
    assert run.code == 2
    assert run.out == b""
    assert run.err.splitlines() == [
        "healthlog: --from 2024-02-07T00:00:00Z is not earlier than --to 2024-02-06T00:00:00Z:"
        " export writes the points that start in [from, to)"
    ]
    assert same.code == 2
    assert same.out == b""
    assert ordered.code == 0
    assert len(ordered.out.splitlines()) == 1


def test_export_of_a_metric_never_stored_says_so_cli_138(cli: Cli, tmp_path: Path) -> None:
    """CLI-138: `export --metric` or `--layer` naming what no stored object has (a name
    mistyped) writes nothing, exits 0 and says so in one line on stderr; a stored metric whose
    range holds no point says nothing, as before."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    typo = cli("export", "--metric", "HeartRate", "--format", "csv", "--data", data)
    layer = cli("export", "--metric", HR, "--layer", "records", "--data", data)
    empty = cli("export", "--metric", HR, "--from", "2025-01-01", "--data", data)
    assert typo.code == 0
    assert typo.out == b"metric,layer,start,end,units,point\r\n"
    assert typo.err.splitlines() == [
        "export: no object of metric HeartRate is stored: names are as `healthlog export`"
        " prints them (heart_rate, minutes)"
    ]
    assert layer.code == 0
    assert layer.out == b""
    assert layer.err.splitlines() == [
        f"export: no object of metric {HR} layer records is stored: names are as"
        " `healthlog export` prints them (heart_rate, minutes)"
    ]
    assert (empty.code, empty.out, empty.err) == (0, b"", "")


def test_export_given_an_option_twice_exits_2_cli_177(cli: Cli, tmp_path: Path) -> None:
    """CLI-177: `export` given `--metric`, `--layer`, `--from`, `--to`, `--format` or
    `--replica` twice exits 2 naming the option and writes nothing, as `/v1/points` refuses a
    repeated parameter (SERVE-93); each once exports. (Before, the last one given counted:
    `--metric heart_rate --metric step_count` wrote step_count's points alone and exited 0.)"""
    data = tmp_path / "data"
    sent = body(
        metric(HR, BPM, point("2024-02-06 07:00:00 -0800")),
        metric("step_count", "count", point("2024-02-06 07:00:00 -0800", qty=12)),
    )
    assert (
        cli(
            "import", "--aggregation", "minutes", "--data", data, write(tmp_path / "a.json", sent)
        ).code
        == 0
    )
    twice = {
        "--metric": [HR, "step_count"],
        "--layer": ["minutes", "minutes"],
        "--from": ["2024-02-01", "2024-02-06"],
        "--to": ["2024-03-01", "2024-02-07"],
        "--format": ["csv", "jsonl"],
        "--replica": [tmp_path / "r1", tmp_path / "r2"],
    }
    for option, (first, second) in twice.items():
        run = cli("export", option, first, option, second, "--data", data)
        assert (run.code, run.out) == (2, b""), option
        assert run.err.splitlines()[-1] == (
            f"healthlog export: error: argument {option}: given twice; it takes one value:"
            " run export once for each"
        ), option
    once = cli(
        "export",
        "--metric",
        HR,
        "--layer",
        "minutes",
        "--from",
        "2024-02-01",
        "--to",
        "2024-03-01",
        "--format",
        "jsonl",
        "--data",
        data,
    )
    assert once.code == 0
    assert [json.loads(line)["metric"] for line in once.out.splitlines()] == [HR]


def log_records(err: str, own: str) -> list[dict[str, Any]]:
    """The log records of a command's stderr, each a JSON object: every line that does not
    match ``own`` (the command's own lines) must be one."""
    records = []
    for line in err.splitlines():
        if not re.match(own, line):
            record = json.loads(line)
            assert isinstance(record, dict), line
            records.append(record)
    return records


def without_log_settings() -> dict[str, str]:
    """This environment without any ``HEALTHLOG_*`` setting."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}


def test_follow_logs_in_the_format_the_environment_sets_cli_49(tmp_path: Path) -> None:
    """CLI-49: `follow` (a command without a data directory) with `HEALTHLOG_LOG_FORMAT=json`
    that cannot reach its service logs that WARNING as a JSON object, like every log line on its
    stderr (it was a `key=value` line whatever the setting)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen(
        healthlog("follow", "--url", url, "--token", "hl_x", "--replica", tmp_path / "replica"),
        stderr=subprocess.PIPE,
        env={**without_log_settings(), "HEALTHLOG_LOG_FORMAT": "json"},
    ) as following:
        said, rest = signalled_after(following, signal.SIGTERM, lambda said: True)
    assert following.returncode == 0
    records = log_records(
        "".join(line + "\n" for line in said) + rest, r"follow: replica at seq 0$"
    )
    assert records[0]["level"] == "WARNING"
    assert records[0]["logger"] == "healthlog.follow"
    assert records[0]["msg"].startswith("follow: the service cannot be reached")


def resend(tmp_path: Path) -> list[Path]:
    """Two deliveries of one point, the second a re-send that changes it: a point collision."""
    at = "2024-02-06 07:00:00 -0800"
    return [
        write(tmp_path / f"{n}.json", body(metric(HR, BPM, point(at, qty=n, source="w"))))
        for n in (1, 2)
    ]


IMPORTED = r"journaled .* as delivery \d+ |delivery \d+: \w+$"
REINDEXED = r"reindex: "


def test_import_and_reindex_log_as_the_data_directory_and_the_environment_set_cli_49(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-49: the `[serve]` table of `healthlog.toml` sets the log format and level of the
    commands on its data directory, `import`'s fold workers included, and `HEALTHLOG_LOG_*`
    wins over it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / TOML).write_text('[serve]\nlog_format = "json"\nlog_level = "info"\n')
    imported = run_cli("import", "--aggregation", "minutes", "--data", data, *resend(tmp_path))
    assert imported.code == 0
    records = log_records(imported.err, IMPORTED)
    said = {(r["level"], r["logger"], r["msg"].split(" kind=")[0]) for r in records}
    # The collision by the fold worker, the lease by the command itself.
    assert ("WARNING", "healthlog.fold", "point collision") in said
    assert any(level == "INFO" and logger == "healthlog.lease" for level, logger, _ in said)
    reindexed = run_cli("reindex", "--data", data)
    assert reindexed.code == 0
    (record,) = log_records(reindexed.err, REINDEXED)
    assert record["level"] == "INFO"
    assert record["msg"].startswith("reindex swapped in")
    quiet = run_cli("reindex", "--data", data, env={"HEALTHLOG_LOG_LEVEL": "WARNING"})
    assert quiet.code == 0
    assert log_records(quiet.err, REINDEXED) == []


def test_commands_log_in_kv_at_warning_when_nothing_is_set_cli_49(tmp_path: Path) -> None:
    """CLI-49: with nothing set, `import` logs its point collision as a `key=value` line and
    `reindex` logs nothing at INFO: the commands are no louder than before."""
    data = tmp_path / "data"
    env = without_log_settings()
    imported = subprocess.run(
        healthlog("import", "--aggregation", "minutes", "--data", data, *resend(tmp_path)),
        capture_output=True,
        env=env,
        timeout=LIMIT_S,
        check=True,
    )
    logged = [
        line for line in imported.stderr.decode().splitlines()[1:] if not re.match(IMPORTED, line)
    ]
    assert len(logged) == 1
    assert re.fullmatch(
        r'time=\S+ level=WARNING logger=healthlog\.fold msg="point collision .*"', logged[0]
    )
    reindexed = subprocess.run(
        healthlog("reindex", "--data", data),
        capture_output=True,
        env=env,
        timeout=LIMIT_S,
        check=True,
    )
    assert all(line.startswith(REINDEXED) for line in reindexed.stderr.decode().splitlines())


@pytest.mark.parametrize(
    ("args", "env", "toml", "says"),
    [
        (
            ["status"],
            {"HEALTHLOG_LOG_LEVEL": "loud"},
            None,
            "invalid log_level: 'loud' (from HEALTHLOG_LOG_LEVEL); it must be debug, info,"
            " warning or error",
        ),
        (["verify"], {}, '[serve]\nlog_format = "xml"\n', "invalid log_format: 'xml' (from "),
        (["export"], {}, "[serve]\nlog_fromat = 1\n", "unknown settings ['log_fromat']"),
        (["token", "add", "phone"], {"HEALTHLOG_LOG_FORMAT": "xml"}, None, "invalid log_format"),
    ],
    ids=["status", "verify", "export", "token-add"],
)
def test_a_log_setting_that_is_not_valid_stops_a_command_with_exit_2_cli_49(
    run_cli: RunCli,
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    toml: str | None,
    says: str,
) -> None:
    """CLI-49: a log level or format that is not valid, from the environment or the data
    directory's `healthlog.toml`, or a file `serve` would refuse, stops a command other than
    `serve` as it stops `serve`: exit 2, one line naming it, nothing done."""
    data = tmp_path / "data"
    assert run_cli("token", "add", "phone", "--data", data).code == 0
    if toml is not None:
        (data / TOML).write_text(toml)
    run = run_cli(*args, "--data", data, env=env)
    assert run.code == 2
    one_line_error(run.err, says)
    assert run.out == b""


def test_a_command_without_a_data_directory_takes_the_environment_alone_cli_49(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-49: `follow` with a log format that is not valid exits 2 with one line and makes no
    replica; the settings of `serve` alone (a port it would refuse) stop no other command."""
    replica = tmp_path / "replica"
    run = run_cli(
        "follow",
        *("--url", "http://127.0.0.1:1", "--token", "hl_x", "--replica", replica),
        env={"HEALTHLOG_LOG_FORMAT": "xml"},
    )
    assert run.code == 2
    one_line_error(run.err, "invalid log_format: 'xml' (from HEALTHLOG_LOG_FORMAT)")
    assert not replica.exists()
    data = tmp_path / "data"
    assert run_cli("token", "add", "phone", "--data", data).code == 0
    (data / TOML).write_text("[serve]\nport = 99999\n")
    DataDir(data).open_journal().close()
    DataDir(data).open_store().close()
    assert run_cli("status", "--data", data).code == 0
    assert run_cli("serve", "--data", data).code == 2


def test_a_storage_error_met_while_writing_names_its_file_cli_51(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-51: a storage error met after the files were opened (a disk that fills during
    `import`, a store that may not be written during `reindex`) exits 3 with one line naming
    the file, as one met while opening does. (Before: `healthlog: database error: disk I/O
    error`, which of the data directory's files left unsaid.)"""
    data = tmp_path / "data"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert run_cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    incompressible = os.urandom(300_000).hex().encode()
    noise = write(tmp_path / "noise.json", b'{"data":{"x":"%s"}}' % incompressible)
    with files_limited_to((data / "journal.sqlite").stat().st_size + 64 * 1024):
        run = run_cli("import", "--no-wait", "--data", data, noise)
    assert run.code == 3
    one_line_error(run.err, "(journal.sqlite)")
    with unwritable(data / "store.sqlite"):
        run = run_cli("reindex", "--data", data)
    assert run.code == 3
    one_line_error(run.err, "(store.sqlite)")
    assert run_cli("verify", "--data", data).code == 0


def test_a_signing_key_that_cannot_be_written_names_its_file_cli_80(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-80: `status` on a data directory that has no snapshot signing key yet (only
    `import` wrote it, or a restore left `signing.key` out) makes one; where the key cannot be
    written (a full disk) it exits 3 with one line naming `signing.key`, and leaves no key
    behind. (Before: `healthlog: [Errno 28] No space left on device`, no file named.)"""
    data = tmp_path / "data"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert run_cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    key = data / "signing.key"
    assert not key.exists()
    with files_limited_to(64):
        run = run_cli("status", "--data", data)
    assert run.code == 3
    one_line_error(run.err, f"({key})")
    assert [p.name for p in data.iterdir() if "signing" in p.name] == []
    assert run_cli("status", "--data", data).code == 0
    assert key.exists()


def torn_copy(run_cli: RunCli, tmp_path: Path, torn: str, *, points: int = 240) -> Path:
    """A copy of a data directory taken file by file while it changes, as `cp -a` or `rsync -a`
    of a running service's directory takes it: ``torn`` (``journal.sqlite`` or
    ``store.sqlite``) at one instant, its ``-wal`` file after SQLite has checkpointed the
    file's later writes into it and written more; the other files whole (SQLite's backup).
    Each delivery has ``points`` points in each of 8 metrics: with 240 the torn pages are
    the b-tree's, with 55 only the bodies' (each a page of its own). Which counts do that
    depends on the rows' layout: with the 8 bytes of `journaled_at` (JOURNAL-45) in each row,
    each of 50, 58, 59, 60, 61, 62, 64 and 70 tore b-tree pages too (60 had torn bodies only
    before)."""
    live = tmp_path / "live"
    args = ("import", "--aggregation", "minutes", "--data", live)

    step = 3600 // points

    def sent(first: int, count: int) -> list[Path]:
        files = []
        for n in range(first, first + count):
            metrics = [
                metric(
                    f"m{k}",
                    "count",
                    *(
                        point(
                            f"2024-02-{1 + n // 24:02d} {n % 24:02d}:"
                            f"{m * step // 60:02d}:{m * step % 60:02d} +0000",
                            qty=(n * 7919 + m * 104729 + k * 1299709) % 1000003 / 7,
                        )
                        for m in range(points)
                    ),
                )
                for k in range(8)
            ]
            files.append(write(tmp_path / f"sent-{n}.json", body(*metrics)))
        return files

    copy = tmp_path / "copy"
    copy.mkdir()
    assert run_cli(*args, *sent(0, 20)).code == 0
    # The service's connection: while it is open, a command's closing leaves the -wal file.
    with closing(sqlite3.connect(live / torn)) as service:
        service.execute("SELECT count(*) FROM sqlite_master").fetchone()
        assert run_cli(*args, *sent(20, 5)).code == 0
        service.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert run_cli(*args, *sent(25, 5)).code == 0
        # cp, as the user does: a copy in this process would drop the service's locks.
        subprocess.run(["cp", "-a", live / torn, copy / torn], check=True)
        service.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert run_cli(*args, *sent(30, 1)).code == 0
        subprocess.run(["cp", "-a", live / f"{torn}-wal", copy / f"{torn}-wal"], check=True)
    for whole in {"journal.sqlite", "store.sqlite", "tokens.sqlite"} - {torn}:
        src, dst = sqlite3.connect(live / whole), sqlite3.connect(copy / whole)
        with closing(src), closing(dst):
            src.backup(dst)
    return copy


def serve_exit(data: Path) -> subprocess.CompletedProcess[str]:
    """`healthlog serve` on ``data`` (port 0), as a real process that must stop by itself."""
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    return subprocess.run(
        [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", data],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


def test_a_torn_copy_of_the_journal_is_refused_with_what_to_do_journal_39(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """JOURNAL-39: a copy of a data directory whose journal.sqlite was copied at another
    instant than its -wal file (SQLite checkpointed in between) is damaged: `serve`, `import`,
    `reindex` and `verify` exit 3 with one line naming journal.sqlite as damaged and how to
    restore, and journal nothing. (Before, `serve` started on it and answered 200 for
    deliveries appended to the damaged file, whose earlier deliveries it could not read.)"""
    copy = torn_copy(run_cli, tmp_path, "journal.sqlite")
    with closing(sqlite3.connect(copy / "journal.sqlite")) as conn:
        size_before = conn.execute("PRAGMA page_count").fetchone()[0]
    served = serve_exit(copy)
    assert served.returncode == 3, served.stdout + served.stderr
    assert "serving on" not in served.stdout
    one_line_error(served.stderr, "journal.sqlite is damaged")
    assert "sqlite3 .backup" in served.stderr
    later = write(
        tmp_path / "later.json",
        body(metric("later", "count", point("2024-03-01 00:00:00 +0000", qty=1))),
    )
    for command in (
        ("import", "--aggregation", "minutes", "--data", copy, later),
        ("reindex", "--data", copy),
        ("verify", "--data", copy),
    ):
        run = run_cli(*command)
        assert run.code == 3, (command, run.err)
        one_line_error(run.err, "journal.sqlite is damaged")
    with closing(sqlite3.connect(copy / "journal.sqlite")) as conn:
        assert conn.execute("PRAGMA page_count").fetchone()[0] == size_before


def test_a_torn_copy_of_the_store_is_refused_until_rebuilt_store_53(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-53: a copy whose store.sqlite was copied at another instant than its -wal file is
    damaged: `verify` and `reindex` exit 3 with one line naming store.sqlite as damaged and
    saying to move it away and reindex (`serve` journals beside it: STORE-142); done, `reindex`
    folds the whole journal, which `verify` then proves. (Before, `serve` started and folded
    into the damaged store.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    for command in ("verify", "reindex"):
        run = run_cli(command, "--data", copy)
        assert run.code == 3, (command, run.err)
        one_line_error(run.err, "store.sqlite is damaged")
        assert "healthlog reindex" in run.err
    for store_file in copy.glob("store.sqlite*"):
        store_file.unlink()
    assert run_cli("reindex", "--data", copy).code == 0
    assert run_cli("verify", "--data", copy).code == 0
    status = json.loads(run_cli("status", "--json", "--data", copy).out)
    assert status["deliveries"]["parsed"] == 31


@contextlib.contextmanager
def serving_into(data: Path, err: Path, env: dict[str, str] | None = None) -> Iterator[Served]:
    """`healthlog serve` on ``data`` (port 0) as a real process, its stderr into ``err``;
    killed at the end unless it stopped by itself."""
    environ = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"} | (env or {})
    with (
        err.open("w") as stderr,
        subprocess.Popen(
            healthlog("serve", "--port", "0", "--data", data),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=environ,
        ) as proc,
    ):
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("healthlog serving on http://127.0.0.1:"), line + err.read_text()
            yield Served(proc, line.split()[3].rstrip("/"), err)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@dataclasses.dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    err: Path

    def said(self, text: str) -> str:
        """The stderr once it holds ``text`` (within ``LIMIT_S``)."""
        deadline = time.monotonic() + LIMIT_S
        while text not in (said := self.err.read_text()):
            assert self.proc.poll() is None, said
            assert time.monotonic() < deadline, said
            time.sleep(0.05)
        return said

    def post(self, token: str, sent: Path) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/deliveries",
            content=sent.read_bytes(),
            headers={"Authorization": f"Bearer {token}", "automation-aggregation": "minutes"},
            timeout=LIMIT_S,
        )

    def get(self, path: str) -> int:
        return httpx.get(f"{self.url}{path}", timeout=LIMIT_S).status_code


def test_serve_journals_beside_a_damaged_store_and_says_what_to_do_store_142(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-142: `serve` on a torn copy of the store (the journal whole) listens and journals:
    deliveries posted before and after its check found the store damaged are answered 200,
    `/healthz` 200, `/readyz` 503, one ERROR names store.sqlite as damaged, what to do, and that
    nothing folds meanwhile; SIGTERM stops it with 0, and once the store is moved away and
    rebuilt every delivery answered is folded. (Before, `serve` exited 3 before it listened: a
    supervisor started it again into the same exit, and the phone's deliveries were refused.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "phone", "--data", copy).out.decode().strip()
    sent = [
        write(
            tmp_path / f"posted-{n}.json",
            body(metric(f"posted{n}", "count", point("2024-03-01 08:00:00 +0000", qty=n))),
        )
        for n in range(2)
    ]
    with serving_into(copy, tmp_path / "serve.err") as served:
        assert served.post(token, sent[0]).status_code == 200
        said = served.said("store.sqlite is damaged")
        errors = [line for line in said.splitlines() if "store.sqlite is damaged" in line]
        assert len(errors) == 1, said
        assert "ERROR" in errors[0], said
        assert "move store.sqlite and its -wal and -shm files away" in errors[0]
        assert "folds none (/readyz answers 503)" in errors[0]
        assert served.post(token, sent[1]).status_code == 200
        assert served.get("/healthz") == 200
        assert served.get("/readyz") == 503
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0, served.err.read_text()
    assert "Traceback" not in served.err.read_text()
    for store_file in copy.glob("store.sqlite*"):
        store_file.unlink()
    assert run_cli("reindex", "--data", copy).code == 0
    status = json.loads(run_cli("status", "--json", "--data", copy).out)
    assert status["deliveries"]["parsed"] == 33
    exported = {line["metric"] for line in run_cli("export", "--data", copy).json_lines()}
    assert {"posted0", "posted1"} <= exported


def test_serve_beside_a_damaged_store_answers_its_reads_503_saying_so_serve_150_151(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """SERVE-150, SERVE-151: `serve` journaling beside a torn store (STORE-142) answers
    `/v1/points`, `/v1/deliveries/{id}` and `/v1/snapshots` 503 `STORE_DAMAGED` with a message
    saying that nothing is read from the store until it is moved away, logging no line per
    request above INFO; `/v1/status` answers 200 with `lag.stopped_because` `store_damaged`, and
    so does `healthlog status` run beside it. (Before, `/v1/points` was 500 `INTERNAL` and an
    ERROR each time, and both statuses said `empty`.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "phone", "--data", copy).out.decode().strip()
    headers = {"Authorization": f"Bearer {token}"}
    with serving_into(copy, tmp_path / "serve.err") as served:
        before = served.said("store.sqlite is damaged")
        for path in ("/v1/points", "/v1/points?metric=m1", "/v1/deliveries/1", "/v1/snapshots"):
            answer = httpx.get(f"{served.url}{path}", headers=headers, timeout=LIMIT_S)
            assert answer.status_code == 503, (path, answer.text)
            assert "Retry-After" not in answer.headers
            refusal = answer.json()
            assert refusal["error"] == "STORE_DAMAGED", path
            assert "nothing is read from it until serve is started again" in refusal["message"]
        status = httpx.get(f"{served.url}/v1/status", headers=headers, timeout=LIMIT_S)
        assert status.status_code == 200, status.text
        assert status.json()["lag"]["stopped_because"] == "store_damaged"
        assert status.json()["first_pass_completed"] is False
        beside = run_cli("status", "--json", "--data", copy)
        assert beside.code == 0, beside.err
        assert json.loads(beside.out)["lag"]["stopped_because"] == "store_damaged"
        text = run_cli("status", "--data", copy).out.decode()
        assert "last pass stopped: store_damaged" in text, text
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0
    after = served.err.read_text()[len(before) :]
    noisy = [line for line in after.splitlines() if "level=ERROR" in line or "WARNING" in line]
    assert noisy == [], after


def test_reads_of_a_damaged_store_during_its_check_wait_for_its_verdict_serve_163(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """SERVE-163: `serve` on a torn store, its check held back 10 s by a fault point (the
    check of 4 years read from the disk takes 10 to 20 s): `/v1/points` and `/v1/snapshots`
    asked meanwhile, reading the store unchecked, fail there and wait for the check's verdict:
    each is answered 503 `STORE_DAMAGED` once the check has found the store damaged, as after
    it (SERVE-150), and no line above INFO is logged for them. (Before, `/v1/points` was 500
    `INTERNAL` with an ERROR `unhandled StorageError in GET /v1/points`, and `/v1/snapshots` 503
    `SNAPSHOT_UNAVAILABLE` with `Retry-After: 60` and a WARNING, until the check ended.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "phone", "--data", copy).out.decode().strip()
    headers = {"Authorization": f"Bearer {token}"}
    plan = {"store.check": {"hits": [1], "do": "delay", "seconds": 10}}
    held = {"HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    with serving_into(copy, tmp_path / "serve.err", held) as served:
        before = served.said("fault injected at store.check")
        paths = ("/v1/points?metric=m1", "/v1/snapshots")
        # Both asked at once, some 10 s before the check begins.
        assert "store.sqlite is damaged" not in served.err.read_text()
        with concurrent.futures.ThreadPoolExecutor(len(paths)) as asking:
            asked = [
                asking.submit(httpx.get, f"{served.url}{path}", headers=headers, timeout=LIMIT_S)
                for path in paths
            ]
        for path, answer in zip(paths, (future.result() for future in asked), strict=True):
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"] == "STORE_DAMAGED", (path, answer.text)
            assert "Retry-After" not in answer.headers
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0
    after = served.err.read_text()[len(before) :]
    noisy = [line for line in after.splitlines() if "level=ERROR" in line or "WARNING" in line]
    assert len(noisy) == 1, after
    assert "store.sqlite is damaged" in noisy[0]


def test_a_stop_ends_a_read_waiting_for_the_store_check_serve_163(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """SERVE-163: a `/v1/points` that failed on a torn store and waits for the check's verdict
    (the check held back 10 minutes by a fault point) does not hold a SIGTERM up: `serve` exits
    0 within 10 s, the read answered (the error it met, 500) as it stops. (Waiting for the
    verdict alone, the stop waited for the request up to the graceful timeout, 30 s.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "phone", "--data", copy).out.decode().strip()
    plan = {"store.check": {"hits": [1], "do": "delay", "seconds": 600}}
    held = {"HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    with serving_into(copy, tmp_path / "serve.err", held) as served:
        served.said("fault injected at store.check")
        with concurrent.futures.ThreadPoolExecutor(1) as asking:
            asked = asking.submit(
                httpx.get,
                f"{served.url}/v1/points?metric=m1",
                headers={"Authorization": f"Bearer {token}"},
                timeout=LIMIT_S,
            )
            with pytest.raises(concurrent.futures.TimeoutError):
                asked.result(timeout=1)
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(10) == 0, served.err.read_text()
            assert asked.result().status_code == 500
    assert "Traceback" not in served.err.read_text()


def upgrade(url: str, token: str) -> tuple[int, dict[str, str], bytes]:
    """The answer to a websocket upgrade of `/v1/stream` with ``token``, sent on a real socket:
    its status, headers (lowercase names) and body (none for a 101)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=LIMIT_S) as conn:
        conn.sendall(
            (
                f"GET /v1/stream?after=0 HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
            ).encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := conn.recv(65536)):
            answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        lines = head.decode("latin1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = 0 if status == 101 else int(headers["content-length"])
        while len(rest) < length and (chunk := conn.recv(65536)):
            rest += chunk
    return status, headers, rest[:length]


def test_the_stream_beside_a_damaged_store_is_refused_503_before_the_upgrade_stream_205(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STREAM-205: `serve` journaling beside a torn store (STORE-142) refuses a `/v1/stream`
    upgrade with a live token before the handshake, as `/v1/points` is refused (SERVE-150): 503
    `{"error": "STORE_DAMAGED", "message": ...}` without `Retry-After`, each refusal one INFO
    line and no WARNING; a token that is not live is still refused 4401 after the handshake.
    (Before, every connection was accepted and closed 1011, each with a WARNING naming
    StorageError: 7 in a minute from one `healthlog follow`.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "nas", "--data", copy).out.decode().strip()
    with serving_into(copy, tmp_path / "serve.err") as served:
        before = served.said("store.sqlite is damaged")
        for _ in range(3):
            status, headers, refused = upgrade(served.url, token)
            assert status == 503, (status, refused)
            assert "retry-after" not in headers
            assert json.loads(refused)["error"] == "STORE_DAMAGED"
            assert "until serve is started again" in json.loads(refused)["message"]
        status, _, _ = upgrade(served.url, "hl_not_a_token")
        assert status == 101
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0
    after = served.err.read_text()[len(before) :]
    assert after.count("refused 503 GET /v1/stream from 127.0.0.1: the store was found unfit") == 3
    noisy = [line for line in after.splitlines() if "level=ERROR" in line or "WARNING" in line]
    assert noisy == [], after


def follow_refused(served: Served, token: str, replica: Path, refusal: str) -> str:
    """The stderr of `healthlog follow` at INFO into ``replica`` against ``served``, stopped by
    SIGINT (exit 0) once it has said three connections lost for ``refusal``."""
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    env |= {"HEALTHLOG_TOKEN": token, "HEALTHLOG_LOG_LEVEL": "INFO"}
    err = replica.parent / f"{replica.name}.err"
    with (
        err.open("w") as stderr,
        subprocess.Popen(
            healthlog("follow", "--url", served.url, "--replica", replica),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        ) as follower,
    ):
        try:
            deadline = time.monotonic() + LIMIT_S
            while err.read_text().count(f"connection lost (ConnectionLost: {refusal}") < 3:
                assert follower.poll() is None, err.read_text()
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            follower.send_signal(signal.SIGINT)
            assert follower.wait(LIMIT_S) == 0, err.read_text()
        finally:
            if follower.poll() is None:
                follower.kill()
    said = err.read_text()
    assert "Traceback" not in said
    return said


def said_damaged_once(said: str) -> None:
    """``said`` holds STREAM-206's WARNING, once."""
    warnings = [line for line in said.splitlines() if "cannot be followed" in line]
    assert len(warnings) == 1, said
    assert "level=WARNING" in warnings[0]
    assert "the service cannot be followed: its store.sqlite is damaged" in warnings[0]
    assert "until it is started again with the store moved away" in warnings[0]


def test_follow_says_once_that_the_store_is_damaged_and_backs_off_stream_206(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STREAM-206: `healthlog follow` against a `serve` journaling beside a torn store says at
    once, in one WARNING, that the service's store.sqlite is damaged and what the service does
    until it is started again, and goes on retrying with its backoff (the service's 503s
    counted), not saying it again; SIGINT stops it with 0. (Before, its one WARNING came after a
    minute of reconnects and said only `the stream ended`.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    token = run_cli("token", "add", "nas", "--data", copy).out.decode().strip()
    with serving_into(copy, tmp_path / "serve.err") as served:
        served.said("store.sqlite is damaged")
        said = follow_refused(served, token, tmp_path / "replica", "the server refused the stream")
    said_damaged_once(said)


def test_follow_says_once_that_the_store_is_damaged_when_its_snapshot_is_refused_stream_206(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STREAM-206, STREAM-207: a replica ahead of the torn store's head (it followed the live
    directory one delivery further), whose `follow` asks the service for its snapshot, refused
    503 `STORE_DAMAGED` by `GET /v1/snapshots`, says the same one WARNING, at once, and retries;
    that the service's stream went back behind the replica is said once, not at each retry.
    (Before, that WARNING came again at every retry: 4 in its first 5 s, then 2 a minute.)"""
    copy = torn_copy(run_cli, tmp_path, "store.sqlite")
    live = tmp_path / "live"
    later = write(
        tmp_path / "later.json",
        body(metric("later", "count", point("2024-03-05 10:00:00 +0000", qty=3))),
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", live, later).code == 0
    live_token = run_cli("token", "add", "nas", "--data", live).out.decode().strip()
    replica = tmp_path / "replica"
    with serving_into(live, tmp_path / "live.err") as served:
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        env["HEALTHLOG_TOKEN"] = live_token
        caught_up = subprocess.run(
            healthlog("follow", "--url", served.url, "--replica", replica, "--until-caught-up"),
            capture_output=True,
            text=True,
            env=env,
            timeout=LIMIT_S,
            check=False,
        )
        assert caught_up.returncode == 0, caught_up.stderr
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0
    # The same service: its instance is the journal's, its snapshot key this file.
    shutil.copy2(live / "signing.key", copy / "signing.key")
    token = run_cli("token", "add", "nas", "--data", copy).out.decode().strip()
    with serving_into(copy, tmp_path / "serve.err") as served:
        served.said("store.sqlite is damaged")
        said = follow_refused(served, token, replica, "/v1/snapshots answered 503")
    said_damaged_once(said)
    assert said.count("the service's stream went back from seq") == 1, said


def test_serve_journals_while_it_checks_the_store_and_a_signal_stops_the_check_run_162(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """RUN-162: `serve` listens once the journal is checked: while its store check is held open
    (a fault point in it sleeps 10 minutes), `/healthz` answers 200, a delivery 200 and
    `/readyz` 503, and SIGTERM stops it with 0 without waiting for the check; the next start
    folds the delivery. (Before, `serve` read every page of both files before it listened:
    after a power cut on 4 years of data the phone's deliveries were refused for 18 s.)"""
    data = tmp_path / "data"
    first = write(
        tmp_path / "first.json",
        body(metric("first", "count", point("2024-03-01 08:00:00 +0000", qty=1))),
    )
    posted = write(
        tmp_path / "posted.json",
        body(metric("posted", "count", point("2024-03-01 09:00:00 +0000", qty=2))),
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, first).code == 0
    token = run_cli("token", "add", "phone", "--data", data).out.decode().strip()
    plan = {"store.check": {"hits": [1], "do": "delay", "seconds": 600}}
    held = {"HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    with serving_into(data, tmp_path / "serve.err", held) as served:
        served.said("fault injected at store.check")
        assert served.get("/healthz") == 200
        assert served.post(token, posted).status_code == 200
        assert served.get("/readyz") == 503
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(LIMIT_S) == 0, served.err.read_text()
    assert "Traceback" not in served.err.read_text()
    folded = run_cli("import", "--aggregation", "minutes", "--data", data, first)
    assert folded.code == 0, folded.err
    exported = {line["metric"] for line in run_cli("export", "--data", data).json_lines()}
    assert exported == {"first", "posted"}


def test_a_signal_during_the_journal_check_stops_serve_before_it_listens_run_163(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """RUN-163: a SIGTERM while `serve` checks the journal, before it listens (a fault point in
    the check sleeps 10 minutes), stops it with 0 without waiting for the check and without
    listening, no traceback; the next start journals and folds. (Before, the check ran to its
    end, 2.9 s at 4 years read from the disk, then `serve` listened and stopped: here it was
    still running 10 s after the signal.)"""
    data = tmp_path / "data"
    first = write(
        tmp_path / "first.json",
        body(metric("first", "count", point("2024-03-01 08:00:00 +0000", qty=1))),
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, first).code == 0
    plan = {"journal.check": {"hits": [1], "do": "delay", "seconds": 600}}
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    env["HEALTHLOG_FAULT_PLAN"] = json.dumps(plan)
    err = tmp_path / "serve.err"
    with (
        err.open("w") as stderr,
        subprocess.Popen(
            healthlog("serve", "--port", "0", "--data", data),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        ) as proc,
    ):
        try:
            deadline = time.monotonic() + LIMIT_S
            while "fault injected at journal.check" not in err.read_text():
                assert proc.poll() is None, err.read_text()
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0, err.read_text()
            assert proc.stdout is not None
            assert "serving on" not in proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    said = err.read_text()
    assert "Traceback" not in said, said
    assert "stopping on SIGTERM" in said, said
    second = write(
        tmp_path / "second.json",
        body(metric("second", "count", point("2024-03-01 09:00:00 +0000", qty=2))),
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, second).code == 0
    exported = {line["metric"] for line in run_cli("export", "--data", data).json_lines()}
    assert exported == {"first", "second"}


DATABASES = ("journal.sqlite", "store.sqlite")
DEBUG = {"HEALTHLOG_LOG_LEVEL": "DEBUG"}


def not_read_again(err: str) -> set[str]:
    """The database files a command's DEBUG lines say it did not read again."""
    return {
        name
        for name in DATABASES
        if f"{name}: unchanged since it was last found whole, not read again" in err
    }


def tear_in_place(path: Path) -> None:
    """Zero page 2 of the database at ``path`` (a b-tree page) in its own inode, its size and
    modification time put back: of what a start compares, only the change time (ctime) moves,
    which the kernel sets for any program that writes into the file."""
    before = path.stat()
    with path.open("r+b") as held:
        page = int.from_bytes(held.read(18)[16:18], "big")
        held.seek(page)
        held.write(bytes(page))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def serve_debug(data: Path, stop: signal.Signals, beside: Callable[[], None] = lambda: None) -> str:
    """The stderr of `healthlog serve` at DEBUG on ``data``, sent ``stop`` once it is ready
    (its store checked beside intake: RUN-162) and ``beside`` has run."""
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"} | DEBUG
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as served:
        try:
            assert served.stdout is not None
            line = served.stdout.readline().decode()
            assert line.startswith("healthlog serving on http://127.0.0.1:"), line
            while httpx.get(f"{line.split()[3]}/readyz", timeout=LIMIT_S).status_code != 200:
                time.sleep(0.05)
            beside()
        finally:
            served.send_signal(stop)
            _, err = served.communicate(timeout=LIMIT_S)
    assert served.returncode == (0 if stop == signal.SIGTERM else -stop), err
    return err.decode()


def test_a_start_reads_no_page_of_files_healthlog_left_whole_journal_50_store_140_run_160_161(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """JOURNAL-50, STORE-140, RUN-160, RUN-161: `import`, `seal` and `serve` started on files
    that the last process to close them had found whole do not read them again, nor does a
    `seal` beside a `serve` that found them whole; a file another program wrote since
    (`sqlite3 store.sqlite VACUUM`) is read again, as both are after a `serve` killed outright;
    a `serve` stopped by SIGTERM records them as a command does. (Before,
    every start read every page of both: 16 s of the 17.6 s `serve` took to answer after a
    reboot on 4 years of data.)"""
    data = tmp_path / "data"
    sent = [
        write(
            tmp_path / f"sent-{n}.json",
            body(metric("steps", "count", point(f"2024-03-0{n + 1} 08:00:00 +0000", qty=n))),
        )
        for n in range(4)
    ]
    imported = ("import", "--aggregation", "minutes", "--data", data)
    first = run_cli(*imported, sent[0], env=DEBUG)
    assert first.code == 0, first.err
    assert not_read_again(first.err) == set()
    assert sorted(json.loads((data / "checked.json").read_text())["closed"]) == list(DATABASES)
    assert stat.S_IMODE((data / "checked.json").stat().st_mode) == 0o600
    again = run_cli(*imported, sent[1], env=DEBUG)
    assert again.code == 0, again.err
    assert not_read_again(again.err) == set(DATABASES)
    with closing(sqlite3.connect(data / "store.sqlite")) as conn:
        conn.execute("VACUUM")
    sealed = run_cli("seal", "--before", "2024-03-02", "--data", data, env=DEBUG)
    assert sealed.code == 0, sealed.err
    assert not_read_again(sealed.err) == {"journal.sqlite"}

    def seal_beside() -> None:
        beside = run_cli("seal", "--before", "2024-03-03", "--no-wait", "--data", data, env=DEBUG)
        assert beside.code == 0, beside.err
        assert not_read_again(beside.err) == set(DATABASES)

    assert not_read_again(serve_debug(data, signal.SIGTERM, seal_beside)) == set(DATABASES)
    after_serve = run_cli(*imported, sent[2], env=DEBUG)
    assert not_read_again(after_serve.err) == set(DATABASES)
    assert not_read_again(serve_debug(data, signal.SIGKILL)) == set(DATABASES)
    after_kill = run_cli(*imported, sent[3], env=DEBUG)
    assert after_kill.code == 0, after_kill.err
    assert not_read_again(after_kill.err) == set()
    assert run_cli("verify", "--data", data).code == 0


@pytest.mark.parametrize("name", DATABASES)
def test_a_file_left_whole_then_written_in_place_is_refused_journal_51_store_141(
    run_cli: RunCli, tmp_path: Path, name: str
) -> None:
    """JOURNAL-51, STORE-141: a file recorded as found whole, then damaged in place by another
    program (page 2 zeroed in the same inode, its size and modification time put back), is
    read again: `import` exits 3 with one line naming it as damaged, and nothing is journaled;
    so does `serve` for the journal, and for the store says so at ERROR while it listens
    (STORE-142); a copy of the directory with its record (`cp -a`) is read whole, every file
    of it another inode."""
    data = tmp_path / "data"
    sent = write(
        tmp_path / "sent.json",
        body(metric("steps", "count", point("2024-03-01 08:00:00 +0000", qty=1))),
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", data, copy], check=True)
    copied = run_cli("import", "--aggregation", "minutes", "--data", copy, sent, env=DEBUG)
    assert copied.code == 0, copied.err
    assert not_read_again(copied.err) == set()
    tear_in_place(data / name)
    journal_size = (data / "journal.sqlite").stat().st_size
    if name == "journal.sqlite":
        served = serve_exit(data)
        assert served.returncode == 3, served.stdout + served.stderr
        assert "serving on" not in served.stdout
        one_line_error(served.stderr, f"{name} is damaged")
    else:
        with serving_into(data, tmp_path / "serve.err") as beside:
            beside.said(f"{name} is damaged")
            beside.proc.send_signal(signal.SIGTERM)
            assert beside.proc.wait(LIMIT_S) == 0, beside.err.read_text()
    run = run_cli("import", "--aggregation", "minutes", "--data", data, sent)
    assert run.code == 3, run.err
    one_line_error(run.err, f"{name} is damaged")
    assert (data / "journal.sqlite").stat().st_size == journal_size


def test_reindex_keeps_the_points_of_bodies_the_journal_lost_store_56(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-56: a torn copy of the journal whose lost pages were only bodies (SQLite's page
    check finds it whole), beside the store that folded them: `verify` names the deliveries and
    says to restore the journal, not to reindex, and `reindex` exits 3 with one line naming
    them and saying to restore the journal, and changes nothing, the store keeping their
    points. (Before, `reindex` recorded them failed
    and dropped their 40 objects from the store, the only copy left of them, with exit 0.)"""
    copy = torn_copy(run_cli, tmp_path, "journal.sqlite", points=55)
    with closing(sqlite3.connect(copy / "journal.sqlite")) as conn:
        assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    before = run_cli("export", "--data", copy).out
    assert len(before.splitlines()) == 31 * 8 * 55
    verified = run_cli("verify", "--data", copy)
    assert verified.code == 1
    assert "delivery 26 is recorded parsed, a rebuild records it failed" in verified.err
    assert "records them anew" not in verified.err
    assert (
        "verify: 5 deliveries folded into the store no longer match their sha256 in the journal"
        " (delivery 26, 27, 28, 29, 30)"
    ) in verified.err
    run = run_cli("reindex", "--data", copy)
    assert run.code == 3, run.err
    refusal = [line for line in run.err.splitlines() if line.startswith("healthlog: ")]
    assert len(refusal) == 1, run.err
    assert "delivery 26, 27, 28, 29, 30" in refusal[0]
    assert "Restore the journal from a backup" in refusal[0]
    assert "Traceback" not in run.err
    assert run_cli("export", "--data", copy).out == before


def test_a_store_folded_from_another_journal_is_refused_until_reindexed_cli_52(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-52: a journal restored from a backup older than the store (or emptied) gives again
    the ids of deliveries the store has folded: `import`, `status` and `verify` exit 3 with one
    line that says so and how to mend it, journaling nothing, and so does `reindex`, which
    would keep the folded deliveries' change events; with the store moved away, `reindex` folds
    that journal into a new one, and a new delivery folds and exports. (Before, `import`
    journaled its file under the id of a delivery the store had folded, reported that one's
    outcome, `parsed`, and never folded it: its points were lost to the projection; and after
    a `reindex` every fold collided with the old change events and was never written.)"""
    data = tmp_path / "data"
    args = ("import", "--aggregation", "minutes", "--data", data)

    def sent(name: str, at: str) -> Path:
        return write(tmp_path / f"{name}.json", body(metric(name, "count", point(at, qty=1))))

    assert run_cli(*args, sent("first", "2024-02-06 07:00:00 -0800")).code == 0
    backup = tmp_path / "journal-backup.sqlite"
    with sqlite3.connect(data / "journal.sqlite") as live, sqlite3.connect(backup) as copy:
        live.backup(copy)
    copy.close()
    live.close()
    assert run_cli(*args, sent("second", "2024-02-06 08:00:00 -0800")).code == 0
    for leftover in data.glob("journal.sqlite*"):
        leftover.unlink()
    backup.rename(data / "journal.sqlite")

    later = sent("later", "2024-02-06 09:00:00 -0800")
    for command in (
        (*args, later),
        ("status", "--data", data),
        ("verify", "--data", data),
        ("reindex", "--data", data),
    ):
        run = run_cli(*command)
        assert run.code == 3, (command, run.err)
        one_line_error(run.err, "healthlog reindex")
        assert "another journal" in run.err
    assert run_cli("status", "--json", "--data", data).code == 3
    for store_file in data.glob("store.sqlite*"):
        store_file.unlink()
    assert run_cli("reindex", "--data", data).code == 0
    status = json.loads(run_cli("status", "--json", "--data", data).out)
    assert status["journal"]["deliveries"] == 1
    assert run_cli(*args, later).code == 0
    exported = run_cli("export", "--data", data).json_lines()
    assert [line["metric"] for line in exported] == ["first", "later"]
    assert run_cli("verify", "--data", data).code == 0


def without_stdout(*args: str | os.PathLike[str]) -> tuple[int, str]:
    """Exit code and stderr of a command started with its stdout closed (``>&-``)."""
    proc = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *healthlog(*args)],
        stderr=subprocess.PIPE,
        timeout=LIMIT_S,
        check=False,
    )
    return proc.returncode, proc.stderr.decode()


def to_full_stdout(*args: str | os.PathLike[str]) -> tuple[int, str]:
    """Exit code and stderr of a command whose stdout is ``/dev/full`` (every write fails with
    ENOSPC, as on a full disk)."""
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            healthlog(*args), stdout=full, stderr=subprocess.PIPE, timeout=LIMIT_S, check=False
        )
    return proc.returncode, proc.stderr.decode()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_stdout_that_cannot_be_written_is_named_cli_57(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-57: `export`, `status` (plain, `--json`, `--failed`), `token list` and a `verify`
    that finds differences, writing to a full stdout, exit 3 with one line naming stdout, not
    a bare `[Errno 28] No space left on device` that reads as the data directory's disk; and
    so does each started with its stdout closed (before: a traceback for most, exit 0 with
    nothing said for `verify`'s `print`)."""
    data = differing(run_cli, tmp_path)
    assert run_cli("token", "add", "phone", "--data", data).code == 0
    for command in (
        ("export",),
        ("export", "--format", "csv"),
        ("status",),
        ("status", "--json"),
        ("status", "--failed"),
        ("token", "list"),
        ("verify",),
    ):
        code, err = to_full_stdout(*command, "--data", data)
        assert code == 3, (command, err)
        assert "Traceback" not in err
        assert err.splitlines()[-1] == "healthlog: cannot write to stdout: No space left on device"
        code, err = without_stdout(*command, "--data", data)
        assert code == 3, (command, err)
        assert "Traceback" not in err
        assert err.splitlines()[-1] == "healthlog: cannot write to stdout: it is closed"
    assert run_cli("export", "--data", data).lines()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_token_that_cannot_be_shown_is_not_kept_cli_58(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-58: `token add` whose token cannot be printed (a full stdout, or a reader gone
    before the write) revokes it and exits 3 saying so; the name is free again. (Before: the
    token was kept, unseen, its name taken, with exit 0 and nothing said for a reader gone.)"""
    data = tmp_path / "data"
    assert run_cli("token", "add", "watch", "--data", data).code == 0
    code, err = to_full_stdout("token", "add", "phone", "--data", data)
    assert code == 3
    one_line_error(err, "token 'phone' not added, since it could not be shown: cannot write")
    read_end, write_end = os.pipe()
    os.close(read_end)
    with subprocess.Popen(
        healthlog("token", "add", "tablet", "--data", data),
        stdout=write_end,
        stderr=subprocess.PIPE,
    ) as add:
        os.close(write_end)
        _, gone = add.communicate(timeout=LIMIT_S)
    assert add.returncode == 3
    one_line_error(gone.decode(), "token 'tablet' not added, since it could not be shown")
    code, err = without_stdout("token", "add", "laptop", "--data", data)
    assert code == 3
    one_line_error(err, "token 'laptop' not added, since it could not be shown: cannot write")
    assert run_cli("token", "list", "--data", data).out.decode().splitlines() == ["watch"]
    again = run_cli("token", "add", "phone", "--data", data)
    assert again.code == 0
    assert again.out.decode().startswith("hl_")


def test_the_data_directory_s_files_are_readable_by_its_user_alone_store_62(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-62: under the usual umask 022, every file healthlog makes in a new data directory
    (the journal, the store, the tokens, their ``-wal`` and ``-shm`` files, a store swapped in
    by ``reindex``, a snapshot file, the signing key) is its user's alone, mode 0600."""
    data = DataDir(tmp_path / "data")
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    previous = os.umask(0o022)
    try:
        assert run_cli("token", "add", "phone", "--data", data.path).code == 0
        assert run_cli("import", "--aggregation", "minutes", "--data", data.path, hr).code == 0
        assert run_cli("reindex", "--data", data.path).code == 0
        with data.open_journal() as journal, data.open_store() as store, data.open_tokens():
            snapshot_files.build(
                data.snapshot_dir, journal, store, data.signing_key(), "/v1/snapshots"
            )
            modes = {
                path.relative_to(data.path).as_posix(): stat.S_IMODE(path.stat().st_mode)
                for path in data.path.rglob("*")
                if path.is_file()
            }
    finally:
        os.umask(previous)
    names = {name.rsplit("/", 1)[-1] for name in modes}
    assert {"journal.sqlite-wal", "store.sqlite-shm", "tokens.sqlite", "signing.key"} <= names
    assert any(name.endswith(".snap") for name in names)
    assert {name: oct(mode) for name, mode in modes.items() if mode & 0o077} == {}


def test_no_directory_healthlog_makes_is_writable_by_others_store_96(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-96: under umask 000, the directories healthlog makes (a new data directory and
    the missing ones above it, ``snapshots/``, a replica's directory and those above it) are
    0755: none lets another account remove or replace the journal, the tokens or the signing
    key, or plant a link where a snapshot is written. Its files stay 0600."""
    data = DataDir(tmp_path / "nas" / "health" / "data")
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    previous = os.umask(0o000)
    try:
        assert run_cli("token", "add", "phone", "--data", data.path).code == 0
        assert run_cli("import", "--aggregation", "minutes", "--data", data.path, hr).code == 0
        assert run_cli("reindex", "--data", data.path).code == 0
        with data.open_journal() as journal, data.open_store() as store:
            snapshot_files.build(
                data.snapshot_dir, journal, store, data.signing_key(), "/v1/snapshots"
            )
        Replica(tmp_path / "laptop" / "replica").close()
    finally:
        os.umask(previous)
    modes = {
        path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
        for path in tmp_path.rglob("*")
    }
    directories = {name for name in modes if (tmp_path / name).is_dir()}
    assert {"nas", "nas/health", "nas/health/data", "nas/health/data/snapshots"} <= directories
    assert {"laptop", "laptop/replica"} <= directories
    assert {name: oct(modes[name]) for name in directories if modes[name] != 0o755} == {}
    in_data = {name: mode for name, mode in modes.items() if name.startswith("nas/health/data/")}
    assert {
        name: oct(mode)
        for name, mode in in_data.items()
        if name not in directories and mode != 0o600
    } == {}


def test_files_every_user_may_read_are_named_at_start_store_79(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-79: a data directory whose databases an older healthlog made readable by every
    user (0644, their `-wal` and `-shm` files too) is named in one WARNING as a runtime starts
    on it (`import` here, `serve` alike), with `chmod -R o-rwx DIR`; after that command the next
    start says nothing of it."""
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    for name in ("journal.sqlite", "store.sqlite"):
        (data / name).chmod(0o644)
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    warned = [line for line in again.err.splitlines() if "readable by every user" in line]
    assert len(warned) == 1, again.err
    assert "level=WARNING logger=healthlog.datadir" in warned[0]
    for name in ("journal.sqlite", "store.sqlite"):
        for suffix in ("", "-wal", "-shm"):
            assert f" {name}{suffix} (mode 0644)" in warned[0], warned[0]
    assert "tokens.sqlite" not in warned[0]
    assert f"(mode 0644); `chmod -R o-rwx {data}` makes them unreadable" in warned[0], warned[0]
    assert "older healthlog" not in warned[0], warned[0]
    assert "1.5" not in warned[0]
    subprocess.run(["chmod", "-R", "o-rwx", data], check=True)
    mended = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert mended.code == 0, mended.err
    assert "readable by every user" not in mended.err


@pytest.mark.parametrize("fmt", ["kv", "json"])
def test_a_record_naming_a_path_that_is_not_utf8_is_logged_serve_160(
    run_cli: RunCli, tmp_path: Path, fmt: str
) -> None:
    """SERVE-160: GIVEN a data directory named with a byte that is not UTF-8 (`donn\\xe9es`, as
    a disk formatted under Latin-1 names it) whose databases every user may read WHEN a runtime
    starts on it (`import`) THEN STORE-79's WARNING is one record in the format asked for, the
    byte written `\\udce9` as the command's own lines write it. (Before, the formatter refused
    the lone surrogate Python reads such a byte as: the record was lost, and stderr had a
    `--- Logging error ---` traceback instead.)"""
    data = Path(os.fsdecode(os.fsencode(tmp_path) + b"/donn\xe9es"))
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    for name in ("journal.sqlite", "store.sqlite"):
        (data / name).chmod(0o644)
    again = run_cli(
        "import", "--aggregation", "minutes", "--data", data, hr, env={"HEALTHLOG_LOG_FORMAT": fmt}
    )
    assert again.code == 0, again.err
    assert "Logging error" not in again.err, again.err
    warned = [line for line in again.err.splitlines() if "readable by every user" in line]
    assert len(warned) == 1, again.err
    shown = os.fspath(data).encode("utf-8", "backslashreplace").decode()
    if fmt == "json":
        record = json.loads(warned[0])
        assert (record["level"], record["logger"]) == ("WARNING", "healthlog.datadir")
        message = record["msg"]
    else:
        prefix, _, quoted = warned[0].partition(" msg=")
        assert re.fullmatch(r"time=\S+ level=WARNING logger=healthlog\.datadir", prefix), prefix
        message = json.loads(quoted)
    assert message.startswith(f"health data readable by every user of the machine in {shown}: ")
    assert f"`chmod -R o-rwx '{shown}'` makes them unreadable" in message


def test_a_restore_readable_by_every_user_is_named_without_a_guessed_cause_store_99(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-99: a journal backed up with `sqlite3 .backup` under umask 022 (0644) and copied
    into a new data directory is named in the WARNING as a runtime starts on it, with its mode
    and `chmod -R o-rwx DIR`, and no cause: it said `made by an older healthlog`, which no
    healthlog did here."""
    sqlite = shutil.which("sqlite3")
    if sqlite is None:
        pytest.skip("the sqlite3 command is missing")
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    backup = tmp_path / "backup"
    backup.mkdir()
    subprocess.run(
        [
            "sh",
            "-c",
            'umask 022 && "$0" "$1" ".backup $2"',
            sqlite,
            data / "journal.sqlite",
            backup / "journal.sqlite",
        ],
        check=True,
    )
    restored = tmp_path / "restored"
    restored.mkdir(mode=0o700)
    shutil.copy(backup / "journal.sqlite", restored / "journal.sqlite")
    assert stat.S_IMODE((restored / "journal.sqlite").stat().st_mode) == 0o644
    again = run_cli("import", "--aggregation", "minutes", "--data", restored, hr)
    assert again.code == 0, again.err
    warned = [line for line in again.err.splitlines() if "readable by every user" in line]
    assert len(warned) == 1, again.err
    assert (
        f"readable by every user of the machine in {restored}: journal.sqlite (mode 0644)"
        in (warned[0])
    ), warned[0]
    assert f"; `chmod -R o-rwx {restored}` makes them unreadable to others" in warned[0]
    assert "older healthlog" not in warned[0], warned[0]


def test_directories_every_user_may_write_in_are_named_at_start_store_97(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-97, STORE-100: a data directory and a `snapshots/` of mode 0777 (an older
    healthlog made them so under umask 000; here a `chmod`) are named in one WARNING as a
    runtime starts on them, with `chmod go-w` of both and no cause (it said `made by an older
    healthlog`, wrong after a `chmod` or a restore); after that command the next start says
    nothing of them."""
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    (data / "snapshots").mkdir()
    for directory in (data, data / "snapshots"):
        directory.chmod(0o777)
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    warned = [line for line in again.err.splitlines() if "may write in" in line]
    assert len(warned) == 1, again.err
    assert "level=WARNING logger=healthlog.datadir" in warned[0]
    assert f" {data} (mode 0777), {data / 'snapshots'} (mode 0777); any" in warned[0], warned[0]
    assert "older healthlog" not in warned[0], warned[0]
    assert f"`chmod go-w {data} {data / 'snapshots'}`" in warned[0], warned[0]
    subprocess.run(["chmod", "go-w", data, data / "snapshots"], check=True)
    mended = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert mended.code == 0, mended.err
    assert "may write in" not in mended.err


def test_what_the_group_may_write_is_named_at_start_store_108(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-108: a data directory of mode 0775 and a `journal.sqlite` of mode 0660, of a group
    another account belongs to, are named in
    one WARNING as a runtime starts on them (`import`), with the journal's `-wal` and `-shm`
    (SQLite gives them its mode), their group, and `chmod g-w` of each; after that command the
    next start says nothing of them. A directory every user may write in is STORE-97's alone
    (STORE-109). (Before, nothing was said: any account of the group could remove or replace
    the journal and the tokens, or rewrite the journal.)"""
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    data.chmod(0o775)
    (data / "journal.sqlite").chmod(0o660)
    shared = shared_group(data.stat().st_uid)
    for path in (data, *data.iterdir()):
        os.chown(path, -1, shared.gr_gid)
    group = shared.gr_name
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    warned = [line for line in again.err.splitlines() if "group may write" in line]
    assert len(warned) == 1, again.err
    assert "level=WARNING logger=healthlog.datadir" in warned[0]
    named = [data, *(data / f"journal.sqlite{suffix}" for suffix in ("", "-wal", "-shm"))]
    listed = ", ".join(
        f"{path} (mode {0o775 if path == data else 0o660:04o}, group {group})" for path in named
    )
    assert f"group may write: {listed}; any" in warned[0], warned[0]
    assert f"`chmod g-w {data} {data}/journal.sqlite*`" in warned[0], warned[0]
    subprocess.run(["chmod", "g-w", data, data / "journal.sqlite"], check=True)
    mended = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert mended.code == 0, mended.err
    assert "group may write" not in mended.err
    data.chmod(0o777)
    (data / "journal.sqlite").chmod(0o600)
    world = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert world.code == 0, world.err
    assert "group may write" not in world.err
    assert len([line for line in world.err.splitlines() if "may write in" in line]) == 1


def shared_group(uid: int) -> grp.struct_group:
    """A group to which an account other than ``uid`` belongs (its primary group, or a member)."""
    return next(
        group
        for group in grp.getgrall()
        if any(
            account.pw_uid != uid
            and (account.pw_gid == group.gr_gid or account.pw_name in group.gr_mem)
            for account in pwd.getpwall()
        )
    )


def test_a_group_of_the_owner_alone_is_not_named_store_110(run_cli: RunCli, tmp_path: Path) -> None:
    """STORE-110: a data directory of mode 0775 and a `journal.sqlite` of mode 0660 whose group
    no account but their owner belongs to (a user private group, as Debian, Ubuntu and Fedora
    give each user, whose umask 002 then makes a `mkdir` 0775) are named in no WARNING: no other
    account may write them. (Before, STORE-108's WARNING named them at every start.)"""
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    owner = pwd.getpwuid(data.stat().st_uid)
    alone = grp.getgrgid(owner.pw_gid)
    assert set(alone.gr_mem) <= {owner.pw_name}
    assert [a.pw_name for a in pwd.getpwall() if a.pw_gid == alone.gr_gid] == [owner.pw_name]
    for path in (data, *data.iterdir()):
        os.chown(path, -1, alone.gr_gid)
    data.chmod(0o775)
    (data / "journal.sqlite").chmod(0o660)
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    assert "group may write" not in again.err, again.err


def test_a_data_directory_another_user_owns_is_named_with_what_to_do_cli_90(
    run_cli: RunCli,
) -> None:
    """CLI-90: a command run as a user that may not write the data directory's files (another
    user's, or read-only) exits 3 with one line naming the file, the user, the file's owner and
    mode, and what to do (`sudo -u OWNER`, `chown -R`); reading commands too, since every
    command opens the databases to write. As root, whom modes do not stop, the commands run as
    user 65534; otherwise the files are made read-only."""
    with reachable_home("healthlog-cli-90-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
        assert run_cli("token", "add", "phone", "--data", data).code == 0
        assert run_cli("status", "--data", data).code == 0
        files = list(data.iterdir())
        as_another: list[str] = []
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("root is stopped by no mode, and setpriv is missing")
            as_another = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        else:
            for path in files:
                path.chmod(0o400)
            data.chmod(0o555)
        try:
            for args in (("export",), ("status",), ("status", "--failed"), ("token", "list")):
                done = subprocess.run(
                    [*as_another, *healthlog(*args, "--data", data)],
                    capture_output=True,
                    timeout=LIMIT_S,
                    check=False,
                    cwd=home,
                )
                err = done.stderr.decode()
                assert done.returncode == 3, (args, err)
                one_line_error(err, " may not ")
                assert re.search(r"\(it is \S+'s, mode 0[0-7]{3}\)", err), err
                assert "as the user it belongs to (`sudo -u " in err, err
                user = re.search(r"user (\S+) may not", err)
                assert user is not None, err
                assert f"(`chown -R {user.group(1)}: {data} && chmod -R u+rwX {data}`)" in err, err
        finally:
            data.chmod(0o755)
            for path in files:
                path.chmod(0o600)


def test_files_made_as_root_are_the_data_directory_owner_s_store_78() -> None:
    """STORE-78: `import`, `token add` and `status` run as root on the data directory of a
    service that runs as another user make `journal.sqlite`, `store.sqlite`, `tokens.sqlite` and
    `signing.key` that user's (they run as that user since CLI-146), and so does a snapshot
    built as root (its directory and file); the service then starts as that user, takes the
    token and serves a snapshot. (Before, they were root's, mode 0600, and `serve` exited 3:
    `user nobody may not read and write .../tokens.sqlite (it is root's, mode 0600)`.)"""
    if os.geteuid() != 0:
        pytest.skip("only root makes files another user owns")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    with reachable_home("healthlog-store-78-") as home:
        data = home / "data"
        data.mkdir()
        os.chown(data, 65534, 65534)
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        as_root = [python_for_all(), "-m", "healthlog.cli"]
        assert run_status([*as_root, "import", "--aggregation", "minutes", "--data", data, hr])[0]
        added, token, err = run_status([*as_root, "token", "add", "phone", "--data", data], home)
        assert added, err
        assert run_status([*as_root, "status", "--data", data], home)[0]
        made = DataDir(data)
        with made.open_journal() as journal, made.open_store() as store:
            snapshot_files.build(
                made.snapshot_dir, journal, store, made.signing_key(), "/v1/snapshots"
            )
        owners = {
            path.relative_to(data).as_posix(): (path.stat().st_uid, path.stat().st_gid)
            for path in data.rglob("*")
        }
        assert {"journal.sqlite", "store.sqlite", "tokens.sqlite", "signing.key"} <= set(owners)
        assert any(name.endswith(".snap") for name in owners), owners
        assert {name: ids for name, ids in owners.items() if ids != (65534, 65534)} == {}
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        with subprocess.Popen(
            [*as_nobody, *healthlog("serve", "--port", "0", "--data", data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=home,
        ) as served:
            try:
                assert served.stdout is not None
                line = served.stdout.readline().decode()
                found = re.search(r"healthlog serving on (http://127\.0\.0\.1:\d+) ", line)
                assert found, line + (served.stderr.read().decode() if served.stderr else "")
                headers = {"Authorization": f"Bearer {token.strip()}"}
                with httpx.Client(base_url=found.group(1), timeout=LIMIT_S) as client:
                    assert client.get("/v1/status", headers=headers).status_code == 200
                    listed = client.get("/v1/snapshots", headers=headers)
                    assert listed.status_code == 200, listed.text
                    fetched = client.get(listed.json()["url"], headers=headers)
                    assert fetched.status_code == 200, fetched.text
            finally:
                served.send_signal(signal.SIGTERM)
                served.communicate(timeout=LIMIT_S)
        assert served.returncode == 0


# The service's user in RUN-64 and RUN-65: another one when the tests run as root, whom modes
# do not stop.
SERVICE_UID = 65534
STORE_WRITER = (
    "import sys\n"
    "from healthlog.storage.datadir import DataDir\n"
    "with DataDir(sys.argv[1]).open_store(create=False) as store:\n"
    "    store.set_mark('written', True)\n"
)
"""``python -c STORE_WRITER DATA``: open the store of DATA and write to it, as a fold worker of
the service (another process) does."""


def as_service_user() -> list[str]:
    """The command prefix that runs a command as the service's user (empty: this one)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root is stopped by no mode, and setpriv is missing")
    return [setpriv, f"--reuid={SERVICE_UID}", f"--regid={SERVICE_UID}", "--clear-groups"]


def serve_process(prefix: list[str], data: Path, err: Path) -> subprocess.Popen[bytes]:
    """``healthlog serve`` on ``data`` as the service's user, its stderr into ``err``."""
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    with err.open("wb") as sink:
        return subprocess.Popen(
            [*prefix, *healthlog("serve", "--port", "0", "--data", data)],
            stdout=subprocess.DEVNULL,
            stderr=sink,
            env=env,
            cwd=data.parent,
        )


def until_logged(err: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    """Wait until ``process`` has written ``text`` to ``err`` (within ``LIMIT_S``)."""
    deadline = time.monotonic() + LIMIT_S
    while text not in err.read_text():
        assert process.poll() is None, err.read_text()
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)


def stopped(process: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> int:
    """Stop ``process`` with ``signum``; its exit status."""
    process.send_signal(signum)
    return process.wait(timeout=LIMIT_S)


def service_directory(home: Path, prefix: list[str]) -> Path:
    """A data directory of the service's user, made by a ``serve`` started and stopped."""
    data = home / "data"
    data.mkdir()
    if prefix:
        os.chown(data, SERVICE_UID, SERVICE_UID)
    first = serve_process(prefix, data, home / "first.err")
    try:
        until_logged(home / "first.err", "fold lease held at epoch 1", first)
    finally:
        assert stopped(first) == 0
    return data


def test_a_store_made_read_only_then_mended_is_written_by_every_process_run_64() -> None:
    """RUN-64: GIVEN a service's `store.sqlite` made mode 0444 and `serve` started on it (the
    RUN-38 warnings) WHEN its mode is mended (0600) THEN another process of the service's user
    writes the store, as its fold worker does, and `serve` killed and started again takes the
    lease at once, no renewal failing; the `-wal` and `-shm` that SQLite made 0444 with the file
    are 0600 then. (Before, the `-shm` stayed 0444: the running service took the lease again
    but its fold worker, and every later start, failed each write with `attempt to write a
    readonly database (store.sqlite)`, a delivery pending for good.)"""
    prefix = as_service_user()
    with reachable_home("healthlog-run-64-") as home:
        data = service_directory(home, prefix)
        store = data / "store.sqlite"
        companions = [data / "store.sqlite-wal", data / "store.sqlite-shm"]
        store.chmod(0o444)
        served = serve_process(prefix, data, home / "served.err")
        try:
            until_logged(home / "served.err", "lease renewal failed", served)
            assert [stat.S_IMODE(path.stat().st_mode) for path in companions] == [0o444, 0o444]
            store.chmod(0o600)
            writer = subprocess.run(
                [*prefix, sys.executable, "-c", STORE_WRITER, data],
                capture_output=True,
                timeout=LIMIT_S,
                check=False,
                cwd=home,
            )
            assert writer.returncode == 0, writer.stderr.decode()
            assert [stat.S_IMODE(path.stat().st_mode) for path in companions] == [0o600, 0o600]
            until_logged(home / "served.err", "fold lease held at epoch", served)
        finally:
            stopped(served, signal.SIGKILL)
        assert all(path.exists() for path in companions)
        again = serve_process(prefix, data, home / "again.err")
        try:
            until_logged(home / "again.err", "fold lease held at epoch", again)
        finally:
            assert stopped(again) == 0
        assert "lease renewal failed" not in (home / "again.err").read_text()


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_a_wal_or_shm_of_another_user_is_said_run_65(mode: int) -> None:
    """RUN-65: GIVEN a service's data directory whose `store.sqlite-shm` (left by a `serve`
    killed) is another user's (root's, mode 0600 or 0644) WHEN `serve` or `import` runs as the
    service's user THEN it exits 3 with one line naming that file, its owner and mode and what
    to do; WHEN it is the service's user's again THEN `serve` takes the lease. (Before, both
    exited 3 with `database error: unable to open database file (DIR/store.sqlite)` for 0600;
    for 0644 `serve` ran on, every lease renewal failing `attempt to write a readonly database
    (store.sqlite)`, and `import` waited for the lease for good: each named the database file,
    whose mode is right.)"""
    if os.geteuid() != 0:
        pytest.skip("only root makes a file another user owns")
    prefix = as_service_user()
    with reachable_home("healthlog-run-65-") as home:
        data = service_directory(home, prefix)
        killed = serve_process(prefix, data, home / "killed.err")
        try:
            until_logged(home / "killed.err", "fold lease held at epoch", killed)
        finally:
            stopped(killed, signal.SIGKILL)
        shm = data / "store.sqlite-shm"
        os.chown(shm, 0, 0)
        shm.chmod(mode)
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        refused = [
            subprocess.run(
                [*prefix, *healthlog(*args, "--data", data)],
                capture_output=True,
                timeout=LIMIT_S,
                check=False,
                cwd=home,
                env=env,
            )
            for args in (("serve", "--port", "0"), ("import", hr))
        ]
        os.chown(shm, SERVICE_UID, SERVICE_UID)
        served = serve_process(prefix, data, home / "served.err")
        try:
            until_logged(home / "served.err", "fold lease held at epoch", served)
        finally:
            assert stopped(served) == 0
    user = pwd.getpwuid(SERVICE_UID).pw_name
    for run in refused:
        assert run.returncode == 3, run.stderr.decode()
        assert run.stderr.decode().splitlines() == [
            f"healthlog: store.sqlite cannot be written: user {user} may not read and write"
            f" {shm} (it is root's, mode {mode:04o}), which every write to store.sqlite goes"
            " through;"
            f" make it {user}'s to read and write (`chown -R {user}: {data} && chmod -R u+rwX"
            f" {data}`)"
        ]


def test_a_data_directory_on_a_read_only_file_system_is_said_so_cli_91(tmp_path: Path) -> None:
    """CLI-91: on a file system mounted read-only (as the kernel remounts one after disk
    errors), `token add` and `import`, which write, exit 3 with one line saying that the file
    system is mounted read-only and which commands read such a directory, not that the user
    may not write the file (root may not either) nor whose it is."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli token add phone --data "$1/data" > /dev/null || exit 97\n'
        'mount -o remount,ro "$1" || exit 96\n'
        '"$PY" -m healthlog.cli token add watch --data "$1/data" > /dev/null\n'
        'echo "token exit $?" >&2\n'
        '"$PY" -m healthlog.cli import --no-wait --data "$1/data" "$2" > /dev/null\n'
        'echo "import exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload)
    for command, file in (("token", "tokens.sqlite"), ("import", "journal.sqlite")):
        assert re.search(
            rf"^healthlog: database error: unable to open database file: the file system of"
            rf" \S+/data is mounted read-only \(as the kernel remounts one after disk errors:"
            rf" see `dmesg`\); {READ_ONLY_COMMANDS}"
            rf" \(\S+/data/{re.escape(file)}\)\n{command} exit 3$",
            stderr,
            re.MULTILINE,
        ), stderr


def test_a_new_directory_on_a_read_only_file_system_is_said_so_store_103(
    tmp_path: Path,
) -> None:
    """STORE-103: `import --data NEWDIR` and `follow --replica NEWDIR` on a file system mounted
    read-only (a real tmpfs remounted so) exit 3 with one line naming the directory and saying
    that its file system is mounted read-only. (Before, each was Python's `healthlog: [Errno
    30] Read-only file system: 'NEWDIR'`.)"""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        'mount -o remount,ro "$1" || exit 96\n'
        '"$PY" -m healthlog.cli import --data "$1/new/data" "$2" > /dev/null\n'
        'echo "import exit $?" >&2\n'
        '"$PY" -m healthlog.cli follow --url http://127.0.0.1:9 --token hl_x'
        ' --replica "$1/new/replica" --data "$3" > /dev/null\n'
        'echo "follow exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, tmp_path / "client")
    read_only = (
        f"the file system of {point_dir} is mounted read-only (as the kernel remounts one after"
        " disk errors: see `dmesg`)"
    )
    assert stderr.splitlines() == [
        f"healthlog: no data directory at {point_dir / 'new' / 'data'}: making a new one",
        f"healthlog: {point_dir / 'new' / 'data'} cannot be made: {read_only}",
        "import exit 3",
        f"healthlog: {point_dir / 'new' / 'replica'} cannot be made: {read_only}",
        "follow exit 3",
    ], stderr


READ_ONLY_COMMANDS = re.escape(
    "of the commands, only export, status and token list read a data directory that cannot be"
    " written"
)


def test_reading_commands_read_a_data_directory_on_read_only_media_cli_105(
    tmp_path: Path,
) -> None:
    """CLI-105: on a file system mounted read-only (a snapshot, a read-only mount) whose
    databases were closed (no `-wal` or `-shm` beside them), `export`, `status`, `status
    --failed` and `token list` exit 0 and print what they printed before the remount, and the
    directory is unchanged."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    commands = ("export", "status", "status --failed", "token list")
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli token add phone --data "$1/data" > /dev/null || exit 97\n'
        "run() {\n"
        f"  for command in {' '.join(repr(command) for command in commands)}; do\n"
        '    "$PY" -m healthlog.cli $command --data "$1/data" > "$3/$4 $command"\n'
        '    echo "$4 $command exit $?" >&2\n'
        "  done\n"
        '  ls -l --time-style=full-iso "$1/data" > "$3/$4 ls"\n'
        "}\n"
        'run "$1" "$2" "$3" writable\n'
        'mount -o remount,ro "$1" || exit 96\n'
        'run "$1" "$2" "$3" read-only\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, out)
    for command in commands:
        for mount in ("writable", "read-only"):
            assert f"{mount} {command} exit 0\n" in stderr, stderr
        assert (out / f"read-only {command}").read_bytes() == (
            out / f"writable {command}"
        ).read_bytes(), command
    assert b"heart_rate" in (out / "read-only export").read_bytes()
    assert (out / "read-only token list").read_bytes() == b"phone\n"
    assert (out / "read-only ls").read_text() == (out / "writable ls").read_text()


OLDER_STORE = (
    "import sys\n"
    "from healthlog.storage._sqlite import connect, migrate\n"
    "from healthlog.storage.store import MIGRATIONS\n"
    "conn = connect(sys.argv[1])\n"
    "migrate(conn, MIGRATIONS[:-1])\n"
    "conn.close()\n"
)
"""Makes the file ``argv[1]`` a store of the schema before this healthlog's."""


def test_a_reader_leaves_no_files_the_service_s_user_cannot_write_cli_105() -> None:
    """CLI-105: a backup user (`nobody`) given group read and write on a data directory whose
    files the service's user (`daemon`) owns, mode 0640, runs `export` and `token list`: with
    the service stopped, their `-wal` files holding changes without a `-shm` (since CLI-115 a
    file whose changes are all in it is read), each exits 3 with one line saying why and leaves
    no `-wal` or `-shm` file behind, and the service's user still writes (`token add`); beside
    the running service `export` exits 0, and nothing of the reader's is left once the service
    stops."""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-cli-105-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        for command in (
            ("import", "--aggregation", "minutes", "--data", data, hr),
            ("token", "add", "phone", "--data", data),
            ("status", "--data", data),
        ):
            assert run_status(healthlog(*command))[0], command
        with subprocess.Popen(
            [sys.executable, "-c", HOLDER, data], stdout=subprocess.PIPE
        ) as holder:
            assert holder.stdout is not None
            assert holder.stdout.readline() == b"open\n"
            for command in (
                ("import", "--aggregation", "minutes", "--data", data, hr),
                ("token", "add", "laptop", "--data", data),
            ):
                assert run_status(healthlog(*command))[0], command
            holder.kill()
        for name in ("journal.sqlite", "store.sqlite", "tokens.sqlite"):
            assert (data / f"{name}-wal").stat().st_size > 0
            (data / f"{name}-shm").unlink()
        subprocess.run(["chown", "-R", "1:65534", data], check=True)
        data.chmod(0o770)
        for name in ("journal.sqlite", "store.sqlite", "tokens.sqlite"):
            for suffix in ("", "-wal"):
                (data / f"{name}{suffix}").chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        for command, file in ((("export",), "store.sqlite"), (("token", "list"), "tokens.sqlite")):
            done, out, err = run_status([*as_nobody, *healthlog(*command, "--data", data)], home)
            assert not done, (command, out)
            one_line_error(
                err,
                f"healthlog: user nobody may not write {data / file}, and reading it while no"
                f" healthlog process has it open would leave {file}-wal and {file}-shm files of"
                f" nobody's beside it, which daemon's service could not write: read it while the"
                " service runs, or as daemon (`sudo -u daemon healthlog ...`)",
            )
        assert sorted(path.name for path in data.iterdir()) == before
        added = run_status([*as_daemon, *healthlog("token", "add", "watch", "--data", data)], home)
        assert added[0], added
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        with subprocess.Popen(
            [*as_daemon, *healthlog("serve", "--port", "0", "--data", data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=home,
        ) as served:
            try:
                assert served.stdout is not None
                assert b"healthlog serving on" in served.stdout.readline()
                beside = run_status([*as_nobody, *healthlog("export", "--data", data)], home)
            finally:
                served.send_signal(signal.SIGTERM)
                served.communicate(timeout=LIMIT_S)
        assert served.returncode == 0
        assert beside[0], beside
        assert "heart_rate" in beside[1]
        assert {path.name for path in data.iterdir() if path.stat().st_uid != 1} == set()


def test_root_reads_a_file_it_may_not_write_cli_105(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-105: root reading a store it may not write (the immutable attribute) exports it
    (exit 0): the `-wal` and `-shm` files SQLite makes there are the file owner's, whom they
    cannot stop."""
    if os.geteuid() != 0:
        pytest.skip("a user other than root is refused, as the test above shows")
    data = tmp_path / "data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    with unwritable(data / "store.sqlite"):
        run = run_cli("export", "--data", data)
    assert run.code == 0, run.err
    assert b"heart_rate" in run.out


HOLDER = (
    "import os, sqlite3, sys, time\n"
    "for name in ('journal.sqlite', 'store.sqlite', 'tokens.sqlite'):\n"
    "    conn = sqlite3.connect(os.path.join(sys.argv[1], name))\n"
    "    conn.execute('SELECT count(*) FROM sqlite_master').fetchall()\n"
    "print('open', flush=True)\n"
    "time.sleep(120)\n"
)
"""Holds the three databases of the data directory ``argv[1]`` open (as a running service
does, so that what others write stays in the ``-wal`` files) until it is killed."""


def test_a_copy_without_its_shm_files_on_read_only_media_cli_105(tmp_path: Path) -> None:
    """CLI-105: a copy of a running service's directory that left the `-shm` files out, on
    read-only media: `token list`, whose `-wal` is empty, exits 0; `export` and `status`, whose
    `-wal` files hold changes SQLite reads only through a `-shm` it cannot make there, exit 3
    with one line naming the file, why and what to do, which works: `export` of a `cp -a`
    copy where it can be written exits 0."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        '"$PY" -m healthlog.cli token add phone --data "$1/data" > /dev/null 2>&1 || exit 98\n'
        '"$PY" -c "$5" "$1/data" || exit 97\n'
        '"$PY" -c "$3" "$1/data" > "$4/held" & held=$!\n'
        'until grep -q open "$4/held"; do sleep 0.05; done\n'
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 96\n"
        'kill -9 "$held"; wait "$held"\n'
        'test -s "$1/data/store.sqlite-wal" || exit 95\n'
        'rm "$1/data/"*-shm\n'
        'mount -o remount,ro "$1" || exit 94\n'
        'for command in "token list" export status; do\n'
        '  "$PY" -m healthlog.cli $command --data "$1/data" > "$4/$command"\n'
        '  echo "$command exit $?" >&2\n'
        "done\n"
        'cp -a "$1/data" "$4/copy"\n'
        '"$PY" -m healthlog.cli export --data "$4/copy" > "$4/copied"\n'
        'echo "copy export exit $?" >&2\n'
    )
    begun = (
        "import sys\n"
        "from healthlog.storage.datadir import DataDir\n"
        "data = DataDir(sys.argv[1])\n"
        "data.open_journal().close()\n"
        "data.open_store().close()\n"
        "data.signing_key()\n"
    )
    stderr = in_full_file_system(script, point_dir, payload, HOLDER, tmp_path, begun)
    assert "token list exit 0\n" in stderr, stderr
    assert (tmp_path / "token list").read_text() == "phone\n"
    for command, file in (("export", "store.sqlite"), ("status", "journal.sqlite")):
        assert re.search(
            rf"^healthlog: \S+/data/{re.escape(file)} cannot be read where it is: its"
            rf" {re.escape(file)}-wal holds changes that may not be in it yet, which SQLite"
            rf" reads only through a {re.escape(file)}-shm file, and there is none beside it \(a"
            r" copy that left the -shm files out\?\) nor can one be made on read-only media;"
            rf" read a copy where it can be written \(`cp -a \S+/data COPY`\)\n"
            rf"{command} exit 3$",
            stderr,
            re.MULTILINE,
        ), stderr
    assert stderr.endswith("\ncopy export exit 0\n"), stderr
    assert b"heart_rate" in (tmp_path / "copied").read_bytes()


def test_an_older_schema_on_read_only_media_is_said_so_cli_107(tmp_path: Path) -> None:
    """CLI-107: a store of an older healthlog's schema on read-only media, which a reading
    command would have to upgrade first, makes `export` and `status` exit 3 with one line naming
    the file, both schema versions, why it cannot be upgraded there and what to do; nothing
    changes, and once the file system can be written `export` upgrades it and exits 0."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli status --data "$1/data" > /dev/null || exit 97\n'
        'rm "$1/data/store.sqlite"\n'
        '"$PY" -c "$3" "$1/data/store.sqlite" || exit 95\n'
        'ls -l --time-style=full-iso "$1/data" > "$4/writable"\n'
        'mount -o remount,ro "$1" || exit 96\n'
        "for command in export status; do\n"
        '  "$PY" -m healthlog.cli $command --data "$1/data" > /dev/null\n'
        '  echo "$command exit $?" >&2\n'
        "done\n"
        'ls -l --time-style=full-iso "$1/data" > "$4/read-only"\n'
        'mount -o remount,rw "$1" || exit 94\n'
        '"$PY" -m healthlog.cli export --data "$1/data" > /dev/null\n'
        'echo "writable export exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, OLDER_STORE, tmp_path)
    for command in ("export", "status"):
        assert re.search(
            rf"^healthlog: \S+/data/store\.sqlite was written by an older healthlog \(schema"
            rf" version {len(STORE_MIGRATIONS) - 1}, this one's is {len(STORE_MIGRATIONS)}\)"
            rf" and is upgraded before it is read, which cannot be"
            rf" done here: the file system of \S+/data is mounted read-only \(as the kernel"
            rf" remounts one after disk errors: see `dmesg`\); a command run where it can be"
            rf" written upgrades it \(as the user it belongs to, or on a copy: `cp -a \S+/data"
            rf" COPY`\)\n{command} exit 3$",
            stderr,
            re.MULTILINE,
        ), stderr
    assert stderr.endswith("\nwritable export exit 0\n"), stderr
    assert (tmp_path / "read-only").read_text() == (tmp_path / "writable").read_text()


def test_status_on_a_full_disk_says_the_pending_deliveries_wait_for_room_cli_109(
    tmp_path: Path,
) -> None:
    """CLI-109: `status` beside a service (a process holding the databases, killed, leaves
    their `-wal` and `-shm` files) on a full file system, with a delivery pending and the last
    recorded pass `empty`, exits 0 with its usual document on stdout and one line on stderr
    saying the disk is full, how many deliveries wait for room, and that why the last pass
    stopped is the last one recorded."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    later = write(
        tmp_path / "later.json",
        body(metric("later", "count", point("2024-03-01 00:00:00 +0000", qty=1))),
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli import --no-wait --data "$1/data" "$3" 2> /dev/null || exit 97\n'
        '"$PY" -m healthlog.cli status --data "$1/data" > /dev/null 2>&1 || exit 96\n'
        '"$PY" -c "$4" "$1/data"\n'
        'dd if=/dev/zero of="$1/fill" bs=4096 2> /dev/null\n'
        '"$PY" -m healthlog.cli status --data "$1/data" > "$5/text"\n'
        'echo "status exit $?" >&2\n'
        '"$PY" -m healthlog.cli status --json --data "$1/data" > "$5/json"\n'
        'echo "status --json exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, later, KILLED_HOLDER, tmp_path)
    said = (
        r"healthlog: the disk is full \(\d+ bytes free in \S+/data\): the 1 pending deliveries"
        r" are not folded until there is room, and why the last pass stopped is that of the"
        r" last pass the service could record \(its GET /v1/status says why it stopped since\);"
        r" free some space"
    )
    for command in ("status", "status --json"):
        assert re.search(rf"^{said}\n{command} exit 0$", stderr, re.MULTILINE), stderr
    assert len(re.findall(said, stderr)) == 2, stderr
    assert "last pass stopped: empty" in (tmp_path / "text").read_text()
    lag = json.loads((tmp_path / "json").read_text())["lag"]
    assert lag["oldest_pending_id"] == 2
    assert lag["stopped_because"] == "empty"


UNFOLDED = (
    r"healthlog: import: delivery (\d+) is journaled but could not be folded: {why}; it stays"
    r" journaled and folds at the next pass of serve or of another import once that is mended"
    r" \(on a full disk, once there is room\): do not import it again, which would journal it"
    r" twice"
)


def test_an_import_whose_fold_the_disk_cannot_hold_ends_cli_200(tmp_path: Path) -> None:
    """CLI-200: `import` of a file the journal has room for but whose fold the store has not (a
    1 MiB file system) exits 3 once its fold could not be written, with one line naming the
    delivery, SQLite's error and the file, and that it stays journaled; no traceback. Once the
    file system has room, the next import folds it too. (Before, it waited for good: a
    WARNING each minute, as its folder tried again, and no exit.)"""
    payload = tmp_path / "minutes.json"
    write_minute_body(payload, metrics=3, points=8 * 1440)
    later = write(
        tmp_path / "later.json",
        body(metric("later", "count", point("2024-03-01 00:00:00 +0000", qty=1))),
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        'timeout 60 "$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2"\n'
        'echo "import exit $?" >&2\n'
        'mount -o remount,size=32m "$1" || exit 96\n'
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$3" 2> /dev/null\n'
        'echo "again exit $?" >&2\n'
        '"$PY" -m healthlog.cli status --json --data "$1/data" > "$4/room"\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, later, tmp_path)
    assert "Traceback" not in stderr
    why = rf"StorageError: {DISK_ERROR} \(store\.sqlite\)"
    assert re.search(rf"^{UNFOLDED.format(why=why)}\nimport exit 3$", stderr, re.MULTILINE), stderr
    assert "again exit 0" in stderr, stderr
    room = json.loads((tmp_path / "room").read_text())["deliveries"]
    assert (room["pending"], room["parsed"]) == (0, 2)


def test_an_import_that_cannot_take_the_fold_lease_ends_cli_201(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-201: `import` beside a `store.sqlite` it cannot write (a file the kernel keeps
    read-only, as after disk errors on it) journals the file, then exits 3 with one line
    saying that the fold lease cannot be written, with SQLite's error and the file, and that
    the delivery stays journaled; once the store can be written, the next import folds it too.
    (Before, it waited for good, a WARNING every 5 s as its lease renewal failed.)"""
    data = tmp_path / "data"
    first = write(tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    later = write(
        tmp_path / "later.json",
        body(metric("later", "count", point("2024-03-01 00:00:00 +0000", qty=1))),
    )
    args = ("import", "--aggregation", "minutes", "--data", data)
    assert run_cli(*args, first).code == 0
    with unwritable(data / "store.sqlite"):
        refused = run_cli(*args, later)
    assert refused.code == 3, refused.err
    assert "Traceback" not in refused.err
    why = (
        r"the fold lease cannot be written: StorageError: SQLITE_READONLY: attempt to write a"
        r" readonly database \(store\.sqlite\)"
    )
    assert re.search(rf"^{UNFOLDED.format(why=why)}$", refused.err, re.MULTILINE), refused.err
    assert "later.json as delivery 2 (" in refused.err
    assert run_cli(*args, later).code == 0
    status = json.loads(run_cli("status", "--json", "--data", data).out)["deliveries"]
    assert (status["pending"], status["parsed"]) == (0, 3)


def test_a_seal_that_cannot_take_the_fold_lease_ends_cli_203(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-203: `seal` beside a `store.sqlite` it cannot write journals the seal, then exits 3
    with one line saying that the fold lease cannot be written and that the seal stays
    journaled; once the store can be written, the next `seal` folds both. (Before, it waited
    for good, as `import` did: CLI-201.)"""
    data = tmp_path / "data"
    hr = write(tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    seal = ("seal", "--before", "2024-02-07T00:00:00Z", "--data", data)
    with unwritable(data / "store.sqlite"):
        refused = run_cli(*seal)
    assert refused.code == 3, refused.err
    assert "Traceback" not in refused.err
    assert re.search(
        r"^healthlog: seal: delivery 2 is journaled but could not be folded: the fold lease"
        r" cannot be written: StorageError: SQLITE_READONLY: attempt to write a readonly"
        r" database \(store\.sqlite\); it stays journaled and folds at the next pass of serve"
        r" or of another import or seal once that is mended \(on a full disk, once there is"
        r" room\)$",
        refused.err,
        re.MULTILINE,
    ), refused.err
    assert run_cli(*seal).code == 0
    status = json.loads(run_cli("status", "--json", "--data", data).out)["deliveries"]
    assert (status["pending"], status["parsed"]) == (0, 3)


def test_an_ext4_the_kernel_took_read_only_is_said_so_cli_202(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-202: on a real ext4 volume mounted `errors=remount-ro` that the kernel took
    read-only after an error (which Linux 6.15 on marks `emergency_ro`, not in the read-only
    flag `statvfs` gives), `import` and `reindex` exit 3 with a line saying the file system is
    mounted read-only and to see `dmesg`, as on a volume remounted read-only; a `serve` started
    on it (which waits for a store it cannot write, RUN-38) says so in each failed lease
    renewal; `status` still reads it (exit 0). (Before, on such a kernel: `healthlog: database
    error: attempt to write a readonly database (journal.sqlite)`, and from `serve` the same of
    store.sqlite every 5 s, naming no cause, which reads as a file of the wrong owner.)"""
    payload = write(tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    with ext4_after_errors(tmp_path) as (volume, fail):
        data = volume / "data"
        args = ("import", "--aggregation", "minutes", "--data", data, payload)
        assert run_cli(*args).code == 0
        # Its signing key made, as `serve` makes it, and its databases held by a process
        # killed, as a service killed (or running) holds them.
        assert run_cli("status", "--data", data).code == 0
        assert run_cli("token", "add", "phone", "--data", data).code == 0
        holder = KILLED_HOLDER.replace("'store.sqlite'", "'store.sqlite', 'tokens.sqlite'")
        subprocess.run([sys.executable, "-c", holder, data], check=False)
        fail()
        imported, reindexed = run_cli(*args), run_cli("reindex", "--data", data)
        status = run_cli("status", "--data", data)
        with subprocess.Popen(
            healthlog("serve", "--port", "0", "--data", data), stderr=subprocess.PIPE
        ) as serve:
            lines, _ = signalled_after(
                serve, signal.SIGTERM, lambda said: "lease renewal failed" in said[-1]
            )
    said = (
        rf"the file system of {re.escape(str(data))} is mounted read-only \(as the kernel"
        r" remounts one after disk errors: see `dmesg`\)"
    )
    assert re.search(
        r'msg="lease renewal failed: StorageError: SQLITE_READONLY: attempt to write a readonly'
        rf' database \(store\.sqlite\): {said}"$',
        lines[-1],
    ), lines
    for run in (imported, reindexed):
        assert run.code == 3, run.err
        assert "Traceback" not in run.err
        assert re.search(rf"^healthlog: .*{said}", run.err, re.MULTILINE), run.err
    assert status.code == 0, status.err
    assert b"parsed 1" in status.out


def test_status_on_read_only_media_without_the_signing_key_cli_106(tmp_path: Path) -> None:
    """CLI-106: `status` on read-only media holding no `signing.key` (a backup that left the
    private key out), where it can make none, exits 0 and prints the public key the journal
    recorded, as it printed it before."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli status --data "$1/data" > "$3/before" || exit 97\n'
        'rm "$1/data/signing.key"\n'
        'mount -o remount,ro "$1" || exit 96\n'
        '"$PY" -m healthlog.cli status --data "$1/data" > "$3/after"\n'
        'echo "status exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, out)
    assert stderr == "status exit 0\n", stderr
    before = (out / "before").read_text()
    assert re.search(r"^snapshot key \(Ed25519\) \S{44}$", before, re.MULTILINE), before
    assert (out / "after").read_text() == before


def test_status_beside_the_service_as_another_user_cli_106() -> None:
    """CLI-106: `status` run as another user (a backup job) that may read the databases of a
    running service (mode 0644, as an older healthlog made them) but not its `signing.key`
    (0600) exits 0 and prints the snapshot key the service's `status` prints, from the
    journal."""
    if os.geteuid() != 0:
        pytest.skip("runs the command as another user, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    with reachable_home("healthlog-cli-106-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        assert run_status(healthlog("import", "--aggregation", "minutes", "--data", data, hr))[0]
        data.chmod(0o755)
        for name in ("journal.sqlite", "store.sqlite"):
            (data / name).chmod(0o644)
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        with subprocess.Popen(
            healthlog("serve", "--port", "0", "--data", data),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        ) as served:
            try:
                assert served.stdout is not None
                assert b"healthlog serving on" in served.stdout.readline()
                assert stat.S_IMODE((data / "signing.key").stat().st_mode) == 0o600
                own = run_status(healthlog("status", "--data", data))
                as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
                other = run_status([*as_nobody, *healthlog("status", "--data", data)], cwd=home)
            finally:
                served.send_signal(signal.SIGTERM)
                served.communicate(timeout=LIMIT_S)
    assert own[0], own
    assert other[0], other
    key = [line for line in own[1].splitlines() if line.startswith("snapshot key")]
    assert len(key) == 1, own
    assert key[0] in other[1].splitlines(), other


def run_status(command: list[str], cwd: Path | None = None) -> tuple[bool, str, str]:
    """Whether ``command`` exited 0, its stdout and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=cwd, timeout=LIMIT_S, check=False
    )
    return done.returncode == 0, done.stdout, done.stderr


def test_a_write_refused_on_a_read_only_file_system_is_said_so_cli_100(tmp_path: Path) -> None:
    """CLI-100: on a file system mounted read-only under a data directory whose databases
    stay readable (a process holding them was killed, leaving their `-wal` and `-shm` files, so
    SQLite opens them read-only), `reindex`, whose first write SQLite refuses, exits 3 with
    one line saying that the file system is mounted read-only, in CLI-91's words, after
    SQLite's own error and before the file."""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    stderr = on_remounted_read_only(tmp_path, payload, "reindex")
    assert re.search(
        r"^healthlog: database error: attempt to write a readonly database: the file system of"
        r" \S+/data is mounted read-only \(as the kernel remounts one after disk errors: see"
        rf" `dmesg`\); {READ_ONLY_COMMANDS}"
        r" \(store\.sqlite\)\nreindex exit 3$",
        stderr,
        re.MULTILINE,
    ), stderr


def _free_port() -> int:
    """A port of loopback that nothing listens on now, as the kernel picks one (``serve``
    whose stdout cannot be written cannot say which port 0 gave it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _unwritable(stack: contextlib.ExitStack, kind: str) -> BinaryIO:
    """A file every write to fails: a pipe whose reader has gone (``reader gone``) or
    /dev/full (``full disk``), closed with ``stack``."""
    if kind == "reader gone":
        reader, writer = os.pipe()
        os.close(reader)
        return stack.enter_context(os.fdopen(writer, "wb"))
    return stack.enter_context(open("/dev/full", "wb"))


@pytest.mark.parametrize("stdout", ["reader gone", "full disk"])
def test_serve_serves_on_when_its_stdout_cannot_be_written_cli_92(
    tmp_path: Path, stdout: str
) -> None:
    """CLI-92: `serve` whose stdout cannot be written (a pipe whose reader has gone, as after
    `healthlog serve | head -1`; a full disk behind `>> healthlog.log`, here /dev/full) logs one
    WARNING with the line it could not print and serves on: it answers, and stops with 0 on
    SIGTERM."""
    if stdout == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    port = _free_port()
    with contextlib.ExitStack() as stack:
        out = _unwritable(stack, stdout)
        serving = subprocess.Popen(
            healthlog("serve", "--port", str(port), "--data", tmp_path / "data"),
            stdout=out,
            stderr=subprocess.PIPE,
        )
    try:
        deadline = time.monotonic() + LIMIT_S
        while True:
            assert serving.poll() is None, serving.communicate()[1].decode()
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = client.recv(64)
                    break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        serving.send_signal(signal.SIGTERM)
        err = serving.communicate(timeout=LIMIT_S)[1].decode()
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
    assert serving.returncode == 0, err
    assert "Traceback" not in err
    assert not [line for line in err.splitlines() if line.startswith("healthlog: [Errno")], err
    (warning,) = [line for line in err.splitlines() if "stdout" in line]
    assert "level=WARNING" in warning
    assert f"healthlog serving on http://127.0.0.1:{port}" in warning


def test_serve_says_where_it_serves_from_a_directory_whose_name_is_not_utf8_cli_270(
    tmp_path: Path,
) -> None:
    """CLI-270: `serve` on a data directory named with a byte that is not UTF-8 (`donn\\xe9es`),
    its stdout strict UTF-8 (as under a UTF-8 locale other than C, `en_US.UTF-8` say, which
    systemd hands a unit from /etc/locale.conf; here `PYTHONIOENCODING`), prints its line with
    the byte written `\\udce9`, as stderr writes it, answers, and stops with 0 on SIGTERM.
    (Before, the line could not be encoded: `serve` ended at once, exit 1, with a traceback
    ending `UnicodeEncodeError: ... surrogates not allowed`.)"""
    data = Path(os.fsdecode(os.fsencode(tmp_path) + b"/donn\xe9es"))
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    env["PYTHONIOENCODING"] = "utf-8:strict"
    serving = subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert serving.stdout is not None
        line = serving.stdout.readline().decode()
        found = re.fullmatch(
            r"healthlog serving on http://127\.0\.0\.1:(\d+) \(data in (.+)\)\n", line
        )
        assert found is not None, (line, serving.communicate(timeout=LIMIT_S)[1].decode())
        assert found.group(2) == os.fspath(data).encode("utf-8", "backslashreplace").decode()
        with httpx.Client(timeout=LIMIT_S) as client:
            answer = client.get(f"http://127.0.0.1:{found.group(1)}/healthz")
        assert answer.status_code == 200
        serving.send_signal(signal.SIGTERM)
        err = serving.communicate(timeout=LIMIT_S)[1].decode()
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
    assert serving.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("stderr", ["reader gone", "full disk"])
def test_import_journals_every_file_when_its_stderr_cannot_be_written_cli_93(
    tmp_path: Path, stderr: str
) -> None:
    """CLI-93: `import A B C` whose stderr cannot be written (a pipe whose reader has gone, as
    after `healthlog import ... 2>&1 | head -1`; a full disk behind `2>> log`, here /dev/full)
    journals and folds all three and exits 0: its lines on stderr are for a person, and one
    that cannot be written is dropped."""
    if stderr == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    files = [
        write(
            tmp_path / f"hr{n}.json",
            body(metric(HR, BPM, point(f"2024-02-06 0{n}:00:00 -0800", qty=60.5 + n))),
        )
        for n in range(3)
    ]
    data = tmp_path / "data"
    with contextlib.ExitStack() as stack:
        err = _unwritable(stack, stderr)
        done = subprocess.run(
            healthlog("import", "--aggregation", "minutes", "--data", data, *files),
            stdout=subprocess.DEVNULL,
            stderr=err,
            timeout=LIMIT_S,
            check=False,
        )
    assert done.returncode == 0
    with DataDir(data).open_store() as store:
        assert store.folded_ids() == {1, 2, 3}


@pytest.mark.parametrize("stderr", ["reader gone", "full disk"])
def test_reindex_and_verify_finish_when_their_stderr_cannot_be_written_cli_94(
    run_cli: RunCli, tmp_path: Path, stderr: str
) -> None:
    """CLI-94: `verify`, `reindex`, `verify` on a projection that differs from a rebuild, each
    with a stderr that cannot be written (a pipe whose reader has gone, a full disk behind
    `2>> log`), do what they would otherwise: exit 1 (one object differs), 0 (rebuilt), 0
    (equal), their progress and lines dropped."""
    if stderr == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    data = differing(run_cli, tmp_path)
    codes = []
    for command in ("verify", "reindex", "verify"):
        with contextlib.ExitStack() as stack:
            err = _unwritable(stack, stderr)
            done = subprocess.run(
                healthlog(command, "--data", data),
                stdout=subprocess.DEVNULL,
                stderr=err,
                timeout=LIMIT_S,
                check=False,
            )
        codes.append(done.returncode)
    assert codes == [1, 0, 0]


CHANGED_WHILE_READ = (
    "import sqlite3, sys\n"
    "from healthlog.storage._sqlite import StorageError\n"
    "from healthlog.storage.datadir import DataDir\n"
    "store = DataDir(sys.argv[1]).open_store(create=False, reading=True)\n"
    "print(len(list(store.iter_objects())), 'objects read', file=sys.stderr)\n"
    "import os; os.unlink(sys.argv[2])\n"
    "writer = sqlite3.connect(store.path)\n"
    "writer.execute('CREATE TABLE later (x)')\n"
    "writer.close()\n"
    "try:\n"
    "    store.close()\n"
    "except StorageError as exc:\n"
    "    print('closing:', exc, file=sys.stderr)\n"
)
"""Reads the store of the data directory ``argv[1]`` on a full disk, then frees the space
(removes ``argv[2]``) and writes the store as a process starting then would (closing it
checkpoints into the file), then closes the reading."""


def test_reading_commands_read_a_stopped_service_s_files_on_a_full_disk_cli_112(
    tmp_path: Path,
) -> None:
    """CLI-112: with the service stopped (its databases closed: no `-wal`, or an empty one) on
    a full file system, `export`, `status`, `status --failed` and `token list` exit 0 and print
    what they printed before the disk filled, and leave no file behind; a reading whose file
    a process changes meanwhile (space freed, a service started) says so on closing. (Before,
    each exited 3 with `database error: disk I/O error: the disk is full (0 bytes free), free
    some space (...)`, leaving a 3-byte `-shm` and an empty `-wal` beside each database.)"""
    payload = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    commands = ("export", "status", "status --failed", "token list")
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli token add phone --data "$1/data" > /dev/null 2>&1 || exit 97\n'
        f"for command in {' '.join(repr(c) for c in commands)}; do\n"
        '  "$PY" -m healthlog.cli $command --data "$1/data" > "$3/before $command" || exit 96\n'
        "done\n"
        'ls "$1/data" > "$3/files before"\n'
        'dd if=/dev/zero of="$1/fill" bs=4096 2> /dev/null\n'
        'df -B1 --output=avail "$1" | tail -1 >&2\n'
        f"for command in {' '.join(repr(c) for c in commands)}; do\n"
        '  "$PY" -m healthlog.cli $command --data "$1/data" > "$3/$command"\n'
        '  echo "$command exit $?" >&2\n'
        "done\n"
        'ls "$1/data" > "$3/files after"\n'
        '"$PY" -c "$4" "$1/data" "$1/fill"\n'
    )
    stderr = in_full_file_system(script, point_dir, payload, tmp_path, CHANGED_WHILE_READ)
    assert stderr.splitlines()[0].strip() == "0", stderr
    for command in commands:
        assert f"\n{command} exit 0\n" in stderr, stderr
        before = (tmp_path / f"before {command}").read_bytes()
        assert before
        if command == "status":
            # The wait since the delivery was journaled grows between the two.
            before, after = (
                re.sub(rb"waited [0-9.]+ s", b"", text)
                for text in (before, (tmp_path / command).read_bytes())
            )
            assert after == before
        else:
            assert (tmp_path / command).read_bytes() == before
    assert b"heart_rate" in (tmp_path / "before export").read_bytes()
    assert (tmp_path / "files after").read_text() == (tmp_path / "files before").read_text()
    assert re.search(
        r"^1 objects read\nclosing: \S+/data/store\.sqlite changed while it was read \(a"
        r" healthlog process opened it meanwhile: the service starting, or one started once"
        r" space was freed\), so what was read may be torn: run the command again$",
        stderr,
        re.MULTILINE,
    ), stderr


def test_a_backup_user_reads_a_directory_it_may_not_write_cli_113() -> None:
    """CLI-113: a backup user (`nobody`) given group read on a stopped service's data directory
    (the service's user `daemon` owns it, mode 0750, its databases 0640, `signing.key` 0600)
    runs `export`, `status`, `status --failed` and `token list`: each exits 0 and prints what
    the service's own user prints, and no file is made. (Before, `export` and `status` exited
    3 with `attempt to write a readonly database: user nobody may not read and write ...`, and
    told the backup user to run as daemon or take the directory over.)"""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    commands = (("export",), ("status",), ("status", "--failed"), ("token", "list"))
    with reachable_home("healthlog-cli-113-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        for command in (
            ("import", "--aggregation", "minutes", "--data", data, hr),
            ("token", "add", "phone", "--data", data),
            ("status", "--data", data),
        ):
            assert run_status(healthlog(*command))[0], command
        subprocess.run(["chown", "-R", "1:65534", data], check=True)
        data.chmod(0o750)
        for name in ("journal.sqlite", "store.sqlite", "tokens.sqlite"):
            (data / name).chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        for command in commands:
            owner = run_status([*as_daemon, *healthlog(*command, "--data", data)], home)
            assert owner[0], (command, owner)
            done, out, err = run_status([*as_nobody, *healthlog(*command, "--data", data)], home)
            assert done, (command, err)
            assert err == ""
            if command == ("status",):
                # The wait since the delivery was journaled grows between the two.
                out, expected = (re.sub(r"waited [0-9.]+ s", "", text) for text in (out, owner[1]))
            else:
                expected = owner[1]
            assert out == expected, command
        assert "heart_rate" in run_status([*as_nobody, *healthlog("export", "--data", data)])[1]
        assert sorted(path.name for path in data.iterdir()) == before


VERIFY_ELSEWHERE = (
    r"verify: {why}: rebuilding into a scratch directory in {tmp} instead, which needs room"
    r" for a second store \([0-9,]+ bytes, as store\.sqlite\) until it is done"
)


def _verify_elsewhere(
    as_user: list[str], data: Path, home: Path, why: str
) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """`verify` of ``data`` run as ``as_user`` with ``TMPDIR`` a scratch directory in ``home``:
    its first line must say why (``why``, a pattern) it rebuilds there, and it must leave
    nothing there. The finished process and its stderr."""
    scratch = home / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    done = subprocess.run(
        [*as_user, *healthlog("verify", "--data", data)],
        capture_output=True,
        env={**env, "TMPDIR": str(scratch)},
        cwd=home,
        timeout=LIMIT_S,
        check=False,
    )
    err = done.stderr.decode()
    line = VERIFY_ELSEWHERE.format(why=why, tmp=re.escape(str(scratch)))
    assert re.search("^" + line + "\n", err, re.MULTILINE), err
    assert list(scratch.iterdir()) == []
    return done, err


def test_verify_rebuilds_elsewhere_on_read_only_media_cli_114(tmp_path: Path) -> None:
    """CLI-114: `verify` on read-only media (a real tmpfs remounted read-only, its databases
    closed) rebuilds into a scratch directory in the temporary directory, says so in one line,
    and exits 1 printing the object that differs, as it did before the remount. (Before, it
    exited 3: `unable to open database file: the file system of DIR is mounted read-only ...;
    of the commands, only export, status and token list read a data directory that cannot be
    written`.)"""
    at = "2024-02-06 07:00:00 -0800"
    live = write(tmp_path / "live.json", body(metric(HR, BPM, point(at, qty=1.5, source="a"))))
    backfill = write(
        tmp_path / "backfill.json", body(metric(HR, BPM, point(at, qty=99.5, source="b")))
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = (
        'args="import --aggregation minutes --data $1/data"\n'
        '"$PY" -m healthlog.cli $args "$2" 2> /dev/null || exit 98\n'
        '"$PY" -m healthlog.cli $args --received-at 2024-01-01T00:00:00Z "$3" 2> /dev/null'
        " || exit 97\n"
        '"$PY" -m healthlog.cli verify --data "$1/data" > "$4/before" 2> /dev/null\n'
        'test -e "$1/data/store.sqlite-shm" && exit 96\n'
        'mount -o remount,ro "$1" || exit 95\n'
        'TMPDIR="$5" "$PY" -m healthlog.cli verify --data "$1/data" > "$4/after"\n'
        'echo "verify exit $?" >&2\n'
        'echo "scratch $(ls -A "$5" | wc -l)" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, live, backfill, tmp_path, scratch)
    why = (
        r"the file system of \S+/data is mounted read-only \(as the kernel remounts one after"
        r" disk errors: see `dmesg`\)"
    )
    assert re.search(
        "^" + VERIFY_ELSEWHERE.format(why=why, tmp=re.escape(str(scratch))) + "\n",
        stderr,
        re.MULTILINE,
    ), stderr
    assert "verify: 1 objects differ\nverify exit 1\nscratch 0\n" in stderr, stderr
    before = (tmp_path / "before").read_bytes()
    assert before.startswith(b"differs\theart_rate\tminutes\t")
    assert (tmp_path / "after").read_bytes() == before


def test_a_backup_user_verifies_a_directory_it_may_not_write_cli_114() -> None:
    """CLI-114: a backup user (`nobody`) given group read on a stopped service's data directory
    (0750, databases 0640) runs `verify`: it rebuilds into a scratch directory in its
    temporary directory (`TMPDIR`), says so in one line, exits 1 with the object that differs
    as the service's user's `verify` prints it, leaves nothing in the temporary directory and
    makes no file in the data directory. (Before, it exited 3: `attempt to write a readonly
    database: user nobody may not read and write DIR/journal.sqlite ...`.)"""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-cli-114-") as home:
        at = "2024-02-06 07:00:00 -0800"
        live = write(home / "live.json", body(metric(HR, BPM, point(at, qty=1.5, source="a"))))
        backfill = write(
            home / "backfill.json", body(metric(HR, BPM, point(at, qty=99.5, source="b")))
        )
        data = home / "data"
        args = ("import", "--aggregation", "minutes", "--data", data)
        assert run_status(healthlog(*args, live))[0]
        assert run_status(healthlog(*args, "--received-at", "2024-01-01T00:00:00Z", backfill))[0]
        subprocess.run(["chown", "-R", "1:65534", data], check=True)
        data.chmod(0o750)
        for name in ("journal.sqlite", "store.sqlite"):
            (data / name).chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        owner = subprocess.run(
            [*as_daemon, *healthlog("verify", "--data", data)], capture_output=True, check=False
        )
        assert owner.returncode == 1, owner.stderr
        why = f"user nobody may not write in {re.escape(str(data))}"
        backup, err = _verify_elsewhere(as_nobody, data, home, why)
        assert backup.returncode == 1, err
        assert backup.stdout == owner.stdout
        assert backup.stdout.startswith(b"differs\theart_rate\tminutes\t")
        assert sorted(path.name for path in data.iterdir()) == before


def test_a_backup_user_reads_a_directory_it_may_write_but_not_its_files_cli_115() -> None:
    """CLI-115: a backup user (`nobody`) given group read and write on a stopped service's data
    directory (`daemon`'s, 0770, its databases 0640, closed cleanly) runs `export`, `status`
    and `token list`: each exits 0, prints what the service's own user prints, and makes no
    file. (Before, `export` and `token list` exited 3 with `user nobody may not write
    DIR/FILE, and reading it while no healthlog process has it open would leave FILE-wal and
    FILE-shm files of nobody's beside it ...`, though every change was in the file.)"""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-cli-115-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        for command in (
            ("import", "--aggregation", "minutes", "--data", data, hr),
            ("token", "add", "phone", "--data", data),
            ("status", "--data", data),
        ):
            assert run_status(healthlog(*command))[0], command
        subprocess.run(["chown", "-R", "1:65534", data], check=True)
        data.chmod(0o770)
        for name in ("journal.sqlite", "store.sqlite", "tokens.sqlite"):
            (data / name).chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        for command in (("export",), ("status",), ("token", "list")):
            owner = run_status([*as_daemon, *healthlog(*command, "--data", data)], home)
            assert owner[0], (command, owner)
            done, out, err = run_status([*as_nobody, *healthlog(*command, "--data", data)], home)
            assert done, (command, err)
            assert err == ""
            if command == ("status",):
                # The wait since the delivery was journaled grows between the two.
                out, expected = (re.sub(r"waited [0-9.]+ s", "", text) for text in (out, owner[1]))
            else:
                expected = owner[1]
            assert out == expected, command
            assert sorted(path.name for path in data.iterdir()) == before, command
        assert "heart_rate" in run_status([*as_nobody, *healthlog("export", "--data", data)])[1]


def test_verify_by_a_user_who_may_not_write_the_store_leaves_no_files_store_84() -> None:
    """STORE-84: a backup user (`nobody`) given group read and write on a stopped service's
    data directory (`daemon`'s, 0770, databases 0640) runs `verify`: it says in one line that
    it may not write `store.sqlite` and rebuilds in the temporary directory, exits 0, and no
    file is made in the data directory; the service's user then journals there (`import`).
    (Before, it exited 0 leaving `journal.sqlite-wal`, `journal.sqlite-shm`,
    `store.sqlite-wal` and `store.sqlite-shm` of nobody's, mode 0640, beside the databases:
    files the service's user could not write, as CLI-105 says.)"""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-store-84-") as home:
        data = home / "data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        assert run_status(healthlog("import", "--aggregation", "minutes", "--data", data, hr))[0]
        subprocess.run(["chown", "-R", "1:65534", data], check=True)
        data.chmod(0o770)
        for name in ("journal.sqlite", "store.sqlite"):
            (data / name).chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        why = f"user nobody may not write {re.escape(str(data / 'store.sqlite'))}"
        done, err = _verify_elsewhere(as_nobody, data, home, why)
        assert done.returncode == 0, err
        assert "verify: 0 objects differ" in err
        assert sorted(path.name for path in data.iterdir()) == before
        again = run_status(
            [*as_daemon, *healthlog("import", "--no-wait", "--data", data, hr)], home
        )
        assert again[0], again


def test_status_by_another_user_makes_no_signing_key_store_85() -> None:
    """STORE-85: `status` run by a backup user (`nobody`) given group read and write on a data
    directory `import` began as the service's user (`daemon`: databases 0640, no
    `signing.key` yet) exits 3 with one line saying it may not make the key and who makes it,
    and makes no file; the service's user then starts the service, and once its key is there
    the backup user's `status` prints the same key. (Before, it exited 0 having made
    `signing.key` of nobody's, mode 0600, and `journal.sqlite-wal` and `-shm` of nobody's:
    `serve` as daemon exited 3, `cannot read DIR/signing.key: Permission denied`.)"""
    if os.geteuid() != 0:
        pytest.skip("runs commands as two other users, which only root can")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    as_daemon = [setpriv, "--reuid=1", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-store-85-") as home:
        data = home / "data"
        data.mkdir()
        subprocess.run(["chown", "1:65534", data], check=True)
        data.chmod(0o770)
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        imported = run_status(
            [*as_daemon, *healthlog("import", "--no-wait", "--data", data, hr)],
            home,
        )
        assert imported[0], imported
        for name in ("journal.sqlite", "store.sqlite"):
            (data / name).chmod(0o640)
        before = sorted(path.name for path in data.iterdir())
        assert "signing.key" not in before
        done, out, err = run_status([*as_nobody, *healthlog("status", "--data", data)], home)
        assert not done
        assert out == ""
        one_line_error(
            err,
            f"healthlog: no {data / 'signing.key'} yet, and user nobody may not make it: {data}"
            " is daemon's, whose service makes it as it starts (one of nobody's would stop the"
            " service); run it as daemon (`sudo -u daemon healthlog ...`)",
        )
        assert sorted(path.name for path in data.iterdir()) == before
        env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
        with subprocess.Popen(
            [*as_daemon, *healthlog("serve", "--port", "0", "--data", data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=home,
        ) as served:
            try:
                assert served.stdout is not None
                assert b"healthlog serving on" in served.stdout.readline()
            finally:
                served.send_signal(signal.SIGTERM)
                served.communicate(timeout=LIMIT_S)
        assert served.returncode == 0
        owner = run_status([*as_daemon, *healthlog("status", "--data", data)], home)
        backup = run_status([*as_nobody, *healthlog("status", "--data", data)], home)
        assert owner[0], owner
        assert backup[0], backup
        key = [line for line in owner[1].splitlines() if line.startswith("snapshot key")]
        assert len(key) == 1
        assert key[0] in backup[1].splitlines()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["verify"]], ids="-".join)
def test_a_store_that_folded_nothing_without_a_journal_makes_none_cli_117(
    cli: Cli, tmp_path: Path, args: list[str]
) -> None:
    """CLI-117: `status` or `verify` on a data directory holding a `store.sqlite` that has
    folded nothing (a process took its lease before anything was journaled) and no
    `journal.sqlite` exits 2 with one line saying nothing was journaled there yet, and makes no
    file; `import` then journals and folds there as CLI-111 allows. (Before, each made an empty
    `journal.sqlite` beside the store.)"""
    data = tmp_path / "data"
    with DataDir(data).open_store():
        pass
    left = files_of(data)
    run = cli(*args, "--data", data)
    assert run.code == 2
    one_line_error(
        run.err,
        f"healthlog: nothing journaled in {data} yet (no journal.sqlite, and its store.sqlite"
        " has folded nothing): `serve` or `import` begins it",
    )
    assert run.out == b""
    assert files_of(data) == left
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert cli("import", "--aggregation", "minutes", "--data", data, file).code == 0
    assert b"journal     1 deliveries" in cli("status", "--data", data).out


def test_progress_says_each_count_once_cli_123(run_cli: RunCli, tmp_path: Path) -> None:
    """CLI-123: `reindex` and `verify` of a journal rebuilt by several worker processes (its
    bodies over 4 MiB) print each progress count on stderr once, the last `N/N`."""
    if available_cores() < 2:
        pytest.skip("a rebuild takes several processes only with two cores or more")
    data = tmp_path / "data"
    minutes = tmp_path / "minutes.json"
    write_minute_body(minutes, metrics=3, points=20_000)
    assert minutes.stat().st_size > PARALLEL_MIN_BYTES
    imported = run_cli("import", "--data", data, "--aggregation", "minutes", minutes)
    assert imported.code == 0, imported.err
    for command in ("reindex", "verify"):
        run = run_cli(command, "--data", data)
        assert run.code == 0, run.err
        counts = re.findall(rf"^{command}: (\d+/\d+)$", run.err, re.MULTILINE)
        assert counts[-1] == "1/1", run.err
        assert len(counts) == len(set(counts)), run.err


FIRST_OF_A_FIFO_IMPORT = body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=61)))
"""The body of the file an import reads before its FIFO (:func:`_importing_before_a_fifo`)."""


@dataclasses.dataclass
class _FifoImport:
    """An ``import --no-wait A FIFO ...`` run that has said A is journaled and waits on FIFO."""

    process: subprocess.Popen[bytes]
    named: Path
    fifo: Path
    said: bytes

    def finish(self) -> bytes:
        """Everything it wrote on stderr, once it has ended (within ``LIMIT_S``)."""
        _, rest = self.process.communicate(timeout=LIMIT_S)
        return self.said + rest


@contextlib.contextmanager
def _importing_before_a_fifo(tmp_path: Path, data: Path, *after: Path) -> Iterator[_FifoImport]:
    """``import --no-wait A FIFO *after`` into ``data`` (A holding
    :data:`FIRST_OF_A_FIFO_IMPORT`), once it has said that A is journaled: it then waits on the
    FIFO, which nothing has written yet. Killed when the block ends. SIGINT stops it as a
    terminal's does, even when the suite runs with SIGINT ignored (a shell's background job)."""
    named = write(tmp_path / "a.json", FIRST_OF_A_FIFO_IMPORT)
    fifo = tmp_path / "b.fifo"
    os.mkfifo(fifo)
    args = ["--no-wait", "--aggregation", "minutes", named, fifo, *after]
    with subprocess.Popen(
        healthlog("import", "--data", data, *args),
        stderr=subprocess.PIPE,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    ) as importing:
        try:
            assert importing.stderr is not None
            fd = importing.stderr.fileno()
            said = b""
            deadline = time.monotonic() + LIMIT_S
            while f"journaled {named} as delivery 1".encode() not in said:
                left = deadline - time.monotonic()
                assert left > 0, said
                assert select.select([fd], [], [], left)[0], said
                chunk = os.read(fd, 65536)
                assert chunk, said
                said += chunk
            yield _FifoImport(importing, named, fifo, said)
        finally:
            importing.kill()


def test_import_reads_each_file_when_its_turn_comes_cli_124(tmp_path: Path) -> None:
    """CLI-124: `import A FIFO` journals A before it reads the FIFO, which is written only once
    A's delivery is said to be journaled: no file is read before the ones before it are
    journaled (each was read, and all held, before the first was); both are journaled, in
    argument order."""
    data = tmp_path / "data"
    first = FIRST_OF_A_FIFO_IMPORT
    second = body(metric(HR, BPM, point("2024-02-06 07:01:00 -0800", qty=62)))
    with _importing_before_a_fifo(tmp_path, data) as run:
        run.fifo.write_bytes(second)
        said = run.finish()
    assert run.process.returncode == 0, said
    refused = subprocess.run(
        healthlog("import", "--data", data, "--no-wait", run.named, tmp_path),
        capture_output=True,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.decode() == f"healthlog: cannot read {tmp_path}: Is a directory\n"
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [first, second]


def test_a_current_directory_the_user_may_not_enter_still_folds_cli_118(tmp_path: Path) -> None:
    """CLI-118: `import` run in a directory its user may not enter (`sudo -u healthlog healthlog
    import ...` in an admin's home, mode 0700; here root without its override of file
    permissions, in `nobody`'s) folds its delivery, `parsed`. (Before, each fold worker, a new
    process multiprocessing starts in its parent's directory, died entering it: `delivery 1: its
    fold worker died; folding it again`, then `recorded failed`, and so was every delivery of a
    `serve` started there.)"""
    if os.geteuid() != 0:
        pytest.skip("only root makes a directory another user's and enters it")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    home = tmp_path / "admin-home"
    home.mkdir(mode=0o700)
    os.chown(home, 65534, 65534)
    no_override = "-dac_override,-dac_read_search"
    as_root_without_override = [
        setpriv,
        f"--bounding-set={no_override}",
        f"--inh-caps={no_override}",
    ]
    env = {**os.environ, "HEALTHLOG_WAKE_PERIOD_S": "1"}
    command = healthlog("import", "--aggregation", "minutes", "--data", tmp_path / "data", hr)
    done = subprocess.run(
        [*as_root_without_override, *command],
        cwd=home,
        env=env,
        capture_output=True,
        timeout=LIMIT_S,
        check=False,
    )
    said = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, said
    assert "delivery 1: parsed" in said, said
    assert "died" not in said, said


def test_a_deleted_current_directory_folds_or_says_so_cli_119(tmp_path: Path) -> None:
    """CLI-119: `import` run in a directory deleted under it, its paths absolute, folds its
    delivery, `parsed`; `status` there without `--data`, whose default `./var` would be read
    from that directory, exits 2 with one line saying so. (Before, `import` waited for good:
    the folding actor crashed every 30 s starting its fold worker, `actor folding crashed
    (FileNotFoundError)`; `status` ended in a traceback.)"""
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    in_deleted = ["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh"]
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    runs = []
    for name, command in (
        ("a", healthlog("import", "--aggregation", "minutes", "--data", tmp_path / "data", hr)),
        ("b", healthlog("status")),
    ):
        gone = tmp_path / name
        gone.mkdir()
        runs.append(
            subprocess.run(
                [*in_deleted, gone, *command],
                env=env,
                capture_output=True,
                timeout=LIMIT_S,
                check=False,
            )
        )
    imported, status = runs
    said = (imported.stdout + imported.stderr).decode()
    assert imported.returncode == 0, said
    assert "delivery 1: parsed" in said, said
    assert status.returncode == 2
    one_line_error(
        status.stderr.decode(),
        "healthlog: the current directory was deleted, and a relative path would be read from"
        " it: run the command from another directory, or give absolute paths",
    )


def test_verify_names_a_backfill_folded_late_as_a_cause_cli_120(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-120: after a backfill (`import --received-at`) of a point with other content, folded
    after the delivery it comes before in journal order, as the README's `import` says it is,
    `verify` exits 1 printing the object `differs`, and its line on what to do names the
    backfill among the causes. (Before, it named only an upgrade and `otherwise changed outside
    healthlog`: a user who had backfilled as the README says was told the store had been
    tampered with.)"""
    found = run_cli("verify", "--data", differing(run_cli, tmp_path))
    assert found.code == 1, found.err
    assert found.out == b"differs\theart_rate\tminutes\t2024-02-06T15:00:00Z\n"
    assert found.err.splitlines()[-2:] == [
        "verify: 1 objects are not what a rebuild of the journal makes (a backfill, `import"
        " --received-at`, folded after later deliveries; after an upgrade: folded under a rule"
        " that has changed since; otherwise changed outside healthlog); `healthlog reindex`"
        " rebuilds them from the journal",
        "verify: 1 objects differ",
    ]


def test_every_command_s_help_gives_the_data_directory_s_default_cli_121() -> None:
    """CLI-121: the `--help` of every command and of each `token` action says where the data
    directory is when `--data` is not given, `(default: $HEALTHLOG_DATA, else ./var)`, as the
    outside contract and the README say every command takes it. (Before, `token --help` and
    `token add --help`, the first command a new user runs, said `data directory` alone.)"""
    commands = [
        [name]
        for name in ("import", "seal", "export", "follow", "serve", "chaos", "reindex", "verify")
    ]
    commands += [["status"], ["token"], ["token", "add"], ["token", "list"], ["token", "revoke"]]
    for command in commands:
        done = subprocess.run(
            healthlog(*command, "--help"), capture_output=True, timeout=LIMIT_S, check=False
        )
        assert done.returncode == 0, done.stderr
        said = " ".join(done.stdout.decode().split())
        assert "--data DATA data directory (default: $HEALTHLOG_DATA, else ./var)" in said, (
            command,
            said,
        )


def test_a_data_directory_the_user_may_not_enter_is_said_so_cli_122() -> None:
    """CLI-122: `status`, `export`, `token list`, `token add`, `import` and `serve` run by a user
    who may not enter the data directory (the README's `chmod 700 /srv/healthlog`, run without
    `sudo -u healthlog`; here `daemon`, on `nobody`'s directory: root runs as the directory's
    owner since CLI-146) exit 3 with one line naming the directory, its owner and mode, and what
    to do, and make nothing. (Before: `healthlog: [Errno 13] Permission denied:
    '.../journal.sqlite'`, or `.../healthlog.toml` for `import` and `serve`, and nothing else.)"""
    if os.geteuid() != 0:
        pytest.skip("only root makes a directory another user's")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing")
    with reachable_home("healthlog-cli-122-") as home:
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        data = home / "srv"
        imported = subprocess.run(
            healthlog("import", "--aggregation", "minutes", "--data", data, hr),
            capture_output=True,
            timeout=LIMIT_S,
            check=False,
        )
        assert imported.returncode == 0, imported.stderr
        for path in [data, *data.rglob("*")]:
            os.chown(path, 65534, 65534)
        data.chmod(0o700)
        left = sorted(path.name for path in data.iterdir())
        as_daemon = [setpriv, "--reuid=1", "--regid=1", "--clear-groups"]
        for command in (
            ["status"],
            ["export"],
            ["token", "list"],
            ["token", "add", "phone"],
            ["import", "--aggregation", "minutes", hr],
            ["serve", "--port", "0"],
        ):
            done = subprocess.run(
                [*as_daemon, *healthlog(*command, "--data", data)],
                cwd=home,
                capture_output=True,
                timeout=LIMIT_S,
                check=False,
            )
            assert done.returncode == 3, (command, done.stderr)
            one_line_error(
                done.stderr.decode(),
                f"healthlog: user daemon may not enter {data} (it is nobody's, mode 0700); run"
                f" every healthlog command on {data} as the user it belongs to (`sudo -u nobody"
                " healthlog ...`)",
            )
            assert done.stdout == b""
        assert sorted(path.name for path in data.iterdir()) == left


def test_import_reads_a_fifo_whose_writer_waits_cli_130(tmp_path: Path) -> None:
    """CLI-130: `import FIFO` whose writer already waits for a reader (`cat body > FIFO &`, then
    the import) journals the whole body, and the writer ends well. The check before any file
    is read opened the FIFO without blocking and closed it: the writer took that open for its
    reader and died of SIGPIPE (a body over the pipe's 64 KiB cannot sit in it), and the import
    then waited on the FIFO for good."""
    data = tmp_path / "data"
    source = tmp_path / "source.json"
    write_minute_body(source, metrics=1, points=3000)
    content = source.read_bytes()
    assert len(content) > 2**16
    fifo = tmp_path / "body.fifo"
    os.mkfifo(fifo)
    broken: list[OSError] = []

    def feed() -> None:
        try:
            with fifo.open("wb") as out:
                out.write(content)
        except BrokenPipeError as exc:
            broken.append(exc)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        run = subprocess.run(
            healthlog("import", "--data", data, "--no-wait", fifo),
            capture_output=True,
            timeout=LIMIT_S,
            check=False,
        )
    finally:
        # A writer still waiting for a reader is let go: it meets a closed pipe.
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(LIMIT_S)
    assert run.returncode == 0, run.stderr
    assert broken == []
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [content]


@pytest.mark.parametrize("number", ["\u00b2", "9" * 20])
def test_a_descriptor_name_with_no_descriptor_behind_it_is_said_cli_162(
    run_cli: RunCli, tmp_path: Path, number: str
) -> None:
    """CLI-162: `import /dev/fd/N` or `/proc/self/fd/N` whose N is no descriptor number (a
    superscript digit, a number too large for one) exits 2 with one line, `cannot read NAME: No
    such file or directory`, and journals nothing. (Before, CLI-161's reading of a given
    descriptor took N as a number: a traceback, exit 1, `ValueError: invalid literal for int()`
    or `OverflowError: Python int too large to convert to C int`.)"""
    data = tmp_path / "data"
    first = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    assert run_cli("import", "--no-wait", "--data", data, first).code == 0
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        name = f"{prefix}{number}"
        run = run_cli("import", "--no-wait", "--data", data, name)
        assert run.code == 2, run.err
        one_line_error(run.err, f"healthlog: cannot read {name}: No such file or directory")
    with DataDir(data).open_journal() as journal:
        assert len(list(journal.iter_order())) == 1


def test_import_waiting_on_a_fifo_stops_on_sigterm_cli_131(tmp_path: Path) -> None:
    """CLI-131: `import A FIFO` whose FIFO no program writes yet, once it has said that A is
    journaled (it then waits on the FIFO), stops on SIGTERM: exit 143, the first delivery kept.
    Each file is read at its turn in a worker thread (CLI-124), which the signal's cancel
    waited for: the command went on waiting on the FIFO, SIGTERM and Ctrl-C alike."""
    data = tmp_path / "data"
    with _importing_before_a_fifo(tmp_path, data) as run:
        run.process.send_signal(signal.SIGTERM)
        said = run.finish()
    assert run.process.returncode == 128 + signal.SIGTERM, said
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [FIRST_OF_A_FIFO_IMPORT]


def _until_closed(pid: int, path: Path) -> None:
    """Wait until process ``pid`` holds no descriptor of ``path``: it has read it and closed it."""
    deadline = time.monotonic() + 30
    fds = Path(f"/proc/{pid}/fd")
    while any(_names(fd, path) for fd in fds.iterdir()):
        assert time.monotonic() < deadline, f"{path} still open in process {pid}"
        time.sleep(0.02)


def _names(fd: Path, path: Path) -> bool:
    try:
        return os.readlink(fd) == os.fspath(path)
    except FileNotFoundError:
        return False


def test_ctrl_c_while_a_delivery_commits_still_says_it_is_journaled_run_75(
    tmp_path: Path,
) -> None:
    """RUN-75: `import A FIFO`, Ctrl-C (SIGINT) while the FIFO's delivery waits for the journal's
    write lock (held by another connection, so that its commit is in flight): once the lock
    goes, the delivery is journaled and the command says so (`journaled FIFO as delivery 2`),
    then that both stay journaled (CLI-186), before `healthlog: interrupted`, exit 130. Before,
    Ctrl-C broke the shielded wait for the commit (trio's KeyboardInterrupt ignores shields):
    the delivery was journaled unsaid, and a user who imported the file again had it twice."""
    data = tmp_path / "data"
    second = body(metric(HR, BPM, point("2024-02-06 07:01:00 -0800", qty=62)))
    with _importing_before_a_fifo(tmp_path, data) as run:
        with closing(sqlite3.connect(DataDir(data).journal_path, isolation_level=None)) as lock:
            lock.execute("BEGIN IMMEDIATE")
            run.fifo.write_bytes(second)
            # The import reads the FIFO to its end, closes it and hands the delivery over, whose
            # append then waits for the lock up to the journal's busy timeout (5 s).
            _until_closed(run.process.pid, run.fifo)
            time.sleep(0.5)
            run.process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            lock.execute("ROLLBACK")
        said = run.finish().decode()
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [
            FIRST_OF_A_FIFO_IMPORT,
            second,
        ]
    assert run.process.returncode == 128 + signal.SIGINT, said
    lines = said.splitlines()
    assert lines[-1] == "healthlog: interrupted", said
    assert lines[-2].startswith("import: stopped; the 2 files journaled (deliveries 1 to 2)"), said
    assert lines[-3].startswith(f"journaled {run.fifo} as delivery 2 "), said


def test_a_file_gone_at_its_turn_says_what_was_journaled_cli_132(tmp_path: Path) -> None:
    """CLI-132: `import A FIFO C` whose C is removed while the import waits on the FIFO (after
    the check made before any file is read) exits 2, and its error line names the deliveries
    journaled before it, A's and the FIFO's, so that nobody imports them again (without a key
    they would be journaled twice); the journal holds those two. Before, the line said only
    `cannot read C: No such file or directory`."""
    data = tmp_path / "data"
    second = body(metric(HR, BPM, point("2024-02-06 07:01:00 -0800", qty=62)))
    gone = write(tmp_path / "c.json", second)
    with _importing_before_a_fifo(tmp_path, data, gone) as run:
        gone.unlink()
        run.fifo.write_bytes(second)
        said = run.finish()
    assert run.process.returncode == 2, said
    last = said.decode().splitlines()[-1]
    assert last == (
        f"healthlog: cannot read {gone}: No such file or directory; journaled before it:"
        f" {run.named} as delivery 1, {run.fifo} as delivery 2 (do not import those again)"
    )
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [
            FIRST_OF_A_FIFO_IMPORT,
            second,
        ]


JOURNAL_LIMIT = 300 * 1024
"""CLI-133: the file size limit (`ulimit -f`) the import runs under, as a full disk: room for a
small delivery's journal, not for a large one's."""


def _files_up_to_journal_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (JOURNAL_LIMIT, resource.RLIM_INFINITY))


def test_a_file_the_journal_has_no_room_for_says_what_was_journaled_cli_133(
    tmp_path: Path,
) -> None:
    """CLI-133: `import A B` whose B does not fit in the journal (its writes fail: here a file
    size limit; a full disk alike) exits 3, and its error line ends with the delivery journaled
    before it, A's, so that nobody imports A again; the journal holds A alone. Before, the line
    was `database error: disk I/O error (journal.sqlite)` alone."""
    data = tmp_path / "data"
    first = body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=61)))
    named = write(tmp_path / "a.json", first)
    # Random, so that it does not shrink in the journal.
    large = tmp_path / "b.json"
    large.write_text(
        json.dumps(
            {
                "data": {
                    "metrics": [
                        {
                            "name": "x",
                            "units": "u",
                            "data": [
                                {"date": "2024-02-06 07:00:00 -0800", "n": os.urandom(32).hex()}
                                for _ in range(20_000)
                            ],
                        }
                    ]
                }
            }
        )
    )
    run = subprocess.run(
        healthlog("import", "--data", data, "--no-wait", "--aggregation", "minutes", named, large),
        capture_output=True,
        timeout=LIMIT_S,
        check=False,
        preexec_fn=_files_up_to_journal_limit,
    )
    said = run.stderr.decode()
    assert run.returncode == 3, said
    assert said.splitlines()[-1].endswith(
        f" (journal.sqlite); journaled before it: {named} as delivery 1 (do not import those again)"
    ), said
    with DataDir(data).open_journal() as journal:
        assert [journal.read_body(m.id) for m in journal.iter_order()] == [first]


def test_a_token_with_a_reserved_name_from_an_older_healthlog_is_said_so_cli_156_cli_157(
    tmp_path: Path, cli: Cli
) -> None:
    """CLI-156, CLI-157: a token named `cli:...`, as a healthlog before the names were reserved
    made it (renamed so in its file, as SEAL-4 builds it), authenticates nothing after the
    upgrade; `token list` says so and how to mend it, and `serve` warns at its start, by count."""
    data = tmp_path / "data"
    made = cli("token", "add", "phone", "--data", data)
    assert made.code == 0, made.err
    token = made.out.decode().strip()
    with closing(sqlite3.connect(data / "tokens.sqlite")) as conn, conn:
        conn.execute("UPDATE tokens SET name = 'cli:phone' WHERE name = 'phone'")
    assert cli("token", "add", "watch", "--data", data).code == 0

    listed = cli("token", "list", "--data", data)
    assert listed.code == 0, listed.err
    assert listed.out == b"cli:phone\nwatch\n"
    assert listed.err.splitlines() == [
        "healthlog: token 'cli:phone' authenticates nothing: names beginning 'cli:' are"
        " reserved (an older healthlog allowed them); revoke it (`healthlog token revoke"
        " cli:phone`) and add one under another name"
    ]

    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as served:
        try:
            assert served.stdout is not None
            line = served.stdout.readline().decode()
            found = re.search(r"healthlog serving on (http://127\.0\.0\.1:\d+) ", line)
            assert found, line
            with httpx.Client(base_url=found.group(1), timeout=LIMIT_S) as client:
                refused = client.post(
                    "/v1/deliveries",
                    content=b'{"data": {"metrics": []}}',
                    headers={"Authorization": f"Bearer {token}"},
                )
            assert refused.status_code == 401
        finally:
            served.send_signal(signal.SIGTERM)
            _, err = served.communicate(timeout=LIMIT_S)
    assert served.returncode == 0, err
    warnings = [line for line in err.decode().splitlines() if "level=WARNING" in line]
    said = [line for line in warnings if "reserved prefix" in line]
    assert len(said) == 1, err
    assert "1 client token(s) named with the reserved prefix 'cli:'" in said[0]
    assert f"`healthlog token list --data {data}`" in said[0]
    assert "phone" not in "".join(warnings)

    revoked = cli("token", "revoke", "cli:phone", "--data", data)
    assert revoked.code == 0, revoked.err
    after = cli("token", "list", "--data", data)
    assert (after.out, after.err) == (b"watch\n", "")


def _served_warnings(data: Path) -> list[str]:
    """The WARNING lines of `healthlog serve` on ``data`` from its start to a SIGTERM once it
    is ready (it says what it finds of the store once it has checked it: RUN-162)."""
    err = serve_debug(data, signal.SIGTERM)
    return [line for line in err.splitlines() if "level=WARNING" in line]


def test_a_store_folded_before_merge_35_says_to_reindex_cli_182_cli_183_cli_184_merge_36(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """CLI-182, CLI-183, CLI-184, MERGE-36: a data directory an older healthlog folded three
    symptoms of one day and two doses taken at once into (one of each kept), upgraded: `serve`
    logs one WARNING at its start with why and `healthlog reindex --data DIR`, naming no record;
    `status` shows it in a line of its own and `--json` as `reindex_advised`, its other keys
    kept; `verify` exits 1 naming the two objects, and says it. After `reindex` the five
    records export, and none of the three says it any more."""
    data = tmp_path / "data"
    records = tmp_path / "records.json"
    records.write_bytes(ONE_MOMENT_RECORDS)
    imported = run_cli("import", "--data", data, records)
    assert imported.code == 0, imported.err
    fold_as_before_merge_35(data / "store.sqlite")
    advice = (
        "a reindex is advised: an older healthlog kept one of the symptoms, medication doses or"
        " cycle-tracking entries that share a start and end, and the journal alone holds the"
        f" others (MERGE-35); `healthlog reindex --data {data}` rebuilds the objects from the"
        " journal (safe while serve runs)"
    )

    warnings = _served_warnings(data)
    said = [line for line in warnings if "reindex" in line]
    assert len(said) == 1, warnings
    assert said[0].endswith(f' msg="{advice}"'), said
    for told in (b"Acne", b"Bloating", b"Headache", b"Lisinopril", b"Metformin", b"Mild"):
        assert told.decode() not in "".join(warnings)

    status = run_cli("status", "--data", data)
    assert status.code == 0, status.err
    assert status.out.decode().splitlines()[-1] == f"advice      {advice}"
    document = json.loads(run_cli("status", "--json", "--data", data).out)
    assert document["reindex_advised"] == ["records_of_one_moment"]
    assert {"journal", "deliveries", "lag", "lease", "first_pass_completed", "subscribers"} <= set(
        document
    )

    verified = run_cli("verify", "--data", data)
    assert verified.code == 1, verified.err
    assert sorted(line.split(b"\t")[1] for line in verified.lines()) == [
        b"medications",
        b"symptoms",
    ]
    assert f"verify: {advice}" in verified.err.splitlines(), verified.err
    assert len(run_cli("export", "--data", data).lines()) == 2

    reindexed = run_cli("reindex", "--data", data)
    assert reindexed.code == 0, reindexed.err
    assert len(run_cli("export", "--data", data).lines()) == 5
    assert "advice" not in run_cli("status", "--data", data).out.decode()
    assert json.loads(run_cli("status", "--json", "--data", data).out)["reindex_advised"] == []
    clean = run_cli("verify", "--data", data)
    assert (clean.code, "advised" in clean.err) == (0, False), clean.err
    assert not [line for line in _served_warnings(data) if "reindex" in line]


def test_verify_says_a_reindex_would_change_no_object_where_none_differs_cli_184(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """CLI-184: a data directory of the older schema whose symptoms never shared a moment (one
    symptom a day), so that the older fold lost none, is advised a reindex all the same (which
    objects lost one only a rebuild tells); `verify` exits 0 and says the reindex would change
    no object and only take the advice away, rather than advise it after `0 objects differ`."""
    data = tmp_path / "data"
    records = tmp_path / "records.json"
    records.write_bytes(
        b'{"data":{"symptoms":[{"start":"2024-02-06 00:00:00 -0800","end":"2024-02-07 00:00:00'
        b' -0800","name":"Headache","severity":"Mild"}]}}'
    )
    imported = run_cli("import", "--data", data, records)
    assert imported.code == 0, imported.err
    fold_as_before_merge_35(data / "store.sqlite")

    verified = run_cli("verify", "--data", data)

    assert verified.code == 0, verified.err
    said = [line for line in verified.err.splitlines() if "advised" in line]
    assert len(said) == 1, verified.err
    assert said[0].startswith("verify: a reindex is advised: "), said
    assert said[0].endswith(
        "; this verify found no object differing: the reindex would change none and only take"
        " this advice away"
    ), said


_PEAK_OF_A_CHILD = """
import os, subprocess, sys
process = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE)
said = process.stderr.read()
_, status, usage = os.wait4(process.pid, 0)
process.returncode = os.waitstatus_to_exitcode(status)
assert process.returncode == 0, said
print(usage.ru_maxrss * 1024)
"""


def _import_peak_rss(data: Path, file: Path) -> int:
    """The peak resident memory, in bytes, of a real `import --no-wait FILE` (which starts no
    fold worker: the figure is the command's own). Started by a small process of its own: a
    peak survives exec, so a child of this one (the test runner) would count the runner's."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK_OF_A_CHILD,
            *healthlog("import", "--data", data, "--no-wait", file),
        ],
        capture_output=True,
        check=True,
    )
    return int(run.stdout)


def test_import_holds_the_compressed_body_not_the_raw_one_twice_cli_185(tmp_path: Path) -> None:
    """CLI-185: `import` of a 16 MiB minute-level body (the app's shape, compressed about five
    times by the journal) peaks at less than the body's size above an import of an empty one:
    it reads the file a chunk at a time into the journal's encoder. (Before, it read the file
    whole and the encoder copied it whole before compressing it: 2.4 times the body above the
    empty import, 992 MiB at the peak for a file of 399 MiB, three years of heart rate and
    steps.) The body is journaled as it was."""
    from healthlog.workload import big_body

    raw = big_body(185, target_bytes=16 * 2**20)
    large, empty = tmp_path / "large.json", tmp_path / "empty.json"
    large.write_bytes(raw)
    empty.write_bytes(b'{"data":{"metrics":[]}}')
    floor = _import_peak_rss(tmp_path / "floor", empty)
    peak = _import_peak_rss(tmp_path / "data", large)
    assert peak - floor < len(raw), (peak - floor) / len(raw)
    with DataDir(tmp_path / "data").open_journal() as journal:
        assert journal.read_body(1) == raw


def test_an_import_stopped_says_what_it_journaled_stays_and_not_to_import_it_again_cli_186(
    tmp_path: Path,
) -> None:
    """CLI-186: `import A B` stopped by SIGTERM while it waits for the fold (another process
    holds the lease) says, before `healthlog: interrupted`, that the 2 files journaled
    (deliveries 1 to 2) stay journaled, who folds them, and not to import them again; `import
    A FIFO C` stopped while it waits on the FIFO says that A (delivery 1) stays and that the
    FIFO and the 1 file after it were not journaled. (Before, only `healthlog: interrupted`:
    the same command run again journaled every file twice.)"""
    data = tmp_path / "data"
    first = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    second = write(tmp_path / "b.json", body(metric(HR, BPM, point("2024-02-06 07:01:00 -0800"))))
    with DataDir(data).open_store() as store:
        assert store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
    with subprocess.Popen(
        healthlog("import", "--data", data, first, second), stderr=subprocess.PIPE
    ) as importing:
        said, err = signalled_after(
            importing, signal.SIGTERM, lambda said: said[-1].startswith("import: waiting")
        )
    assert importing.returncode == 128 + signal.SIGTERM
    lines = [line for line in said + err.splitlines() if not LOG_RECORD.match(line)]
    assert lines[-2:] == [
        "import: stopped; the 2 files journaled (deliveries 1 to 2) stay journaled and fold at"
        " the next pass of serve or of another import: do not import them again, which would"
        " journal them twice",
        "healthlog: interrupted",
    ]
    fifo_data = tmp_path / "fifo-data"
    with _importing_before_a_fifo(tmp_path, fifo_data, second) as run:
        run.process.send_signal(signal.SIGTERM)
        stopped = run.finish().decode().splitlines()
    assert stopped[-2:] == [
        "import: stopped; the file journaled (delivery 1) stays journaled and folds at the next"
        " pass of serve or of another import: do not import it again, which would journal it"
        f" twice; not journaled: {run.fifo} and the 1 file after it",
        "healthlog: interrupted",
    ]


def test_import_says_each_outcome_once_it_is_folded_cli_187(tmp_path: Path) -> None:
    """CLI-187: `import A B`, whose second fold is held (a delay of 120 s at the fault point
    `fold.begin`), says `delivery 1: parsed` while the second still folds; SIGTERM then stops
    it, the second not said. (Before, every outcome was said together once the last was
    folded: six files of three years of minute-level points, 105 s without a line after the
    last was journaled.)"""
    data = tmp_path / "data"
    first = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    second = write(tmp_path / "b.json", body(metric(HR, BPM, point("2024-02-06 07:01:00 -0800"))))
    plan = {"fold.begin": {"hits": [2], "do": "delay", "seconds": 120}}
    env = {**os.environ, "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    with subprocess.Popen(
        healthlog("import", "--data", data, "--aggregation", "minutes", first, second),
        stderr=subprocess.PIPE,
        env=env,
    ) as importing:
        said, err = signalled_after(
            importing, signal.SIGTERM, lambda said: said[-1] == "delivery 1: parsed"
        )
    assert importing.returncode == 143, err
    assert "delivery 2:" not in "\n".join(said) + err
    with DataDir(data).open_store() as store:
        assert store.outcome(2) is None


def test_the_first_start_names_a_token_command_that_runs_cli_236(tmp_path: Path) -> None:
    """CLI-236: `serve` begun on a new data directory prints `no client token yet: create one
    with `COMMAND``, and COMMAND, run as printed from a shell whose `PATH` is the system's (the
    `.venv` is on no one's `PATH`), makes a token (exit 0, `hl_...` on stdout). (Before, it
    printed `healthlog token add NAME --data DIR`, which such a shell answers `command not
    found`, exit 127: measured after `scripts/serve`, as the README's first steps go.)"""
    data = tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if k != "HEALTHLOG_DATA"}
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as served:
        try:
            assert served.stdout is not None
            assert served.stdout.readline().startswith(b"healthlog serving on ")
            hint = served.stdout.readline().decode()
        finally:
            served.send_signal(signal.SIGTERM)
            _, err = served.communicate(timeout=LIMIT_S)
    assert served.returncode == 0, err
    found = re.fullmatch(r"no client token yet: create one with `([^`]+)` and send .*\n", hint)
    assert found, hint
    command = found.group(1).replace("NAME", "phone")
    made = subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        env={**env, "PATH": "/usr/local/bin:/usr/bin:/bin"},
        cwd=tmp_path,
        check=False,
    )
    assert made.returncode == 0, (command, made.returncode, made.stderr)
    assert made.stdout.startswith("hl_"), made.stdout


def test_scripts_serve_starts_an_installed_clone_offline_cli_237(tmp_path: Path) -> None:
    """CLI-237: `scripts/serve` in a clone whose `.venv` has healthlog installed since its
    `pyproject.toml` last changed serves with no package index reachable (a NAS offline, PyPI
    down): it prints where it serves and stops cleanly at SIGTERM. (Before, it ran `pip install
    --upgrade pip` and `pip install -e .` at every start, whose build needs setuptools from an
    index: offline it exited 1 in 2.6 s and served nothing.)"""
    sources = Path(__file__).resolve().parent.parent
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy2(sources / "scripts" / "serve", clone / "scripts" / "serve")
    shutil.copy2(sources / "pyproject.toml", clone / "pyproject.toml")
    installed = Path(sys.executable).parent / "healthlog"
    before = installed.stat().st_mtime - 60
    os.utime(clone / "pyproject.toml", (before, before))
    (clone / ".venv").symlink_to(Path(sys.executable).parent.parent)
    offline = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "HEALTHLOG_"))},
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    with subprocess.Popen(
        [clone / "scripts" / "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=offline,
    ) as served:
        try:
            assert served.stdout is not None
            line = served.stdout.readline().decode()
        finally:
            served.send_signal(signal.SIGTERM)
            _, err = served.communicate(timeout=LIMIT_S)
    assert line.startswith("healthlog serving on http://127.0.0.1:"), (line, err)
    assert f"(data in {clone / 'var'})" in line
    assert served.returncode == 0, err


def test_status_advising_a_reindex_of_a_directory_whose_name_is_not_utf8_prints_cli_271(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """CLI-271: `status` on a data directory named with a byte that is not UTF-8
    (`donn\\xe9es`) where a reindex is advised (CLI-183), its stdout strict UTF-8 (a UTF-8 locale
    other than C), exits 0 and prints its advice line naming the directory with the byte
    written `\\udce9`, as stderr writes it. (Before, it printed nothing and exited 1 with a
    traceback ending `UnicodeEncodeError: ... surrogates not allowed`.)"""
    data = Path(os.fsdecode(os.fsencode(tmp_path) + b"/donn\xe9es"))
    records = tmp_path / "records.json"
    records.write_bytes(ONE_MOMENT_RECORDS)
    assert run_cli("import", "--data", data, records).code == 0
    fold_as_before_merge_35(data / "store.sqlite")
    status = run_cli("status", "--data", data, env={"PYTHONIOENCODING": "utf-8:strict"})
    assert status.code == 0, status.err
    shown = os.fspath(data).encode("utf-8", "backslashreplace").decode()
    advice = status.out.decode().splitlines()[-1]
    assert advice.startswith("advice      a reindex is advised: "), advice
    assert f"`healthlog reindex --data '{shown}'` rebuilds" in advice, advice


def test_the_reindex_advised_for_a_directory_with_a_space_runs_as_given_store_150(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """STORE-150: where a reindex is advised (CLI-183) on a data directory whose path holds a
    space (`/srv/Health Data`, as a NAS share is often named), the command `status` names runs as
    a shell reads it: it rebuilds that directory, and `status` advises nothing after it. (Before,
    the path stood unquoted: the shell read `--data /srv/Health` and `Data`, and `healthlog`
    exited 2, `unrecognized arguments: Data`.)"""
    data = tmp_path / "Health Data"
    records = tmp_path / "records.json"
    records.write_bytes(ONE_MOMENT_RECORDS)
    assert run_cli("import", "--data", data, records).code == 0
    fold_as_before_merge_35(data / "store.sqlite")
    advice = run_cli("status", "--data", data).out.decode().splitlines()[-1]
    found = re.search(r"`(healthlog reindex [^`]+)`", advice)
    assert found is not None, advice
    words = shlex.split(found.group(1))
    assert words[:3] == ["healthlog", "reindex", "--data"], words
    reindexed = run_cli(*words[1:])
    assert reindexed.code == 0, reindexed.err
    assert "advice" not in run_cli("status", "--data", data).out.decode()


def test_the_token_list_said_of_reserved_names_in_a_directory_with_a_space_runs_serve_161(
    tmp_path: Path, cli: Cli, run_cli: RunCli
) -> None:
    """SERVE-161: `serve` on a data directory whose path holds a space (`Health Data`) and a
    token with a reserved name (CLI-157) names a `healthlog token list` that, run as a shell
    reads it, lists that directory's tokens. (Before, the path stood unquoted: the shell read
    `--data .../Health` and `Data`, and `healthlog` exited 2, `unrecognized arguments: Data`.)"""
    data = tmp_path / "Health Data"
    assert cli("token", "add", "phone", "--data", data).code == 0
    with closing(sqlite3.connect(data / "tokens.sqlite")) as conn, conn:
        conn.execute("UPDATE tokens SET name = 'cli:phone' WHERE name = 'phone'")
    said = [line for line in _served_warnings(data) if "reserved prefix" in line]
    assert len(said) == 1, said
    found = re.search(r"`(healthlog token list [^`]+)`", said[0])
    assert found is not None, said
    words = shlex.split(found.group(1).replace('\\"', '"'))
    listed = run_cli(*words[1:])
    assert (listed.code, listed.out) == (0, b"cli:phone\n"), listed.err


def test_the_chown_said_of_a_directory_with_a_space_runs_as_given_store_151(
    run_cli: RunCli,
) -> None:
    """STORE-151: a command run as a user who may not write a data directory whose path holds
    a space (`Health Data`) exits 3 naming a `chown -R USER: DIR && chmod -R u+rwX DIR` (CLI-90)
    with the directory quoted as a shell reads it: run as given (by root), it makes the
    directory that user's, and the command then runs. (Before, the path stood unquoted: `chown`
    and `chmod` said `cannot access` for `.../Health` and `Data`, the directory unchanged.)
    Run by root, as the suite is, with util-linux's `setpriv`: it never skips."""
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    with reachable_home("healthlog-store-151-") as home:
        data = home / "Health Data"
        hr = write(
            home / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
        )
        assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
        refused = run_status([*as_nobody, *healthlog("export", "--data", data)], home)
        assert not refused[0], refused
        found = re.search(r"\(`(chown -R [^`]+)`\)", refused[2])
        assert found is not None, refused[2]
        mending = subprocess.run(["sh", "-c", found.group(1)], capture_output=True, text=True)
        assert mending.returncode == 0, mending.stderr
        exported = run_status([*as_nobody, *healthlog("export", "--data", data)], home)
    assert exported[0], exported
    assert len(exported[1].splitlines()) == 1, exported


def _readable_by_every_user(data: Path) -> str:
    for name in ("journal.sqlite", "store.sqlite"):
        (data / name).chmod(0o644)
    return "readable by every user"


def _writable_by_every_user(data: Path) -> str:
    (data / "snapshots").mkdir(exist_ok=True)
    for directory in (data, data / "snapshots"):
        directory.chmod(0o777)
    return "may write in"


@pytest.mark.parametrize("opening", [_readable_by_every_user, _writable_by_every_user])
def test_the_chmod_said_of_open_modes_in_a_directory_with_a_space_runs_as_given_store_152(
    run_cli: RunCli, tmp_path: Path, opening: Callable[[Path], str]
) -> None:
    """STORE-152: a data directory whose path holds a space (`Health Data`) with files every
    user may read (STORE-79) or directories every user may write in (STORE-97) is named at a
    start with a `chmod` that, run by a shell as given, mends it: the next start says nothing of
    it. (Before, the path stood unquoted: `chmod` said
    `cannot access` for `.../Health` and `Data`, and the modes stayed as they were.)"""
    data = tmp_path / "Health Data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    said = opening(data)
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    [warned] = [line for line in again.err.splitlines() if said in line]
    found = re.search(r"`(chmod [^`]+)`", warned)
    assert found is not None, warned
    mending = subprocess.run(["sh", "-c", found.group(1)], capture_output=True, text=True)
    assert mending.returncode == 0, mending.stderr
    mended = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert mended.code == 0, mended.err
    assert said not in mended.err, mended.err


def _writable_by_the_group(data: Path) -> str:
    data.chmod(0o775)
    (data / "journal.sqlite").chmod(0o660)
    shared = shared_group(data.stat().st_uid)
    for path in (data, *data.iterdir()):
        os.chown(path, -1, shared.gr_gid)
    return "group may write"


def test_the_chmod_g_w_said_runs_as_given_once_the_process_has_exited_store_154(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-154: a data directory whose path holds a space (`Health Data`), of mode 0775, and a
    `journal.sqlite` of mode 0660, of a group another account shares, are named at a start with
    the journal's `-wal` and `-shm` (STORE-108) and a `chmod g-w` that, run by a shell as given
    once that process has exited (SQLite removed the `-wal` and `-shm` as it closed), exits 0 and
    mends them: the next start says nothing of them. (Before, the `chmod` named the `-wal` and
    `-shm` themselves, and the directory unquoted: it said `cannot access` for each, exit 1.)"""
    data = tmp_path / "Health Data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    said = _writable_by_the_group(data)
    again = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert again.code == 0, again.err
    [warned] = [line for line in again.err.splitlines() if said in line]
    assert f"{data}/journal.sqlite-wal (mode 0660" in warned, warned
    assert not (data / "journal.sqlite-wal").exists()
    found = re.search(r"`(chmod g-w [^`]+)`", warned)
    assert found is not None, warned
    mending = subprocess.run(["sh", "-c", found.group(1)], capture_output=True, text=True)
    assert (mending.returncode, mending.stderr) == (0, "")
    mended = run_cli("import", "--aggregation", "minutes", "--data", data, hr)
    assert mended.code == 0, mended.err
    assert said not in mended.err, mended.err


def test_the_status_said_of_a_new_signing_key_in_a_directory_with_a_space_runs_store_153(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-153: a data directory whose path holds a space (`Health Data`) whose signing.key
    is lost is given a new one with STREAM-87's WARNING, which names the `healthlog status
    --data DIR` that prints the new key: run as a shell reads it, it prints that key. (Before,
    the path stood unquoted: the shell read `--data .../Health` and `Data`, and `healthlog`
    exited 2, `unrecognized arguments: Data`.)"""
    data = tmp_path / "Health Data"
    hr = write(
        tmp_path / "hr.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    assert run_cli("import", "--aggregation", "minutes", "--data", data, hr).code == 0
    assert run_cli("status", "--data", data).code == 0
    (data / "signing.key").unlink()
    remade = run_cli("status", "--data", data)
    assert remade.code == 0, remade.err
    new_key = re.search(r"snapshot key \(Ed25519\) (\S+)", remade.out.decode())
    assert new_key is not None, remade.out
    found = re.search(r"`(healthlog status [^`]+)`", remade.err)
    assert found is not None, remade.err
    words = shlex.split(found.group(1))
    assert words[:3] == ["healthlog", "status", "--data"], words
    printed = run_cli(*words[1:])
    assert printed.code == 0, printed.err
    assert f"snapshot key (Ed25519) {new_key.group(1)}" in printed.out.decode()
