"""A pytest plugin: under ``HEALTHLOG_NO_SKIPS`` (as ``.ci/run`` sets it) a test that would be
skipped fails instead, with the skip's reason, which names the missing tool (``setpriv is
missing``) or what the machine lacks (root, two cores, Linux). A skip in CI is a test that
proved nothing on a run that looks green (PROOF-13); elsewhere a skip stays a skip, shown by
``-ra``."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

NO_SKIPS_ENV = "HEALTHLOG_NO_SKIPS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # An expected failure (xfail) is reported as skipped too: it is no skip.
    if report.skipped and os.environ.get(NO_SKIPS_ENV) and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        said = str(reason).removeprefix("Skipped: ")
        report.longrepr = f"{NO_SKIPS_ENV} is set, and this test would be skipped: {said}"
    return report
