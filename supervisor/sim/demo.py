"""`gpuvisor demo`: the whole path in a few seconds, on a simulated node, in a temp dir.

It starts a kubelet stand-in and a real supervisor process (`gpuvisor run --simulate ...`),
shows what the kubelet sees, allocates two GPUs, injects an XID, shows the device go Unhealthy
and come back after a GPU reset, and cleans up. The supervisor's own log goes to a file in the
temp dir, shown only if something fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from supervisor.sim.kubelet import KubeletStandin


def _say(text: str = "") -> None:
    print(text, flush=True)


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def show_devices(kubelet: KubeletStandin, resource: str) -> None:
    devices = kubelet.devices(resource)
    _say(f"  {resource}: capacity {kubelet.capacity(resource)}, allocatable {kubelet.allocatable(resource)}")
    for dev in sorted(devices.values(), key=lambda d: d.id):
        numa = ",".join(str(n) for n in dev.numa_nodes) or "-"
        _say(f"    {dev.id:<44} {dev.health:<9} NUMA {numa}")


def run_demo(profile: str, follow: bool) -> int:
    base = tempfile.mkdtemp(prefix="gvdemo", dir="/tmp")
    plugin_dir = os.path.join(base, "plugins")
    run_dir = os.path.join(base, "run")
    log_path = os.path.join(base, "supervisor.log")
    kubelet = KubeletStandin(plugin_dir)
    proc: subprocess.Popen[bytes] | None = None
    try:
        kubelet.start()
        _say(f"gpuvisor demo: a simulated '{profile}' node, a kubelet stand-in on {kubelet.socket_path}")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "supervisor", "run",
                    "--simulate", profile,
                    "--kubelet-socket", kubelet.socket_path,
                    "--run-dir", run_dir,
                    "--metrics-address", "",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        started = time.monotonic()
        if not _wait(
            lambda: (
                (
                    bool(kubelet.resource_names())
                    and all(kubelet.connected(r) for r in kubelet.resource_names())
                )
                or (proc is not None and proc.poll() is not None)
            ),
            60,
        ):
            raise DemoError("the plugin did not register within 60 s")
        if proc.poll() is not None:
            raise DemoError(f"the supervisor exited with status {proc.returncode}")
        _wait(
            lambda: (
                len(kubelet.resource_names()) > 0
                and all(kubelet.connected(r) for r in kubelet.resource_names())
            ),
            5,
        )
        _say(f"\n1. Registered in {time.monotonic() - started:.2f}s. What the kubelet sees:")
        for resource in kubelet.resource_names():
            show_devices(kubelet, resource)

        resource = (
            "nvidia.com/gpu" if "nvidia.com/gpu" in kubelet.resource_names() else kubelet.resource_names()[0]
        )
        ids, response = kubelet.allocate(resource, 2)
        _say(f"\n2. A pod asks for 2 x {resource}. GetPreferredAllocation picked {', '.join(ids)}.")
        _say("   Allocate answered:")
        for key, value in sorted(response.envs.items()):
            _say(f"     env {key}={value}")
        for spec in response.devices:
            _say(f"     device {spec.host_path} -> {spec.container_path} ({spec.permissions})")

        from supervisor.control.client import send_command

        victim = ids[0].split("::")[0]
        _say(f"\n3. XID 48 (double-bit ECC) on {victim}:")
        send_command(run_dir, "sim", {"action": "xid", "device": victim, "xid": 48})
        t0 = time.monotonic()
        if not _wait(lambda: kubelet.devices(resource)[ids[0]].health == "Unhealthy", 10):
            raise DemoError("the device did not turn Unhealthy")
        _say(f"   the kubelet saw it Unhealthy after {1000 * (time.monotonic() - t0):.1f} ms;"
             f" allocatable now {kubelet.allocatable(resource)}")  # fmt: skip

        _say(f"\n4. The GPU is reset (gpuvisor sim reset --device {victim}):")
        send_command(run_dir, "sim", {"action": "reset", "device": victim})
        t0 = time.monotonic()
        if not _wait(lambda: kubelet.devices(resource)[ids[0]].health == "Healthy", 10):
            raise DemoError("the device did not recover")
        _say(f"   Healthy again after {1000 * (time.monotonic() - t0):.1f} ms, with no restart;"
             f" allocatable {kubelet.allocatable(resource)}")  # fmt: skip

        if follow:
            _say(
                f"\nRunning; try `gpuvisor status --run-dir {run_dir}` or `gpuvisor sim ...`. Ctrl-C to stop."
            )
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                while proc.poll() is None:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
        _say("\nDone: stopping the supervisor and the kubelet stand-in.")
        return 0
    except DemoError as exc:
        _say(f"\ngpuvisor demo failed: {exc}")
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            _say("supervisor log:\n" + fh.read()[-4000:])
        return 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


class DemoError(Exception):
    pass
