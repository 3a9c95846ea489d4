"""The suite under CI: a test that would be skipped there fails instead (PROOF-13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _no_skips import NO_SKIPS_ENV

SKIPPING = """
import pytest


def test_needing_a_tool():
    pytest.skip("frobnicate is missing")


@pytest.mark.skipif(True, reason="needs two cores")
def test_needing_the_machine():
    pass


@pytest.mark.xfail(reason="known")
def test_expected():
    assert False
"""


def run_pytest(directory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest on ``directory`` with this suite's ``_no_skips`` plugin, without the suite's
    own settings, in an environment without ``NO_SKIPS_ENV`` but for ``env``."""
    environment = {k: v for k, v in os.environ.items() if k != NO_SKIPS_ENV}
    environment["PYTHONPATH"] = os.fspath(Path(__file__).parent)
    plugins = ["-p", "no:cacheprovider", "-p", "_no_skips"]
    settings = ["-c", os.devnull, "--rootdir", os.fspath(directory), "-q", "-rA"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugins, *settings, directory],
        capture_output=True,
        text=True,
        env=environment | env,
        timeout=120,
        check=False,
    )


def test_a_skip_fails_under_the_ci_setting_naming_what_it_lacked_proof_13(tmp_path: Path) -> None:
    """PROOF-13: GIVEN a test skipped for a missing tool (`pytest.skip`) and one skipped for
    what the machine lacks (`skipif`) WHEN pytest runs them with HEALTHLOG_NO_SKIPS set, as
    `.ci/run` sets it, THEN both fail, each naming what it lacked, and the run exits 1; without
    it, both are skipped and the run exits 0. An expected failure (`xfail`) is left as it is.
    (Before, a CI machine without `setpriv` or `chattr` skipped every test needing them, and a
    green run said nothing of it.)"""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    skipped = run_pytest(tmp_path)
    assert skipped.returncode == 0, skipped.stdout
    assert "2 skipped, 1 xfailed" in skipped.stdout, skipped.stdout
    failed = run_pytest(tmp_path, **{NO_SKIPS_ENV: "1"})
    assert failed.returncode == 1, failed.stdout
    assert "1 xfailed" in failed.stdout, failed.stdout
    said = [line for line in failed.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert sorted(line.rpartition("::")[2].split()[0] for line in said) == [
        "test_needing_a_tool",
        "test_needing_the_machine",
    ], failed.stdout
    for lacking in ("frobnicate is missing", "needs two cores"):
        assert f"{NO_SKIPS_ENV} is set, and this test would be skipped: {lacking}" in (
            failed.stdout.splitlines()
        ), failed.stdout
