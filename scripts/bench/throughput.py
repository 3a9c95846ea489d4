"""Durable small-delivery intake throughput against a hello-world quart-trio route.

Both servers are separate processes on 127.0.0.1 behind the same hypercorn (trio worker, the
service's own hypercorn settings): the real ``healthlog serve`` on a fresh data directory,
and the hello-world app below (it reads the body and answers a small JSON document). The same
client (httpx on trio, ``CONCURRENCY`` tasks over as many keep-alive connections) sends the same
``REQUESTS`` 1 KB bodies to ``POST /v1/deliveries`` of each, after ``WARMUP`` requests that are
not counted. healthlog answers each only once the delivery is journaled and fsync'd, and folds
them meanwhile, as in service. Runs alternate (hello, healthlog) ``REPEATS`` times; best of
each. Bound: healthlog at least 50% of the hello-world rate.
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path

import common
import httpx
import trio
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio

from healthlog.config import ServeConfig
from healthlog.storage.datadir import DataDir
from transport.serve import hypercorn_config

REQUESTS = 2000
WARMUP = 100
CONCURRENCY = 8
REPEATS = 3
BOUND = 0.5
CLIENT_TIMEOUT_S = 60.0
RUN_LIMIT_S = 300.0


def hello_app() -> QuartTrio:
    app = QuartTrio("hello")

    @app.post("/v1/deliveries")
    async def hello() -> Response:
        body = await request.get_data(cache=False)
        return Response(b'{"ok":true,"bytes":%d}' % len(body), content_type="application/json")

    return app


async def serve_hello() -> None:
    async with trio.open_nursery() as nursery:
        config = hypercorn_config(ServeConfig(port=0))
        binds = await nursery.start(functools.partial(hypercorn_serve, hello_app(), config))
        print(f"hello serving on {binds[0]}", flush=True)


async def drive(url: str, headers: dict[str, str], bodies: list[bytes]) -> float:
    """Requests per second over ``bodies[WARMUP:]`` with ``CONCURRENCY`` tasks."""
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=CLIENT_TIMEOUT_S
    ) as client:

        async def run(batch: list[bytes]) -> float:
            queue = iter(batch)

            async def worker() -> None:
                for body in queue:
                    response = await client.post("/v1/deliveries", content=body)
                    if response.status_code != 200:
                        raise RuntimeError(f"{url} answered {response.status_code}")

            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(CONCURRENCY):
                    nursery.start_soon(worker)
            return len(batch) / (time.perf_counter() - started)

        with trio.fail_after(RUN_LIMIT_S):
            await run(bodies[:WARMUP])
            return await run(bodies[WARMUP:])


def measure_hello(bodies: list[bytes], work: Path) -> float:
    command: list[str | Path] = [sys.executable, __file__, "hello"]
    process, url = common.start_announcing(command, work / "hello.log")
    try:
        return trio.run(drive, url, {}, bodies)
    finally:
        common.stop(process)


def measure_healthlog(bodies: list[bytes], work: Path) -> float:
    with common.serving(DataDir(work / "data"), work / "serve.log") as server:
        return trio.run(drive, server.url, server.auth, bodies)


def main() -> None:
    bodies = [common.small_body(n) for n in range(WARMUP + REQUESTS)]
    size = sum(map(len, bodies)) / len(bodies)
    print(
        f"throughput: {REQUESTS} requests (+{WARMUP} warm-up) of {size:.0f} bytes on average,"
        f" concurrency {CONCURRENCY}, best of {REPEATS}"
    )
    hello, healthlog = [], []
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp:
        for n in range(REPEATS):
            hello.append(measure_hello(bodies, Path(tmp) / f"hello{n}"))
            healthlog.append(measure_healthlog(bodies, Path(tmp) / f"healthlog{n}"))
            print(f"  run {n}: hello {hello[-1]:.0f} req/s, healthlog {healthlog[-1]:.0f} req/s")
    figure, floor = max(healthlog), max(hello)
    common.print_rows(
        [
            common.Row(
                "durable 1 KB intake throughput",
                f"{figure:.0f} req/s",
                f"{floor:.0f} req/s (hello world)",
                f"{figure / floor:.2f}",
                f">= {BOUND}",
                common.judge(figure / floor, bound=BOUND, higher=True),
            )
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["hello"]:
        trio.run(serve_hello)
    else:
        main()
