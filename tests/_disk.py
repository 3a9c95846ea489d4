"""Disks that misbehave, for real, for the tests that need them.

``files_limited_to(size)`` lowers this process's file size limit (RLIMIT_FSIZE) for the block,
so a write past ``size`` bytes of any file fails for real (EFBIG; Python ignores SIGXFSZ), and
SQLite reports it as it reports a full disk (SQLITE_FULL, or SQLITE_IOERR_WRITE when nothing of
the write fitted).

``unwritable(*paths)`` makes files that this process may not open for writing, as a file
created by another user is to the service's user: SQLite then opens them read-only.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import resource
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

DISK_ERROR = r"SQLITE_(FULL: database or disk is full|IOERR\w*: disk I/O error)"
"""How :func:`healthlog.storage._sqlite.describe` names what such a write gets."""


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def unwritable(*paths: Path) -> Iterator[Callable[[], None]]:
    """The files at ``paths`` unwritable for this process for the block: read-only modes, or,
    for root, whom modes do not stop, the immutable attribute (``chattr +i``; the test is
    skipped on a file system without it). The block's ``mend()`` makes them writable again,
    as a ``chown`` would; they are writable after the block in any case."""
    if os.geteuid() != 0:
        modes = {path: stat.S_IMODE(path.stat().st_mode) for path in paths}

        def restore() -> None:
            for path, mode in modes.items():
                path.chmod(mode)

        for path in paths:
            path.chmod(0o444)
    else:
        chattr = shutil.which("chattr")
        if chattr is None:
            pytest.skip("root is stopped only by the immutable attribute, and chattr is missing")

        def restore() -> None:
            subprocess.run([chattr, "-i", *map(str, paths)], check=True)

        setting = subprocess.run([chattr, "+i", *map(str, paths)], capture_output=True)
        if setting.returncode != 0:
            restore()
            pytest.skip(f"chattr +i failed here: {setting.stderr.decode(errors='replace')}")
    try:
        yield restore
    finally:
        restore()


def in_full_file_system(script: str, *args: str | os.PathLike[str], size: str = "1m") -> str:
    """Run the shell ``script`` (``$1`` the mount point, ``$2``... ``args``) in a mount
    namespace of its own where ``$1`` is a real tmpfs of ``size`` (1 MiB), ``PY`` this Python;
    its stderr. Skipped where this process cannot make such a namespace (no unprivileged user
    namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare is missing")
    point = Path(args[0])
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs", point],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"no tmpfs in a namespace of our own: {probe.stderr.decode().strip()}")
    mounted = f'mount -t tmpfs -o size={size} tmpfs "$1" || exit 99\n{script}'
    run = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", mounted, "sh", *args],
        capture_output=True,
        env={**os.environ, "PY": sys.executable},
        timeout=120,
        check=False,
    )
    assert run.returncode != 99, run.stderr.decode()
    return run.stderr.decode()


KILLED_HOLDER = (
    "import os, signal, sqlite3, sys\n"
    "for name in ('journal.sqlite', 'store.sqlite'):\n"
    "    conn = sqlite3.connect(os.path.join(sys.argv[1], name))\n"
    "    conn.execute('SELECT count(*) FROM sqlite_master').fetchall()\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)
"""Opens both databases of the data directory ``argv[1]`` and is killed, leaving their ``-wal``
and ``-shm`` files, as a service killed (or running) leaves them."""


def on_remounted_read_only(tmp_path: Path, payload: Path, command: str, after: str = "") -> str:
    """The stderr of ``healthlog COMMAND`` (stdout dropped, then a line ``COMMAND exit N``, then
    the shell lines ``after``) on a data directory whose file system was remounted read-only
    while its databases stay readable: ``payload`` is imported into ``$1/data`` on a real tmpfs
    (:func:`in_full_file_system`), a process holding both databases is killed there (leaving
    their ``-wal`` and ``-shm`` files, so SQLite opens them read-only), and the file system is
    remounted read-only, as the kernel remounts one after disk errors."""
    point = tmp_path / "mnt"
    point.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -c "$3" "$1/data"\n'
        'test -e "$1/data/store.sqlite-shm" || exit 97\n'
        'mount -o remount,ro "$1" || exit 96\n'
        f'"$PY" -m healthlog.cli {command} --data "$1/data" > /dev/null\n'
        f'echo "{command} exit $?" >&2\n'
        f"{after}"
    )
    return in_full_file_system(script, point, payload, KILLED_HOLDER)


@contextlib.contextmanager
def ext4_after_errors(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A real ext4 file system mounted with ``errors=remount-ro`` from a loop device (as a NAS
    mounts its volume), and a ``fail()`` that raises an error in it through the kernel's own
    ``trigger_fs_error``, after which the kernel takes it read-only, as after a disk error:
    Linux 6.15 on marks it ``emergency_ro`` in its mount options and no longer sets the
    read-only flag that ``statvfs`` reports. Skipped where this process may not make one
    (loop devices are root's)."""
    tools = [shutil.which(name) for name in ("losetup", "mkfs.ext4", "mount", "umount")]
    if os.geteuid() != 0 or None in tools:
        pytest.skip("a loop-mounted ext4 needs root, losetup and mkfs.ext4")
    image, point = tmp_path / "ext4.img", tmp_path / "ext4"
    point.mkdir()
    with image.open("wb") as file:
        file.truncate(32 * 2**20)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
    attached = subprocess.run(
        ["losetup", "--find", "--show", image], capture_output=True, text=True, check=False
    )
    if attached.returncode != 0:
        pytest.skip(f"no loop device here: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        subprocess.run(["mount", "-o", "errors=remount-ro", device, point], check=True)
        trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
        if not trigger.exists():
            subprocess.run(["umount", point], check=True)
            pytest.skip("this kernel's ext4 has no trigger_fs_error")

        def fail() -> None:
            trigger.write_text("healthlog test\n")

        try:
            yield point, fail
        finally:
            subprocess.run(["umount", point], check=True)
    finally:
        subprocess.run(["losetup", "-d", device], check=True)


@contextlib.contextmanager
def reachable_home(prefix: str) -> Iterator[Path]:
    """A temporary directory that another user may enter (mode 0755): pytest's ``tmp_path``
    lies in a directory of mode 0700, which another user could not reach."""
    with tempfile.TemporaryDirectory(prefix=prefix) as base:
        home = Path(base)
        home.chmod(0o755)
        yield home


@functools.cache
def python_for_all() -> str:
    """A Python of this one's version that every user may run, with this one's packages (made
    once, removed at exit): a command run by root on another account's data directory starts
    anew as that account (CLI-146), which must be able to run it, as the service's account runs
    the README's /opt/healthlog; the Python the tests run under may lie under /root (pyenv),
    which no other account may enter."""
    home = Path(tempfile.mkdtemp(prefix="healthlog-python-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    home.chmod(0o755)
    python = python_in(home)
    subprocess.run(["chmod", "-R", "a+rX", home], check=True)
    return python


def python_in(directory: Path) -> str:
    """A virtual environment in ``directory`` of the system's Python of this one's version, with
    this one's packages: its interpreter's path."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = shutil.which(version, path="/usr/local/bin:/usr/bin")
    assert base is not None, f"no {version} every user may run in /usr/local/bin or /usr/bin"
    subprocess.run([base, "-m", "venv", "--without-pip", directory / "venv"], check=True)
    (site,) = (directory / "venv" / "lib").glob("python*/site-packages")
    packages = Path(sysconfig.get_paths()["purelib"])
    sources = Path(__file__).resolve().parent.parent
    if not (_reachable_by_all(packages) and _reachable_by_all(sources)):
        # A clone where other accounts cannot reach (under a 0700 home): a copy they can.
        shutil.copytree(packages, directory / "packages", symlinks=True)
        for name in ("healthlog", "actors", "transport"):
            shutil.copytree(sources / name, directory / "sources" / name, symlinks=True)
        # Before the packages, whose editable install names the clone.
        sources, packages = directory / "sources", directory / "packages"
        (site / "healthlog-sources.pth").write_text(f"{os.fspath(sources)}\n")
    (site / "healthlog-tests.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    return os.fspath(directory / "venv" / "bin" / "python")


def _reachable_by_all(path: Path) -> bool:
    """Whether every account may enter ``path`` and each directory above it."""
    return all(os.stat(part).st_mode & stat.S_IXOTH for part in (path, *path.parents))
