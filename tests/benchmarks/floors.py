"""The floors: what Python itself costs on this machine, measured in the same run as the figures.

A start, a footprint or an idle CPU figure of gpuvisor means little alone on a shared 2-core
machine; beside what the same interpreter and gRPC cost here, in the same run, it shows how far
it is from what Python allows. `measure(quick)` takes them once per run (the benchmarks that read
them share one measurement) and `rows()` reports them:

- interpreter: `python -c pass`, process start to exit;
- worker imports: `python -c "import grpc, zmq, common.kubeletapi.rpc"`: what any worker process
  must import (gRPC, ZeroMQ, the kubelet API's messages), start to exit;
- a bare plugin (`tests.benchmarks.bareplugin`): the smallest Python device plugin, registering
  with the same kubelet stand-in: process start -> registered with 8 healthy devices; its PSS
  once settled; its CPU while idle; a kubelet restart -> registered again;
- an idle interpreter's PSS (`python -c` asleep).

Each start figure is the p50 of several starts.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from supervisor.sim.kubelet import KubeletStandin
from tests.benchmarks.common import Row, p50
from tests.harness import child_env
from tests.helpers import REPO, short_tmpdir

RESOURCE = "nvidia.com/gpu"
DEVICES = 8
WORKER_IMPORTS = "import grpc, zmq, common.kubeletapi.rpc"


@dataclass(frozen=True)
class Floors:
    interpreter_ms: float  # python -c pass
    worker_imports_ms: float  # python -c "import grpc, zmq, common.kubeletapi.rpc"
    bare_start_ms: float  # bare plugin: process start -> registered with DEVICES healthy
    bare_pss_mb: float  # bare plugin, settled
    bare_idle_cpu_pct: float  # bare plugin, % of a core while idle
    bare_restart_ms: float  # kubelet restart -> the bare plugin registered again
    python_pss_mb: float  # an idle interpreter
    idle_window_s: float


def pss_mb(pid: int) -> float:
    """PSS of one process, in MB (10^6 bytes), from /proc/<pid>/smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """CPU time of `procs`, every thread's, from /proc/<pid>/task/<tid>/schedstat (nanoseconds:
    user + system ticks of 10 ms would read an idle process over 10 s as 0 or 0.1 %)."""
    total_ns = 0
    for proc in procs:
        try:
            tids = os.listdir(f"/proc/{proc.pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                    total_ns += int(fh.read().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass  # a thread that ended meanwhile
    return total_ns / 1e9


def idle_cpu_pct(procs: list[psutil.Process], window: float) -> float:
    """CPU (user + system) of `procs` over `window` seconds, as a percentage of one core."""
    before = cpu_seconds(procs)
    t0 = time.monotonic()
    time.sleep(window)
    return 100.0 * (cpu_seconds(procs) - before) / (time.monotonic() - t0)


def _start_to_exit_ms(code: str, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO, check=True)
        samples.append((time.perf_counter() - t0) * 1000)
    return p50(samples)


def _idle_python_pss() -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, env=child_env()
    )
    try:
        time.sleep(0.3)
        return pss_mb(proc.pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def _relisted(kubelet: KubeletStandin, before: object) -> bool:
    res = kubelet.resource(RESOURCE)
    ep = res.endpoint if res is not None else None
    return ep is not None and ep is not before and ep.connected and ep.updates > 0


def _bare_plugin(starts: int, restarts: int, window: float) -> tuple[float, float, float, float]:
    start_ms: list[float] = []
    restart_ms: list[float] = []
    pss = idle = float("nan")
    with short_tmpdir("gvfloor") as base:
        for i in range(starts):
            plugin_dir = os.path.join(base, f"p{i}")
            os.makedirs(plugin_dir)
            kubelet = KubeletStandin(plugin_dir)
            kubelet.start()
            argv = [
                sys.executable,
                "-m",
                "tests.benchmarks.bareplugin",
                "--kubelet-socket",
                kubelet.socket_path,
            ]
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, env=child_env(), cwd=REPO, stdin=subprocess.DEVNULL)
            try:
                if not kubelet.wait_for(lambda k=kubelet: k.allocatable(RESOURCE) == DEVICES, 30):  # type: ignore[misc]
                    raise RuntimeError("the bare plugin did not register within 30 s")
                start_ms.append((time.perf_counter() - t0) * 1000)
                if i == 0:
                    time.sleep(1.0)
                    pss = pss_mb(proc.pid)
                    idle = idle_cpu_pct([psutil.Process(proc.pid)], window)
                    for _ in range(restarts):
                        res = kubelet.resource(RESOURCE)
                        before = res.endpoint if res is not None else None
                        kubelet.restart()
                        t1 = time.perf_counter()
                        if kubelet.wait_for(lambda k=kubelet, b=before: _relisted(k, b), 20):  # type: ignore[misc]
                            restart_ms.append((time.perf_counter() - t1) * 1000)
                        time.sleep(0.2)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                kubelet.stop()
    return p50(start_ms), pss, idle, p50(restart_ms)


@functools.cache
def measure(quick: bool) -> Floors:
    """The floors of this run (measured once, then shared by every benchmark that reads them)."""
    rounds = 5 if quick else 11
    window = 10.0
    bare_start, bare_pss, bare_idle, bare_restart = _bare_plugin(rounds, 5 if quick else 20, window)
    return Floors(
        interpreter_ms=_start_to_exit_ms("pass", rounds),
        worker_imports_ms=_start_to_exit_ms(WORKER_IMPORTS, rounds),
        bare_start_ms=bare_start,
        bare_pss_mb=bare_pss,
        bare_idle_cpu_pct=bare_idle,
        bare_restart_ms=bare_restart,
        python_pss_mb=_idle_python_pss(),
        idle_window_s=window,
    )


def rows(floors: Floors) -> list[Row]:
    note = "same run, same interpreter; what Python itself allows on this machine"
    return [
        Row("python -c pass: start -> exit p50", floors.interpreter_ms, "ms", "", note),
        Row(f"python -c '{WORKER_IMPORTS}': start -> exit p50", floors.worker_imports_ms, "ms", "", note),
        Row(
            "bare plugin: start -> registered p50", floors.bare_start_ms, "ms", "",
            f"tests.benchmarks.bareplugin: one gRPC server, {DEVICES} devices, the same kubelet stand-in",
        ),
        Row("bare plugin: PSS", floors.bare_pss_mb, "MB", "", "one process, settled"),
        Row(
            "bare plugin: idle CPU", floors.bare_idle_cpu_pct, "% of a core", "",
            f"over {floors.idle_window_s:g} s",
        ),
        Row("bare plugin: kubelet restart -> registered p50", floors.bare_restart_ms, "ms", "", "inotify on the dir"),
        Row("idle python: PSS", floors.python_pss_mb, "MB", "", "python -c, asleep"),
    ]  # fmt: skip
