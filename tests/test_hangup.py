"""The long-running commands as a NAS owner runs them from an SSH session (specs/runtime.md,
RUN-76 to RUN-79; specs/cli.md, CLI-167 to CLI-170): the session closes under them (a hangup,
SIGHUP), they run under ``nohup``, they are stopped by a signal to them alone, their stderr's
reader is gone, they are killed and started again.

The session is a real interactive ``bash`` on a pseudo-terminal of the test's: closing the
terminal's side the test holds is what an SSH logout, or a dropped connection, does to it."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from _baseline import severe_lines
from _cli_bodies import body, metric, point, write
from _namespaces import in_pid_namespace, kill_namespace
from _service_helpers import CLIENT_TIMEOUT_S, Drip, post_stream, serving
from _stream_helpers import acked, post_small, until_cursor

from actors.lease import LeaseActor
from healthlog.storage.datadir import DataDir
from healthlog.storage.rebuild import SCRATCH_PREFIX
from healthlog.storage.replica import REPLICA_FILE, Replica
from healthlog.storage.store import Lease

LIMIT_S = 60.0
POLL_S = 0.05
URL_LINE = re.compile(rb"healthlog serving on (http://\S+) ")


def healthlog(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "healthlog.cli", *map(os.fspath, args)]


def environment() -> dict[str, str]:
    """This environment without ``HEALTHLOG_*`` settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}


def add_token(data: Path) -> dict[str, str]:
    """The headers of a client token made in ``data`` with ``token add``."""
    made = subprocess.run(
        healthlog("token", "add", "phone", "--data", data),
        env=environment(),
        capture_output=True,
        check=True,
    )
    return {"Authorization": f"Bearer {made.stdout.decode().strip()}"}


def children(pid: int) -> set[int]:
    try:
        return {
            int(child)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        }
    except FileNotFoundError:
        return set()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def lease_holder(data: DataDir) -> str | None:
    with data.open_store() as store:
        return store.lease().holder


def _controlling_terminal() -> None:
    """In the shell's process, after ``setsid``: its stdin, the terminal, becomes the new
    session's controlling terminal, and SIGHUP is a hangup's, as a login shell starts with
    (whatever this test runs under: ``nohup`` would have it ignored)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextlib.contextmanager
def ssh_session(env: dict[str, str]) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """An interactive bash on a pseudo-terminal, as an SSH login gives one: the terminal's
    other side (closing it is the hangup) and the shell. Anything left of it is killed."""
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed to play an SSH session"
    master, slave = os.openpty()
    try:
        shell = subprocess.Popen(
            [bash, "--norc", "--noprofile", "-i"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
    finally:
        os.close(slave)
    try:
        yield master, shell
    finally:
        with contextlib.suppress(OSError):
            os.close(master)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def type_line(master: int, line: str) -> None:
    os.write(master, line.encode() + b"\n")


def read_until(master: int, pattern: re.Pattern[bytes]) -> re.Match[bytes]:
    """Read the terminal until ``pattern`` shows."""
    seen = b""
    deadline = time.monotonic() + LIMIT_S
    while (found := pattern.search(seen)) is None:
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        seen += os.read(master, 4096)
    return found


def wait_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + LIMIT_S
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(POLL_S)


async def folded(client: httpx.AsyncClient, auth: dict[str, str]) -> None:
    """Post one delivery and wait until the service has folded it (a fold worker then runs)."""
    delivery = body(metric("heart_rate", "count/min", point("2024-03-01 10:00:00 +0000", qty=61)))
    headers = {**auth, "automation-aggregation": "minutes"}
    posted = await client.post("/v1/deliveries", content=delivery, headers=headers)
    assert posted.status_code == 200
    delivery_id = posted.json()["delivery_id"]
    with trio.fail_after(LIMIT_S):
        while (await client.get(f"/v1/deliveries/{delivery_id}", headers=auth)).json()[
            "status"
        ] == "pending":
            await trio.sleep(POLL_S)


async def test_serve_stops_gracefully_when_its_ssh_session_closes_run_76(tmp_path: Path) -> None:
    """RUN-76: `healthlog serve 2>LOG`, run in the foreground of an interactive shell on a
    terminal, its fold worker running and an upload in flight, when the terminal hangs up (the
    SSH session closes): the service stops as on SIGTERM. The upload is answered 200, LOG says
    `stopping on SIGHUP` and nothing at ERROR, the fold lease is released and no fold worker is
    left. (Before, SIGHUP ended it at once: the upload's connection was cut, the lease stayed
    held, and a restart folded nothing for the lease's term, 15 s.)"""
    data = tmp_path / "data"
    log = tmp_path / "serve.log"
    auth = add_token(data)
    serve = shlex.join(healthlog("serve", "--data", data, "--port", "0"))
    gate = trio.Event()
    held = Drip([b'{"data": ', b"{}}"], gate=gate)
    answers: list[Any] = []
    with ssh_session(environment()) as (master, shell):
        type_line(master, f"{serve} 2>{shlex.quote(str(log))}")
        url = read_until(master, URL_LINE).group(1).decode()
        (service,) = children(shell.pid)
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            await folded(client, auth)
            workers = children(service) - {service}
            assert workers, "no fold worker runs"

            async def upload() -> None:
                try:
                    answers.append((await post_stream(client, held, auth)).status_code)
                except httpx.TransportError as exc:
                    answers.append(type(exc).__name__)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload)
                await held.held.wait()
                os.close(master)
                await trio.sleep(0.5)
                gate.set()
        await trio.to_thread.run_sync(wait_gone, {service, *workers})
    said = log.read_text()
    assert answers == [200], said[-3000:]
    assert "stopping on SIGHUP" in said, said[-3000:]
    assert severe_lines(said) == []
    assert lease_holder(DataDir(data)) is None


async def test_serve_under_nohup_outlives_its_ssh_session_run_77(tmp_path: Path) -> None:
    """RUN-77: `nohup healthlog serve >OUT 2>LOG &`, run from an interactive shell on a terminal,
    when the terminal hangs up: SIGHUP, ignored as it started, stays ignored, and the service
    serves on (`/healthz` 200, a delivery journaled) until it is stopped with SIGTERM."""
    data = tmp_path / "data"
    out, log = tmp_path / "serve.out", tmp_path / "serve.log"
    auth = add_token(data)
    serve = shlex.join(["nohup", *healthlog("serve", "--data", data, "--port", "0")])
    with ssh_session(environment()) as (master, shell):
        type_line(master, f"{serve} >{shlex.quote(str(out))} 2>{shlex.quote(str(log))} &")
        deadline = time.monotonic() + LIMIT_S
        while (found := URL_LINE.search(out.read_bytes() if out.exists() else b"")) is None:
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(POLL_S)
        (service,) = children(shell.pid)
        os.close(master)
        await trio.to_thread.run_sync(wait_gone, {shell.pid})
    try:
        async with httpx.AsyncClient(
            base_url=found.group(1).decode(), timeout=CLIENT_TIMEOUT_S
        ) as client:
            assert (await client.get("/healthz")).status_code == 200
            await folded(client, auth)
    finally:
        os.kill(service, signal.SIGTERM)
        await trio.to_thread.run_sync(wait_gone, {service})
    said = log.read_text()
    assert "stopping on SIGTERM" in said, said[-3000:]
    assert "SIGHUP" not in said


def _interrupted(returncode: int | None, err: bytes, signum: int, data: DataDir) -> None:
    """Asserts that a command stopped by ``signum`` exited ``128 + signum``, its last line
    `healthlog: interrupted`, with no traceback and its fold lease released."""
    said = err.decode()
    assert returncode == 128 + signum, said[-3000:]
    assert said.splitlines()[-1] == "healthlog: interrupted"
    assert "Traceback" not in said
    assert lease_holder(data) is None


def _one_folded(tmp_path: Path) -> tuple[DataDir, Path]:
    """A data directory with one delivery imported and folded, and the file it came from."""
    data = DataDir(tmp_path / "data")
    file = write(
        tmp_path / "a.json",
        body(metric("heart_rate", "count/min", point("2024-02-06 07:00:00 -0800"))),
    )
    subprocess.run(
        healthlog("import", "--aggregation", "minutes", "--data", data.path, file),
        env=environment(),
        capture_output=True,
        check=True,
    )
    return data, file


def _held_at(fault: str, seconds: float) -> dict[str, str]:
    """The environment of a command held for ``seconds`` at ``fault``'s first hit."""
    plan = {fault: {"hits": [1], "do": "delay", "seconds": seconds}}
    return {**environment(), "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}


def _first_fold_held(data: DataDir) -> bool:
    return lease_holder(data) is not None


def _rebuilding(data: DataDir) -> bool:
    return any(data.path.glob(f"{SCRATCH_PREFIX}*"))


@pytest.mark.parametrize(
    ("command", "fault", "underway"),
    [
        ("reindex", "rebuild.scratch", _rebuilding),
        ("verify", "rebuild.scratch", _rebuilding),
        ("import", "fold.begin", _first_fold_held),
    ],
)
def test_a_hangup_stops_a_long_command_as_sigterm_does_cli_167(
    tmp_path: Path, command: str, fault: str, underway: Any
) -> None:
    """CLI-167: `reindex`, `verify` (held in their rebuild by a delay at the fault point
    `rebuild.scratch`) and `import` (its fold held at `fold.begin`) get SIGHUP, as from the
    terminal they run in closing: each stops as on SIGTERM, exit 129 and the last line
    `healthlog: interrupted`, its fold lease released, its scratch store removed, and no worker
    process left. (Before, each died of the signal at once: the lease stayed held for its term,
    and a rebuild's scratch directory, a second store's size, stayed beside the store.)"""
    data, file = _one_folded(tmp_path)
    args = {"import": ["--aggregation", "minutes", file]}.get(command, [])
    with subprocess.Popen(
        healthlog(command, "--data", data.path, *args),
        stderr=subprocess.PIPE,
        env=_held_at(fault, 3),
        preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
    ) as running:
        workers: set[int] = set()
        deadline = time.monotonic() + LIMIT_S
        while not underway(data):
            assert running.poll() is None, running.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, f"{command} never got under way"
            workers |= children(running.pid)
            time.sleep(0.01)
        workers |= children(running.pid)
        running.send_signal(signal.SIGHUP)
        _, err = running.communicate(timeout=LIMIT_S)
    _interrupted(running.returncode, err, signal.SIGHUP, data)
    assert not _rebuilding(data)
    wait_gone(workers)


async def test_follow_whose_terminal_hangs_up_stops_cleanly_cli_168(tmp_path: Path) -> None:
    """CLI-168: `healthlog follow --subscriber backup` with its stdout and stderr on a terminal,
    following a service live: the terminal hangs up and the follower gets SIGHUP (as the shell
    it ran in signals its jobs). It stops as on SIGTERM: exit 0 after its last ACK, which the
    service stores for `backup` at the replica's cursor; its last line, which the closed
    terminal cannot take, is dropped. (Before, SIGHUP ended it at once, exit -1; and stopped by
    SIGTERM with its terminal gone, it exited 3, its last line's write failing, as if its
    replica could not be written.)"""
    async with serving(tmp_path / "server") as service:
        total = await post_small(service, 0, 5)
        directory = tmp_path / "replica"
        master, slave = os.openpty()
        command = [
            *healthlog("follow", "--url", service.url, "--replica", directory),
            *("--subscriber", "backup"),
        ]
        try:
            process = await trio.lowlevel.open_process(
                command,
                env={**environment(), "HEALTHLOG_TOKEN": service.token},
                stdin=subprocess.DEVNULL,
                stdout=slave,
                stderr=slave,
                preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
            )
        finally:
            os.close(slave)
        try:
            with trio.fail_after(LIMIT_S):
                while not (directory / REPLICA_FILE).exists():
                    await trio.sleep(POLL_S)
                with Replica(directory) as reading:
                    await until_cursor(reading, total)
            os.close(master)
            process.send_signal(signal.SIGHUP)
            with trio.fail_after(LIMIT_S):
                await process.wait()
        finally:
            with contextlib.suppress(OSError):
                os.close(master)
            if process.returncode is None:
                process.kill()
        assert process.returncode == 0
        await acked(service, "backup", total)


def descendants(pid: int) -> set[int]:
    found = children(pid)
    for child in list(found):
        found |= descendants(child)
    return found


def serving_child(pid: int) -> bool:
    """Whether a `healthlog serve` runs under ``pid``."""
    for child in descendants(pid):
        with contextlib.suppress(FileNotFoundError):
            if b"\0serve\0" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_chaos_stopped_by_a_signal_stops_its_services_cli_169(tmp_path: Path, signum: int) -> None:
    """CLI-169: `healthlog chaos`, a `healthlog serve` of its running, gets SIGTERM (a `kill`
    of its process alone, a CI runner's timeout) or SIGHUP (its terminal closed): it exits 143
    or 129 with `healthlog: interrupted`, having stopped every process it started, and its
    temporary directory is removed. (Before, it died at once, exit -15 or -1: its `serve`, with
    its fold worker, went on running for good, holding a port and a data directory in the
    temporary directory, which stayed.)"""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with subprocess.Popen(
        healthlog("chaos", "--runs", "3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**environment(), "TMPDIR": str(temporary)},
        preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
    ) as chaos:
        started: set[int] = set()
        try:
            deadline = time.monotonic() + LIMIT_S
            while not serving_child(chaos.pid):
                assert chaos.poll() is None, chaos.communicate()[1].decode()[-3000:]
                assert time.monotonic() < deadline, "chaos started no service"
                time.sleep(POLL_S)
            started = descendants(chaos.pid)
            chaos.send_signal(signum)
            _, err = chaos.communicate(timeout=LIMIT_S)
            wait_gone(started)
        finally:
            for pid in started:
                with contextlib.suppress(ProcessLookupError):
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
    said = err.decode()
    assert chaos.returncode == 128 + signum, said[-3000:]
    assert said.splitlines()[-1] == "healthlog: interrupted"
    assert list(temporary.iterdir()) == []


def test_chaos_whose_stderr_reader_is_gone_runs_every_run_cli_170(tmp_path: Path) -> None:
    """CLI-170: `healthlog chaos --runs 2` whose stderr's reader is gone (`2>&1 | head -1`, a
    log collector that died) runs both runs and prints its table, ending `chaos: runs 2, ...`,
    with the exit status of its invariants; its progress lines are dropped. (Before, the first
    progress line's BrokenPipeError ended it after one run: no table, and exit 0, which says
    every invariant held.)"""
    reading, writing = os.pipe()
    os.close(reading)
    try:
        ran = subprocess.run(
            healthlog("chaos", "--runs", "2"),
            stdout=subprocess.PIPE,
            stderr=writing,
            env=environment(),
            timeout=20 * LIMIT_S,
        )
    finally:
        os.close(writing)
    last = (ran.stdout.decode().splitlines() or [""])[-1]
    assert last.startswith("chaos: runs 2, "), ran.stdout.decode()[-3000:]
    assert ran.returncode == (0 if " lost 0, mismatched 0" in last else 1)


def start_serve(
    data: Path, env: dict[str, str], log: Path, *, within: Sequence[str] = (), **popen: Any
) -> tuple[subprocess.Popen[bytes], str]:
    """`healthlog serve` on a free port, its stderr into ``log``, run by the words ``within``
    (:func:`in_pid_namespace`) if given: the process and its URL."""
    with open(log, "wb") as err:
        process = subprocess.Popen(
            [*within, *healthlog("serve", "--data", data, "--port", "0")],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            **popen,
        )
    assert process.stdout is not None
    found = URL_LINE.search(process.stdout.readline())
    assert found is not None, log.read_text()[-3000:]
    return process, found.group(1).decode()


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while httpx.get(f"{url}/readyz").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(POLL_S)


def test_a_restart_beside_a_holder_it_cannot_take_from_says_it_waits_run_78(
    tmp_path: Path,
) -> None:
    """RUN-78: `healthlog serve` (lease term 12 s, renewed every 2 s) stopped with SIGSTOP, a
    holder that is there but renews nothing (as a killed holder that cannot be looked at from
    here is: another pid namespace, another host), then another started: until the first's
    lease expires the new service is not ready, and it says why in one INFO line, `fold lease
    held by HOLDER for N s more: folding waits until it releases the lease or the lease expires
    (...)`, N at most the term; then it holds the lease at epoch 2 and is ready. (Before, it
    said nothing for those seconds, 15.7 s at the default term.)"""
    data = tmp_path / "data"
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "12", "HEALTHLOG_LEASE_RENEW_S": "2"}
    first, url = start_serve(data, env, tmp_path / "first.log")
    with first:
        try:
            wait_ready(url)
            holder = lease_holder(DataDir(data))
            assert holder is not None
            first.send_signal(signal.SIGSTOP)
            again, url = start_serve(data, env, tmp_path / "again.log")
            with again:
                try:
                    wait_ready(url)
                finally:
                    again.send_signal(signal.SIGTERM)
        finally:
            first.kill()
    said = (tmp_path / "again.log").read_text()
    waits = re.findall(
        rf"fold lease held by {re.escape(holder)} for (\d+) s more: folding waits", said
    )
    assert len(waits) == 1, said[-3000:]
    assert int(waits[0]) <= 12
    assert said.index("folding waits") < said.index("fold lease held at epoch 2")


def _said(log: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    """Wait until ``process`` has written ``text`` into ``log``."""
    deadline = time.monotonic() + LIMIT_S
    while text not in log.read_text():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"never said {text!r}"
        time.sleep(POLL_S)


def _status(url: str, headers: dict[str, str], delivery_id: int) -> str:
    answer = httpx.get(f"{url}/v1/deliveries/{delivery_id}", headers=headers)
    return str(answer.json()["status"])


def _folded(url: str, headers: dict[str, str], delivery_id: int) -> None:
    deadline = time.monotonic() + LIMIT_S
    while _status(url, headers, delivery_id) == "pending":
        assert time.monotonic() < deadline, f"delivery {delivery_id} never folded"
        time.sleep(POLL_S)


def _step_body(minute: int) -> bytes:
    return body(metric("step_count", "count", point(f"2024-02-06 07:{minute:02d}:00 -0800")))


def _took_over_at_once(tmp_path: Path, data: Path, holder: str, env: dict[str, str]) -> None:
    """The service started again (its log ``again.log``) took ``holder``'s lease over at
    epoch 2 without waiting for it to expire, said so, and left a store `verify` finds equal."""
    with DataDir(data).open_store() as store:
        assert store.lease().epoch == 2
    said = (tmp_path / "again.log").read_text()
    assert f"fold lease of {holder} taken over before it expires" in said, said[-3000:]
    assert "folding waits" not in said
    run = subprocess.run(healthlog("verify", "--data", data), env=env, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-3000:]


def test_a_serve_killed_mid_fold_and_started_again_folds_at_once_run_150(
    tmp_path: Path,
) -> None:
    """RUN-150: `healthlog serve` (lease term 600 s) killed with its fold worker by SIGKILL (a
    power cut of its process tree) while it folds a delivery, then started again: the new
    service takes the dead one's lease over at once, at epoch 2, says so at INFO, is ready and
    folds that delivery and a new one, long before the lease would have expired; `verify`
    exits 0. (Before, it waited out the dead lease: 14.3 to 17.2 s at the default term of 15 s,
    measured over 3 restarts, and here 600 s.)"""
    data = tmp_path / "data"
    headers = {**add_token(data), "automation-aggregation": "minutes"}
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "600"}
    plan = {"fold.begin": {"hits": [1], "do": "delay", "seconds": 600}}
    held = {**env, "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    first, url = start_serve(data, held, tmp_path / "first.log", start_new_session=True)
    with first:
        try:
            wait_ready(url)
            assert httpx.post(f"{url}/v1/deliveries", content=_step_body(1), headers=headers)
            _said(tmp_path / "first.log", "fault injected at fold.begin", first)
            holder = lease_holder(DataDir(data))
        finally:
            os.killpg(first.pid, signal.SIGKILL)
    assert holder is not None
    assert holder.startswith("serve:")
    again, url = start_serve(data, env, tmp_path / "again.log")
    with again:
        try:
            wait_ready(url)
            _folded(url, headers, 1)
            delivery = httpx.post(f"{url}/v1/deliveries", content=_step_body(2), headers=headers)
            _folded(url, headers, delivery.json()["delivery_id"])
            assert _status(url, headers, 1) == "parsed"
        finally:
            again.send_signal(signal.SIGTERM)
    _took_over_at_once(tmp_path, data, holder, env)


def _namespace_of(holder: str) -> str:
    """SPACE in a ``serve:`` or ``reindex:`` holder name, the digest of its boot and pid
    namespace (FENCE-40)."""
    return holder.split(":")[5]


def test_a_container_killed_and_started_again_takes_its_dead_self_s_lease_at_once_run_176(
    tmp_path: Path,
) -> None:
    """RUN-176: `healthlog serve` (lease term 600 s) as process 1 of a pid namespace of its
    own, killed with its namespace by SIGKILL while it folds a delivery (`docker kill`, a
    `docker restart` past its stop timeout, the out-of-memory killer), then started again as
    process 1 of a new pid namespace on the same kernel and data directory, as a container
    started again is: it finds the dead one's lock in `lease.lock` gone (FENCE-43), takes its
    lease over at once at epoch 2 and says so at INFO, is ready, and folds that delivery;
    `verify` exits 0. (Before, it waited out the dead lease, not ready and folding nothing:
    14.8 to 14.9 s from its start to `/readyz` 200 at the default term, and here 600 s.)"""
    within = in_pid_namespace()
    data = tmp_path / "data"
    headers = {**add_token(data), "automation-aggregation": "minutes"}
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "600"}
    plan = {"fold.begin": {"hits": [1], "do": "delay", "seconds": 600}}
    held = {**env, "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    log = tmp_path / "first.log"
    first, url = start_serve(data, held, log, within=within, start_new_session=True)
    with first:
        try:
            wait_ready(url)
            assert httpx.post(f"{url}/v1/deliveries", content=_step_body(1), headers=headers)
            _said(log, "fault injected at fold.begin", first)
            holder = lease_holder(DataDir(data))
        finally:
            kill_namespace(first)
    assert holder is not None
    assert holder.startswith("serve:")
    again, url = start_serve(
        data, env, tmp_path / "again.log", within=within, start_new_session=True
    )
    with again:
        try:
            wait_ready(url)
            taker = lease_holder(DataDir(data))
            _folded(url, headers, 1)
            assert _status(url, headers, 1) == "parsed"
        finally:
            os.killpg(again.pid, signal.SIGTERM)
    assert taker is not None
    # Looked at through the lock, not through /proc: the two namespaces are not one.
    assert _namespace_of(taker) != _namespace_of(holder)
    _took_over_at_once(tmp_path, data, holder, env)


def test_a_container_beside_a_stopped_one_waits_for_its_lease_run_177(tmp_path: Path) -> None:
    """RUN-177: `healthlog serve` (lease term 600 s) as process 1 of a pid namespace of its
    own, stopped by SIGSTOP with its namespace (`docker pause`: alive, renewing nothing), and a
    second serve started in another new pid namespace on the same data directory (a second
    container, by mistake): the second finds the first's lock standing, says that folding
    waits, answers `/readyz` 503, and the lease stays the first's at epoch 1; once the first
    goes on and stops (SIGTERM), releasing it, the second holds the lease at epoch 2 and is
    ready. A live holder never loses its lease to the lock test."""
    within = in_pid_namespace()
    data = tmp_path / "data"
    add_token(data)
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "600", "HEALTHLOG_LEASE_RENEW_S": "1"}
    first, url = start_serve(
        data, env, tmp_path / "first.log", within=within, start_new_session=True
    )
    with first:
        try:
            wait_ready(url)
            holder = lease_holder(DataDir(data))
            os.killpg(first.pid, signal.SIGSTOP)
            log = tmp_path / "second.log"
            second, second_url = start_serve(data, env, log, within=within, start_new_session=True)
            with second:
                try:
                    _said(log, f"fold lease held by {holder} for", second)
                    assert httpx.get(f"{second_url}/readyz").status_code == 503
                    with DataDir(data).open_store() as store:
                        assert (store.lease().holder, store.lease().epoch) == (holder, 1)
                    os.killpg(first.pid, signal.SIGCONT)
                    os.killpg(first.pid, signal.SIGTERM)
                    assert first.wait(timeout=LIMIT_S) == 0
                    wait_ready(second_url)
                    assert _namespace_of(lease_holder(DataDir(data)) or "") != _namespace_of(
                        holder or ""
                    )
                finally:
                    os.killpg(second.pid, signal.SIGTERM)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
    said = log.read_text()
    assert "taken over before it expires" not in said, said[-3000:]
    with DataDir(data).open_store() as store:
        assert store.lease().epoch == 2


def test_a_reindex_killed_in_a_container_is_taken_over_at_once_from_the_host_cli_282(
    tmp_path: Path,
) -> None:
    """CLI-282: `healthlog reindex` run in a pid namespace of its own (`docker exec` into a
    container started again, or `docker compose run`), killed with it by SIGKILL while it
    rebuilds; a `reindex` run on the host (another pid namespace, same kernel) finds its lock in
    `lease.lock` gone, takes its lease at once at the next epoch and exits 0; `verify` exits 0.
    (Before, it exited 2, `another reindex holds the fold lease (HOLDER, 300 s more unless it
    renews it)`, for the killed reindex's five minutes.)"""
    within = in_pid_namespace()
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", _step_body(1))
    env = environment()
    imported = subprocess.run(
        healthlog("import", "--aggregation", "minutes", "--data", data, file),
        env=env,
        capture_output=True,
    )
    assert imported.returncode == 0, imported.stderr.decode()[-3000:]
    log = tmp_path / "reindex.log"
    with (
        open(log, "wb") as err,
        subprocess.Popen(
            [*within, *healthlog("reindex", "--data", data)],
            stderr=err,
            env=_held_at("rebuild.scratch", 600),
            start_new_session=True,
        ) as killed,
    ):
        try:
            deadline = time.monotonic() + LIMIT_S
            while not _rebuilding(DataDir(data)):
                assert killed.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "reindex never got under way"
                time.sleep(POLL_S)
            with DataDir(data).open_store() as store:
                held = store.lease()
        finally:
            kill_namespace(killed)
    assert held.holder is not None
    assert held.holder.startswith("reindex:")
    run = subprocess.run(
        healthlog("reindex", "--data", data), env=env, capture_output=True, timeout=LIMIT_S
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    with DataDir(data).open_store() as store:
        assert store.lease() == Lease(None, held.epoch + 1, 0)
    run = subprocess.run(healthlog("verify", "--data", data), env=env, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-3000:]


@pytest.mark.parametrize("then", ["import", "serve"])
def test_an_import_killed_mid_fold_leaves_no_lease_to_wait_for_cli_250(
    tmp_path: Path, then: str
) -> None:
    """CLI-250: `import` (lease term 600 s) killed with its fold worker by SIGKILL while it
    folds its file; the same `import` run again, or `serve` started, takes its lease over at
    once, at epoch 2: the import exits 0, the service is ready, and the killed import's
    delivery is folded. (Before, each waited for the dead import's lease to expire: its term,
    here 600 s.)"""
    data = tmp_path / "data"
    file = write(tmp_path / "a.json", _step_body(1))
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "600"}
    log = tmp_path / "import.log"
    with (
        open(log, "wb") as err,
        subprocess.Popen(
            healthlog("import", "--aggregation", "minutes", "--data", data, file),
            stderr=err,
            env=_held_at("fold.begin", 600) | {"HEALTHLOG_LEASE_TTL_S": "600"},
            start_new_session=True,
        ) as killed,
    ):
        try:
            deadline = time.monotonic() + LIMIT_S
            while not (DataDir(data).store_path.exists() and _first_fold_held(DataDir(data))):
                assert killed.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "import never got under way"
                time.sleep(POLL_S)
        finally:
            os.killpg(killed.pid, signal.SIGKILL)
    assert lease_holder(DataDir(data)) is not None
    if then == "import":
        run = subprocess.run(
            healthlog("import", "--aggregation", "minutes", "--data", data, file),
            env=env,
            capture_output=True,
            timeout=LIMIT_S,
        )
        assert run.returncode == 0, run.stderr.decode()[-3000:]
    else:
        again, url = start_serve(data, env, tmp_path / "serve.log")
        with again:
            try:
                wait_ready(url)
            finally:
                again.send_signal(signal.SIGTERM)
    with DataDir(data).open_store() as store:
        assert store.outcome(1) is not None
        assert store.lease().epoch == 2


def test_a_fold_worker_whose_serve_is_killed_alone_ends_its_fold_at_once_run_170(
    tmp_path: Path,
) -> None:
    """RUN-170: `healthlog serve`'s main process killed alone by SIGKILL (the out-of-memory
    killer's choice, or a `kill -9` of its pid) while its fold worker is in the middle of a
    fold, its transaction open (held for 600 s at `fold.before_commit`, as a long fold holds
    it): the worker and the rest of the service's children end within seconds, the worker
    saying why in one WARNING; its fold's writes are rolled back, and the service started
    again folds the delivery (parsed, at epoch 2) and `verify` exits 0. (Before, the orphaned
    worker went on with its fold, holding the store's write lock, for as long as the fold
    took: 28.3 s for a 200 MiB delivery, and here 600 s.)"""
    data = tmp_path / "data"
    headers = {**add_token(data), "automation-aggregation": "minutes"}
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "600"}
    plan = {"fold.before_commit": {"hits": [1], "do": "delay", "seconds": 600}}
    held = {**env, "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    first, url = start_serve(data, held, tmp_path / "first.log", start_new_session=True)
    with first:
        try:
            wait_ready(url)
            assert httpx.post(f"{url}/v1/deliveries", content=_step_body(1), headers=headers)
            _said(tmp_path / "first.log", "fault injected at fold.before_commit", first)
            left = children(first.pid)
            assert left
            first.send_signal(signal.SIGKILL)
            first.wait()
            deadline = time.monotonic() + LIMIT_S
            while any(alive(pid) for pid in left):
                assert time.monotonic() < deadline, "the orphaned fold worker went on"
                time.sleep(POLL_S)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
    said = (tmp_path / "first.log").read_text()
    gone = [line for line in said.splitlines() if f"(pid {first.pid}) is gone" in line]
    assert len(gone) == 1, said[-3000:]
    assert "level=WARNING" in gone[0]
    again, url = start_serve(data, env, tmp_path / "again.log")
    with again:
        try:
            wait_ready(url)
            _folded(url, headers, 1)
            assert _status(url, headers, 1) == "parsed"
        finally:
            again.send_signal(signal.SIGTERM)
    with DataDir(data).open_store() as store:
        assert store.lease().epoch == 2
    run = subprocess.run(healthlog("verify", "--data", data), env=env, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()[-3000:]


async def test_a_lease_left_by_a_dead_holder_is_taken_as_it_expires_run_79(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """RUN-79: a lease actor (term 15 s, renewed every 5 s) started while another holder's lease,
    left by a process that was killed, has 7 s to run: it takes the lease at epoch 2 as that
    lease expires, 7 s on, not at the first renewal after that, 10 s on. (Before, the try came
    only with the next renewal: a service started again after a kill folded nothing for up to
    5 s more.)"""
    start_us = 1_000_000_000_000
    with DataDir(tmp_path).open_store() as store:
        assert store.acquire_lease("dead", now=start_us - 8_000_000, ttl=15_000_000) == 1
        limiter = trio.CapacityLimiter(1)
        send, receive = trio.open_memory_channel[int | None](0)
        actor = LeaseActor(
            store,
            limiter,
            "again",
            send,
            ttl_s=15,
            renew_s=5,
            clock=lambda: start_us + int(autojump_clock.current_time() * 1_000_000),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            assert await receive.receive() == 2
            taken_at = trio.current_time()
            nursery.cancel_scope.cancel()
    assert taken_at == pytest.approx(7.0, abs=0.01)


def _gauges(url: str) -> dict[str, float]:
    """The fold lease's gauges of ``url``'s ``/metrics`` (whether this process holds it, and
    who does), by name and labels."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in lines)
        if name.startswith(("healthlog_fold_lease_held", "healthlog_fold_lease_holder"))
    }


def test_a_second_serve_on_one_data_directory_is_said_and_shown_run_140_run_141(
    tmp_path: Path,
) -> None:
    """RUN-140, RUN-141: two `healthlog serve` on one data directory, on two ports (lease term
    3 s, renewed every 1 s): the second says once at WARNING, after six renewal periods, that
    another serve, named by its host and process id, holds the fold lease and what to do, and
    the first never; `/metrics` says which one folds: `healthlog_fold_lease_held` 1 in the first
    and 0 in the second, `healthlog_fold_lease_holder{kind="this_process"}` 1 in the first and
    `{kind="serve"}` 1 in the second, no series naming a host. Once the first stops, the second
    holds the lease. (Before, the second said only `fold lease held by ... folding waits` at
    INFO, and the two `/metrics` differed in no series of the lease: both
    `healthlog_lease_epoch 1`.)"""
    data = tmp_path / "data"
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "3", "HEALTHLOG_LEASE_RENEW_S": "1"}
    first, first_url = start_serve(data, env, tmp_path / "first.log")
    second = None
    try:
        wait_ready(first_url)
        second, second_url = start_serve(data, env, tmp_path / "second.log")
        deadline = time.monotonic() + LIMIT_S
        while "another healthlog serve" not in (tmp_path / "second.log").read_text():
            assert second.poll() is None
            assert time.monotonic() < deadline, "never said"
            time.sleep(POLL_S)
        kinds = ("this_process", "serve", "reindex", "command", "none")
        assert _gauges(first_url) == {
            "healthlog_fold_lease_held": 1.0,
            **{f'healthlog_fold_lease_holder{{kind="{kind}"}}': 0.0 for kind in kinds},
            'healthlog_fold_lease_holder{kind="this_process"}': 1.0,
        }
        assert _gauges(second_url) == {
            "healthlog_fold_lease_held": 0.0,
            **{f'healthlog_fold_lease_holder{{kind="{kind}"}}': 0.0 for kind in kinds},
            'healthlog_fold_lease_holder{kind="serve"}': 1.0,
        }
        assert httpx.get(f"{second_url}/readyz").status_code == 503
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=LIMIT_S) == 0
        wait_ready(second_url)
        assert _gauges(second_url)["healthlog_fold_lease_held"] == 1.0
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=LIMIT_S) == 0
    finally:
        for process in (first, second):
            if process is not None:
                if process.poll() is None:
                    process.kill()
                process.wait()
                assert process.stdout is not None
                process.stdout.close()
    said = (tmp_path / "second.log").read_text()
    warned = [line for line in said.splitlines() if "another healthlog serve" in line]
    assert len(warned) == 1, said[-3000:]
    assert "WARNING" in warned[0].upper()
    held_s = re.search(r"for (\d+) s:", warned[0])
    assert held_s is not None
    assert int(held_s.group(1)) >= 6
    assert f"(host {socket.gethostname()}, pid {first.pid})" in warned[0]
    assert "run one serve per data directory" in warned[0]
    assert "another healthlog serve" not in (tmp_path / "first.log").read_text()


def test_a_serve_that_folded_before_another_took_the_lease_is_not_said_unready_run_152(
    tmp_path: Path,
) -> None:
    """RUN-152: a `healthlog serve` (lease term 3 s, renewed every 1 s) that completed a
    folding pass, frozen (SIGSTOP) while a second serve takes its expired lease, then
    continued: it loses the lease, and once the other has held it for six renewal periods it
    says so at WARNING; its `/readyz` answers 200 (the first pass completed), and the line
    says 503 only of a service that has not completed one. (Before, the line said `its
    /readyz answers 503` while it answered 200.)"""
    data = tmp_path / "data"
    env = {**environment(), "HEALTHLOG_LEASE_TTL_S": "3", "HEALTHLOG_LEASE_RENEW_S": "1"}
    first, first_url = start_serve(data, env, tmp_path / "first.log")
    second = None
    try:
        wait_ready(first_url)
        first.send_signal(signal.SIGSTOP)
        second, second_url = start_serve(data, env, tmp_path / "second.log")
        wait_ready(second_url)
        first.send_signal(signal.SIGCONT)
        _said(tmp_path / "first.log", "another healthlog serve", first)
        assert httpx.get(f"{first_url}/readyz").status_code == 200
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait()
                assert process.stdout is not None
                process.stdout.close()
    said = (tmp_path / "first.log").read_text()
    (warned,) = [line for line in said.splitlines() if "another healthlog serve" in line]
    assert "fold lease lost" in said
    assert "its /readyz answers 503 until it has completed a folding pass" in warned
    assert "its /readyz answers 503, while" not in warned


def _catches(pid: int, signum: int) -> bool | None:
    """Whether ``pid`` has a handler of its own for ``signum`` (None once it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    (caught,) = (line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signalled_again_as_import_stops_is_the_same_stop_cli_193(
    tmp_path: Path, signum: int
) -> None:
    """CLI-193: `import` (its fold held at `fold.begin`) gets the stopping signal, and once more
    as it stops, after it has stopped watching for it (the terminal's hangup signals the
    foreground job twice, measured 0.2 ms apart: the shell's and the kernel's as the shell
    exits; `timeout` signals the command and then its group): it still stops as on the first,
    exit 128 + the signal and `healthlog: interrupted`, its fold lease released. (Before, the
    second found the default action back and killed it: exit -1 and the lease held for its
    term, in 1 of 2 real hangups.)"""
    data = DataDir(tmp_path / "data")
    file = write(
        tmp_path / "a.json",
        body(metric("heart_rate", "count/min", point("2024-02-06 07:00:00 -0800"))),
    )
    plan = {"fold.begin": {"hits": [1], "do": "delay", "seconds": 3}}
    env = {**environment(), "HEALTHLOG_FAULT_PLAN": json.dumps(plan)}
    with subprocess.Popen(
        healthlog("import", "--aggregation", "minutes", "--data", data.path, file),
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
    ) as running:
        deadline = time.monotonic() + LIMIT_S
        while not (data.store_path.exists() and _first_fold_held(data)):
            assert running.poll() is None, running.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "import never got under way"
            time.sleep(0.01)
        running.send_signal(signum)
        # Once the first signal is taken, the command no longer catches it: the second comes.
        while (catches := _catches(running.pid, signum)) is True:
            assert time.monotonic() < deadline, "the signal is caught for good"
        assert catches is not None, "import ended before the second signal could come"
        running.send_signal(signum)
        _, err = running.communicate(timeout=LIMIT_S)
    _interrupted(running.returncode, err, signum, data)


def _to_rebuild(tmp_path: Path, command: str) -> tuple[DataDir, list[str]]:
    """A data directory with one delivery folded, and ``command`` (`reindex` or `verify`) to
    run there."""
    data, _ = _one_folded(tmp_path)
    return data, healthlog(command, "--data", data.path)


def _rebuild_held(seconds: float) -> dict[str, str]:
    """The environment of a rebuild held for ``seconds`` at the fault point `rebuild.scratch`."""
    return _held_at("rebuild.scratch", seconds)


@pytest.mark.parametrize("command", ["reindex", "verify"])
def test_a_hangup_signalled_twice_stops_a_rebuild_once_cli_194(
    tmp_path: Path, command: str
) -> None:
    """CLI-194: `reindex` and `verify` (held in their rebuild at `rebuild.scratch`) get SIGHUP
    twice back to back, as a terminal's hangup delivers it (the shell's and the kernel's, 0.2 ms
    apart), and once more after they have stopped watching for it, as they stop: each stops as
    on one signal, at its next report, exit 129 with `healthlog: interrupted`, the lease
    released and the scratch directory removed. (Before, the second was taken for a second
    Ctrl-C and raised from the signal handler, wherever the rebuild stood, inside a lock its
    worker pool's shutdown needs next as well; and the last found the default action put back
    and killed the command, exit -1.)"""
    data, command_line = _to_rebuild(tmp_path, command)
    with subprocess.Popen(
        command_line,
        stderr=subprocess.PIPE,
        env=_rebuild_held(3),
        preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
    ) as running:
        deadline = time.monotonic() + LIMIT_S
        while not _rebuilding(data):
            assert running.poll() is None, running.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, f"{command} never got under way"
            time.sleep(0.01)
        os.kill(running.pid, signal.SIGHUP)
        os.kill(running.pid, signal.SIGHUP)
        while (catches := _catches(running.pid, signal.SIGHUP)) is True:
            assert time.monotonic() < deadline, "the signal is caught for good"
        assert catches is not None, f"{command} ended before the last signal could come"
        running.send_signal(signal.SIGHUP)
        _, err = running.communicate(timeout=LIMIT_S)
    _interrupted(running.returncode, err, signal.SIGHUP, data)
    assert not _rebuilding(data)


def test_a_second_ctrl_c_seconds_later_stops_a_rebuild_at_once_cli_195(tmp_path: Path) -> None:
    """CLI-195: `reindex` held in its rebuild for a minute (at `rebuild.scratch`) gets Ctrl-C
    (SIGINT) and, 1.5 s later, Ctrl-C again: someone insisting, not the first delivered twice,
    so it stops at once, without waiting for its next report: exit 130 with `healthlog:
    interrupted`, the lease released and the scratch directory removed."""
    data, command_line = _to_rebuild(tmp_path, "reindex")
    with subprocess.Popen(command_line, stderr=subprocess.PIPE, env=_rebuild_held(60)) as running:
        deadline = time.monotonic() + LIMIT_S
        while not _rebuilding(data):
            assert running.poll() is None, running.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "reindex never got under way"
            time.sleep(0.01)
        running.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert running.poll() is None, "the first Ctrl-C stopped the rebuild inside its delay"
        running.send_signal(signal.SIGINT)
        _, err = running.communicate(timeout=30)
    _interrupted(running.returncode, err, signal.SIGINT, data)
    assert not _rebuilding(data)


async def test_follow_signalled_again_as_it_stops_stops_once_cli_196(tmp_path: Path) -> None:
    """CLI-196: `healthlog follow --subscriber backup`, following a service live, gets SIGHUP
    twice back to back, as a terminal's hangup delivers it, and once more after it has stopped
    watching for it, as it sends its last ACK: it stops as on one signal, exit 0 with `follow:
    replica at seq N`, the service holding `backup` at the replica's cursor. (Before, the last
    found the default action put back and killed it, exit -1, its last ACK unsent.)"""
    async with serving(tmp_path / "server") as service:
        total = await post_small(service, 0, 5)
        directory = tmp_path / "replica"
        command = [
            *healthlog("follow", "--url", service.url, "--replica", directory),
            *("--subscriber", "backup"),
        ]
        process = await trio.lowlevel.open_process(
            command,
            env={**environment(), "HEALTHLOG_TOKEN": service.token},
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=functools.partial(signal.signal, signal.SIGHUP, signal.SIG_DFL),
        )
        try:
            with trio.fail_after(LIMIT_S):
                while not (directory / REPLICA_FILE).exists():
                    await trio.sleep(POLL_S)
                with Replica(directory) as reading:
                    await until_cursor(reading, total)
            os.kill(process.pid, signal.SIGHUP)
            os.kill(process.pid, signal.SIGHUP)
            deadline = time.monotonic() + LIMIT_S
            while (catches := _catches(process.pid, signal.SIGHUP)) is True:
                assert time.monotonic() < deadline, "the signal is caught for good"
            assert catches is not None, "follow ended before the last signal could come"
            os.kill(process.pid, signal.SIGHUP)
            assert process.stderr is not None
            with trio.fail_after(LIMIT_S):
                said = b""
                while chunk := await process.stderr.receive_some():
                    said += chunk
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
        assert process.returncode == 0, said.decode()[-3000:]
        assert said.decode().splitlines()[-1] == f"follow: replica at seq {total}"
        await acked(service, "backup", total)


def test_serve_started_with_sigint_ignored_keeps_it_ignored_run_175(tmp_path: Path) -> None:
    """RUN-175: `healthlog serve &` from a script (its shell starts the job with SIGINT
    ignored), listening, gets SIGINT and then SIGTERM: the SIGINT stays ignored, as `import`
    and `seal` keep it (RUN-75), and SIGTERM stops it, exit 0, `stopping on SIGTERM`. (Before,
    a SIGINT in the first 2 s of its start, before its watch opened, was dropped, and one after
    stopped it: the first Ctrl-C of a script's terminal did nothing and the second stopped the
    service, or the first stopped it, by when it came.)"""
    data = tmp_path / "data"
    log = tmp_path / "serve.log"
    with (
        log.open("wb") as err,
        subprocess.Popen(
            healthlog("serve", "--data", data, "--port", "0"),
            stdout=subprocess.PIPE,
            stderr=err,
            env=environment(),
            preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN),
        ) as service,
    ):
        assert service.stdout is not None
        assert URL_LINE.search(service.stdout.readline()), log.read_text()[-3000:]
        service.send_signal(signal.SIGINT)
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=LIMIT_S)
    said = log.read_text()
    assert service.returncode == 0, said[-3000:]
    assert "stopping on SIGTERM" in said, said[-3000:]
    assert "SIGINT" not in said


STARTING = """
import sys

import trio

from healthlog import cli


async def starting() -> None:
    print("starting", flush=True)
    sys.stdin.readline()
    await trio.sleep_forever()


try:
    cli._run_terminable(starting)
except BaseException as exc:
    print("exit", cli._stopped_by_signal(exc), flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_as_a_command_starts_stops_it_cli_280(signum: int) -> None:
    """CLI-280: a command of `_run_terminable` (`import`, `seal`) gets SIGTERM or SIGINT while
    its first step runs before it yields (held here on stdin; for `import` it is loading the
    runtime's modules, seconds on a loaded NAS): the command stops as on a signal later, exit
    143 or 130. (Before, the signal landed on the ignored disposition set
    before the watch opened and was dropped: an `import` sent SIGINT 2.0 s after it started,
    beside a CPU burner, journaled and folded its file and exited 0, 6.1 s later.)"""
    with subprocess.Popen(
        [sys.executable, "-c", STARTING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(),
    ) as command:
        assert command.stdin is not None
        assert command.stdout is not None
        assert command.stdout.readline() == b"starting\n"
        command.send_signal(signum)
        command.stdin.write(b"go on\n")
        command.stdin.flush()
        try:
            out, err = command.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            command.kill()
            out, err = command.communicate()
    assert out.decode() == f"exit {128 + signum}\n", err.decode()[-3000:]


FOLLOWING = """
import sys

import trio

from healthlog import cli


async def starting() -> None:
    print("starting", flush=True)
    sys.stdin.readline()
    await trio.sleep_forever()


trio.run(cli._until_stopped, starting)
print("stopped", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_as_follow_starts_stops_it_cli_281(signum: int) -> None:
    """CLI-281: `follow` (`_until_stopped`) gets SIGTERM or SIGINT while its first step runs
    before it yields (held here on stdin): it stops, as on a signal later. (Before, the signal
    landed on the ignored disposition set before the watch's own task ran and was dropped: the
    follower ran on.)"""
    with subprocess.Popen(
        [sys.executable, "-c", FOLLOWING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(),
    ) as command:
        assert command.stdin is not None
        assert command.stdout is not None
        assert command.stdout.readline() == b"starting\n"
        command.send_signal(signum)
        command.stdin.write(b"go on\n")
        command.stdin.flush()
        try:
            out, err = command.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            command.kill()
            out, err = command.communicate()
    assert out.decode() == "stopped\n", err.decode()[-3000:]
