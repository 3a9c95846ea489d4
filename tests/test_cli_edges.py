"""The command line at its edges: a closed pipe, Ctrl-C, and settings out of range
(specs/cli.md, CLI-25 to CLI-30). Every command runs as a real process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _cli_bodies import body, metric, point, write

from healthlog.cli import build_parser
from healthlog.config import load_serve_config
from healthlog.storage.datadir import DataDir

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


def test_verify_with_differences_exits_1_when_its_reader_goes_cli_25(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-25: `verify` whose stdout reader closed before the differences are printed still
    exits 1 (objects differ), with no traceback."""
    data = tmp_path / "data"
    at = "2024-02-06 07:00:00 -0800"
    live = write(tmp_path / "live.json", body(metric(HR, BPM, point(at, qty=1.5, source="a"))))
    backfill = write(
        tmp_path / "backfill.json", body(metric(HR, BPM, point(at, qty=99.5, source="b")))
    )
    args = ("import", "--aggregation", "minutes", "--data", data)
    assert run_cli(*args, live).code == 0
    assert run_cli(*args, "--received-at", "2024-01-01T00:00:00Z", backfill).code == 0
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


def test_ctrl_c_stops_a_waiting_import_with_130_and_keeps_what_it_journaled_cli_26(
    tmp_path: Path,
) -> None:
    """CLI-26: Ctrl-C (SIGINT) while `import` waits for the fold: exit 130, one line saying so
    after the one that names the journaled delivery, and no traceback; the delivery stays
    journaled."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
    # SIGINT as a terminal delivers it, even when the suite runs with it ignored (a shell's
    # background job), which the command would inherit; killed if the test fails.
    with subprocess.Popen(
        healthlog("import", "--aggregation", "minutes", "--data", data, file),
        stderr=subprocess.PIPE,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    ) as importing:
        try:
            deadline = time.monotonic() + LIMIT_S
            with DataDir(data).open_journal() as journal:
                while journal.count()[0] == 0:
                    assert time.monotonic() < deadline, "the import journaled nothing"
                    time.sleep(0.05)
            importing.send_signal(signal.SIGINT)
            _, err = importing.communicate(timeout=LIMIT_S)
        finally:
            if importing.poll() is None:
                importing.kill()
    assert importing.returncode == 130
    lines = err.decode().splitlines()
    assert "Traceback" not in err.decode()
    assert lines[0].startswith(f"journaled {file} as delivery 1")
    assert lines[1:] == ["healthlog: interrupted"]
    with DataDir(data).open_journal() as journal:
        assert journal.count()[0] == 1


@pytest.mark.parametrize(
    ("flags", "toml", "says"),
    [
        ([], '[serve]\nlog_level = "loud"\n', "invalid log_level"),
        (["--port", "99999"], None, "invalid port"),
        (["--port", "-1"], None, "invalid port"),
        (["--max-body-mib", "-3"], None, "invalid max_body_mib"),
        (["--max-body-mib", "nan"], None, "invalid max_body_mib"),
        (["--max-body-mib", "inf"], None, "invalid max_body_mib"),
        ([], "serve = 1\n", "serve must be a table"),
        ([], "port = 8788\n", "unknown settings ['port'] (outside [serve])"),
        ([], "[serve]\nwake_period_s = 0\n", "invalid wake_period_s"),
        ([], "[serve]\nlease_ttl_s = 4\n", "lease_renew_s must be shorter than lease_ttl_s"),
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


def test_follow_with_a_port_out_of_range_exits_2_cli_30(cli: Cli, tmp_path: Path) -> None:
    """CLI-30: `follow --url` with a port outside 0 to 65535 exits 2 with one line."""
    url = "http://127.0.0.1:99999"
    run = cli("follow", "--url", url, "--token", "t", "--replica", tmp_path / "replica")
    assert run.code == 2
    one_line_error(run.err, f"not a service or stream URL: {url}")


def test_verify_says_what_is_not_folded_yet_cli_32(cli: Cli, tmp_path: Path) -> None:
    """CLI-32: `verify` on a data directory with journaled deliveries not folded yet (another
    process holds the fold lease) exits 0 for what is folded and says how many are not."""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", body(metric(HR, BPM, point("2024-02-06 07:00:00 -0800"))))
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
    assert cli("import", "--no-wait", "--aggregation", "minutes", "--data", data, file).code == 0
    run = cli("verify", "--data", data)
    assert run.code == 0
    assert "verify: 1 journaled deliveries are not folded yet" in run.err
    assert run.err.splitlines()[-1] == "verify: 0 objects differ"


@pytest.mark.parametrize("before", [True, False])
def test_token_takes_data_after_its_own_name_and_lists_names_alone_cli_33(
    cli: Cli, tmp_path: Path, before: bool
) -> None:
    """CLI-33: `token` takes `--data DIR` after its own name and after the action alike, and
    `token list` prints one name per line and nothing else (never a secret)."""
    data = tmp_path / "data"

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
    assert not (tmp_path / "var").exists()
