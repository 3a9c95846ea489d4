"""What the benchmarks share: the workload, a real ``healthlog serve``, memory figures, the table.

Every benchmark prints its detail lines, then its rows of the table
``benchmark | figure | floor | ratio | bound | verdict`` (``scripts/bench/run`` gathers the rows
of all of them). A row's verdict is ``FAIL`` when its bound is missed, ``ok`` when the bound is
met, ``goal`` when the goal is met too; a row with only a goal is ``goal`` or ``below goal``, and
``n/a`` marks a figure that could not be taken. Servers run with the default configuration.
"""

from __future__ import annotations

import math
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from healthlog.storage.datadir import DataDir
from healthlog.workload import big_body, encode, window

BODY_BYTES = 62 * 2**20
BODY_SEED = 62
MINUTES_PER_DAY = 1440
SMALL_MINUTES = 3
START_LIMIT_S = 60.0
STOP_LIMIT_S = 30.0
TOKEN_NAME = "bench"
HEALTHLOG = Path(sys.executable).with_name("healthlog")


def large_body() -> bytes:
    """The 62 MiB minute-level delivery of every large-body benchmark."""
    return big_body(BODY_SEED, target_bytes=BODY_BYTES)


def small_body(n: int) -> bytes:
    """The ``n``-th small delivery: three minutes of three metrics, about 1 KB."""
    return encode(window(n, first_minute=n * SMALL_MINUTES, minutes=SMALL_MINUTES), n)


def day_body(n: int) -> bytes:
    """One day of minute-level points (72 hourly objects), starting ``n`` days after the epoch."""
    return encode(window(n, first_minute=n * MINUTES_PER_DAY, minutes=MINUTES_PER_DAY), n)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of a process, in bytes."""
    figures = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                figures[name] = int(value.split()[0]) * 1024
    return figures


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.extend(int(child) for child in (task / "children").read_text().split())
    return found


def tree_rss(pid: int) -> int:
    """The resident memory of ``pid`` and every process below it, summed (a process that
    ended meanwhile counts for nothing)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += memory(current).get("VmRSS", 0)
            pending.extend(children(current))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _sample_tree(pid: int, every_s: float) -> None:
    """Print the highest :func:`tree_rss` of ``pid``, sampled every ``every_s`` seconds until
    standard input has something to read or ends."""
    peak = 0
    while True:
        peak = max(peak, tree_rss(pid))
        if select.select([sys.stdin], [], [], every_s)[0]:
            break
    print(peak)


@contextmanager
def tree_rss_peak(pid: int, every_s: float) -> Iterator[list[int]]:
    """Sample the resident memory of ``pid`` and every process below it, summed, every
    ``every_s`` seconds, in a process of its own (so that this one's timings do not pay for
    it); the list yielded holds the highest sum seen once the block has ended. A sample can
    miss a peak shorter than ``every_s``."""
    peak: list[int] = []
    sampler = subprocess.Popen(
        [sys.executable, __file__, str(pid), str(every_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield peak
    finally:
        out, _ = sampler.communicate("stop\n", timeout=30)
        peak.append(int(out.strip()))


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values``: the smallest value that at least
    ``fraction`` of them do not exceed (rank ``ceil(fraction * n)``)."""
    ordered = sorted(values)
    rank = math.ceil(round(fraction * len(ordered), 9))
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


@dataclass(frozen=True)
class Server:
    """A running ``healthlog serve``: its process, base URL and client token."""

    process: subprocess.Popen[bytes]
    url: str
    token: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def add_token(data: DataDir) -> str:
    with data.open_tokens() as tokens:
        return tokens.add(TOKEN_NAME)


@contextmanager
def serving(data: DataDir, log: Path) -> Iterator[Server]:
    """Run the real ``healthlog serve`` on 127.0.0.1 and a free port; SIGTERM it on exit."""
    token = add_token(data)
    command: list[str | Path] = [
        HEALTHLOG,
        "serve",
        "--data",
        data.path,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors)
    try:
        yield Server(process, _announced_url(process, log), token)
    finally:
        stop(process)


def start_announcing(command: list[str | Path], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process that prints ``... serving on URL ...`` first; return it and URL."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors)
    try:
        return process, _announced_url(process, log)
    except BaseException:
        stop(process)
        raise


def _announced_url(process: subprocess.Popen[bytes], log: Path) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_LIMIT_S)
    line = process.stdout.readline().decode() if ready else ""
    if "serving on " not in line:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the server did not start: {line!r}\n{tail}")
    return line.split("serving on ", 1)[1].split()[0]


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process, wait (bounded) and kill it if it is still there."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_LIMIT_S)
    if process.stdout is not None:
        process.stdout.close()


@dataclass(frozen=True)
class Row:
    benchmark: str
    figure: str
    floor: str
    ratio: str
    bound: str
    verdict: str


def judge(
    value: float, *, bound: float | None = None, goal: float | None = None, higher: bool = False
) -> str:
    """``FAIL`` when the bound is missed, ``goal`` when the goal is met too, else ``ok``.

    ``higher`` says that higher values are better (bounds and goals are minimums).
    A row with a goal and no bound is ``goal`` or ``below goal``.
    """

    def within(limit: float) -> bool:
        return value >= limit if higher else value <= limit

    if bound is not None and not within(bound):
        return "FAIL"
    if goal is not None and not within(goal):
        return "ok" if bound is not None else "below goal"
    return "goal" if goal is not None else "ok"


HEADER = "| benchmark | figure | floor | ratio | bound | verdict |"


def print_rows(rows: list[Row]) -> None:
    print()
    print(HEADER)
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.benchmark} | {row.figure} | {row.floor} | {row.ratio} | {row.bound} |"
            f" {row.verdict} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    _sample_tree(int(sys.argv[1]), float(sys.argv[2]))
