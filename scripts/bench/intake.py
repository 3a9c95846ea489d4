"""Intake of a 62 MiB delivery until its 200, against writing the same bytes to a file + fsync.

Each repetition starts a fresh ``healthlog serve`` (real process, 127.0.0.1) on an empty data
directory, warms the connection with a ``GET /v1/status`` and times one ``POST
/v1/deliveries`` of the body with httpx until the 200 (the delivery is then journaled and
fsync'd). The floor writes the same bytes to a new file in the same temporary directory and
fsyncs it. The median of ``REPEATS`` for both: a lone fsync that returns early (the virtual
disk's cache) made a best-of-three floor four times faster than its other repetitions. Bound:
at most 3.0 times the floor; goal 1.5.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import common
import httpx

from healthlog.storage.datadir import DataDir

REPEATS = 5
BOUND = 3.0
GOAL = 1.5
CLIENT_TIMEOUT_S = 300.0


def post_once(body: bytes, work: Path) -> tuple[float, int, int]:
    """Seconds until the 200 of one large POST, the server's RSS before and its peak RSS."""
    with (
        common.serving(DataDir(work / "data"), work / "serve.log") as server,
        httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client,
    ):
        client.get("/v1/status", headers=server.auth).raise_for_status()
        baseline = common.memory(server.process.pid)["VmRSS"]
        started = time.perf_counter()
        response = client.post("/v1/deliveries", content=body, headers=server.auth)
        seconds = time.perf_counter() - started
        if response.status_code != 200 or response.json()["bytes"] != len(body):
            raise RuntimeError(f"intake answered {response.status_code}: {response.text[:200]}")
        return seconds, baseline, common.memory(server.process.pid)["VmHWM"]


def write_once(body: bytes, path: Path) -> float:
    started = time.perf_counter()
    with path.open("wb") as out:
        out.write(body)
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - started


def main() -> None:
    body = common.large_body()
    print(f"intake: body {common.mib(len(body))} ({len(body)} bytes), median of {REPEATS}")
    posts, floors = [], []
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp:
        for n in range(REPEATS):
            seconds, baseline, peak = post_once(body, Path(tmp) / f"run{n}")
            floors.append(write_once(body, Path(tmp) / f"floor{n}.json"))
            posts.append(seconds)
            print(
                f"  run {n}: POST until 200 {seconds:.3f} s (serve RSS before"
                f" {common.mib(baseline)}, peak {common.mib(peak)}),"
                f" write+fsync {floors[-1]:.3f} s"
            )
    figure, floor = statistics.median(posts), statistics.median(floors)
    ratio = figure / floor
    common.print_rows(
        [
            common.Row(
                "intake 62 MiB until 200",
                f"{figure:.3f} s",
                f"{floor:.3f} s (write+fsync)",
                f"{ratio:.2f}x",
                f"<= {BOUND}x (goal {GOAL}x)",
                common.judge(ratio, bound=BOUND, goal=GOAL),
            )
        ]
    )


if __name__ == "__main__":
    main()
