"""Tests of the MPS daemons' supervision (supervisor/mps/daemons.py) against the fake
`nvidia-cuda-mps-control` of tests/mpsfake.py: real daemon processes, started, probed, restarted."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.mps import daemons as mps
from supervisor.node.nvml import Nvml
from supervisor.node.planning import plan_resources
from supervisor.sim.nvml import load_simulator
from tests import nodes
from tests.helpers import checkout_path, wait_until
from tests.mpsfake import (
    EVEN,
    RESOURCE,
    Recorder,
    behave,
    cfg,
    commands,
    daemon_pids,
    dead,
    manager,
    mps_plans,
    tick_until,
)

# --- settings -------------------------------------------------------------------------------------


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
    assert recorder.events == [
        (RESOURCE, False, "MPS control daemon not started yet")
    ]  # one report while down
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
    assert reason.startswith(
        f"MPS control daemon (pid {pid}) refused its limits: 'set_default_device_pinned_mem_limit 0 "
    )
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
    assert reason.startswith(
        f"cannot set compute mode EXCLUSIVE_PROCESS on GPU {node.gpus[0].uuid} for {RESOURCE}: "
    )
    failing.shutdown()
    with pytest.raises(ValueError, match="exclusive_process needs the NVML module"):
        mps.MpsDaemons(Recorder(), exclusive_process=True)


# --- errors ---------------------------------------------------------------------------------------


# --- reaping under a subreaper ------------------------------------------------------------------

SUBREAPER_SCRIPT = r"""
import json, os, signal, subprocess, sys, time

from common.model import ResourcePlan
from supervisor.mps import daemons as mps
from supervisor.mps import layout as mpslayout
from supervisor.workers.zygote import become_subreaper

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
        env={**os.environ, "PYTHONPATH": checkout_path()},
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
