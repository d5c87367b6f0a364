"""Benchmark: the real NVML binding over the project's fake libnvidia-ml, beside the simulator's figures.

- Discovery per profile (the simulator's built-ins and NVIDIA's mock profiles): `Nvml.discover()`
  over the real `pynvml`, timed inside a child process per profile after one nvmlInit; the same
  discovery over the Python simulator is timed in this process, for comparison.
- XID -> Unhealthy at the kubelet: `gpuvisor run` on the real binding (dgx-a100), an XID 48
  appended to the library's control file, timed from the write until the kubelet stand-in
  receives the ListAndWatch message with the GPU Unhealthy. The path: the inotify watch wakes the
  health thread blocked in nvmlEventSetWait -> event -> health book on the main loop -> ZeroMQ ->
  worker -> ListAndWatch; `bench_health` times the same path from the simulator's injection.
  XID 48 is made transient here (quiet period 0.2 s) so each round recovers; the way back (the
  quiet period, then a passing probe every 0.1 s) is reported too.

Reports a NaN row with the reason where the library cannot be built (no C compiler).
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from pathlib import Path

import yaml

from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import Simulator
from tests import fakenvml
from tests.benchmarks.bench_health import Arrival
from tests.benchmarks.common import Row, p50, p99

GPU = "nvidia.com/gpu"
FAULT_PROFILE = "dgx-a100"
ROUNDS, ROUNDS_QUICK = 40, 10
DISCOVERIES, DISCOVERIES_QUICK = 50, 10
PROBE_S = 0.1


def _simulator_p50(profile: str, rounds: int) -> float:
    nvml = Nvml(Simulator(fakenvml.spec_for(profile)), sysfs_root=None)
    nvml.init()
    samples = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        nvml.discover()
        samples.append((time.perf_counter() - start) * 1000)
    nvml.shutdown()
    return p50(samples[1:])


def _discovery_rows(libdir: Path, tmp: str, rounds: int) -> list[Row]:
    rows = []
    for profile in fakenvml.profiles():
        node = fakenvml.FakeNode(tempfile.mkdtemp(dir=tmp), profile)
        report = fakenvml.child_report(
            node.environ(libdir), "--sysfs", "none", "--discover-rounds", str(rounds + 1), timeout=120
        )
        samples = report["discover_ms"][1:]  # the first pays for lazy symbol lookups
        gpus = len(report["node"]["gpus"])
        note = (
            f"{gpus} GPUs, {rounds} rounds; nvmlInit {report['init_ms']:.1f} ms; "
            f"simulator {_simulator_p50(profile, rounds):.2f} ms"
        )
        rows.append(Row(f"discovery {profile} p50 (real binding)", p50(samples), "ms", "", note))
    return rows


def _fault_rows(libdir: Path, tmp: str, rounds: int) -> list[Row]:
    fake = fakenvml.FakeNode(tempfile.mkdtemp(dir=tmp), FAULT_PROFILE)
    to_unhealthy: list[float] = []
    to_healthy: list[float] = []
    config = os.path.join(tmp, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        yaml.safe_dump(
            {
                "version": "v1",
                "gpuvisor": {"health": {"transientQuietSeconds": 0.2, "xids": {"48": "transient"}}},
            },
            fh,
        )
    args = ["--config-file", config, "--probe-interval", str(PROBE_S)]
    with fakenvml.real_node(fake.environ(libdir), args) as node:
        node.wait_listed([GPU], 60)
        arrival = Arrival()
        node.kubelet.listeners.append(arrival)
        phase = random.Random(17)
        for i in range(rounds):
            gpu = fake.uuids[i % len(fake.uuids)]
            time.sleep(phase.uniform(0, PROBE_S))
            arrival.expect(gpu, "Unhealthy")
            start = time.perf_counter()
            fake.control.inject_xid(gpu, 48)
            to_unhealthy.append((arrival.wait() - start) * 1000)
            arrival.expect(gpu, "Healthy")
            start = time.perf_counter()
            to_healthy.append((arrival.wait() - start) * 1000)
    note = f"{rounds} XID 48 on {FAULT_PROFILE}: control file written -> stand-in's ListAndWatch"
    back = f"Unhealthy -> Healthy: quiet period 0.2 s, then a passing probe (every {PROBE_S:g} s)"
    return [
        Row("real binding XID->Unhealthy p50", p50(to_unhealthy), "ms", "", note),
        Row("real binding XID->Unhealthy p99", p99(to_unhealthy), "ms", "", note),
        Row("real binding XID->Unhealthy max", max(to_unhealthy), "ms", "", note),
        Row("real binding recovery p50", p50(to_healthy), "ms", "", back),
    ]


def run(quick: bool) -> list[Row]:
    reason = fakenvml.skip_reason()
    if reason is not None:
        return [Row("real binding", math.nan, "", "", reason)]
    with fakenvml.built() as libdir, tempfile.TemporaryDirectory(prefix="gvbench-") as tmp:
        rows = _discovery_rows(libdir, tmp, DISCOVERIES_QUICK if quick else DISCOVERIES)
        rows += _fault_rows(libdir, tmp, ROUNDS_QUICK if quick else ROUNDS)
    return rows
