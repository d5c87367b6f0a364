"""Benchmark: the real NVML binding over NVIDIA's mock libnvidia-ml, beside the simulator's figures.

- Discovery per mock profile: `supervisor.node.nvml.Nvml.discover()` over the real `pynvml`, timed inside
  a child process per profile (the mock reads its profile at process start), after one nvmlInit;
  the simulator's dgx-h100 discovery is timed the same way in this process, for comparison.
- Fault -> Unhealthy at the kubelet: `gpuvisor run` on the real binding (a100 profile), an XID 48
  written to the mock's override file, timed from the write until the kubelet stand-in receives the
  ListAndWatch message with the GPU Unhealthy; then the fault is cleared and the way back is timed.
  On the mock a fault trips only on a guarded device call, so the path is: the mock re-reads the
  file (every 50 ms here) -> the supervisor's next probe of the GPU (every 100 ms here) trips it and
  already finds the failed row remapping the mock reports with an uncorrectable error -> health
  book -> ZeroMQ -> worker -> ListAndWatch; the XID event follows on the same thread. Each fault
  is written at a random phase of the probe period (else every round would start right after the
  probe that ended the previous one and measure one whole period), so p50 is about half a period
  plus gpuvisor's path, and the minimum is about gpuvisor's path alone; the simulator's
  `bench_health` times the event path alone. XID 48 is made transient here (quiet period 0.2 s) so each round recovers: NVML has
  no event for the GPU reset an until-reset fault waits for.

Reports NaN rows with the reason where the mock is not beside the checkout.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time

import yaml

from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import load_simulator
from tests import mocknvml
from tests.benchmarks.bench_health import Arrival
from tests.benchmarks.common import Row, p50, p99

GPU = "nvidia.com/gpu"
FAULT_PROFILE = "a100"
ROUNDS, ROUNDS_QUICK = 40, 10
DISCOVERIES, DISCOVERIES_QUICK = 50, 10
PROBE_S = 0.1
TTL = "50ms"


def _discovery_rows(libdir: str, rounds: int) -> list[Row]:
    rows = []
    for profile in mocknvml.profiles():
        report = mocknvml.child_report(
            mocknvml.environ(libdir, profile), "--discover-rounds", str(rounds + 1), timeout=120
        )
        samples = report["discover_ms"][1:]  # the first pays for lazy symbol lookups
        note = f"{len(report['node']['gpus'])} GPUs, {rounds} rounds; nvmlInit {report['init_ms']:.1f} ms"
        rows.append(Row(f"discovery {profile} p50 (real binding)", p50(samples), "ms", "", note))
    sim = load_simulator("dgx-h100")
    nvml = Nvml(sim)
    nvml.init()
    samples = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        nvml.discover()
        samples.append((time.perf_counter() - start) * 1000)
    nvml.shutdown()
    rows.append(
        Row("discovery dgx-h100 p50 (simulator)", p50(samples[1:]), "ms", "", f"8 GPUs, {rounds} rounds")
    )
    return rows


def _fault_rows(libdir: str, rounds: int) -> list[Row]:
    gpus = [g.uuid for g in mocknvml.expected_node(FAULT_PROFILE).gpus]
    to_unhealthy: list[float] = []
    to_healthy: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gvbench-") as tmp:
        overrides = mocknvml.overrides_file(tmp)
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
        with mocknvml.real_node(libdir, FAULT_PROFILE, args, overrides=overrides, overrides_ttl=TTL) as node:
            node.wait_listed([GPU], 60)
            arrival = Arrival()
            node.kubelet.listeners.append(arrival)
            phase = random.Random(17)
            for i in range(rounds):
                index = i % len(gpus)
                time.sleep(phase.uniform(0, PROBE_S))
                arrival.expect(gpus[index], "Unhealthy")
                start = time.perf_counter()
                mocknvml.write_overrides(overrides, {index: mocknvml.xid_fault(48)})
                to_unhealthy.append((arrival.wait() - start) * 1000)
                arrival.expect(gpus[index], "Healthy")
                start = time.perf_counter()
                mocknvml.write_overrides(overrides)
                to_healthy.append((arrival.wait() - start) * 1000)
    note = f"{rounds} XID 48 faults on {FAULT_PROFILE}, override written -> stand-in's ListAndWatch; TTL {TTL}, probes every {PROBE_S:g} s at a random phase"
    back = "fault cleared -> Healthy (quiet period 0.2 s and a passing probe)"
    return [
        Row("real binding fault->Unhealthy p50", p50(to_unhealthy), "ms", "", note),
        Row("real binding fault->Unhealthy p99", p99(to_unhealthy), "ms", "", note),
        Row("real binding fault->Unhealthy max", max(to_unhealthy), "ms", "", note),
        Row(
            "real binding fault->Unhealthy min",
            min(to_unhealthy),
            "ms",
            "",
            "a write just before a probe round: the mock re-reading the file, the round, gpuvisor's path",
        ),
        Row("real binding cleared->Healthy p50", p50(to_healthy), "ms", "", back),
    ]


def run(quick: bool) -> list[Row]:
    reason = mocknvml.skip_reason()
    if reason is not None:
        return [Row("real binding", math.nan, "", "", reason)]
    with mocknvml.unpacked("gvbench-mocknvml-") as libdir:
        rows = _discovery_rows(libdir, DISCOVERIES_QUICK if quick else DISCOVERIES)
        rows += _fault_rows(libdir, ROUNDS_QUICK if quick else ROUNDS)
    return rows
