"""The command line against real files and real processes (specs/cli.md).

A few tests run ``python -m healthlog.cli`` as a real process (``run_cli``); the fine-grained
ones call ``healthlog.cli.main`` in-process (``cli``). Both give exit code, stdout and stderr.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import select
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _cli_bodies import body, compact, metric, point, raw_point, write
from _hostile_corpus import corpus
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from healthlog import clock, faults
from healthlog.fold import NO_LAYER, UNKNOWN_HEADER
from healthlog.hae import MAX_BODY_NESTING, MIN_BYTES_PER_VALUE, RECORD_SECTIONS
from healthlog.storage import _sqlite
from healthlog.storage._sqlite import StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.replica import REPLICA_FILE, Replica
from healthlog.storage.store import (
    COUNT_QUERIES,
    GIVEN_UP,
    MIGRATIONS,
    Store,
    listing_queries,
)
from healthlog.timestamps import format_instant, hour_of, parse_instant

if TYPE_CHECKING:
    from conftest import Cli, Outcomes, RunCli

HR = "heart_rate"
BPM = "count/min"
LINE_KEYS = ["metric", "layer", "start", "end", "units", "point"]
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{0,5}[1-9])?Z")
STATUS_KEYS = {
    "journal": {"deliveries", "bytes"},
    "deliveries": {"pending", "parsed", "partial", "failed"},
    "lag": {"oldest_pending_id", "waited_s", "stopped_because"},
    "lease": {"holder", "epoch"},
}


def minute(n: int, day: int = 6) -> str:
    """``n`` minutes after 2024-02-{day} 15:00 UTC, in the app's date shape."""
    hour, mins = divmod(15 * 60 + n, 60)
    return f"2024-02-{day + hour // 24:02d} {hour % 24:02d}:{mins:02d}:00 +0000"


def journal_order(data: Path) -> list[tuple[bytes, int]]:
    """(body, received_at) of every delivery, in journal order."""
    with DataDir(data).open_journal() as journal:
        return [(journal.read_body(m.id), m.received_at) for m in journal.iter_order()]


def status_of(cli: Cli, data: Path) -> dict[str, Any]:
    run = cli("status", "--json", "--data", data)
    assert run.code == 0, run.err
    document: dict[str, Any] = json.loads(run.out)
    return document


def exported(cli: Cli, data: Path, *args: str) -> list[bytes]:
    run = cli("export", "--data", data, *args)
    assert run.code == 0, run.err
    return run.lines()


def import_ok(cli: Cli, data: Path, *args: str | Path) -> None:
    run = cli("import", "--data", data, *args)
    assert run.code == 0, run.err


# -- data directory and import ------------------------------------------------------------


def test_import_as_a_real_process_journals_each_file_in_argument_order_cli_2(
    run_cli: RunCli, outcomes: Outcomes, tmp_path: Path
) -> None:
    """CLI-2, CLI-1: `import --data DIR A B` as a process; A then B, both folded and exported."""
    data = tmp_path / "data"
    a = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    b = write(tmp_path / "b.json", body(metric("step_count", "count", point(minute(1), qty=9))))
    run = run_cli("import", "--aggregation", "minutes", "--data", data, a, b)
    assert run.code == 0, run.err
    assert "waiting" not in run.err, "CLI-46: the lease was free, the import folded itself"
    assert [content for content, _ in journal_order(data)] == [a.read_bytes(), b.read_bytes()]
    assert list(outcomes(data).values()) == ["parsed", "parsed"]
    export = run_cli("export", "--data", data)
    assert export.code == 0, export.err
    assert [(d["metric"], d["point"]["qty"]) for d in export.json_lines()] == [
        (HR, 61),
        ("step_count", 9),
    ]


def test_environment_names_the_data_dir_and_var_is_the_default_cli_1(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-1: without `--data`, a real process uses $HEALTHLOG_DATA, else ./var, also when
    $HEALTHLOG_DATA is set but empty."""
    data = tmp_path / "from-env"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    env = {"HEALTHLOG_DATA": str(data)}
    assert run_cli("import", "--aggregation", "minutes", sent, env=env).code == 0
    export = run_cli("export", env=env)
    assert export.code == 0, export.err
    assert [d["point"]["qty"] for d in export.json_lines()] == [61]
    assert run_cli("import", "--aggregation", "minutes", sent, cwd=tmp_path).code == 0
    empty = {"HEALTHLOG_DATA": ""}
    assert run_cli("import", "--aggregation", "minutes", sent, cwd=tmp_path, env=empty).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "from-env", "var"]
    with DataDir(data).open_journal() as journal, DataDir(tmp_path / "var").open_journal() as var:
        assert (journal.count()[0], var.count()[0]) == (1, 2)


def test_data_flag_wins_over_the_environment_cli_1(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CLI-1: `--data` after the command name beats $HEALTHLOG_DATA."""
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    monkeypatch.setenv("HEALTHLOG_DATA", str(tmp_path / "env"))
    import_ok(cli, tmp_path / "flag", "--aggregation", "minutes", sent)
    assert (tmp_path / "flag" / "journal.sqlite").is_file()
    assert not (tmp_path / "env").exists()


def test_received_at_stamps_every_file_and_keeps_argument_order_cli_3(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-3: one `--received-at` for all files; journal order = argument order; last one wins."""
    first = write(tmp_path / "first.json", body(metric(HR, BPM, point(minute(0), qty=70))))
    second = write(tmp_path / "second.json", body(metric(HR, BPM, point(minute(0), qty=80))))
    stamp = "2024-02-07T08:00:00Z"
    for order, kept in (((first, second), 80), ((second, first), 70)):
        data = tmp_path / f"data-{kept}"
        import_ok(cli, data, "--received-at", stamp, "--aggregation", "minutes", *order)
        assert journal_order(data) == [(f.read_bytes(), parse_instant(stamp)) for f in order]
        assert [json.loads(line)["point"]["qty"] for line in exported(cli, data)] == [kept]
        assert cli("verify", "--data", data).code == 0


@pytest.mark.parametrize(
    ("given", "layer"), [("Minutes", "minutes"), ("HOURS", "hours"), ("Default", "default")]
)
def test_aggregation_is_case_insensitive_and_stored_lowercase_cli_4(
    cli: Cli, tmp_path: Path, given: str, layer: str
) -> None:
    """CLI-4: the layer stored (delivery outcome) and exported is the lowercase word."""
    data = tmp_path / "data"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    import_ok(cli, data, "--aggregation", given, sent)
    with DataDir(data).open_journal() as journal, DataDir(data).open_store() as store:
        (meta,) = journal.iter_order()
        row = store.outcome(meta.id)
    assert row is not None
    assert (row.status, row.layer) == ("parsed", layer)
    assert [json.loads(line)["layer"] for line in exported(cli, data)] == [layer]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["import", "--aggregation", "fortnight", "GOOD"], "--aggregation"),
        (["import", "--received-at", "last tuesday", "GOOD"], "--received-at"),
        (["import", "GOOD", "MISSING"], "missing.json"),
        (["export", "--from", "2024-13-01T00:00:00Z"], "--from"),
        (["export", "--format", "xml"], "--format"),
    ],
    ids=["aggregation", "received-at", "missing-file", "from", "format"],
)
def test_usage_errors_exit_2_and_journal_nothing_cli_5(
    cli: Cli, tmp_path: Path, args: list[str], message: str
) -> None:
    """CLI-5: invalid flags or an unreadable file: exit 2, a message, nothing journaled."""
    data = tmp_path / "data"
    good = write(tmp_path / "good.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    import_ok(cli, data, "--aggregation", "minutes", good)
    before = status_of(cli, data)
    files = {"GOOD": str(good), "MISSING": str(tmp_path / "missing.json")}
    run = cli(args[0], "--data", data, *(files.get(a, a) for a in args[1:]))
    assert run.code == 2
    assert message in run.err
    assert run.out == b""
    assert status_of(cli, data)["journal"] == before["journal"]


def test_aggregation_error_names_the_choices_cli_5(cli: Cli, tmp_path: Path) -> None:
    """CLI-5: the message for a bad `--aggregation` lists the accepted layers."""
    run = cli("import", "--data", tmp_path / "data", "--aggregation", "fortnight", "x.json")
    assert run.code == 2
    for layer in ("seconds", "minutes", "hours", "days", "weeks", "months", "years", "default"):
        assert layer in run.err
    assert not (tmp_path / "data").exists()


def test_a_received_at_later_than_now_is_refused_cli_59(cli: Cli, tmp_path: Path) -> None:
    """CLI-59: `import --received-at` later than now (2062 for 2026) exits 2 naming the flag,
    journals nothing and makes no data directory where there is none; the next live delivery
    carries the time it was received, not that stamp, which journal stamps, never going back,
    would have pinned every later one to."""
    data = tmp_path / "data"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    import_ok(cli, data, "--aggregation", "minutes", sent)
    before = status_of(cli, data)
    run = cli("import", "--data", data, "--received-at", "2062-01-01T00:00:00Z", sent)
    assert run.code == 2
    assert run.err.splitlines()[-1] == (
        "healthlog import: error: argument --received-at: 2062-01-01T00:00:00Z is later than"
        " now: a backfill takes the past instant its data was received at"
    )
    assert status_of(cli, data)["journal"] == before["journal"]
    elsewhere = tmp_path / "new"
    run = cli("import", "--data", elsewhere, "--received-at", "2062-01-01T00:00:00Z", sent)
    assert run.code == 2
    assert "making a new one" not in run.err
    assert not elsewhere.exists()
    started = time.time()
    again = write(tmp_path / "b.json", body(metric(HR, BPM, point(minute(1), qty=62))))
    import_ok(cli, data, "--aggregation", "minutes", again)
    with DataDir(data).open_journal() as journal:
        stamps = [meta.received_at for meta in journal.iter_order()]
    assert len(stamps) == 2
    assert started - 60 < stamps[-1] / 1e6 <= time.time()


def test_no_wait_leaves_deliveries_pending_until_a_later_import_cli_6(
    cli: Cli, run_cli: RunCli, outcomes: Outcomes, tmp_path: Path
) -> None:
    """CLI-6: while another process holds the fold lease, `--no-wait` journals and returns;
    status shows both pending, oldest first; once the lease is free, the next import folds all."""
    data = tmp_path / "data"
    files = [
        write(tmp_path / f"{n}.json", body(metric(HR, BPM, point(minute(n), qty=60 + n))))
        for n in range(3)
    ]
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
        # A real process, which a wait for the held lease would hold past its time limit.
        run = run_cli("import", "--no-wait", "--aggregation", "minutes", "--data", data, *files[:2])
        assert run.code == 0, run.err
        status = status_of(cli, data)
        assert status["deliveries"] == {"pending": 2, "parsed": 0, "partial": 0, "failed": 0}
        assert status["lease"]["holder"] == "elsewhere"
        assert status["lag"]["oldest_pending_id"] == next(iter(outcomes(data)))
        assert status["lag"]["waited_s"] >= 0
        assert exported(cli, data) == []
        store.release_lease("elsewhere", epoch)
    import_ok(cli, data, "--aggregation", "minutes", files[2])
    assert list(outcomes(data).values()) == ["parsed"] * 3
    status = status_of(cli, data)
    assert status["deliveries"] == {"pending": 0, "parsed": 3, "partial": 0, "failed": 0}
    assert status["lag"]["oldest_pending_id"] is None
    assert [json.loads(line)["point"]["qty"] for line in exported(cli, data)] == [60, 61, 62]


@pytest.mark.parametrize("live_first", [False, True], ids=["backfill", "live-then-backfill"])
def test_a_backfill_waits_from_when_it_was_journaled_cli_95(
    cli: Cli, run_cli: RunCli, tmp_path: Path, live_first: bool
) -> None:
    """CLI-95: while another process holds the fold lease, a delivery imported with a
    historical `--received-at` has waited, in `status`, since it was journaled, not since its
    `received_at` two years before; with a live delivery journaled before it and pending too,
    the lag names the live one, journaled first, though the backfill is first in journal
    order."""
    data = tmp_path / "data"
    files = [
        write(tmp_path / f"{n}.json", body(metric(HR, BPM, point(minute(n), qty=60 + n))))
        for n in range(2)
    ]

    def imported(*args: str | Path) -> int:
        run = run_cli("import", "--no-wait", "--aggregation", "minutes", "--data", data, *args)
        assert run.code == 0, run.err
        found = re.search(r"as delivery (\d+) ", run.out.decode() + run.err)
        assert found is not None, run.err
        return int(found.group(1))

    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
        before = time.time_ns() // 1000
        live = imported(files[1]) if live_first else None
        backfill = imported("--received-at", "2024-02-06T15:00:00Z", files[0])
        lag = status_of(cli, data)["lag"]
        waited_at_most = (time.time_ns() // 1000 - before) / 1e6
        with DataDir(data).open_journal() as journal:
            assert journal.iter_order()[0].id == backfill
        store.release_lease("elsewhere", epoch)

    assert lag["oldest_pending_id"] == (live if live_first else backfill)
    assert 0 <= lag["waited_s"] <= waited_at_most


def test_automation_id_lets_a_sparse_delivery_inherit_its_layer_cli_24(
    cli: Cli, outcomes: Outcomes, tmp_path: Path
) -> None:
    """CLI-24: a lone point inherits the layer of its automation's earlier delivery, or fails."""
    data = tmp_path / "data"
    dense = write(
        tmp_path / "dense.json",
        body(metric(HR, BPM, point(minute(0), qty=61), point(minute(1), qty=62))),
    )
    lone = write(tmp_path / "lone.json", body(metric(HR, BPM, point(minute(30), qty=63))))
    import_ok(cli, data, "--automation-id", "A", dense)
    import_ok(cli, data, "--automation-id", "A", lone)
    import_ok(cli, data, "--automation-id", "B", lone)
    import_ok(cli, data, lone)
    assert list(outcomes(data).values()) == ["parsed", "parsed", "failed", "failed"]
    lines = [json.loads(line) for line in exported(cli, data)]
    assert [(d["layer"], d["point"]["qty"]) for d in lines] == [
        ("minutes", 61),
        ("minutes", 62),
        ("minutes", 63),
    ]


# -- export -------------------------------------------------------------------------------


def test_export_lines_have_the_documented_keys_and_utc_instants_cli_7(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-7: keys in order; UTC with Z; whole seconds or a trimmed fraction; instants end=start."""
    data = tmp_path / "data"
    sent = body(
        metric(
            HR,
            BPM,
            point("2024-02-06 07:00:00 -0800", qty=61),
            point("2024-02-06T15:10:00.1200Z", qty=62),
            point("2024-02-06T15:20:00.000001+00:00", qty=63),
            compact({"start": "2024-02-06 16:00:00 +0100", "end": "2024-02-06 16:30:05 +0100"}),
        ),
        metric(
            "sleep_analysis",
            "hr",
            compact(
                {"startDate": "2024-02-06 23:00:00 -0500", "endDate": "2024-02-07 00:15:30 -0500"}
            ),
        ),
    )
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "a.json", sent))
    lines = [json.loads(line) for line in exported(cli, data)]
    for line in lines:
        assert list(line) == LINE_KEYS
        assert ISO_UTC.fullmatch(line["start"]), line["start"]
        assert ISO_UTC.fullmatch(line["end"]), line["end"]
    assert [(d["metric"], d["layer"], d["start"], d["end"], d["units"]) for d in lines] == [
        (HR, "minutes", "2024-02-06T15:00:00Z", "2024-02-06T15:00:00Z", BPM),
        (HR, "minutes", "2024-02-06T15:00:00Z", "2024-02-06T15:30:05Z", BPM),
        (HR, "minutes", "2024-02-06T15:10:00.12Z", "2024-02-06T15:10:00.12Z", BPM),
        (HR, "minutes", "2024-02-06T15:20:00.000001Z", "2024-02-06T15:20:00.000001Z", BPM),
        ("sleep_analysis", "minutes", "2024-02-07T04:00:00Z", "2024-02-07T05:15:30Z", "hr"),
    ]


def test_export_is_sorted_by_metric_layer_start_end_cli_8(cli: Cli, tmp_path: Path) -> None:
    """CLI-8: several metrics and layers, sent out of order, over more than 64 hourly objects."""
    data = tmp_path / "data"
    hourly = [point(minute(60 * h + 7), qty=h) for h in reversed(range(70))]
    segments = [
        compact({"startDate": minute(30), "endDate": minute(end), "value": f"s{end}"})
        for end in (90, 45, 60)
    ]
    first = body(
        metric("walking_speed", "mi/hr", point(minute(5), qty=3), point(minute(1), qty=2)),
        metric(HR, BPM, *hourly),
        metric("Zone_upper", "x", point(minute(2), qty=1), point(minute(0), qty=1)),
        metric("ätna", "x", point(minute(2), qty=1)),
        metric("sleep_analysis", "hr", *segments),
    )
    second = body(metric(HR, BPM, point(minute(120), qty=7), point(minute(0), qty=8)))
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "1.json", first))
    import_ok(cli, data, "--aggregation", "hours", write(tmp_path / "2.json", second))
    lines = [json.loads(line) for line in exported(cli, data)]
    assert len(lines) == 2 + 70 + 2 + 1 + 3 + 2

    def order(d: dict[str, Any]) -> tuple[str, str, int, int]:
        return d["metric"], d["layer"], parse_instant(d["start"]), parse_instant(d["end"])

    assert lines == sorted(lines, key=order)
    assert [d["point"]["value"] for d in lines if d["metric"] == "sleep_analysis"] == [
        "s45",
        "s60",
        "s90",
    ]


VERBATIM_POINTS = [
    # (as sent, as exported): key order, escapes and digits as sent; whitespace may go.
    (
        b'{"source":"Jonathan\\u2019s Apple\\u00a0Watch","qty":1.50,'
        b'"date":"2024-02-06 15:00:00 +0000"}',
        b'{"source":"Jonathan\\u2019s Apple\\u00a0Watch","qty":1.50,'
        b'"date":"2024-02-06 15:00:00 +0000"}',
    ),
    (
        '{"date":"2024-02-06 15:01:00 +0000","qty":125.00000000000001,'
        '"source":"Anton\u2019s <b>&amp;</b> & \U0001f431"}'.encode(),
        '{"date":"2024-02-06 15:01:00 +0000","qty":125.00000000000001,'
        '"source":"Anton\u2019s <b>&amp;</b> & \U0001f431"}'.encode(),
    ),
    (
        b'{"date":"2024-02-06 15:02:00 +0000","qty":1,"qty":2}',
        b'{"date":"2024-02-06 15:02:00 +0000","qty":1,"qty":2}',
    ),
    (
        b'{"date":"2024-02-06 15:03:00 +0000","qty":1180591620717411303424,"e":1E+2,"z":-0.0}',
        b'{"date":"2024-02-06 15:03:00 +0000","qty":1180591620717411303424,"e":1E+2,"z":-0.0}',
    ),
    (
        b'{ "date" : "2024-02-06 15:04:00 +0000" ,\n'
        b'  "note" : "a  \\"b\\" \\\\ \\/ \\n \\u0026 <>" }',
        b'{"date":"2024-02-06 15:04:00 +0000","note":"a  \\"b\\" \\\\ \\/ \\n \\u0026 <>"}',
    ),
]


def test_export_points_are_byte_identical_to_what_was_sent_cli_9(cli: Cli, tmp_path: Path) -> None:
    """CLI-9: key order, duplicate keys, escapes, raw UTF-8, `&<>`, number digits as sent."""
    data = tmp_path / "data"
    sent = body(metric(HR, BPM, *(raw for raw, _ in VERBATIM_POINTS)))
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "a.json", sent))
    lines = exported(cli, data)
    assert [raw_point(line) for line in lines] == [want for _, want in VERBATIM_POINTS]


@pytest.fixture
def filter_data(cli: Cli, tmp_path: Path) -> Path:
    """HR minutes at 15:00, 15:30, 16:00, 16:30, 17:00; HR hours at 16:00; steps at 16:15."""
    data = tmp_path / "data"
    minutes = body(
        metric(HR, BPM, *(point(minute(m), qty=m) for m in (0, 30, 60, 90, 120))),
        metric("step_count", "count", point(minute(75), qty=75)),
    )
    hours = body(metric(HR, BPM, point(minute(60), qty=1060)))
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "m.json", minutes))
    import_ok(cli, data, "--aggregation", "hours", write(tmp_path / "h.json", hours))
    return data


_WRITES_COUNTED = """
import sys
from healthlog import cli

def writes():
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("syscw:"))

before = writes()
try:
    code = cli.main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
sys.stdout.flush()
print(code, writes() - before, file=sys.stderr)
"""
"""Runs ``healthlog ARGS`` in this process and says on stderr its exit code and how many
write system calls it made (``syscw`` of ``/proc/self/io``)."""


def test_export_writes_its_lines_in_chunks_also_unbuffered_cli_205(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-205: `healthlog export` of 3,000 points with ``PYTHONUNBUFFERED=1`` (as many
    container images set it) into a pipe writes every line, in far fewer write calls than lines
    (it made one per line: 1.2 million for a year of minute-level data, a quarter's export
    taking 4.6 s instead of 2.6 s)."""
    data = tmp_path / "data"
    points = [point(minute(n), qty=60 + n % 40) for n in range(3000)]
    import_ok(cli, data, write(tmp_path / "b.json", body(metric(HR, BPM, *points))))
    run = subprocess.run(
        [sys.executable, "-c", _WRITES_COUNTED, "export", "--data", str(data)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        check=False,
        timeout=120,
    )
    code, writes = run.stderr.decode().split()[-2:]
    assert code == "0", run.stderr
    assert len(run.stdout.splitlines()) == 3000
    assert int(writes) < 3000 // 50, writes


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], [1060, 0, 30, 60, 90, 120, 75]),
        (["--metric", HR], [1060, 0, 30, 60, 90, 120]),
        (["--metric", "step_count"], [75]),
        (["--metric", "no_such_metric"], []),
        (["--layer", "hours"], [1060]),
        (["--from", "2024-02-06T15:30:00Z", "--to", "2024-02-06T16:30:00Z"], [1060, 30, 60, 75]),
        (["--from", "2024-02-06T17:30:00+02:00"], [1060, 30, 60, 90, 120, 75]),
        (["--to", "2024-02-06T16:30:00Z"], [1060, 0, 30, 60, 75]),
        (["--to", "2024-02-06T16:00:00.000001Z"], [1060, 0, 30, 60]),
        (["--metric", HR, "--layer", "minutes", "--from", "2024-02-06T16:00:00Z"], [60, 90, 120]),
    ],
)
def test_export_filters_by_metric_layer_and_half_open_start_range_cli_10(
    cli: Cli, filter_data: Path, args: list[str], expected: list[int]
) -> None:
    """CLI-10: `--metric`, `--layer` exact; start in [from, to), also inside one hour."""
    lines = [json.loads(line) for line in exported(cli, filter_data, *args)]
    assert [d["point"]["qty"] for d in lines] == expected


def test_csv_has_the_header_and_the_jsonl_values_cli_11(cli: Cli, tmp_path: Path) -> None:
    """CLI-11: header `metric,layer,start,end,units,point`; point as compact JSON; null units."""
    data = tmp_path / "data"
    sent = body(
        metric(
            HR,
            BPM,
            *(raw for raw, _ in VERBATIM_POINTS),
            point(minute(9), qty=1, note='comma, "quote"\nnewline'),
        ),
        workouts=[compact({"name": "Walk, short", "start": minute(0), "end": minute(20)})],
    )
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "a.json", sent))
    jsonl = exported(cli, data)
    rows = list(csv.reader(io.StringIO(b"".join(exported(cli, data, "--format", "csv")).decode())))
    assert rows[0] == LINE_KEYS
    assert len(rows) == 1 + len(jsonl) == 1 + 7
    for row, line in zip(rows[1:], jsonl, strict=True):
        d = json.loads(line)
        assert row[:5] == [d["metric"], d["layer"], d["start"], d["end"], d["units"] or ""]
        assert row[5].encode() == raw_point(line)
    assert rows[-1][:5] == [
        "workouts",
        "records",
        "2024-02-06T15:00:00Z",
        "2024-02-06T15:20:00Z",
        "",
    ]


def test_section_records_export_as_records_layer_without_units_cli_12(
    cli: Cli, outcomes: Outcomes, tmp_path: Path
) -> None:
    """CLI-12: workouts and symptoms: metric = section, layer `records`, units null."""
    data = tmp_path / "data"
    workout = compact(
        {
            "id": "W-1",
            "name": "Walk",
            "start": "2024-02-06 08:00:00 -0700",
            "end": "2024-02-06 08:45:10 -0700",
        }
    )
    symptom = compact(
        {"name": "Headache", "start": minute(0), "end": minute(90), "severity": "Mild"}
    )
    sent = write(tmp_path / "a.json", body(workouts=[workout], symptoms=[symptom]))
    import_ok(cli, data, sent)
    assert list(outcomes(data).values()) == ["parsed"]
    lines = exported(cli, data)
    assert [json.loads(line) | {"point": None} for line in lines] == [
        {
            "metric": "symptoms",
            "layer": "records",
            "start": "2024-02-06T15:00:00Z",
            "end": "2024-02-06T16:30:00Z",
            "units": None,
            "point": None,
        },
        {
            "metric": "workouts",
            "layer": "records",
            "start": "2024-02-06T15:00:00Z",
            "end": "2024-02-06T15:45:10Z",
            "units": None,
            "point": None,
        },
    ]
    assert [raw_point(line) for line in lines] == [symptom, workout]


# -- status -------------------------------------------------------------------------------


@pytest.fixture
def mixed_data(cli: Cli, tmp_path: Path) -> tuple[Path, int]:
    """One parsed, one partial and one failed delivery; returns the dir and the raw bytes."""
    data = tmp_path / "data"
    files = [
        write(tmp_path / "parsed.json", body(metric(HR, BPM, point(minute(0), qty=61)))),
        write(
            tmp_path / "partial.json",
            body(metric(HR, BPM, point(minute(1), qty=62), point("yesterday", qty=63))),
        ),
        write(tmp_path / "failed.json", b'{"data": {"metrics": ['),
    ]
    import_ok(cli, data, "--aggregation", "minutes", *files)
    return data, sum(f.stat().st_size for f in files)


def test_status_json_has_exactly_the_documented_keys_and_counts_cli_13(
    cli: Cli, mixed_data: tuple[Path, int]
) -> None:
    """CLI-13: documented keys (more may follow) and types; counts match journal and outcomes."""
    data, size = mixed_data
    status = status_of(cli, data)
    assert set(status) >= {*STATUS_KEYS, "first_pass_completed", "subscribers"}
    for key, members in STATUS_KEYS.items():
        assert set(status[key]) == members, key
    assert status["journal"] == {"deliveries": 3, "bytes": size}
    assert status["deliveries"] == {"pending": 0, "parsed": 1, "partial": 1, "failed": 1}
    lag = status["lag"]
    assert lag["oldest_pending_id"] is None
    assert isinstance(lag["waited_s"], int | float)
    assert lag["stopped_because"] == "empty"
    lease = status["lease"]
    assert lease["holder"] is None or isinstance(lease["holder"], str)
    assert isinstance(lease["epoch"], int)
    assert not isinstance(lease["epoch"], bool)
    assert lease["epoch"] >= 1
    assert status["first_pass_completed"] is True
    assert status["subscribers"] == {}


def test_plain_status_prints_the_same_figures_as_lines_cli_14(
    cli: Cli, mixed_data: tuple[Path, int]
) -> None:
    """CLI-14: labelled, readable lines with the figures of the JSON document."""
    data, size = mixed_data
    run = cli("status", "--data", data)
    assert run.code == 0, run.err
    text = run.out.decode()
    lines = text.splitlines()
    labels = [line.split()[0] for line in lines]
    assert labels[:5] == ["journal", "deliveries", "lag", "lease", "first"]
    assert "3 deliveries" in lines[0]
    assert f"{size} bytes" in lines[0]
    for figure in ("pending 0", "parsed 1", "partial 1", "failed 1"):
        assert figure in lines[1]
    assert lines[4].split()[-1] == "completed"
    assert "not" not in lines[4]
    assert lines[2].startswith("lag         nothing pending, last pass stopped: ")
    assert lines[3].startswith("lease       free, epoch ")
    assert "None" not in text
    assert not text.lstrip().startswith("{")


def test_status_before_any_pass_says_so_in_words_cli_13_cli_14_cli_50(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-13, CLI-14, CLI-50: a delivery journaled while another process holds the fold lease,
    no pass run yet, one subscriber: the document has them (`no_pass_yet`, first pass false),
    plain status says them in words (`no pass yet`, the oldest pending, the holder, `not
    completed`, the subscriber), never `no_pass_yet` or `None`."""
    data = tmp_path / "data"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
        store.ack("nas", 0)
    import_ok(cli, data, "--no-wait", "--aggregation", "minutes", sent)
    status = status_of(cli, data)
    assert status["deliveries"] == {"pending": 1, "parsed": 0, "partial": 0, "failed": 0}
    assert status["lag"]["oldest_pending_id"] == 1
    assert status["lag"]["stopped_because"] == "no_pass_yet"
    assert status["lease"] == {"holder": "elsewhere", "epoch": epoch}
    assert status["first_pass_completed"] is False
    assert status["subscribers"] == {"nas": 0}
    run = cli("status", "--data", data)
    assert run.code == 0, run.err
    text = run.out.decode()
    lines = text.splitlines()
    assert re.fullmatch(
        r"lag {9}oldest pending 1, waited \d+(\.\d+)? s, last pass stopped: no pass yet",
        lines[2],
    ), lines[2]
    assert lines[3] == f"lease       holder elsewhere, epoch {epoch}"
    assert lines[4] == "first pass  not completed"
    assert any(line.startswith("subscriber  nas acked 0, last ACK ") for line in lines[5:])
    assert "no_pass_yet" not in text
    assert "None" not in text


# -- status --failed / --partial ------------------------------------------------------------

LIST_KEYS = ["statuses", "total", "limit", "deliveries"]
LISTED_KEYS = ["delivery_id", "received_at", "status", "reason"]
BACKFILL_AT = "2024-01-01T00:00:00Z"


def listed(cli: Cli, data: Path, *flags: str) -> dict[str, Any]:
    run = cli("status", "--data", data, *flags, "--json")
    assert run.code == 0, run.err
    document: dict[str, Any] = json.loads(run.out)
    return document


def listed_ids(document: dict[str, Any]) -> list[int]:
    return [delivery["delivery_id"] for delivery in document["deliveries"]]


@pytest.fixture
def failing_data(cli: Cli, tmp_path: Path) -> Path:
    """Deliveries 1 parsed, 2 failed (not JSON), 3 partial, 4 failed (no layer), and 5 failed
    (not JSON) backfilled before them all: newest first, the failed ones are 4, 2, 5."""
    data = tmp_path / "data"
    parsed = write(tmp_path / "parsed.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    broken = write(tmp_path / "broken.json", b'{"data": {"metrics": [')
    partial = write(
        tmp_path / "partial.json",
        body(metric(HR, BPM, point(minute(1), qty=62), point("yesterday", qty=63))),
    )
    sparse = write(tmp_path / "sparse.json", body(metric("step_count", "count", point(minute(2)))))
    import_ok(cli, data, "--aggregation", "minutes", parsed, broken, partial)
    import_ok(cli, data, sparse)
    import_ok(cli, data, "--received-at", BACKFILL_AT, broken)
    return data


def test_status_failed_lists_the_failed_deliveries_newest_first_cli_41(
    run_cli: RunCli, failing_data: Path
) -> None:
    """CLI-41: `status --failed` as a process: the failed deliveries, last in journal order
    first, with id, received_at, status and the recorded reason; `--json` the list document."""
    data = failing_data
    with DataDir(data).open_journal() as journal, DataDir(data).open_store() as store:
        stamps = {m.id: format_instant(m.received_at) for m in journal.iter_order()}
        reasons = {i: outcome.reason for i in stamps if (outcome := store.outcome(i)) is not None}
    assert stamps[5] == BACKFILL_AT
    run = run_cli("status", "--failed", "--json", "--data", data)
    assert run.code == 0, run.err
    document = json.loads(run.out)
    assert list(document) == LIST_KEYS
    assert (document["statuses"], document["total"], document["limit"]) == (["failed"], 3, 20)
    assert [list(d) for d in document["deliveries"]] == [LISTED_KEYS] * 3
    assert document["deliveries"] == [
        {"delivery_id": i, "received_at": stamps[i], "status": "failed", "reason": reasons[i]}
        for i in (4, 2, 5)
    ]
    assert reasons[4] == NO_LAYER
    assert reasons[2] == reasons[5] == "undecodable body: body is not a JSON object or array"
    plain = run_cli("status", "--failed", "--data", data)
    assert plain.code == 0, plain.err
    lines = plain.out.decode().splitlines()
    assert lines[0] == "3 failed deliveries, newest first:"
    assert lines[1].split() == ["delivery", "received_at", "status", "reason"]
    rows = [line.split(maxsplit=3) for line in lines[2:]]
    assert rows == [[str(i), stamps[i], "failed", reasons[i]] for i in (4, 2, 5)]
    starts = {line.index(reasons[i]) for line, i in zip(lines[2:], (4, 2, 5), strict=True)}
    assert starts == {lines[1].index("reason")}
    assert "None" not in plain.out.decode()


def test_status_lists_partial_ones_on_request_bounded_by_limit_cli_42(
    cli: Cli, failing_data: Path, tmp_path: Path
) -> None:
    """CLI-42: `--partial` lists the partial deliveries, both flags both kinds; `--limit N`
    keeps the newest N of `total`; a delivery not folded yet is not listed; none: a line."""
    data = failing_data
    partial = listed(cli, data, "--partial")
    assert (partial["statuses"], partial["total"], listed_ids(partial)) == (["partial"], 1, [3])
    assert partial["deliveries"][0]["reason"].startswith("point rejected: ")
    both = listed(cli, data, "--partial", "--failed")
    assert (both["statuses"], both["total"], listed_ids(both)) == (
        ["failed", "partial"],
        4,
        [4, 3, 2, 5],
    )
    newest = listed(cli, data, "--failed", "--partial", "--limit", "2")
    assert (newest["total"], newest["limit"], listed_ids(newest)) == (4, 2, [4, 3])
    run = cli("status", "--failed", "--partial", "--limit", "2", "--data", data)
    assert run.code == 0, run.err
    lines = run.out.decode().splitlines()
    assert lines[0].startswith("the newest 2 of 4 failed or partial deliveries")
    assert [line.split()[0] for line in lines[2:]] == ["4", "3"]
    # All but one listed is still the newest N; all listed is the whole count.
    for limit, first in (
        ("3", "the newest 3 of 4 failed or partial deliveries"),
        ("4", "4 failed or partial deliveries, newest first:"),
    ):
        run = cli("status", "--failed", "--partial", "--limit", limit, "--data", data)
        assert run.code == 0, run.err
        said = run.out.decode().splitlines()
        assert said[0].startswith(first), said[0]
        # Statuses of two widths: the reasons still start in the header's column.
        column = said[1].index("reason")
        assert all(line[column - 2 : column] == "  " != line[column] for line in said[2:]), said
    broken = write(tmp_path / "late.json", b"not json")
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert epoch is not None
        import_ok(cli, data, "--no-wait", broken)
        assert status_of(cli, data)["deliveries"]["pending"] == 1
        assert listed(cli, data, "--failed") == listed(cli, data, "--failed", "--limit", "20")
        assert listed_ids(listed(cli, data, "--failed")) == [4, 2, 5]
        store.release_lease("elsewhere", epoch)
    clean = tmp_path / "clean"
    import_ok(cli, clean, "--aggregation", "minutes", write(tmp_path / "ok.json", body()))
    none = cli("status", "--failed", "--data", clean)
    assert (none.code, none.out) == (0, b"no failed deliveries\n")
    assert listed(cli, clean, "--failed", "--partial") == {
        "statuses": ["failed", "partial"],
        "total": 0,
        "limit": 20,
        "deliveries": [],
    }


# What a recorded reason is made of: kinds of failure and rejection named by the code, each
# rejection with its count, never text from a body (fold.py, hae.py, points.py, timestamps.py,
# seals.py and the store's own failures).
_TIMESTAMP_ERRORS = (
    r"timestamp (year is out of range 1\.\.9999|month is out of range 1\.\.12"
    r"|day does not exist in its month|hour is out of range 0\.\.23"
    r"|minute is out of range 0\.\.59"
    r"|second is out of range 0\.\.59 \(leap seconds are rejected\)"
    r"|UTC offset is beyond ±18:00|instant falls outside years 1\.\.9999 UTC"
    r"|UTC offset minutes are out of range 0\.\.59|does not match a supported date/time shape"
    r"|12-hour clock hour is out of range (1\.\.12|0\.\.11)"
    r"|must be a str, not (int|float|bool|NoneType|list|dict)"
    r"|is longer than \d+ characters|is empty)"
)
_POINT_ERRORS = (
    r"point is not valid JSON|point nested deeper than \d+ levels|no start, startDate or date"
    r"|end before start|point is a JSON (int|float|str|bool|NoneType|list), not an object"
    rf"|unparseable (start|startDate|date|end|endDate): {_TIMESTAMP_ERRORS}"
)
_PROBLEMS = (
    r"nested array envelope|array element is not an object|data is not an object"
    r"|envelope nested too deep|metrics is not an array|metric without a name"
    r"|metric name holds U\+0000|metric data is not an array"
    rf"|section ({'|'.join(sorted(RECORD_SECTIONS))}) is not an array"
)
_FAILURES = "|".join(
    re.escape(text)
    for text in (
        NO_LAYER,
        UNKNOWN_HEADER,
        "undecodable body: body is not a JSON object or array",
        f"undecodable body: body holds more than one JSON value per {MIN_BYTES_PER_VALUE} bytes",
        f"undecodable body: body nests deeper than {MAX_BODY_NESTING} levels",
        "nothing could be read",
        "body does not match its sha256",
        *GIVEN_UP,
        "seal body is not a seal document",
        "seal body has an unreadable instant",
        "seal body names an empty metric or layer",
    )
)
REASON_PART = re.compile(
    rf"({_FAILURES}|internal error: [A-Za-z_][A-Za-z0-9_]*"
    rf"|(point rejected: ({_POINT_ERRORS})|{_PROBLEMS}) \(x[1-9][0-9]*\)"
    r"|and [1-9][0-9]* more kinds)"
)


def test_listed_reasons_carry_no_value_cli_43(cli: Cli, outcomes: Outcomes, tmp_path: Path) -> None:
    """CLI-43: over the hostile corpus and bodies with distinctive values, device names and a
    token-like field, `status --failed --partial` (plain and `--json`) prints none of them, and
    every reason it lists is made of named kinds of failure and rejection only."""
    data = tmp_path / "data"
    cases = corpus()
    files = [write(tmp_path / f"case-{n}.json", case.body) for n, case in enumerate(cases)]
    secret = [
        body(
            metric(
                HR,
                BPM,
                point(minute(0), qty=4242.4242, source="Secret Watch ZQX-1"),
                point("ZQX-BAD-DATE-31", qty=5151.5151, token="hl_tok_9f8e7d6c5b4a"),
                b'"Other Device QJV-2"',
            ),
            compact({"name": "7373.7373", "data": "Other Device QJV-2"}),
        ),
        b'{"data": SECRET-GARBAGE-77',
        compact([{"data": {"metrics": [{"name": "Backfill Phone KLM-3", "data": 6161.6161}]}}]),
    ]
    files += [write(tmp_path / f"secret-{n}.json", content) for n, content in enumerate(secret)]
    import_ok(cli, data, "--aggregation", "minutes", *files)
    expected = sum(case.status != "parsed" for case in cases) + len(secret)
    not_parsed = [i for i, status in outcomes(data).items() if status != "parsed"]
    assert len(not_parsed) == expected
    document = listed(cli, data, "--failed", "--partial", "--limit", "1000")
    assert document["total"] == len(document["deliveries"]) == expected
    assert listed_ids(document) == not_parsed[::-1]
    for delivery in document["deliveries"]:
        for part in delivery["reason"].split("; "):
            assert REASON_PART.fullmatch(part), (delivery["delivery_id"], part)
    plain = cli("status", "--failed", "--partial", "--limit", "1000", "--data", data)
    assert plain.code == 0, plain.err
    assert len(plain.out.splitlines()) == expected + 2
    for text in (json.dumps(document), plain.out.decode()):
        for value in SECRETS:
            assert value not in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--failed", "--limit", "0"], "--limit"),
        (["--failed", "--limit", "1001"], "--limit"),
        (["--partial", "--limit", "ten"], "--limit"),
        (["--limit", "5"], "--limit goes with --failed or --partial"),
        (["--json", "--limit", "5"], "--limit goes with --failed or --partial"),
    ],
    ids=["zero", "over-1000", "not-a-number", "alone", "alone-json"],
)
def test_status_list_usage_errors_exit_2_cli_44(
    cli: Cli, failing_data: Path, flags: list[str], message: str
) -> None:
    """CLI-44: a `--limit` that is not 1 to 1000, or without `--failed` or `--partial`: exit
    2, a message naming it, nothing on stdout."""
    run = cli("status", "--data", failing_data, *flags)
    assert run.code == 2
    assert message in run.err
    assert run.out == b""


# The store's schema before the index of the failed and partial outcomes (migration 5).
BEFORE_LISTED_INDEX = MIGRATIONS[:4]
LISTED_INDEX_READ = re.compile(
    r"SEARCH outcomes USING (COVERING )?INDEX outcomes_listed \(status=\?\)"
)
LISTINGS = [["failed"], ["partial"], ["failed", "partial"]]


def listing_plans(path: Path, statuses: list[str], limit: int) -> list[list[str]]:
    """The query plan of each statement ``status`` runs to list ``statuses``."""
    with closing(sqlite3.connect(path)) as conn:
        return [
            [step[3] for step in conn.execute(f"EXPLAIN QUERY PLAN {sql}", args)]
            for sql, args in listing_queries(statuses, limit)
        ]


def test_status_lists_read_an_index_of_failed_and_partial_outcomes_cli_45(tmp_path: Path) -> None:
    """CLI-45: a store of the previous schema gets `outcomes_listed` when opened; every
    statement of a list then reads that index alone (no scan, no sort), where it scanned the
    outcomes before, and lists what the whole table holds, newest first, for any limit."""
    assert "outcomes_listed" in MIGRATIONS[len(BEFORE_LISTED_INDEX)]
    path = tmp_path / "store.sqlite"
    base = 1_700_000_000_000_000
    rows = []
    for n in range(1, 2001):
        status = "failed" if n % 97 == 0 else "partial" if n % 61 == 0 else "parsed"
        # pairs share a stamp (the id decides between them); every 400th is a backfill
        received_at = base - n * 10**9 if n % 400 == 0 else base + (n // 2) * 60 * 10**6
        reason = None if status == "parsed" else f"reason {n}"
        rows.append((n, received_at, None, status, reason, "minutes", '{"points": 1}', 1))
    with closing(_sqlite.connect(path)) as conn:
        _sqlite.migrate(conn, BEFORE_LISTED_INDEX)
        with _sqlite.write_transaction(conn):
            conn.executemany("INSERT INTO outcomes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    for statuses in LISTINGS:
        for plan in listing_plans(path, statuses, 20):
            assert any(step.startswith("SCAN outcomes") for step in plan), plan
    with Store(path) as store:
        for statuses in LISTINGS:
            for plan in listing_plans(path, statuses, 20):
                reads = [step for step in plan if "outcomes" in step]
                assert reads, plan
                assert all(LISTED_INDEX_READ.fullmatch(step) for step in reads), plan
                assert not any(step.startswith("SCAN") or "TEMP B-TREE" in step for step in plan)
            kept = sorted(
                (row for row in rows if row[3] in statuses),
                key=lambda row: (row[1], row[0]),
                reverse=True,
            )
            for limit in (1, 2, 7, 20, 1000):
                total, newest = store.newest_outcomes(statuses, limit)
                assert total == len(kept)
                assert [(o.delivery_id, o.received_at, o.status, o.reason) for o in newest] == [
                    (row[0], row[1], row[3], row[4]) for row in kept[:limit]
                ]
        with pytest.raises(ValueError, match="among failed, partial"):
            store.newest_outcomes(["parsed"], 20)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (len(MIGRATIONS),)


def test_status_counts_read_indexes_not_outcomes_cli_47(tmp_path: Path) -> None:
    """CLI-47: the deliveries by status are counted without reading an outcome's row: each
    statement's plan reads a covering index (the counts read the whole table before), and the
    counts are those of the rows, by status."""
    path = tmp_path / "store.sqlite"
    statuses = [
        "failed" if n % 7 == 0 else "partial" if n % 5 == 0 else "parsed" for n in range(1, 501)
    ]
    rows = [
        (n, 1_700_000_000_000_000 + n, None, status, None, "minutes", "{}", 1)
        for n, status in enumerate(statuses, start=1)
    ]
    with Store(path) as store:
        assert store.folded_view(lambda *_: True, counts=True).counts.get("parsed", 0) == 0
    with closing(_sqlite.connect(path)) as conn, _sqlite.write_transaction(conn):
        conn.executemany("INSERT INTO outcomes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    with closing(sqlite3.connect(path)) as conn:
        for sql in COUNT_QUERIES:
            plan = [step[3] for step in conn.execute(f"EXPLAIN QUERY PLAN {sql}")]
            reads = [step for step in plan if "outcomes" in step]
            assert reads, plan
            assert all("USING COVERING INDEX" in step for step in reads), plan
    executed: list[str] = []
    with Store(path) as store:
        # The statements the store runs (its connection is private; this test reads its trace).
        store._conn.set_trace_callback(executed.append)
        counts = store.folded_view(lambda *_: True, counts=True).counts
    assert {k: v for k, v in counts.items() if v} == dict(Counter(statuses))
    assert [sql for sql in executed if "count(*)" in sql and "delivery_id" not in sql] == list(
        COUNT_QUERIES
    )


def test_a_data_directory_of_the_previous_schema_lists_the_same_cli_45(
    cli: Cli, failing_data: Path
) -> None:
    """CLI-45: `status --failed`, `--partial` and both print the same over a data directory
    whose store is of the previous schema, which the first of them migrates."""
    data = failing_data
    flags = [["--failed"], ["--partial"], ["--failed", "--partial", "--limit", "2"]]
    documents = [listed(cli, data, *f) for f in flags]
    plain = cli("status", "--failed", "--partial", "--data", data).out
    with closing(sqlite3.connect(data / "store.sqlite")) as conn:
        conn.execute("DROP INDEX outcomes_listed")
        # The later migrations are undone too: the schema is then that before the index.
        conn.execute("ALTER TABLE subscribers DROP COLUMN acked_at")
        conn.execute("DROP TABLE counter_totals")
        conn.execute("ALTER TABLE checkpoint DROP COLUMN outcomes")
        conn.execute("ALTER TABLE checkpoint DROP COLUMN outcome_ids")
        conn.execute("ALTER TABLE events DROP COLUMN tag")
        conn.execute(f"PRAGMA user_version = {len(BEFORE_LISTED_INDEX)}")
    assert cli("status", "--failed", "--partial", "--data", data).out == plain
    assert [listed(cli, data, *f) for f in flags] == documents
    assert listed_ids(documents[2]) == [4, 3]
    with closing(sqlite3.connect(data / "store.sqlite")) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (len(MIGRATIONS),)
        assert conn.execute(
            "SELECT count(*) FROM sqlite_schema WHERE name = 'outcomes_listed'"
        ).fetchone() == (1,)


def test_export_of_a_damaged_object_exits_3_naming_it_cli_34(cli: Cli, tmp_path: Path) -> None:
    """CLI-34: `export` reaching an object whose body does not decode exits 3 with one line
    naming the object and the remedy, after the lines of the objects before it."""
    data = tmp_path / "data"
    sent = write(
        tmp_path / "a.json",
        body(metric(HR, BPM, point(minute(0), qty=61)), metric("steps", "count", point(minute(1)))),
    )
    import_ok(cli, data, "--aggregation", "minutes", sent)
    with closing(sqlite3.connect(data / "store.sqlite")) as conn, conn:
        conn.execute("UPDATE objects SET body = x'00112233' WHERE metric = 'steps'")
    run = cli("export", "--data", data)
    assert run.code == 3
    assert [json.loads(line)["metric"] for line in run.lines()] == [HR]
    assert run.err.splitlines() == [
        "healthlog: object body cannot be decoded: BadGzipFile (steps minutes"
        f" {format_instant(hour_of(parse_instant(minute(1))))}); `healthlog verify` lists such"
        " objects, `healthlog reindex` rebuilds them"
    ]


def test_an_export_reads_one_state_of_the_store_while_a_fold_commits_cli_215(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-215: a delivery folds (here by `import`; the service's folds alike) while `export`
    writes into a pipe nobody reads yet, after the first page of objects it read: the export
    holds the store as it was when it began, every point the first delivery's, never some
    hours of each. Before, each page of 64 objects was read on its own: measured, an export of
    200,000 points during a fold wrote 15,360 points of the old values and 184,640 of the new,
    a state the store never held (each fold is one transaction)."""
    data = tmp_path / "data"
    hours = 300
    sent = [
        write(
            tmp_path / f"{qty}.json",
            body(metric(HR, BPM, *(point(minute(n), qty=qty) for n in range(hours * 60)))),
        )
        for qty in (1, 2)
    ]
    assert run_cli("import", "--aggregation", "minutes", "--data", data, sent[0]).code == 0
    with subprocess.Popen(
        [sys.executable, "-m", "healthlog.cli", "export", "--data", data],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as export:
        assert export.stdout is not None
        # Its first lines came: it read the first page, whose lines (64 objects of 60 points)
        # fill the pipe many times over, so it reads no further page until they are taken.
        readable, _, _ = select.select([export.stdout], [], [], 30)
        assert readable, "export wrote nothing"
        assert run_cli("import", "--aggregation", "minutes", "--data", data, sent[1]).code == 0
        out, err = export.communicate(timeout=60)
    assert export.returncode == 0, err
    values = Counter(json.loads(line)["point"]["qty"] for line in out.splitlines())
    assert values == {1: hours * 60}
    run = run_cli("export", "--data", data)
    assert Counter(json.loads(line)["point"]["qty"] for line in run.out.splitlines()) == {
        2: hours * 60
    }


def test_import_folds_under_the_data_directorys_settings_cli_35(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CLI-35: `import` folds under the fold budget that `healthlog.toml`, and over it
    `HEALTHLOG_FOLD_BUDGET_S`, set (as `serve` would); a settings file that is not valid stops
    `import` and `seal` with exit 2 and one line, before anything is journaled."""
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    data = tmp_path / "data"
    data.mkdir()
    settings = data / "healthlog.toml"
    settings.write_text("[serve]\nfold_budget_s = 1e-9\nfold_budget_per_mib_s = 1e-9\n")
    assert cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    settings.write_text("[serve]\nfold_budget_s = 600\n")
    monkeypatch.setenv("HEALTHLOG_FOLD_BUDGET_S", "1e-9")
    assert cli("import", "--aggregation", "minutes", "--data", data, sent).code == 0
    monkeypatch.delenv("HEALTHLOG_FOLD_BUDGET_S")
    with DataDir(data).open_store() as store:
        outcomes = [store.outcome(n) for n in (1, 2)]
    assert [(o.status, o.reason) for o in outcomes if o is not None] == [
        ("failed", "fold over its time budget")
    ] * 2

    settings.write_text("[serve]\nfold_budget_s = 'soon'\n")
    for args in (["import", sent], ["seal", "--before", minute(0)]):
        run = cli(*args, "--data", data)
        assert run.code == 2
        assert len(run.err.splitlines()) == 1
    with DataDir(data).open_journal() as journal:
        assert journal.count()[0] == 2


@pytest.mark.parametrize(
    ("name", "command"),
    [("store.sqlite", ["status"]), ("tokens.sqlite", ["token", "list"])],
    ids=["status", "token list"],
)
def test_storage_error_exits_3_with_one_line_cli_23(
    cli: Cli, tmp_path: Path, name: str, command: list[str]
) -> None:
    """CLI-23: a store (or tokens) file that is not a database: exit 3, a message naming the
    file, no traceback."""
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(b"this is not an SQLite file" * 200)
    run = cli(*command, "--data", data)
    assert run.code == 3
    assert run.err == f"healthlog: database error: file is not a database ({data / name})\n"
    assert run.out == b""


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b"-----BEGIN PRIVATE KEY-----\ntruncated",
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        ),
    ],
    ids=["garbage", "truncated", "not-ed25519"],
)
def test_a_damaged_signing_key_exits_3_with_one_line_cli_23(
    cli: Cli, tmp_path: Path, content: bytes
) -> None:
    """CLI-23: a ``signing.key`` that is not an Ed25519 private key (damaged, or another
    kind): exit 3, one line naming the file and saying to restore it, no traceback."""
    data = tmp_path / "data"
    data.mkdir()
    DataDir(data).open_journal().close()
    DataDir(data).open_store().close()
    (data / "signing.key").write_bytes(content)
    for args in (["status"], ["status", "--json"]):
        run = cli(*args, "--data", data)
        assert run.code == 3
        assert run.err.startswith(f"healthlog: {data / 'signing.key'} is not ")
        assert "restore it from a backup" in run.err
        assert len(run.err.splitlines()) == 1
        assert run.out == b""


@pytest.mark.parametrize("name", ["journal.sqlite", "store.sqlite", "tokens.sqlite"])
def test_a_newer_schema_is_refused_naming_its_file_cli_23(
    cli: Cli, tmp_path: Path, name: str
) -> None:
    """CLI-23: a database of a newer healthlog (a restore after a downgrade): exit 3, one line
    naming the file."""
    data = tmp_path / "data"
    assert cli("token", "add", "phone", "--data", data).code == 0
    DataDir(data).open_journal().close()
    DataDir(data).open_store().close()
    assert cli("status", "--data", data).code == 0
    with closing(sqlite3.connect(data / name)) as conn:
        conn.execute("PRAGMA user_version = 99")
    run = (
        cli("status", "--data", data)
        if name != "tokens.sqlite"
        else cli("token", "list", "--data", data)
    )
    assert run.code == 3
    assert run.err.startswith(
        f"healthlog: database schema is newer than this healthlog ({data / name}: version 99,"
    )
    assert len(run.err.splitlines()) == 1


# What each file of a newer healthlog's schema is refused with, after its versions: how to go
# back to this healthlog without losing what the newer one journaled (CLI-284).
GOING_BACK = {
    "store.sqlite": "a newer healthlog wrote it; run that one again, or, to go back to this one,"
    " move store.sqlite and its -wal and -shm files away and run `healthlog reindex` (or start"
    " serve): this one folds the journal into a new store, losing nothing (followers then"
    " restore a snapshot once)",
    "journal.sqlite": "a newer healthlog wrote it, and this one cannot read it: run that one"
    " again (a backup taken before the upgrade lacks every delivery journaled since)",
    "tokens.sqlite": "a newer healthlog wrote it; run that one again, or move tokens.sqlite and"
    " its -wal and -shm files away and add the tokens again (`healthlog token add NAME`)",
    "replica.sqlite": "a newer healthlog wrote it; run that one again, or follow into another"
    " --replica directory",
}


@pytest.mark.parametrize("name", sorted(GOING_BACK))
def test_a_database_of_a_newer_healthlog_says_how_to_go_back_cli_284(
    cli: Cli, tmp_path: Path, name: str
) -> None:
    """CLI-284: a data directory (or replica) that a newer healthlog upgraded, opened by this
    one (a downgrade): exit 3, one line naming the file, its schema version and this one's, and
    how to go back without losing what the newer one journaled, the file left byte for byte as
    it was; for the store, doing what it says (moving it away, `reindex`) brings back every
    delivery journaled. (Before, the line said `database schema is newer than this healthlog`
    alone, and the README's `going back needs the backup` lost the deliveries journaled since
    the upgrade: 4 of 12 in the audit, where moving the store away kept them all.)"""
    data, replica = tmp_path / "data", tmp_path / "replica"
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    assert cli("token", "add", "phone", "--data", data).code == 0
    import_ok(cli, data, "--aggregation", "minutes", sent)
    Replica(replica).close()
    path = replica / REPLICA_FILE if name == REPLICA_FILE else data / name
    with closing(sqlite3.connect(path)) as conn:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        conn.execute(f"PRAGMA user_version = {version + 1}")
    before = path.read_bytes()
    run = {
        "store.sqlite": lambda: cli("status", "--data", data),
        "journal.sqlite": lambda: cli("status", "--data", data),
        "tokens.sqlite": lambda: cli("token", "list", "--data", data),
        "replica.sqlite": lambda: cli("export", "--replica", replica),
    }[name]()
    assert (run.code, run.out) == (3, b"")
    assert run.err == (
        f"healthlog: database schema is newer than this healthlog ({path}: version"
        f" {version + 1}, this one's is {version}): {GOING_BACK[name]}\n"
    )
    assert path.read_bytes() == before
    if name == "store.sqlite":
        aside = tmp_path / "aside"
        aside.mkdir()
        for moved in data.glob("store.sqlite*"):
            moved.rename(aside / moved.name)
        assert cli("reindex", "--data", data).code == 0
        assert [line["point"]["qty"] for line in cli("export", "--data", data).json_lines()] == [61]
        assert cli("verify", "--data", data).code == 0


def test_journal_refusing_an_import_exits_3_with_one_line_cli_23(cli: Cli, tmp_path: Path) -> None:
    """CLI-23: the journal refuses the delivery (disk full): exit 3, one line, no traceback."""
    sent = write(tmp_path / "a.json", body(metric(HR, BPM, point(minute(0), qty=61))))
    (tmp_path / "data").mkdir()
    refuse = faults.raise_fault(lambda _: StorageError("disk full"))
    plan = faults.Plan(actions={"journal.append": faults.Action(frozenset({1}), refuse)})
    with faults.loaded(plan):
        run = cli("import", "--aggregation", "minutes", "--data", tmp_path / "data", sent)
    assert run.code == 3
    assert run.err == "healthlog: disk full\n"


# -- verify and reindex -------------------------------------------------------------------


def test_verify_is_clean_after_imports_in_journal_order_cli_15(cli: Cli, tmp_path: Path) -> None:
    """CLI-15: verify exits 0, progress on stderr only; reindex changes nothing."""
    data = tmp_path / "data"
    sends = [
        body(metric(HR, BPM, point(minute(0), qty=61, source="Watch"), point(minute(1), qty=62))),
        body(metric(HR, BPM, point(minute(0), qty=61), point(minute(1), qty=99))),
        body(metric(HR, BPM, point(minute(1), qty=62, source="Phone", context="rest"))),
    ]
    for n, sent in enumerate(sends):
        import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / f"{n}.json", sent))
    before = exported(cli, data)
    run = cli("verify", "--data", data)
    assert run.code == 0, run.err
    assert run.out == b""
    assert "verify: 3/3" in run.err
    run = cli("reindex", "--data", data)
    assert run.code == 0, run.err
    assert "reindex: 3/3" in run.err
    assert run.err.splitlines()[-1] == "reindex: done, 0 objects changed"
    assert exported(cli, data) == before
    assert cli("verify", "--data", data).code == 0


def moved_an_hour(cli: Cli, tmp_path: Path) -> Path:
    """A data directory whose live store lost its first object and holds one two hours after
    the second, which no delivery made (as a store folded under an older rule can be)."""
    data = tmp_path / "data"
    sent = body(metric(HR, BPM, point(minute(0), qty=71.2468), point(minute(60), qty=72.1357)))
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "a.json", sent))
    with sqlite3.connect(data / "store.sqlite") as store:
        (lost,) = store.execute("SELECT min(hour) FROM objects").fetchone()
        store.execute("DELETE FROM objects WHERE hour = ?", (lost,))
        store.execute(
            "INSERT INTO objects SELECT metric, layer, hour + ?, units, first, last, points,"
            " created_by, hash, sealed, body FROM objects",
            (2 * 3_600_000_000,),
        )
    store.close()
    return data


def test_verify_names_missing_and_extra_objects_cli_16(cli: Cli, tmp_path: Path) -> None:
    """CLI-16: an object the live store lost is `missing`, one it holds that no delivery made is
    `extra`, each one line with its key and no value; verify exits 1, and 0 after reindex."""
    data = moved_an_hour(cli, tmp_path)
    found = cli("verify", "--data", data)
    assert found.code == 1, found.err
    assert [line.split("\t") for line in found.out.decode().splitlines()] == [
        ["missing", HR, "minutes", "2024-02-06T15:00:00Z"],
        ["extra", HR, "minutes", "2024-02-06T18:00:00Z"],
    ]
    assert found.err.splitlines()[-1] == "verify: 2 objects differ"
    for value in ("71.2468", "72.1357"):
        assert value not in found.out.decode() + found.err
    fixed = cli("reindex", "--data", data)
    assert fixed.code == 0, fixed.err
    assert fixed.err.splitlines()[-1] == "reindex: done, 2 objects changed"
    assert cli("verify", "--data", data).code == 0


def test_verify_says_that_reindex_rebuilds_what_differs_cli_101(cli: Cli, tmp_path: Path) -> None:
    """CLI-101: objects that differ from a rebuild (after an upgrade, folded under a rule that
    has changed since) come with one line saying that `healthlog reindex` rebuilds them from
    the journal, before the count."""
    found = cli("verify", "--data", moved_an_hour(cli, tmp_path))
    assert found.code == 1, found.err
    assert found.err.splitlines()[-2:] == [
        "verify: 2 objects are not what a rebuild of the journal makes (a backfill, `import"
        " --received-at`, folded after later deliveries; after an upgrade: folded under a rule"
        " that has changed since; otherwise changed outside healthlog); `healthlog reindex`"
        " rebuilds them from the journal",
        "verify: 2 objects differ",
    ]


def test_a_metric_name_with_control_characters_stays_on_one_verify_line_cli_55(
    cli: Cli, tmp_path: Path
) -> None:
    """CLI-55: a metric whose name (as the body sent it) holds a newline, a tab, another
    control character, a line separator or a backslash is printed by `verify` escaped, `\\n`,
    `\\t`, `\\x1b`, `\\u2028`, `\\\\` (other characters as they are), so that each
    differing object is still one line of four tab-separated fields. (Before, the name's newline
    and tab split the object's line, and a script reading one object per line read two, neither
    of them whole, the second starting like a `missing` line of its own.)"""
    data = tmp_path / "data"
    name = "evil\n\tmissing\x1b[2J\\x\u2028\x85é"
    sent = body(metric(name, BPM, point(minute(0), qty=1)))
    import_ok(cli, data, "--aggregation", "minutes", write(tmp_path / "a.json", sent))
    with sqlite3.connect(data / "store.sqlite") as store:
        store.execute("DELETE FROM objects")
    store.close()
    found = cli("verify", "--data", data)
    assert found.code == 1, found.err
    assert [line.split("\t") for line in found.out.decode().splitlines()] == [
        [
            "missing",
            "evil\\n\\tmissing\\x1b[2J\\\\x\\u2028\\x85é",
            "minutes",
            "2024-02-06T15:00:00Z",
        ]
    ]


def test_colliding_backfill_is_found_by_verify_and_fixed_by_reindex_cli_16(
    run_cli: RunCli, cli: Cli, tmp_path: Path
) -> None:
    """CLI-16: verify exits 1 naming (metric, layer, hour) and no value; reindex; verify 0."""
    data = tmp_path / "data"
    live = write(
        tmp_path / "live.json",
        body(metric(HR, BPM, point(minute(0), qty=123.456789, source="SRC-ALPHA-7731"))),
    )
    backfill = write(
        tmp_path / "backfill.json",
        body(metric(HR, BPM, point(minute(0), qty=987.654321, source="SRC-BETA-4409"))),
    )
    runs = [run_cli("import", "--aggregation", "minutes", "--data", data, live)]
    runs.append(
        run_cli(
            "import",
            "--aggregation",
            "minutes",
            "--received-at",
            "2024-01-01T00:00:00Z",
            "--data",
            data,
            backfill,
        )
    )
    assert [r.code for r in runs] == [0, 0]
    assert [json.loads(line)["point"]["qty"] for line in exported(cli, data)] == [987.654321]
    found = run_cli("verify", "--data", data)
    runs.append(found)
    assert found.code == 1, found.err
    (line,) = found.out.decode().splitlines()
    assert line.split("\t") == ["differs", HR, "minutes", "2024-02-06T15:00:00Z"]
    runs.append(run_cli("reindex", "--data", data))
    assert runs[-1].code == 0, runs[-1].err
    assert runs[-1].err.splitlines()[-1] == "reindex: done, 1 objects changed"
    assert re.search(r"reindex: \d+/\d+", runs[-1].err)
    runs.append(run_cli("verify", "--data", data))
    assert runs[-1].code == 0, runs[-1].err
    assert re.search(r"verify: \d+/\d+", runs[-1].err)
    assert [json.loads(line)["point"]["qty"] for line in exported(cli, data)] == [123.456789]
    for run in runs:
        for secret in ("123.456789", "987.654321", "SRC-ALPHA-7731", "SRC-BETA-4409"):
            assert secret not in run.err
            assert secret.encode() not in run.out


SECRETS = (
    "Secret Watch ZQX-1",
    "Other Device QJV-2",
    "hl_tok_9f8e7d6c5b4a",
    "4242.4242",
    "7373.7373",
    "5151.5151",
    "ZQX-BAD-DATE-31",
    "SECRET-GARBAGE-77",
    "Backfill Phone KLM-3",
    "6161.6161",
)


def test_no_source_token_or_value_reaches_the_output_cli_17(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """CLI-17: collisions, rejections, failures and a backfill log without any content."""
    data = tmp_path / "data"
    files = [
        write(
            tmp_path / "a.json",
            body(
                metric(
                    HR,
                    BPM,
                    point(minute(0), qty=4242.4242, source="Secret Watch ZQX-1"),
                    point(minute(1), qty=1, token="hl_tok_9f8e7d6c5b4a"),
                )
            ),
        ),
        write(
            tmp_path / "b.json",
            body(
                metric(
                    HR,
                    BPM,
                    point(minute(0), qty=7373.7373, source="Other Device QJV-2"),
                    point("ZQX-BAD-DATE-31", qty=5151.5151),
                )
            ),
        ),
        write(tmp_path / "c.json", b'{"data": SECRET-GARBAGE-77'),
    ]
    backfill = write(
        tmp_path / "d.json",
        body(metric(HR, BPM, point(minute(0), qty=6161.6161, source="Backfill Phone KLM-3"))),
    )
    runs = [
        run_cli("import", "--aggregation", "minutes", "--data", data, *files),
        run_cli(
            "import",
            "--aggregation",
            "minutes",
            "--received-at",
            "2024-01-01T00:00:00Z",
            "--data",
            data,
            backfill,
        ),
        run_cli("verify", "--data", data),
        run_cli("reindex", "--data", data),
        run_cli("status", "--data", data),
    ]
    assert [r.code for r in runs] == [0, 0, 1, 0, 0]
    own = re.compile(r"journaled .* as delivery \d+ |delivery \d+: \w+$|fold: \d+/\d+$")
    logged = [line for r in runs[:2] for line in r.err.splitlines() if not own.match(line)]
    assert logged, "the collisions, the rejection and the backfill logged nothing"
    for run in runs:
        for secret in SECRETS:
            assert secret not in run.err
            assert secret.encode() not in run.out


def test_status_says_when_each_subscriber_last_acked_store_89(cli: Cli, tmp_path: Path) -> None:
    """STORE-89: `status` and `status --json` say when each named subscriber's last ACK was
    stored, beside its cursor: one silent for 40 days (a laptop given away) is told from one
    that acked now, which its cursor alone does not tell."""
    data = tmp_path / "data"
    with DataDir(data).open_journal(), DataDir(data).open_store() as store:
        clock.jump(-40 * 86_400)
        try:
            before = clock.now_us()
            store.ack("laptop", 7)
            after = clock.now_us()
        finally:
            clock.jump(40 * 86_400)
        store.ack("desk", 9)
    status = status_of(cli, data)
    assert status["subscribers"] == {"laptop": 7, "desk": 9}
    last = status["subscribers_last_ack"]
    assert sorted(last) == ["desk", "laptop"]
    assert before <= parse_instant(last["laptop"]) <= after
    assert clock.now_us() - parse_instant(last["desk"]) < 86_400 * 10**6
    run = cli("status", "--data", data)
    assert run.code == 0, run.err
    lines = run.out.decode().splitlines()
    assert f"subscriber  laptop acked 7, last ACK {last['laptop']}" in lines
    assert f"subscriber  desk acked 9, last ACK {last['desk']}" in lines
