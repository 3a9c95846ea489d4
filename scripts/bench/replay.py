"""Replay: events per second from cursor 0 to one follower, against a bare websocket reader.

``DAYS`` deliveries of one day of minute-level points each (72 hourly objects apiece, so 73
events: one ``object.changed`` per object and one ``delivery.folded``) are journaled and folded
in this process (``run_pass``), then the real ``healthlog serve`` is started on that data
directory. The figure is ``Follower(..., until_caught_up=True).run()`` from cursor 0 into an
empty replica (applying every event); the floor is a bare websocket reader on the same stream
that only counts frames until the head. Runs alternate ``REPEATS`` times; best of each.
Goal: at least 20,000 events per second to the follower.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import common
import trio
import trio_websocket

from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery
from healthlog.storage.passes import run_pass
from healthlog.storage.replica import Replica
from transport.follow import MAX_MESSAGE_BYTES, Endpoints, Follower

DAYS = 281
BATCH = 16
REPEATS = 2
GOAL = 20_000
RUN_LIMIT_S = 300.0
LEASE_TTL_US = 3600 * 1_000_000


def prepare(data: DataDir) -> int:
    """Journal and fold the deliveries; return the stream head."""
    with data.open_journal() as journal, data.open_store() as store:
        for first in range(0, DAYS, BATCH):
            journal.append_many(
                [
                    NewDelivery(body=common.day_body(n), client="bench")
                    for n in range(first, min(DAYS, first + BATCH))
                ]
            )
        epoch = store.acquire_lease("bench", now=time.time_ns() // 1000, ttl=LEASE_TTL_US)
        assert epoch is not None
        folding = run_pass(journal, store, epoch)
        store.release_lease("bench", epoch)
        if not folding.reached_end:
            raise RuntimeError(f"folding stopped: {folding.stopped_because}")
        return store.event_window()[1]


async def bare(server: common.Server, head: int) -> float:
    """Seconds to receive every frame up to the head, counting them and nothing else."""
    url = f"ws://127.0.0.1:{server.port}/v1/stream?after=0"
    headers = [(b"authorization", f"Bearer {server.token}".encode())]
    with trio.fail_after(RUN_LIMIT_S):
        started = time.perf_counter()
        async with trio_websocket.open_websocket_url(
            url, extra_headers=headers, max_message_size=MAX_MESSAGE_BYTES
        ) as ws:
            for _ in range(head):
                await ws.get_message()
        return time.perf_counter() - started


async def follow(server: common.Server, replica: Replica) -> float:
    """Seconds for a follower to catch up from cursor 0 into the empty ``replica``."""
    follower = Follower(Endpoints.parse(server.url), server.token, replica, until_caught_up=True)
    with trio.fail_after(RUN_LIMIT_S):
        started = time.perf_counter()
        await follower.run()
        return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-") as tmp:
        work = Path(tmp)
        data = DataDir(work / "data")
        started = time.perf_counter()
        head = prepare(data)
        print(
            f"replay: {DAYS} deliveries journaled and folded in"
            f" {time.perf_counter() - started:.1f} s, stream head {head}, best of {REPEATS}"
        )
        followers, floors = [], []
        with common.serving(data, work / "serve.log") as server:
            for n in range(REPEATS):
                floors.append(head / trio.run(bare, server, head))
                with Replica(work / f"replica{n}") as replica:
                    followers.append(head / trio.run(follow, server, replica))
                    cursor = replica.binding().cursor
                if cursor != head:
                    raise RuntimeError(f"the replica stopped at {cursor}, not at {head}")
                print(
                    f"  run {n}: follower {followers[-1]:.0f} events/s,"
                    f" bare reader {floors[-1]:.0f} frames/s"
                )
    figure, floor = max(followers), max(floors)
    common.print_rows(
        [
            common.Row(
                "replay to one follower",
                f"{figure:.0f} events/s ({head} events)",
                f"{floor:.0f} frames/s (bare reader)",
                f"{figure / floor:.2f}",
                f"goal >= {GOAL} events/s",
                common.judge(figure, goal=GOAL, higher=True),
            )
        ]
    )


if __name__ == "__main__":
    main()
