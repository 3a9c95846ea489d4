"""What a ``healthlog follow`` run for months meets (specs/stream.md, STREAM-117 to STREAM-124):
refusals asking it to wait longer than its backoff, said as waited (STREAM-117).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing
from _stream_helpers import listen, read_head

from healthlog.storage.replica import Replica
from transport.follow import Endpoints, Follower


def unavailable(retry_after_s: int) -> bytes:
    """A whole HTTP answer 503 asking to come back in ``retry_after_s`` (a front's, or the
    service's for a snapshot it cannot build)."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: %d\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}" % retry_after_s
    )


@pytest.mark.parametrize(
    ("met", "asked", "warning"),
    [
        pytest.param(
            False,
            120,
            "follow: the service cannot be reached (ConnectionLost: /v1/status answered 503);"
            " retrying in 120 s, as the server asks",
            id="new",
        ),
        pytest.param(
            True,
            60,
            "follow: no progress for a while, the last connection lost (ConnectionLost:"
            " /v1/status answered 503); retrying in 60 s, as the server asks",
            id="met",
        ),
    ],
)
async def test_the_warning_says_the_wait_a_retry_after_asks_stream_117(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    met: bool,
    asked: int,
    warning: str,
) -> None:
    """STREAM-117: a follower every request of which is answered 503 with a ``Retry-After``
    longer than its backoff's cap (a front's, or a service that cannot build the snapshot) waits
    what it asks, and its one WARNING says that wait, not the backoff's 30 s: at its first
    failure for a replica that never met its service, once the backoff has reached its cap for
    one that has."""
    # The clock jumps only once nothing has run for 0.2 s: the front answers in the same run.
    autojump_clock.autojump_threshold = 0.2
    answer = unavailable(asked)

    async def refuse(client: trio.SocketStream) -> None:
        async with client:
            await read_head(client)
            await client.send_all(answer)

    with (
        Replica(tmp_path / "replica") as replica,
        caplog.at_level(logging.INFO, "healthlog.follow"),
    ):
        if met:
            replica.bind("a1b2c3", "S2V5")
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, refuse)
            follower = Follower(Endpoints.parse(f"http://127.0.0.1:{port}"), "hl_x", replica)
            with trio.move_on_after(10 * asked):
                await follower.run()
            nursery.cancel_scope.cancel()
    said = [r for r in caplog.records if r.name == "healthlog.follow"]
    assert [r.getMessage() for r in said if r.levelno >= logging.WARNING] == [warning]
    retries = {r.getMessage() for r in said if r.getMessage().startswith("follow: retrying")}
    assert retries == {
        f"follow: retrying in {asked:.1f} s, as the server asks (Retry-After: {asked} s)"
    }
