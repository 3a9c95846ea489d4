"""Graceful shutdown of ``healthlog serve`` with uploads in flight (specs/service.md,
SERVE-27 and SERVE-28): in this trio run through the shutdown event, and as a real process
through SIGTERM."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _baseline import severe_lines
from _cli_bodies import body, metric, point
from _service_helpers import CLIENT_TIMEOUT_S, Drip, post_stream, read_journal, serving

from healthlog.config import ServeConfig
from healthlog.storage.datadir import DataDir
from transport.serve import serve

MiB = 2**20
CHUNKS = 10
STOP_AFTER_S = 0.15
GRACEFUL_S = 1.0
PROCESS_GRACEFUL_S = 2.0
PROCESS_START_LIMIT_S = 30.0
EXIT_MARGIN_S = 30.0
SOURCE = "Anna\u2019s distinctive Watch"
URL_LINE = re.compile(rb"healthlog serving on (http://\S+) ")
LOG_LINE = re.compile(r'time=\S+ level=[A-Z]+ logger=\S+ msg=".*"')


def upload(n: int, pause_s: float) -> Drip:
    """Delivery ``n`` in ``CHUNKS`` pieces with ``pause_s`` between them."""
    content = body(
        metric(
            "heart_rate",
            "count/min",
            point(f"2024-03-01 10:{n:02d}:00 +0000", qty=60 + n, source=SOURCE),
        )
    )
    step = -(-len(content) // CHUNKS)
    return Drip([content[i : i + step] for i in range(0, len(content), step)], pause_s=pause_s)


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def journal_and_lease(data: DataDir) -> tuple[set[str], str | None]:
    """The sha256 of every journaled delivery, and the fold lease holder."""
    with data.open_store() as store:
        holder = store.lease().holder
    return {meta.sha256 for meta in read_journal(data)}, holder


async def test_shutdown_with_uploads_in_flight(tmp_path: Path) -> None:
    """SERVE-27: each upload is answered 200 and journaled, or fails (503 `SHUTTING_DOWN`, or
    the connection closed) and is not journaled."""
    uploads = [upload(n, pause_s) for n, pause_s in enumerate((0.03, 0.05, 0.3, 0.5, 0.8))]
    outcomes: dict[int, tuple[int | None, float]] = {}

    async def send(client: httpx.AsyncClient, n: int, headers: dict[str, str]) -> None:
        try:
            response = await post_stream(client, uploads[n], headers)
        except httpx.TransportError:
            outcomes[n] = (None, trio.current_time())
        else:
            if response.status_code == 200:
                assert response.json()["sha256"] == sha256(uploads[n].body)
            if response.status_code == 503:
                assert response.json() == {"error": "SHUTTING_DOWN"}
                assert response.headers["retry-after"] == "5"
            outcomes[n] = (response.status_code, trio.current_time())

    data = DataDir(tmp_path / "data")
    async with (
        serving(data.path, graceful_timeout_s=GRACEFUL_S) as service,
        trio.open_nursery() as nursery,
    ):
        for n in range(len(uploads)):
            nursery.start_soon(send, service.client, n, service.auth)
        await trio.sleep(STOP_AFTER_S)
        stopped_at = trio.current_time()
        service.stop.set()
    journaled, holder = journal_and_lease(data)
    print({n: status for n, (status, _) in sorted(outcomes.items())})
    for n, (status, _) in outcomes.items():
        assert status in (200, 503, None), (n, status)
        assert (sha256(uploads[n].body) in journaled) == (status == 200), n
    answered = [done for status, done in outcomes.values() if status == 200]
    assert len(outcomes) == len(uploads)
    assert answered
    assert any(done > stopped_at for done in answered)
    assert len(answered) < len(uploads)
    assert len(journaled) == len(answered)
    assert holder is None


async def test_a_delivery_committed_after_the_graceful_timeout_is_answered_serve_36(
    tmp_path: Path,
) -> None:
    """SERVE-36: a whole delivery waits for the write-locked journal while the service shuts
    down with a 1 s graceful timeout; the lock goes 2 s later, before the journal's busy
    timeout: the delivery is journaled once and its client gets the 200."""
    data = DataDir(tmp_path / "data")
    content = upload(0, 0.0).body
    answers: list[int] = []
    async with serving(data.path, graceful_timeout_s=GRACEFUL_S) as service:
        with closing(sqlite3.connect(data.journal_path, isolation_level=None)) as lock:
            lock.execute("BEGIN IMMEDIATE")
            async with trio.open_nursery() as nursery:

                async def post() -> None:
                    answers.append((await service.post(content)).status_code)

                nursery.start_soon(post)
                await trio.sleep(GRACEFUL_S)
                service.stop.set()
                await trio.sleep(2 * GRACEFUL_S)
                lock.execute("ROLLBACK")
    assert answers == [200]
    assert [meta.sha256 for meta in read_journal(data)] == [sha256(content)]


async def read_url(stdout: trio.abc.ReceiveStream) -> tuple[str, bytes]:
    """The base URL from the process's first line, and what else was read with it."""
    seen = b""
    while (found := URL_LINE.search(seen)) is None:
        chunk = await stdout.receive_some()
        assert chunk, seen
        seen += chunk
    return found.group(1).decode(), seen


async def drain(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    async for chunk in stream:
        into += chunk


async def start_serve(
    nursery: trio.Nursery,
    command: list[Any],
    env: dict[str, str],
    out: bytearray,
    err: bytearray,
    **popen: Any,
) -> tuple[trio.Process, str]:
    """Start ``healthlog serve`` as a process in ``nursery``, its output drained into ``out``
    and ``err``: the process and the base URL it serves on, once it says so."""
    process: trio.Process = await nursery.start(
        partial(
            trio.run_process,
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            check=False,
            **popen,
        )
    )
    assert process.stdout is not None
    assert process.stderr is not None
    nursery.start_soon(drain, process.stderr, err)
    with trio.fail_after(PROCESS_START_LIMIT_S):
        url, first = await read_url(process.stdout)
    out += first
    nursery.start_soon(drain, process.stdout, out)
    return process, url


async def test_serve_process_stops_on_sigterm(tmp_path: Path) -> None:
    """SERVE-28: `healthlog serve --port 0` as a process: layered settings, SIGTERM, exit 0."""
    data = tmp_path / "data"
    cli = [sys.executable, "-m", "healthlog.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    made = await trio.run_process(
        [*cli, "token", "add", "phone", "--data", data], env=env, capture_stdout=True
    )
    token = made.stdout.decode().strip()
    auth = {"Authorization": f"Bearer {token}"}
    (data / "healthlog.toml").write_text(
        "[serve]\nmax_body_mib = 0.5\nlog_format = 'json'\n"
        f"graceful_timeout_s = {PROCESS_GRACEFUL_S}\n"
    )
    env |= {"HEALTHLOG_MAX_BODY_MIB": "1", "HEALTHLOG_LOG_FORMAT": "kv"}
    serve = [*cli, "serve", "--data", data, "--port", "0", "--max-body-mib", "2"]
    out, err = bytearray(), bytearray()
    async with trio.open_nursery() as nursery:
        process, url = await start_serve(nursery, serve, env, out, err)
        quick, slow = upload(1, 0.05), upload(2, 1.0)
        answers: dict[str, int | None] = {}
        refusals: dict[str, tuple[Any, str | None]] = {}

        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:

            async def send(name: str, drip: Drip) -> None:
                try:
                    response = await post_stream(client, drip, auth)
                except httpx.TransportError:
                    answers[name] = None
                else:
                    answers[name] = response.status_code
                    if response.status_code == 503:
                        refusals[name] = (response.json(), response.headers.get("retry-after"))

            under_flag = b"x" * (3 * MiB // 2)
            accepted = await client.post("/v1/deliveries", content=under_flag, headers=auth)
            assert accepted.status_code == 200
            over = {**auth, "Connection": "close", "Content-Length": str(5 * MiB // 2)}
            over_flag = await post_stream(client, Drip([b"x" * (5 * MiB // 2)]), over)
            assert over_flag.status_code == 413
            async with trio.open_nursery() as uploads:
                uploads.start_soon(send, "quick", quick)
                uploads.start_soon(send, "slow", slow)
                await trio.sleep(STOP_AFTER_S)
                process.send_signal(signal.SIGTERM)
                signalled_at = trio.current_time()
                with trio.fail_after(PROCESS_GRACEFUL_S + EXIT_MARGIN_S):
                    await process.wait()
                exited_after = trio.current_time() - signalled_at
    print(f"serve exited {exited_after:.2f} s after SIGTERM; uploads {answers}")
    assert process.returncode == 0, err.decode()
    assert answers == {"quick": 200, "slow": 503}
    assert refusals == {"slow": ({"error": "SHUTTING_DOWN"}, "5")}
    journaled, holder = journal_and_lease(DataDir(data))
    assert journaled == {sha256(under_flag), sha256(quick.body)}
    assert holder is None
    log = err.decode()
    lines = log.splitlines()
    assert lines
    assert all(LOG_LINE.fullmatch(line) for line in lines), log
    for secret in (token, SOURCE):
        assert secret not in log
        assert secret.encode() not in out


def _children(pid: int) -> set[int]:
    return {
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    }


async def with_a_token(data: Path) -> tuple[list[Any], dict[str, str], dict[str, str]]:
    """The command line of healthlog as a process, an environment without ``HEALTHLOG_*``
    settings, and the headers of a client token made in ``data`` with ``token add``."""
    cli: list[Any] = [sys.executable, "-m", "healthlog.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    made = await trio.run_process(
        [*cli, "token", "add", "phone", "--data", data], env=env, capture_stdout=True
    )
    return cli, env, {"Authorization": f"Bearer {made.stdout.decode().strip()}"}


async def test_serve_stops_cleanly_when_its_whole_process_group_gets_sigterm_serve_40(
    tmp_path: Path,
) -> None:
    """SERVE-40: `healthlog serve` in a process group of its own, its fold worker running,
    stopped as systemd stops a service (SIGTERM to the whole group): it exits 0, logs nothing
    at ERROR or above, and leaves no worker process behind."""
    data = tmp_path / "data"
    cli, env, auth = await with_a_token(data)
    delivery = body(metric("heart_rate", "count/min", point("2024-03-01 10:00:00 +0000", qty=61)))
    out, err = bytearray(), bytearray()
    async with trio.open_nursery() as nursery:
        serve = [*cli, "serve", "--data", data, "--port", "0"]
        process, url = await start_serve(nursery, serve, env, out, err, start_new_session=True)
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            posted = await client.post(
                "/v1/deliveries",
                content=delivery,
                headers={**auth, "automation-aggregation": "minutes"},
            )
            assert posted.status_code == 200
            with trio.fail_after(PROCESS_START_LIMIT_S):
                while (await client.get("/v1/deliveries/1", headers=auth)).json()[
                    "status"
                ] == "pending":
                    await trio.sleep(0.05)
        workers = _children(process.pid)
        assert workers
        os.killpg(process.pid, signal.SIGTERM)
        with trio.fail_after(EXIT_MARGIN_S):
            await process.wait()
    assert process.returncode == 0, err.decode()[-3000:]
    assert severe_lines(err.decode()) == []
    with trio.fail_after(EXIT_MARGIN_S):
        while any(Path(f"/proc/{worker}").exists() for worker in workers):
            await trio.sleep(0.05)


async def test_a_stop_signal_delivered_twice_stops_cleanly_serve_45(tmp_path: Path) -> None:
    """SERVE-45: SIGINT delivered twice a moment apart, as `timeout -s INT` delivers it (to the
    service, then to its process group): the service stops as at one signal, exit 0, without
    `healthlog: interrupted` and without an ERROR."""
    cli = [sys.executable, "-m", "healthlog.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    out, err = bytearray(), bytearray()
    async with trio.open_nursery() as nursery:
        serve = [*cli, "serve", "--data", tmp_path / "data", "--port", "0"]
        process, _ = await start_serve(nursery, serve, env, out, err, start_new_session=True)
        process.send_signal(signal.SIGINT)
        await trio.sleep(0.02)
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        with trio.fail_after(EXIT_MARGIN_S):
            await process.wait()
    assert process.returncode == 0, (process.returncode, err.decode()[-3000:])
    assert "healthlog: interrupted" not in err.decode()
    assert severe_lines(err.decode()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
async def test_a_stop_signal_queued_as_the_stop_ends_is_not_delivered_again_run_58(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """RUN-58: the same stop signal twice, the second 0 to 40 ms after the first (as `timeout`
    delivers it to the service and then to its process group): each of five services stops as
    at one signal, exit 0, without `healthlog: interrupted`; a second signal that came as the
    stop ended, still queued when the service stopped watching for signals, is not delivered
    again (SIGINT's then raised KeyboardInterrupt, exit 130; SIGTERM's killed the process,
    -15)."""
    cli = [sys.executable, "-m", "healthlog.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    for n, gap_s in enumerate((0.0, 0.01, 0.02, 0.03, 0.04)):
        out, err = bytearray(), bytearray()
        async with trio.open_nursery() as nursery:
            serve = [*cli, "serve", "--data", tmp_path / f"data{n}", "--port", "0"]
            process, _ = await start_serve(nursery, serve, env, out, err, start_new_session=True)
            process.send_signal(signum)
            await trio.sleep(gap_s)
            if process.returncode is None:
                process.send_signal(signum)
            with trio.fail_after(EXIT_MARGIN_S):
                await process.wait()
        assert process.returncode == 0, (gap_s, process.returncode, err.decode()[-3000:])
        assert "healthlog: interrupted" not in err.decode()


async def test_a_stop_signal_repeated_later_stops_at_once_serve_45(tmp_path: Path) -> None:
    """SERVE-45: while the stop still runs (an upload that sends nothing holds it for up to
    `graceful_timeout_s`, 20 s), SIGINT again more than a second after the first is someone
    insisting: the service stops at once, `healthlog: interrupted`, exit 130."""
    data = tmp_path / "data"
    cli, env, auth = await with_a_token(data)
    out, err = bytearray(), bytearray()
    held = Drip([b'{"data": ', b"{}}"], gate=trio.Event())
    async with trio.open_nursery() as nursery:
        serve = [*cli, "serve", "--data", data, "--port", "0"]
        process, url = await start_serve(nursery, serve, env, out, err, start_new_session=True)
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            uploading = trio.CancelScope()

            async def send() -> None:
                with uploading, contextlib.suppress(httpx.TransportError):
                    await post_stream(client, held, auth)

            nursery.start_soon(send)
            await held.held.wait()
            process.send_signal(signal.SIGINT)
            await trio.sleep(1.5)
            assert process.returncode is None, "the stop did not wait for the upload"
            process.send_signal(signal.SIGINT)
            with trio.fail_after(EXIT_MARGIN_S / 3):
                await process.wait()
            # The upload's body waits for a gate nobody opens.
            uploading.cancel()
    assert process.returncode == 130, err.decode()[-3000:]
    assert err.decode().splitlines()[-1] == "healthlog: interrupted"


class _StopOnListening(logging.Handler):
    """Sets ``stop`` as hypercorn says where it listens, the moment before it reports that it
    listens: in the same step, as a signal landing there would."""

    def __init__(self, stop: trio.Event) -> None:
        super().__init__(logging.INFO)
        self.stop = stop

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Running on "):
            self.stop.set()


async def test_a_stop_as_serve_begins_to_listen_stops_it_cleanly_run_179(tmp_path: Path) -> None:
    """RUN-179: a stop that comes as hypercorn begins to listen, before ``serve`` has said
    where, ends ``serve`` cleanly in each of 12 starts: it reports its URL (it listened) and
    stops as it does once listening, no exception. (Before, trio ran the service's own watch of
    the stop before or after the task reporting the URL, in either order: in about half the
    starts the watch took ``serve`` for one still starting and cancelled it, the URL already
    reported, and ``StoppedBeforeListening`` escaped after it, where `healthlog serve` had
    printed `serving on`.)"""
    config = ServeConfig(port=0, wake_period_s=0.2)
    hypercorn_log = logging.getLogger("hypercorn.error")
    level = hypercorn_log.level
    hypercorn_log.setLevel(logging.INFO)
    try:
        for n in range(12):
            stop = trio.Event()
            watch = _StopOnListening(stop)
            hypercorn_log.addHandler(watch)
            try:
                with trio.fail_after(CLIENT_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        url = await nursery.start(
                            partial(serve, DataDir(tmp_path / "data"), config, shutdown=stop)
                        )
            finally:
                hypercorn_log.removeHandler(watch)
            assert stop.is_set(), n
            assert url.startswith("http://127.0.0.1:"), n
    finally:
        hypercorn_log.setLevel(level)
