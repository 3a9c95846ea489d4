"""The service at its process limit: no thread can be started (RUN-70 to RUN-79).

The limit is a real one: `healthlog serve` runs as another user than root (whom the kernel
does not hold to ``RLIMIT_NPROC``), and ``prlimit``, run as that user too, lowers the soft
process limit of the running service below the tasks that user has, then raises it back. That
user runs a virtual environment of an interpreter it may run (this one's may lie under a
home of mode 0700) with this one's packages.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from _cli_bodies import body, metric, point
from _disk import reachable_home

LIMIT_S = 120.0
SERVICE_UID = 65534
THREAD_IDLE_S = 12.0
"""The folder's period in these tests: longer than the 10 s after which trio ends an idle
worker thread, so that between two passes the service has a moment with no thread but its
main one, when the limit is lowered; the next pass then needs a new thread."""
RENEW_S = 20.0
"""The lease's renewal period in these tests: after the first moment without a thread (10 s
after the first pass), so that a renewal meets the limit too."""
HEART_RATE = body(
    metric(
        "heart_rate",
        "count/min",
        point("2024-03-01 10:00:00 +0000", qty=61),
        point("2024-03-01 10:01:00 +0000", qty=62),
    )
)


def as_service_user() -> list[str]:
    """The prefix that runs a command as the service's user: another one than root, whom the
    process limit does not hold; none when this is not root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "setpriv (util-linux) is needed to run the service as a user"
    return [setpriv, f"--reuid={SERVICE_UID}", f"--regid={SERVICE_UID}", "--clear-groups"]


def service_interpreter(where: Path, prefix: list[str]) -> Path:
    """A virtual environment in ``where`` that the service's user may run, of this Python's
    version, with this one's packages (through ``outer.pth``): its ``bin/python``."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [
        Path(sys._base_executable).resolve(),
        *(Path(d, f"python{version}") for d in ("/usr/local/bin", "/usr/bin")),
    ]
    # Its version, if the user may run it: it spawns the fold workers (and its access says
    # so where running it as that user needs not fail).
    check = (
        "import os, sys; print(os.access(sys.executable, os.X_OK)"
        " and f'{sys.version_info.major}.{sys.version_info.minor}')"
    )
    base = next(
        (
            python
            for python in candidates
            if python.exists()
            and subprocess.run([*prefix, python, "-c", check], capture_output=True, check=False)
            .stdout.decode()
            .strip()
            == version
        ),
        None,
    )
    assert base is not None, f"no Python {version} that uid {SERVICE_UID} may run: {candidates}"
    subprocess.run([base, "-m", "venv", "--without-pip", where], check=True)
    [site] = (where / "lib").glob("python3*/site-packages")
    outer = sysconfig.get_paths()["purelib"]
    (site / "outer.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    return where / "bin" / "python"


def healthlog(python: Path, prefix: list[str], *args: str | os.PathLike[str]) -> list[str]:
    return [*prefix, str(python), "-m", "healthlog.cli", *map(os.fspath, args)]


def set_process_limit(prefix: list[str], pid: int, soft: int | None) -> None:
    """Set the soft process limit of process ``pid`` to ``soft`` (None: its hard limit), as
    its own user: root may not here (the container drops CAP_SYS_RESOURCE) and needs not."""
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    limit = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    value = f"{limit if soft is None else soft}:{limit}"
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is needed to limit the service"
    subprocess.run([*prefix, prlimit, f"--pid={pid}", f"--nproc={value}"], check=True)


@contextmanager
def serving(
    home: Path, python: Path, prefix: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`healthlog serve` on ``home/data`` as the service's user, folding every
    ``THREAD_IDLE_S`` and renewing its lease every ``RENEW_S`` (each takes a thread): the
    process, its URL and its log (at DEBUG)."""
    data = home / "data"
    log = home / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    env |= {
        "HEALTHLOG_WAKE_PERIOD_S": str(THREAD_IDLE_S),
        "HEALTHLOG_LEASE_TTL_S": "900",
        "HEALTHLOG_LEASE_RENEW_S": str(RENEW_S),
        "HEALTHLOG_LOG_LEVEL": "debug",
    }
    command = healthlog(python, prefix, "serve", "--port", "0", "--data", data)
    with (
        log.open("wb") as stderr,
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, cwd=home) as p,
    ):
        try:
            assert p.stdout is not None
            line = p.stdout.readline().decode()
            found = re.search(r"healthlog serving on (http://127\.0\.0\.1:\d+) ", line)
            assert found, line + log.read_text()
            yield p, found.group(1), log
        finally:
            p.terminate()
            p.wait(timeout=LIMIT_S)


def until(condition_met: bool, what: str, log: Path, deadline: float) -> bool:
    """False while ``condition_met`` is not, failing with the log once ``deadline`` passed."""
    assert time.monotonic() < deadline, f"waited for {what}:\n{log.read_text()}"
    if not condition_met:
        time.sleep(0.05)
    return condition_met


def limited(
    prefix: list[str], process: subprocess.Popen[bytes], log: Path, deadline: float
) -> None:
    """Once trio has ended the idle threads of ``process`` (its main thread left), lower its
    soft process limit below what its user has: no thread can be started."""
    tasks = Path(f"/proc/{process.pid}/task")
    while not until(len(list(tasks.iterdir())) == 1, "the idle threads' end", log, deadline):
        pass
    set_process_limit(prefix, process.pid, 1)


def said(log: str) -> list[str]:
    """The records of ``log`` above DEBUG, without their time."""
    return [line.split(" ", 1)[1] for line in log.splitlines() if "level=DEBUG" not in line]


def test_no_thread_leaves_deliveries_pending_and_intake_answering_503_run_70_run_71() -> None:
    """RUN-70, RUN-71: a `healthlog serve` whose user reaches its process limit (``prlimit
    --nproc`` below the tasks it has, after trio ended its idle threads): a delivery journaled
    meanwhile stays pending through the folder's tries, a delivery sent is answered 503 with
    Retry-After, nothing crashes (the folder, the lease renewal, the token read), and one ERROR
    says what is short and what to do, the rest at DEBUG; once the limit is raised the delivery
    folds, one INFO says threads start again, and a delivery sent is answered 200. (Before,
    each try crashed the folding actor, `actor folding crashed (RuntimeError)`, and intake
    answered 500.)"""
    prefix = as_service_user()
    with reachable_home("healthlog-run-70-") as home:
        if prefix:
            os.chown(home, SERVICE_UID, SERVICE_UID)
        python = service_interpreter(home / "venv", prefix)
        made = subprocess.run(
            healthlog(python, prefix, "token", "add", "phone", "--data", home / "data"),
            capture_output=True,
            check=True,
            cwd=home,
        )
        token = made.stdout.decode().split()[-1]
        file = home / "hr.json"
        file.write_bytes(HEART_RATE)
        headers = {"Authorization": f"Bearer {token}", "automation-aggregation": "minutes"}
        with (
            serving(home, python, prefix) as (process, url, log),
            httpx.Client(base_url=url, headers=headers, timeout=LIMIT_S) as client,
        ):
            deadline = time.monotonic() + LIMIT_S
            limited(prefix, process, log, deadline)
            subprocess.run(
                healthlog(python, prefix, "import", "--no-wait", "--aggregation", "minutes", file),
                capture_output=True,
                check=True,
                cwd=home,
                env={**os.environ, "HEALTHLOG_DATA": str(home / "data")},
            )
            while not until(
                (
                    log.read_text().count("a thread still cannot be started") >= 2
                    and "lease renewal failed" in log.read_text()
                )
                or "crashed" in log.read_text(),
                "the folder's tries and a renewal",
                log,
                deadline,
            ):
                pass
            refused = client.post("/v1/deliveries", content=HEART_RATE)
            while_limited = log.read_text()
            set_process_limit(prefix, process.pid, None)
            while not until("delivery 1 folded" in log.read_text(), "the fold", log, deadline):
                pass
            answered = client.post("/v1/deliveries", content=HEART_RATE)
            status = client.get("/v1/deliveries/1").json()["status"]

        assert (refused.status_code, "retry-after" in refused.headers) == (503, True)
        assert "delivery 1 folded" not in while_limited
        assert [line for line in said(while_limited) if "level=INFO" not in line] == [
            "level=ERROR logger=healthlog.threads msg=\"no thread can be started (can't start"
            " new thread: the process limit reached?); raise the service user's process limit"
            " (ulimit -u, LimitNPROC=) or the container's pids limit: meanwhile deliveries are"
            ' answered 503 and pending ones wait, tried again until one starts"',
        ]
        assert 'msg="threads start again, after' in log.read_text()
        assert (answered.status_code, status) == (200, "parsed")


def test_a_service_stopped_at_the_process_limit_stops_cleanly_run_73() -> None:
    """RUN-73: a `healthlog serve` stopped (SIGTERM) while no thread can be started exits 0,
    and nothing crashes on the way out. (Before, its folding actor crashed ending its worker
    cache, which takes a thread: `actor folding crashed (RuntimeError)`.)"""
    prefix = as_service_user()
    with reachable_home("healthlog-run-73-") as home:
        if prefix:
            os.chown(home, SERVICE_UID, SERVICE_UID)
        python = service_interpreter(home / "venv", prefix)
        with serving(home, python, prefix) as (process, _, log):
            limited(prefix, process, log, time.monotonic() + LIMIT_S)
            process.terminate()
            code = process.wait(timeout=LIMIT_S)

        assert (code, [line for line in said(log.read_text()) if "crashed" in line]) == (0, [])
