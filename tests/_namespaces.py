"""Commands run in a pid namespace of their own, as a container's processes are."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest


def in_pid_namespace() -> list[str]:
    """The words that run a command as process 1 of a new pid namespace with a ``/proc`` of
    its own, on this machine's kernel, as ``docker restart`` or ``docker compose up -d``
    starts a container's service; it is killed with ``unshare``. As root ``unshare --pid``
    does it, otherwise in a user namespace of its own too. Skipped where neither can be
    made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare is missing")
    said = []
    for user in ([], ["--user", "--map-root-user"]):
        words = [unshare, *user, "--pid", "--fork", "--mount-proc", "--kill-child"]
        probe = subprocess.run([*words, "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return words
        said.append(probe.stderr.decode(errors="replace").strip())
    pytest.skip(f"no pid namespace of our own: {'; '.join(said)}")


def kill_namespace(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """Kill by SIGKILL process 1 of the pid namespace that ``process``, ``unshare`` run by
    the words of :func:`in_pid_namespace`, made, and wait until ``unshare`` has reaped it:
    every process of the namespace has ended then, and its files are closed (killed all at
    once, ``unshare`` could end while its child still closed them)."""
    task = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    os.kill(int(task.read_text().split()[0]), signal.SIGKILL)
    os.kill(process.pid, signal.SIGCONT)
    process.wait()
