"""Hostile bodies through ``healthlog import`` (specs/cli.md, CLI-20 to CLI-22).

Every body goes into a data directory that already holds a folded baseline. Whatever the body,
it is journaled and gets an outcome; nothing crashes (no traceback, no ERROR record, no
"internal error" outcome); the baseline exports exactly as before and ``verify`` exits 0.
Hostile points use the metric ``hostile`` and are imported with ``--aggregation minutes``, so
the layer is never what decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _baseline import BASELINE, BASELINE_LINES, errors
from _cli_bodies import body, metric, point, raw_point, write

from healthlog.storage.datadir import DataDir

if TYPE_CHECKING:
    from conftest import Cli, Outcomes

    FoldHostile = Callable[[bytes], tuple[str, list[bytes]]]

GOOD = point("2024-03-01 10:00:00 +0000", qty=7)
OTHER = point("2024-03-01 10:01:00 +0000", qty=8)


def hostile(*points: bytes) -> bytes:
    return body(metric("hostile", "count", *points))


VALID = hostile(GOOD, OTHER)
DEEP = b"[" * 10_000 + b"]" * 10_000


def reason_of_last(data: Path) -> str:
    """The recorded reason of the delivery last in journal order ('' when none)."""
    directory = DataDir(data)
    with directory.open_journal() as journal, directory.open_store() as store:
        row = store.outcome(journal.iter_order()[-1].id)
    assert row is not None
    return row.reason or ""


@pytest.fixture
def fold_hostile(
    cli: Cli, outcomes: Outcomes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> FoldHostile:
    """Import one body over the baseline; return its status and its exported points."""
    data = tmp_path / "data"
    run = cli("import", "--data", data, write(tmp_path / "baseline.json", BASELINE))
    assert run.code == 0, run.err
    before = cli("export", "--data", data).lines()
    assert len(before) == BASELINE_LINES

    def fold(content: bytes) -> tuple[str, list[bytes]]:
        journaled = len(outcomes(data))
        sent = write(tmp_path / "hostile.json", content)
        run = cli("import", "--aggregation", "minutes", "--data", data, sent)
        assert run.code == 0, run.err
        assert "Traceback" not in run.err
        statuses = list(outcomes(data).values())
        assert len(statuses) == journaled + 1
        assert "internal error" not in reason_of_last(data)
        lines = cli("export", "--data", data).lines()
        assert [line for line in lines if json.loads(line)["metric"] != "hostile"] == before
        assert cli("verify", "--data", data).code == 0
        assert errors(caplog) == []
        hostile_lines = [line for line in lines if json.loads(line)["metric"] == "hostile"]
        return statuses[-1], [raw_point(line) for line in hostile_lines]

    return fold


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(VALID[:1], id="truncated-1"),
        pytest.param(VALID[:9], id="truncated-9"),
        pytest.param(VALID[: len(VALID) // 2], id="truncated-half"),
        pytest.param(VALID[:-1], id="truncated-last-brace"),
        pytest.param(VALID[:-3], id="truncated-inside-points"),
        pytest.param(b'"x"', id="root-string"),
        pytest.param(b"3", id="root-number"),
        pytest.param(b"null", id="root-null"),
        pytest.param(hostile(GOOD, b'{"date":"2024-03-01 10:01:00 +0000","qty":NaN}'), id="nan"),
        pytest.param(
            hostile(GOOD, b'{"date":"2024-03-01 10:01:00 +0000","qty":Infinity}'), id="inf"
        ),
        pytest.param(hostile(b'{"date":"2024-03-01 10:01:00 +0000","qty":-Infinity}'), id="-inf"),
        pytest.param(DEEP, id="nested-10000-root"),
        pytest.param(
            hostile(GOOD, b'{"date":"2024-03-01 10:01:00 +0000","qty":%s}' % DEEP),
            id="nested-10000-in-a-point",
        ),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff" + VALID, id="invalid-utf8-before-the-root"),
        pytest.param(b'{"data":"x"}', id="data-not-an-object"),
        pytest.param(b'{"data":{"metrics":{}}}', id="metrics-not-an-array"),
        pytest.param(b"[1,2]", id="array-of-numbers"),
    ],
)
def test_undecodable_bodies_are_journaled_and_failed_cli_20(
    fold_hostile: FoldHostile, content: bytes
) -> None:
    """CLI-20: journaled, `failed`, exit 0; nothing of them folded; the baseline unchanged."""
    assert fold_hostile(content) == ("failed", [])


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b'{"date":1709287260,"qty":8}', id="date-as-number"),
        pytest.param(b'{"date":"01/03/2024 10:01","qty":8}', id="unknown-date-format"),
        pytest.param(
            b'{"date":"2024-03-01 10:01:00 +0000","qty":8,"source":"W\xff\xfe"}', id="invalid-utf8"
        ),
        pytest.param(b'{"date":null,"qty":8}', id="date-null"),
        pytest.param(b'"not an object"', id="point-not-an-object"),
        pytest.param(b'{"date":"2024-03-01 10:01:00 +0000","qty":1e400}', id="number-overflow"),
    ],
)
def test_bad_points_are_rejected_and_good_ones_kept_cli_21(
    fold_hostile: FoldHostile, bad: bytes
) -> None:
    """CLI-21: the delivery is `partial`; the good point is folded, the bad one is not."""
    assert fold_hostile(hostile(GOOD, bad)) == ("partial", [GOOD])


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(b"5", id="entry-not-an-object"),
        pytest.param(metric("", "count", OTHER), id="empty-name"),
        pytest.param(b'{"name":5,"data":[%s]}' % OTHER, id="name-not-a-string"),
        pytest.param(b'{"name":"hostile_too","data":{}}', id="data-not-an-array"),
    ],
)
def test_bad_metric_entries_are_rejected_and_good_ones_kept_cli_21(
    fold_hostile: FoldHostile, entry: bytes
) -> None:
    """CLI-21: a metric entry that cannot be read is rejected; the good metric is folded."""
    content = b'{"data":{"metrics":[%s,%s]}}' % (metric("hostile", "count", GOOD), entry)
    assert fold_hostile(content) == ("partial", [GOOD])


@pytest.mark.parametrize(
    ("content", "exported"),
    [
        pytest.param(b"\xef\xbb\xbf" + VALID, [GOOD, OTHER], id="utf8-bom"),
        pytest.param(b"{}", [], id="empty-object"),
        pytest.param(b"[]", [], id="empty-array"),
        pytest.param(b'{"data":{}}', [], id="empty-data"),
        pytest.param(b'{"data":{"metrics":[],"future":[1]}}', [], id="unknown-section"),
        pytest.param(
            hostile(point("1900-01-01 00:00:00 +0000", qty=1), point("2999-12-31 23:59:59 +0000")),
            [point("1900-01-01 00:00:00 +0000", qty=1), point("2999-12-31 23:59:59 +0000")],
            id="first-and-last-instants-read",
        ),
        pytest.param(
            hostile(b'{"date":"2024-03-01 10:00:00 +0000","qty":1,"qty":2}'),
            [b'{"date":"2024-03-01 10:00:00 +0000","qty":1,"qty":2}'],
            id="duplicate-keys-in-a-point",
        ),
        pytest.param(
            b'{"data":{"metrics":[]},' + VALID[1:], [GOOD, OTHER], id="duplicate-data-key-last-wins"
        ),
        pytest.param(
            hostile(point("2024-03-01 10:00:00 +0000", qty="12.5")),
            [b'{"date":"2024-03-01 10:00:00 +0000","qty":"12.5"}'],
            id="qty-as-string",
        ),
        pytest.param(
            hostile(b'{"date":"2024-03-01 10:00:00 +0000","qty":%d}' % 2**70),
            [b'{"date":"2024-03-01 10:00:00 +0000","qty":1180591620717411303424}'],
            id="integer-2**70",
        ),
        pytest.param(
            hostile(b'{"date":"2024-03-01 10:00:00 +0000","source":"<script>a&b</script> >"}'),
            [b'{"date":"2024-03-01 10:00:00 +0000","source":"<script>a&b</script> >"}'],
            id="html-characters",
        ),
    ],
)
def test_odd_but_readable_bodies_are_parsed_and_exported_verbatim_cli_22(
    fold_hostile: FoldHostile, content: bytes, exported: list[bytes]
) -> None:
    """CLI-22: `parsed`; the points export byte for byte as sent."""
    assert fold_hostile(content) == ("parsed", exported)


def test_hostile_bodies_in_a_row_leave_the_baseline_alone_cli_20(
    fold_hostile: FoldHostile,
) -> None:
    """CLI-20, CLI-21, CLI-22: one data directory takes every kind in turn."""
    assert fold_hostile(VALID[:-1])[0] == "failed"
    assert fold_hostile(hostile(GOOD, b'{"date":1709287260}'))[0] == "partial"
    assert fold_hostile(b"\xef\xbb\xbf" + VALID) == ("parsed", [GOOD, OTHER])
    assert fold_hostile(DEEP)[0] == "failed"
