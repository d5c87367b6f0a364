"""A fake `nvidia-cuda-mps-control` and the helpers the MPS tests share (tests/conftest.py's `fake`
fixture installs it; tests/unit/test_mps_layout.py and tests/process/test_mps_daemons.py use it).

The fake behaves like the real tool in what the manager relies on: `-d` forks a background daemon
and returns at once (the daemon writes `nvidia-cuda-mps-control.pid` in the pipe directory a
moment later); without arguments it reads one command from stdin, fails when no daemon is alive
for that pipe directory, and `quit` ends the daemon. It records every command in the log
directory, and a `fake-behaviour` file beside it makes it misbehave on demand. `install_client`
adds a fake MPS client that honours CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (an allocation past it fails).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.model import ResourcePlan
from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.mps import daemons as mps
from supervisor.mps import layout as mpslayout
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.helpers import wait_until

FAKE_CONTROL = r"""
import json, os, signal, sys, time

PIPE = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
LOG = os.environ["CUDA_MPS_LOG_DIRECTORY"]
PID_FILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")
RECORD = os.path.join(LOG, "fake-commands.log")
STATE = os.path.join(PIPE, "fake-state.json")
BEHAVIOUR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake-behaviour")


def record(line):
    with open(RECORD, "a") as handle:
        handle.write(line + "\n")


def behaviour():
    try:
        with open(BEHAVIOUR) as handle:
            return set(handle.read().split())
    except OSError:
        return set()


def daemon_pid():
    try:
        with open(PID_FILE) as handle:
            pid = int(handle.read().strip())
        os.kill(pid, 0)
        with open("/proc/%d/stat" % pid) as handle:
            if handle.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                return None
    except (OSError, ValueError, IndexError):
        return None
    return pid


def run_daemon():
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    time.sleep(0.05)  # the real daemon also takes a moment: -d has returned before the pid file exists
    tmp = PID_FILE + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(tmp, PID_FILE)
    record("daemon-start %d" % os.getpid())

    def stop(signum, frame):
        try:
            os.unlink(PID_FILE)
        except OSError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.alarm(120)  # never outlive a test run
    while True:
        signal.pause()


def main():
    args = sys.argv[1:]
    if args == ["-d"]:
        if "fail-start" in behaviour():
            print("fake: cannot start the control daemon")
            return 1
        if daemon_pid():
            print("An instance of this daemon is already running")
            return 1
        child = os.fork()
        if child:
            os.waitpid(child, 0)
            return 0
        os.setsid()
        if os.fork():
            os._exit(0)
        run_daemon()
    if args:
        print("usage: nvidia-cuda-mps-control [-d | -f]", file=sys.stderr)
        return 2
    command = sys.stdin.read().strip()
    pid = daemon_pid()
    if pid is None:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    flags = behaviour()
    if "hang-query" in flags and command.startswith("get_"):
        time.sleep(60)
    if "refuse" in flags and command.startswith("set_"):
        print("refused: " + command, file=sys.stderr)
        return 1
    record(command)
    try:
        with open(STATE) as handle:
            state = json.load(handle)
    except (OSError, ValueError):
        state = {}
    if command == "quit":
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while daemon_pid() == pid and time.monotonic() < deadline:
            time.sleep(0.01)
        return 0
    word = command.split()
    if word[0] == "set_default_active_thread_percentage":
        state["thread"] = word[1]
    elif word[0] == "set_default_device_pinned_mem_limit":
        state.setdefault("pinned", {})[word[1]] = word[2]
    elif word[0] == "get_default_active_thread_percentage":
        print("%.1f" % float(state.get("thread", "100")))
    elif word[0] != "get_server_list":
        print("Unknown command: " + command)
    with open(STATE, "w") as handle:
        json.dump(state, handle)
    return 0


sys.exit(main())
"""


FAKE_CLIENT = r"""
import os, re, sys

# A CUDA program as an MPS client, for what gpuvisor relies on: it reaches the control daemon
# through CUDA_MPS_PIPE_DIRECTORY (no live daemon there: it cannot run as a client) and honours
# CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "<device ordinal>=<limit>" entries joined by "," (NVIDIA's MPS
# docs, Environment Variables): an allocation that would take the device past its limit fails in
# this client with CUDA_ERROR_OUT_OF_MEMORY. Usage: fake-mps-client <MiB> [<MiB> ...] (device 0).
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
try:
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid")) as handle:
        os.kill(int(handle.read().strip()), 0)
except (OSError, ValueError):
    print("no MPS control daemon at %r" % pipe)
    sys.exit(3)
limits = {}
for item in filter(None, os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").split(",")):
    m = re.fullmatch(r"([0-9]+)=([0-9]+)([KMGT]?)B?", item.strip())
    if m is None:
        print("bad CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry %r" % item)
        sys.exit(4)
    limits[int(m.group(1))] = int(m.group(2)) * UNITS[m.group(3)]
used = 0
for mib in map(int, sys.argv[1:]):
    if 0 in limits and used + (mib << 20) > limits[0]:
        print("cudaMalloc(%d MiB): CUDA_ERROR_OUT_OF_MEMORY (pinned device memory limit %d MiB, %d MiB in use)"
              % (mib, limits[0] >> 20, used >> 20))
        sys.exit(2)
    used += mib << 20
    print("cudaMalloc(%d MiB): ok" % mib)
sys.exit(0)
"""


def _install(tmp_path: Path, name: str, source: str) -> Path:
    """`source` as an executable script `name` in tmp_path/bin, run by this interpreter."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text(f"#!{sys.executable} -S\n{source}")
    path.chmod(0o755)
    return path


def install_client(tmp_path: Path) -> Path:
    """The fake MPS client (`FAKE_CLIENT`) in tmp_path/bin."""
    return _install(tmp_path, "fake-mps-client", FAKE_CLIENT)


def install(tmp_path: Path) -> Path:
    """The fake control binary in tmp_path/bin."""
    return _install(tmp_path, "nvidia-cuda-mps-control", FAKE_CONTROL)


def kill_daemons(tmp_path: Path) -> None:
    """End every daemon the fake started under tmp_path, by the PIDs it recorded."""
    for record in tmp_path.rglob("fake-commands.log"):
        for line in record.read_text().splitlines():
            if line.startswith("daemon-start "):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)


def behave(fake: Path, *flags: str) -> None:
    (fake.parent / "fake-behaviour").write_text(" ".join(flags))


def cfg(text: str = "", **flags: object) -> Config:
    return config_from_data(parse_config_text(text, "test.yaml"), flags=flags, source="test.yaml")


UNEVEN = (
    "sharing: {mps: {resources: ["
    "{name: gpu, rename: gpu-mps, devices: [0], replicas: 2}, "
    "{name: gpu, rename: gpu-mps, devices: [1], replicas: 4}]}}"
)
EVEN = "sharing: {mps: {resources: [{name: gpu, rename: gpu-mps, devices: [0, 1], replicas: 4}]}}"
RESOURCE = "nvidia.com/gpu-mps"


def mps_plans(root: Path, text: str = UNEVEN) -> dict[str, ResourcePlan]:
    return plan_resources(nodes.pcie_l4(), cfg(text, mps_root=str(root)))


class Recorder:
    """Collects on_change calls (from whichever thread makes them)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool, str]] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, resource: str, up: bool, reason: str) -> None:
        with self._lock:
            self.events.append((resource, up, reason))
            self.threads.add(threading.current_thread().name)


def manager(fake: Path, recorder: Recorder, **kwargs: Any) -> mps.MpsDaemons:
    options: dict[str, Any] = {"backoff_initial": 0.0, "probe_interval": 0.2, "command_timeout": 5.0}
    options.update(kwargs)
    return mps.MpsDaemons(recorder, binary=str(fake), **options)


def tick_until(daemons: mps.MpsDaemons, predicate: Callable[[], object], timeout: float = 20.0) -> bool:
    def step() -> bool:
        daemons.tick(time.monotonic())
        return bool(predicate())

    return wait_until(step, timeout, interval=0.02)


def commands(root: Path, resource: str = RESOURCE) -> list[str]:
    path = root / resource / "log" / "fake-commands.log"
    return path.read_text().splitlines() if path.exists() else []


def daemon_pids(root: Path, resource: str = RESOURCE) -> list[int]:
    return [int(line.split()[1]) for line in commands(root, resource) if line.startswith("daemon-start ")]


def dead(pid: int) -> bool:
    return not mpslayout._alive(pid)
