"""Conformance over real Health Auto Export bodies (specs/cli.md, CLI-18 and CLI-19).

The samples live outside the project (``/work/shared/hae-samples``) and are only read. The
expected counts below were taken by reading each file; the content check compares every
exported point with the point in the file, keys in order and numbers as written.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest

if TYPE_CHECKING:
    from conftest import Cli, CliRun, Outcomes, RunCli

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "hae-samples"
RECORD_SECTIONS = ("workouts", "symptoms")

CORNFLOWER_DAYS = {
    "active_energy": 7,
    "apple_exercise_time": 7,
    "apple_sleeping_wrist_temperature": 8,
    "apple_stand_hour": 7,
    "apple_stand_time": 7,
    "atrial_fibrillation_burden": 2,
    "basal_energy_burned": 7,
    "blood_oxygen_saturation": 7,
    "cardio_recovery": 3,
    "environmental_audio_exposure": 8,
    "flights_climbed": 4,
    "headphone_audio_exposure": 7,
    "heart_rate": 7,
    "heart_rate_variability": 7,
    "physical_effort": 8,
    "respiratory_rate": 7,
    "resting_heart_rate": 7,
    "six_minute_walking_test_distance": 1,
    "sleep_analysis": 7,
    "stair_speed_down": 1,
    "stair_speed_up": 2,
    "step_count": 7,
    "time_in_daylight": 7,
    "vo2_max": 5,
    "walking_asymmetry_percentage": 7,
    "walking_double_support_percentage": 7,
    "walking_heart_rate_average": 7,
    "walking_running_distance": 7,
    "walking_speed": 7,
    "walking_step_length": 7,
}


@attrs.frozen
class Expected:
    """What a careful reader expects from one sample."""

    status: str
    layer: str | None
    counts: dict[tuple[str, str], int]
    firsts: dict[tuple[str, str], tuple[str, str]] = attrs.Factory(dict)
    rejected: int = 0


EXPECTED = {
    "a7d-corp__apple-health-ingestor__payload_full.json": Expected(
        "parsed",
        "hours",
        {
            ("heart_rate", "hours"): 5,
            ("resting_heart_rate", "hours"): 3,
            ("step_count", "hours"): 5,
            ("workouts", "records"): 2,
        },
        firsts={
            ("heart_rate", "hours"): ("2026-03-14T00:00:04Z", "2026-03-14T01:00:00Z"),
            ("resting_heart_rate", "hours"): ("2026-03-12T00:00:00Z", "2026-03-12T23:59:59Z"),
            ("workouts", "records"): ("2026-03-10T19:27:48Z", "2026-03-10T20:13:23Z"),
        },
    ),
    "benmurrell__workouts-to-ical__workoutA-workoutB.json": Expected(
        "parsed",
        None,
        {("workouts", "records"): 2},
        firsts={("workouts", "records"): ("2023-06-07T01:05:57Z", "2023-06-07T01:21:43Z")},
    ),
    "ivailop7__Healthkit-influxdb-grafana__sample-data.json": Expected(
        "parsed",
        "minutes",
        {("step_count", "minutes"): 6},
        firsts={("step_count", "minutes"): ("2021-03-14T00:01:00Z", "2021-03-14T00:01:00Z")},
    ),
    "mswiatlo__MaxAct2__mcp-workouts-seconds.json": Expected(
        "parsed",
        None,
        {("workouts", "records"): 1},
        firsts={("workouts", "records"): ("2024-02-06T13:59:58Z", "2024-02-06T18:32:36Z")},
    ),
    "squagwallow__Cornflower_Health__hae_live_2026-04-06.json": Expected(
        "parsed",
        "days",
        {(name, "days"): n for name, n in CORNFLOWER_DAYS.items()},
        firsts={("heart_rate", "days"): ("2026-03-30T06:00:00Z", "2026-03-30T06:00:00Z")},
    ),
    "wpfleger96__OSCAR-MCP__hae_payload.json": Expected(
        "partial",
        "hours",
        {
            ("blood_oxygen_saturation", "hours"): 1,
            ("respiratory_rate", "hours"): 2,
            ("sleep_analysis", "hours"): 6,
            ("step_count", "hours"): 1,
        },
        firsts={("sleep_analysis", "hours"): ("2024-01-16T04:00:00Z", "2024-01-16T05:00:00Z")},
        rejected=1,
    ),
}


@pytest.fixture(scope="module")
def samples() -> Path:
    """The real bodies, which live outside the repository: elsewhere these tests are skipped,
    visibly, unless ``HEALTHLOG_REQUIRE_SAMPLES`` is set (as CI sets it), when they fail."""
    if not SAMPLES.is_dir():
        missing = f"the Health Auto Export samples are not at {SAMPLES}"
        if os.environ.get("HEALTHLOG_REQUIRE_SAMPLES"):
            pytest.fail(missing)
        pytest.skip(missing)
    return SAMPLES


def ordered(text: str | bytes) -> Any:
    """JSON with objects as tuples of pairs (key order and duplicates kept), numbers as written."""
    return json.loads(text, object_pairs_hook=tuple, parse_float=str, parse_int=str)


def file_points(path: Path, layer: str | None) -> list[tuple[str, str | None, Any]]:
    """(metric, layer, point) for every point in a sample, minus empty ones (no start)."""
    document = dict(ordered(path.read_bytes()))
    inner = dict(document.get("data", document))
    found: list[tuple[str, str | None, Any]] = []
    for entry in inner.get("metrics", ()):
        fields = dict(entry)
        found.extend((fields["name"], layer, p) for p in fields["data"] if p)
    for section in RECORD_SECTIONS:
        found.extend((section, "records", r) for r in inner.get(section, ()) if r)
    return found


def exported_points(run: CliRun) -> list[tuple[str, str | None, Any]]:
    found: list[tuple[str, str | None, Any]] = []
    for line in run.out.splitlines():
        fields = dict(ordered(line))
        found.append((fields["metric"], fields["layer"], fields["point"]))
    return found


def test_every_sample_has_expectations_read_from_the_file_cli_18(samples: Path) -> None:
    """CLI-18: one expectation per sample; Cornflower is 30 metrics and 182 points."""
    assert set(EXPECTED) == {p.name for p in samples.glob("*.json")}
    assert len(CORNFLOWER_DAYS) == 30
    assert sum(CORNFLOWER_DAYS.values()) == 182


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_sample_exports_the_points_a_reader_expects_cli_18(
    cli: Cli, outcomes: Outcomes, samples: Path, tmp_path: Path, name: str
) -> None:
    """CLI-18: outcome, layer, count per metric, first start/end, content as sent."""
    expected = EXPECTED[name]
    data = tmp_path / "data"
    run = cli("import", "--data", data, samples / name)
    assert run.code == 0, run.err
    assert list(outcomes(data).values()) == [expected.status]
    export = cli("export", "--data", data)
    assert export.code == 0, export.err
    lines = export.json_lines()
    assert Counter((d["metric"], d["layer"]) for d in lines) == expected.counts
    for key, (start, end) in expected.firsts.items():
        first = next(d for d in lines if (d["metric"], d["layer"]) == key)
        assert (first["start"], first["end"]) == (start, end), key
    for d in lines:
        assert d["units"] is None if d["layer"] == "records" else isinstance(d["units"], str)
    points = file_points(samples / name, expected.layer)
    assert len(points) == sum(expected.counts.values())
    assert sorted(exported_points(export), key=repr) == sorted(points, key=repr)


def test_oscar_rejects_only_the_empty_point_and_keeps_sleep_segments_apart_cli_18(
    cli: Cli, samples: Path, tmp_path: Path
) -> None:
    """CLI-18: the `{}` sleep point is counted as rejected; six segments stay six points."""
    data = tmp_path / "data"
    assert (
        cli("import", "--data", data, samples / "wpfleger96__OSCAR-MCP__hae_payload.json").code == 0
    )
    status = json.loads(cli("status", "--json", "--data", data).out)
    assert status["deliveries"] == {"pending": 0, "parsed": 0, "partial": 1, "failed": 0}
    sleep = cli("export", "--data", data, "--metric", "sleep_analysis").json_lines()
    assert [d["point"]["value"] for d in sleep] == [
        "In Bed",
        "Asleep",
        "Core",
        "Awake",
        "Deep",
        "REM",
    ]
    assert len({(d["start"], d["end"]) for d in sleep}) == 6


def test_cornflower_keeps_unicode_escapes_as_sent_cli_18(
    cli: Cli, samples: Path, tmp_path: Path
) -> None:
    """CLI-18: `\\u2019` and `\\u00a0` in source strings are exported as the escapes sent."""
    data = tmp_path / "data"
    name = "squagwallow__Cornflower_Health__hae_live_2026-04-06.json"
    assert cli("import", "--data", data, samples / name).code == 0
    out = cli("export", "--data", data, "--metric", "apple_sleeping_wrist_temperature").out
    assert out.count(b'"source":"Jonathan\\u2019s Apple\\u00a0Watch"') == 8
    assert "\u2019".encode() not in out


def test_reimporting_every_sample_changes_nothing_cli_19(
    run_cli: RunCli, outcomes: Outcomes, samples: Path, tmp_path: Path
) -> None:
    """CLI-19: all samples twice through the real command: same export, verify 0, none failed."""
    data = tmp_path / "data"
    files = sorted(samples.glob("*.json"))
    assert run_cli("import", "--data", data, *files).code == 0
    first = run_cli("export", "--data", data)
    assert first.code == 0, first.err
    assert run_cli("import", "--data", data, *files).code == 0
    again = run_cli("export", "--data", data)
    assert again.out == first.out
    assert len(first.out.splitlines()) == sum(sum(e.counts.values()) for e in EXPECTED.values())
    statuses = list(outcomes(data).values())
    assert statuses[: len(files)] == statuses[len(files) :]
    assert "failed" not in statuses
    verify = run_cli("verify", "--data", data)
    assert verify.code == 0, verify.out
