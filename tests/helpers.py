"""Shared test helpers: short temp dirs for unix sockets, poll-until-true, process checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_path() -> str:
    """PYTHONPATH for a gpuvisor child: the checkout first, then whatever this process's
    PYTHONPATH already held (packages installed beside the checkout, as on a GPU machine that
    carries them in a folder of their own)."""
    parts = [REPO, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO)]
    return os.pathsep.join(parts)


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is truthy or `timeout` passes; returns whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


@contextmanager
def short_tmpdir(prefix: str = "gv") -> Iterator[str]:
    """A temp dir with a short path: unix socket paths must stay under 108 bytes."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def tmpfs_at(path: str, size: str) -> Iterator[bool]:
    """A tmpfs of `size` mounted at `path` (made here, 0700) for the block; yields whether it could
    be mounted (it needs root). Afterwards a tmpfs is unmounted (lazily: a process may still hold a
    file there) and the dir holding `path` is removed, as its owner (a SimNode's temp dir, closed
    first) could not while a mount point was in it; an unmounted `path` is just removed."""
    os.makedirs(path, mode=0o700)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path]
    mounted = subprocess.run(mount, capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], capture_output=True, check=False)
        shutil.rmtree(os.path.dirname(path) if mounted else path, ignore_errors=True)


def sockets_in(directory: str) -> list[str]:
    import stat

    found = []
    for entry in os.scandir(directory):
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                found.append(entry.name)
        except FileNotFoundError:
            pass
    return sorted(found)


def gone(pids: list[int]) -> bool:
    """True when none of these PIDs is a live (non-zombie) process."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def plant_stray(path: str, kind: str, target: str) -> None:
    """A non-socket entry at `path`, named like a socket: a "dir", a regular "file", or a "link" to `target`."""
    if kind == "dir":
        os.mkdir(path)
    elif kind == "file":
        with open(path, "w") as fh:
            fh.write("not a socket")
    else:
        os.symlink(target, path)


def fill_filesystem(directory: str) -> str:
    """Fill the filesystem of `directory` to the last byte; returns the filler file's path."""
    import contextlib

    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 65536)
    return path


def write_mig_minors(path: Path) -> None:
    """The driver's /proc/driver/nvidia-caps/mig-minors layout for 8 GPUs: config, monitor, then
    per GPU and GPU instance its access minor followed by its compute instances'."""
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(8):
        for gi in range(15):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            for ci in range(8):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor + 1 + ci}")
            minor += 9
    path.write_text("\n".join(lines) + "\n")
