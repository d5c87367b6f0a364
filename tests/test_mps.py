"""Tests of supervisor.mps against a fake `nvidia-cuda-mps-control` written by the tests.

The fake behaves like the real tool in what the manager relies on: `-d` forks a background daemon
and returns at once (the daemon writes `nvidia-cuda-mps-control.pid` in the pipe directory a
moment later); without arguments it reads one command from stdin, fails when no daemon is alive
for that pipe directory, and `quit` ends the daemon. It records every command in the log
directory, and a `fake-behaviour` file beside it makes it misbehave on demand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.config import Config, config_from_data, parse_config_text
from common.model import ResourcePlan
from common.nvml import Nvml
from common.planning import plan_resources
from common.simulator import load_simulator
from supervisor import mps, mpslayout
from tests import nodes
from tests.helpers import wait_until

FAKE_CONTROL = r'''
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
'''


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Path]:
    """The fake control binary in tmp_path/bin; afterwards every daemon it started is gone."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    path = bindir / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable} -S\n{FAKE_CONTROL}")
    path.chmod(0o755)
    yield path
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


# --- settings -------------------------------------------------------------------------------------


def test_settings_follow_replica_counts(tmp_path: Path) -> None:
    """Pinned-memory limits are per GPU from that GPU's replicas; the thread share is 100 / the largest count."""
    plan = mps_plans(tmp_path)[RESOURCE]
    settings = mps.daemon_settings(plan)
    memory = nodes.pcie_l4().gpus[0].memory_mib
    assert settings.pinned_limits == ((0, memory // 2), (1, memory // 4))
    assert settings.thread_percentage == 25
    assert settings.commands() == [
        f"set_default_device_pinned_mem_limit 0 {memory // 2}M",
        f"set_default_device_pinned_mem_limit 1 {memory // 4}M",
        "set_default_active_thread_percentage 25",
    ]
    even = mps.daemon_settings(mps_plans(tmp_path, "sharing: {mps: {resources: [{name: gpu, replicas: 3}]}}")["nvidia.com/gpu"])
    assert even.thread_percentage == 33 and len(even.pinned_limits) == 4
    assert even.gpu_uuids == tuple(g.uuid for g in nodes.pcie_l4().gpus)


# --- running daemons --------------------------------------------------------------------------


def test_start_commands_markers_and_shutdown(tmp_path: Path, fake: Path) -> None:
    """Start sends the limits, writes .started/.ready and reports up; shutdown quits the daemon and removes the markers."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder)
    daemons.set_plans(mps_plans(root))
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    assert daemons.all_up()
    memory = nodes.pcie_l4().gpus[0].memory_mib
    pid = daemon_pids(root)[0]
    assert commands(root)[1:] == [
        f"set_default_device_pinned_mem_limit 0 {memory // 2}M",
        f"set_default_device_pinned_mem_limit 1 {memory // 4}M",
        "set_default_active_thread_percentage 25",
    ]
    assert recorder.events == [
        (RESOURCE, False, "MPS control daemon not started yet"),
        (RESOURCE, True, f"MPS control daemon up (pid {pid})"),
    ]
    assert (root / RESOURCE / "pipe" / "nvidia-cuda-mps-control.pid").read_text() == str(pid)
    assert (root / RESOURCE / ".started").exists()
    ready = json.loads((root / ".ready").read_text())
    assert ready["resources"][RESOURCE]["replicas"] == {"0": 2, "1": 4}
    assert stat.S_IMODE(os.stat(root / "shm").st_mode) == 0o1777
    status = daemons.status()[RESOURCE]
    assert (status.state, status.pid, status.thread_percentage) == ("up", pid, 25)

    daemons.shutdown()
    assert commands(root)[-1] == "quit"
    assert dead(pid)
    assert not (root / RESOURCE / ".started").exists() and not (root / ".ready").exists()
    assert not daemons.is_up(RESOURCE)


def test_dead_daemon_is_restarted(tmp_path: Path, fake: Path) -> None:
    """A killed daemon is reported down (markers removed), started again, and gets its limits again."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder)
    daemons.set_plans(mps_plans(root, EVEN))
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    first = daemon_pids(root)[0]
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: dead(first))
    daemons.tick(time.monotonic())
    assert recorder.events[-1] == (RESOURCE, False, f"MPS control daemon (pid {first}) exited")
    assert not (root / RESOURCE / ".started").exists() and not (root / ".ready").exists()
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    second = daemon_pids(root)[-1]
    assert second != first
    assert recorder.events[-1] == (RESOURCE, True, f"MPS control daemon up (pid {second})")
    assert commands(root).count("set_default_active_thread_percentage 25") == 2
    assert daemons.status()[RESOURCE].restarts == 1
    daemons.shutdown()
    assert dead(second)


def test_hung_daemon_is_killed_and_restarted(tmp_path: Path, fake: Path) -> None:
    """A daemon that stops answering the health query twice is reported down, killed, and replaced."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder, command_timeout=0.5, probe_interval=0.05)
    daemons.set_plans(mps_plans(root, EVEN))
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    first = daemon_pids(root)[0]
    behave(fake, "hang-query")
    assert tick_until(daemons, lambda: not daemons.is_up(RESOURCE))
    resource, up, reason = recorder.events[-1]
    assert (resource, up) == (RESOURCE, False)
    assert reason == f"MPS control daemon (pid {first}) is not answering: no answer within 0.5s"
    assert wait_until(lambda: dead(first))
    behave(fake)
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    assert daemon_pids(root)[-1] != first
    daemons.shutdown()


def test_start_failure_is_reported_and_retried(tmp_path: Path, fake: Path) -> None:
    """A failing `-d` keeps the resource down with the tool's own message, and a later start succeeds."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder, backoff_initial=30.0)
    behave(fake, "fail-start")
    daemons.set_plans(mps_plans(root))
    now = time.monotonic()
    daemons.tick(now)
    assert not daemons.is_up(RESOURCE)
    status = daemons.status()[RESOURCE]
    assert status.state == "down"
    assert status.reason.endswith("-d exited with status 1: fake: cannot start the control daemon")
    assert recorder.events == [(RESOURCE, False, "MPS control daemon not started yet")]  # one report while down
    behave(fake)
    daemons.tick(now + 10)  # still backing off: nothing started
    assert daemon_pids(root) == []
    daemons.tick(now + 31)
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    daemons.shutdown()


def test_refused_limits_fail_the_start(tmp_path: Path, fake: Path) -> None:
    """A daemon that refuses its limits until the start deadline is killed and reported down with the command."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder, start_timeout=0.3, backoff_initial=60.0)
    behave(fake, "refuse")
    daemons.set_plans(mps_plans(root, EVEN))
    assert tick_until(daemons, lambda: daemon_pids(root))
    pid = daemon_pids(root)[0]
    assert tick_until(daemons, lambda: daemons.status()[RESOURCE].state == "down")
    reason = daemons.status()[RESOURCE].reason
    assert reason.startswith(f"MPS control daemon (pid {pid}) refused its limits: 'set_default_device_pinned_mem_limit 0 ")
    assert "exit status 1: refused: set_default_device_pinned_mem_limit 0" in reason
    assert wait_until(lambda: dead(pid))
    daemons.shutdown()


def test_running_daemon_is_adopted(tmp_path: Path, fake: Path) -> None:
    """A daemon left running by an earlier gpuvisor is adopted, not restarted, and gets its limits again."""
    root = tmp_path / "mps"
    earlier = manager(fake, Recorder())
    earlier.set_plans(mps_plans(root, EVEN))
    assert tick_until(earlier, lambda: earlier.is_up(RESOURCE))
    pid = daemon_pids(root)[0]
    recorder = Recorder()
    later = manager(fake, recorder)
    later.set_plans(mps_plans(root, EVEN))
    assert tick_until(later, lambda: later.is_up(RESOURCE))
    assert daemon_pids(root) == [pid]
    assert recorder.events[-1] == (RESOURCE, True, f"MPS control daemon up (pid {pid})")
    assert commands(root).count("set_default_active_thread_percentage 25") == 2
    later.shutdown()
    assert dead(pid)


def test_reload_updates_limits_in_place_and_stops_removed(tmp_path: Path, fake: Path) -> None:
    """A reload re-sends changed limits to the same daemon and quits the daemon of a resource no longer on MPS."""
    root = tmp_path / "mps"
    daemons = manager(fake, Recorder())
    daemons.set_plans(mps_plans(root, EVEN))
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    pid = daemon_pids(root)[0]
    daemons.set_plans(mps_plans(root))  # GPU 0 now 2 replicas
    daemons.tick(time.monotonic())
    memory = nodes.pcie_l4().gpus[0].memory_mib
    assert f"set_default_device_pinned_mem_limit 0 {memory // 2}M" in commands(root)
    assert daemon_pids(root) == [pid] and daemons.is_up(RESOURCE)
    assert json.loads((root / ".ready").read_text())["resources"][RESOURCE]["replicas"] == {"0": 2, "1": 4}
    daemons.set_plans(plan_resources(nodes.pcie_l4(), cfg()))
    daemons.tick(time.monotonic())
    assert commands(root)[-1] == "quit" and dead(pid)
    assert daemons.status() == {} and daemons.all_up()
    assert not (root / ".ready").exists()
    daemons.shutdown()


def test_thread_ticks_and_reports_from_its_own_thread(tmp_path: Path, fake: Path) -> None:
    """start_thread supervises without hand ticks; on_change runs on the MPS thread; shutdown ends both."""
    root = tmp_path / "mps"
    recorder = Recorder()
    daemons = manager(fake, recorder)
    daemons.start_thread(interval=0.05)
    daemons.set_plans(mps_plans(root))
    assert wait_until(lambda: daemons.is_up(RESOURCE), 20)
    assert recorder.threads == {"gpuvisor-mps"}
    pid = daemon_pids(root)[0]
    daemons.shutdown()
    assert dead(pid)
    assert not any(t.name == "gpuvisor-mps" for t in threading.enumerate())


def test_exclusive_process_mode(tmp_path: Path, fake: Path) -> None:
    """exclusive_process sets EXCLUSIVE_PROCESS while the daemon runs, DEFAULT after; an NVML failure keeps it down."""
    sim = load_simulator("pcie-l4")
    nvml = Nvml(sim)
    nvml.init()
    node = nvml.discover()
    text = "sharing: {mps: {resources: [{name: gpu, rename: gpu-mps, devices: [0], replicas: 2}]}}"
    plans = plan_resources(node, cfg(text, mps_root=str(tmp_path / "mps")))
    handle0 = sim.nvmlDeviceGetHandleByIndex(0)
    handle1 = sim.nvmlDeviceGetHandleByIndex(1)
    daemons = manager(fake, Recorder(), nvml_module=sim, exclusive_process=True)
    daemons.set_plans(plans)
    assert tick_until(daemons, lambda: daemons.is_up(RESOURCE))
    assert sim.nvmlDeviceGetComputeMode(handle0) == sim.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert sim.nvmlDeviceGetComputeMode(handle1) == sim.NVML_COMPUTEMODE_DEFAULT  # not MPS-shared
    daemons.shutdown()
    assert sim.nvmlDeviceGetComputeMode(handle0) == sim.NVML_COMPUTEMODE_DEFAULT

    sim.fail("nvmlDeviceSetComputeMode", 4)  # NVML_ERROR_NO_PERMISSION
    failing = manager(fake, Recorder(), nvml_module=sim, exclusive_process=True, backoff_initial=60.0)
    failing.set_plans(plans)
    failing.tick(time.monotonic())
    reason = failing.status()[RESOURCE].reason
    assert reason.startswith(f"cannot set compute mode EXCLUSIVE_PROCESS on GPU {node.gpus[0].uuid} for {RESOURCE}: ")
    failing.shutdown()
    with pytest.raises(ValueError, match="exclusive_process needs the NVML module"):
        mps.MpsDaemons(Recorder(), exclusive_process=True)


# --- errors ---------------------------------------------------------------------------------------


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    """A missing control binary fails set_plans with where it looked and how to fix it; non-MPS plans need none."""
    daemons = mps.MpsDaemons(Recorder(), environ={"PATH": str(tmp_path / "empty")}, driver_root=str(tmp_path / "drv"))
    with pytest.raises(mps.MpsError) as err:
        daemons.set_plans(mps_plans(tmp_path / "mps"))
    text = str(err.value)
    assert text.startswith("MPS sharing needs the CUDA MPS control binary nvidia-cuda-mps-control, but it is neither on PATH")
    assert f"{tmp_path}/drv/usr/bin/nvidia-cuda-mps-control" in text and "--mps-control-binary" in text
    daemons.set_plans(plan_resources(nodes.pcie_l4(), cfg()))  # no MPS: fine
    with pytest.raises(mps.MpsError, match=r"^MPS sharing needs the CUDA MPS control binary, but /nope/x does not exist"):
        mps.MpsDaemons(Recorder(), binary="/nope/x").set_plans(mps_plans(tmp_path / "mps"))


def test_binary_found_on_path_or_under_driver_root(tmp_path: Path, fake: Path) -> None:
    """The bare name is looked up on PATH first, then in the driver root's bin directories."""
    assert mps.find_control_binary(path=str(fake.parent)) == str(fake)
    driver = tmp_path / "driver"
    (driver / "usr" / "bin").mkdir(parents=True)
    target = driver / "usr" / "bin" / "nvidia-cuda-mps-control"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    assert mps.find_control_binary(driver_root=str(driver), path=str(tmp_path / "empty")) == str(target)


def test_mps_plan_without_root_is_refused(tmp_path: Path, fake: Path) -> None:
    """A hand-made MPS plan with no MPS root is refused before anything starts."""
    plan = mps_plans(tmp_path / "mps")[RESOURCE]
    broken = dataclasses.replace(plan, allocate=dataclasses.replace(plan.allocate, mps_root=""))
    with pytest.raises(mps.MpsError, match=r"^resource nvidia.com/gpu-mps is shared with MPS but has no MPS root"):
        manager(fake, Recorder()).set_plans({RESOURCE: broken})


# --- reaping under a subreaper ------------------------------------------------------------------

SUBREAPER_SCRIPT = r"""
import json, os, signal, subprocess, sys, time

from common.model import ResourcePlan
from supervisor import mps, mpslayout
from supervisor.zygote import become_subreaper

fake, plan_path, resource = sys.argv[1:4]


def stat_of(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rpartition(")")[2].split()
    except OSError:
        return None


def until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


assert become_subreaper()
with open(plan_path) as handle:
    plan = ResourcePlan.from_json(handle.read())
daemons = mps.MpsDaemons(lambda *args: None, binary=fake, backoff_initial=60.0, probe_interval=60.0)
daemons.set_plans({resource: plan})
out = {}
try:
    assert until(lambda: daemons.tick(time.monotonic()) or daemons.is_up(resource))
    pid = daemons.status()[resource].pid
    out["pid"] = pid
    out["adopted"] = stat_of(pid)[1] == str(os.getpid())
    os.kill(pid, signal.SIGKILL)
    until(lambda: (stat_of(pid) or ["Z"])[0] == "Z")
    until(lambda: daemons.tick(time.monotonic()) or not daemons.is_up(resource))
    out["reaped"] = stat_of(pid) is None

    # A zombie child that is not an MPS daemon (a worker), named by a stale pid file: its exit
    # status stays with whoever waits for it.
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    until(lambda: (stat_of(child.pid) or ["Z"])[0] == "Z")
    out["stranger_alive"] = mpslayout._alive(child.pid)
    out["stranger_status"] = child.wait()
finally:
    daemons.shutdown()
print(json.dumps(out))
"""


def test_daemon_zombie_is_reaped_by_a_subreaper_that_is_not_pid_1(tmp_path: Path, fake: Path) -> None:
    """A daemon re-parented to a (non-PID-1) subreaper is reaped when it dies; a worker's zombie is left alone."""
    import subprocess

    from tests.helpers import REPO

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(mps_plans(tmp_path / "mps", EVEN)[RESOURCE].to_json())
    done = subprocess.run(
        [sys.executable, "-c", SUBREAPER_SCRIPT, str(fake), str(plan_path), RESOURCE],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["adopted"], "the daemon was not re-parented to the subreaper"
    assert out["reaped"], f"MPS daemon {out['pid']} was left a zombie of the subreaper"
    assert out["stranger_alive"] is False
    assert out["stranger_status"] == 7
