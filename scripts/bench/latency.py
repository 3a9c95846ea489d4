"""Latency of 1 KB deliveries while the 62 MiB delivery folds, on a real ``healthlog serve``.

The floor is the same measurement on the idle service: ``IDLE_POSTS`` sequential 1 KB POSTs
before anything large arrives. Then the 62 MiB body is posted and, from its 200 on, 1 KB
deliveries are posted one after the other (one client, keep-alive), each timed until its 200,
until ``GET /v1/deliveries/{id}`` of the large one says it is folded (checked every
``CHECK_EVERY_S``; at most ``MAX_POSTS`` posts or ``LIMIT_S`` seconds, and a fold that has not
finished by then fails the row). Bound: p99 at most 50 ms. The serve log is searched for lost
fold leases, which cancel the fold in flight. The run also reports the peak RSS of the serving
process and of its fold worker process(es), each against the same bound as the fold benchmark
(3 times the body, goal 2), and the peak of their sum: the service's memory, process and
children together, sampled every ``TREE_SAMPLE_S`` from the large POST until it is folded
(reported; the issue bounds the serving process).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import common
import httpx

from healthlog.storage.datadir import DataDir

IDLE_POSTS = 300
MAX_POSTS = 50_000
LIMIT_S = 150.0
CHECK_EVERY_S = 0.25
CLIENT_TIMEOUT_S = 300.0
P99_BOUND_MS = 50.0
RSS_BOUND = 3.0
RSS_GOAL = 2.0
TREE_SAMPLE_S = 0.005


def post_small(client: httpx.Client, server: common.Server, n: int) -> float:
    """Milliseconds until the 200 of the ``n``-th small delivery."""
    body = common.small_body(n)
    started = time.perf_counter()
    response = client.post("/v1/deliveries", content=body, headers=server.auth)
    millis = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"small delivery answered {response.status_code}")
    return millis


def folded(client: httpx.Client, server: common.Server, delivery_id: int) -> bool:
    response = client.get(f"/v1/deliveries/{delivery_id}", headers=server.auth)
    response.raise_for_status()
    return bool(response.json()["status"] != "pending")


def summary(millis: list[float]) -> str:
    return (
        f"p50 {common.percentile(millis, 0.5):.1f} ms, p99 {common.percentile(millis, 0.99):.1f}"
        f" ms, max {max(millis):.1f} ms, n={len(millis)}"
    )


def worker_peaks_now(pid: int, peaks: dict[int, int]) -> None:
    """Add the peak RSS of each child of ``pid`` to ``peaks``, by child: read while the fold
    runs, since a worker ends after a large fold (RUN-59) and a reading after it would find
    only its successor."""
    try:
        found = common.children(pid)
    except FileNotFoundError:
        return
    for child in found:
        try:
            peaks[child] = max(peaks.get(child, 0), common.memory(child)["VmHWM"])
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue


def main() -> None:
    body = common.large_body()
    size = len(body)
    print(f"latency: body {common.mib(size)}, 1 KB deliveries during its fold")
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp:
        work = Path(tmp)
        with (
            common.serving(DataDir(work / "data"), work / "serve.log") as server,
            httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client,
        ):
            idle = [post_small(client, server, n) for n in range(IDLE_POSTS)]
            print(f"  idle: {summary(idle)}")
            baseline = common.memory(server.process.pid)["VmRSS"]
            with common.tree_rss_peak(server.process.pid, TREE_SAMPLE_S) as tree_peak:
                started = time.perf_counter()
                response = client.post("/v1/deliveries", content=body, headers=server.auth)
                response.raise_for_status()
                big_id = response.json()["delivery_id"]
                accepted = time.perf_counter()
                busy: list[float] = []
                check_at = accepted + CHECK_EVERY_S
                done = False
                peaks: dict[int, int] = {}
                while len(busy) < MAX_POSTS and time.perf_counter() - accepted < LIMIT_S:
                    busy.append(post_small(client, server, IDLE_POSTS + len(busy)))
                    if time.perf_counter() >= check_at:
                        worker_peaks_now(server.process.pid, peaks)
                        done = folded(client, server, big_id)
                        if done:
                            break
                        check_at = time.perf_counter() + CHECK_EVERY_S
                waited = time.perf_counter() - accepted
            serve_peak = common.memory(server.process.pid)["VmHWM"]
            worker_peaks_now(server.process.pid, peaks)
            worker_peaks = list(peaks.values())
        losses = (work / "serve.log").read_text(errors="replace").count("fold lease lost")
    worker_peak = max(worker_peaks, default=0)
    fate = f"folded {waited:.1f} s after it" if done else f"NOT folded after {waited:.1f} s"
    print(f"  large POST until 200 {accepted - started:.2f} s, {fate}; fold lease lost {losses}x")
    print(f"  during the fold: {summary(busy)}")
    print(
        f"  serving process RSS before the large POST {common.mib(baseline)};"
        f" peak RSS: serving process {common.mib(serve_peak)}, fold worker(s)"
        f" {', '.join(common.mib(p) for p in worker_peaks) or 'none'}"
    )
    p99, idle_p99 = common.percentile(busy, 0.99), common.percentile(idle, 0.99)
    figure = (
        f"p99 {p99:.1f} ms (p50 {common.percentile(busy, 0.5):.1f}, max {max(busy):.1f},"
        f" n={len(busy)})"
    )
    if losses:
        figure += f"; fold lease lost {losses}x"
    common.print_rows(
        [
            common.Row(
                "1 KB p99 during 62 MiB fold",
                figure if done else f"{figure}; fold never finished",
                f"idle p99 {idle_p99:.1f} ms",
                f"{p99 / idle_p99:.2f}x",
                f"p99 <= {P99_BOUND_MS:.0f} ms",
                common.judge(p99, bound=P99_BOUND_MS) if done else "FAIL",
            ),
            common.Row(
                "serving process peak RSS",
                f"{common.mib(serve_peak)} (baseline {common.mib(baseline)})",
                f"body {common.mib(size)}",
                f"{serve_peak / size:.2f}x body",
                f"<= {RSS_BOUND}x body (goal {RSS_GOAL}x)",
                common.judge(serve_peak / size, bound=RSS_BOUND, goal=RSS_GOAL),
            ),
            common.Row(
                "service peak RSS (process and children, sampled)",
                f"{common.mib(tree_peak[0])} (every {TREE_SAMPLE_S * 1000:.0f} ms)",
                f"body {common.mib(size)}",
                f"{tree_peak[0] / size:.2f}x body",
                "reported",
                "",
            ),
            common.Row(
                "fold worker peak RSS",
                common.mib(worker_peak) if done else "- (fold never finished, worker restarted)",
                f"body {common.mib(size)}",
                f"{worker_peak / size:.2f}x body" if done else "-",
                f"<= {RSS_BOUND}x body (goal {RSS_GOAL}x)",
                common.judge(worker_peak / size, bound=RSS_BOUND, goal=RSS_GOAL) if done else "n/a",
            ),
        ]
    )


if __name__ == "__main__":
    main()
