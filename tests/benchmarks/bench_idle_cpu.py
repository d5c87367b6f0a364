"""CPU of the whole tree (supervisor, zygote, workers) while the node is idle.

After every resource is registered and listed, the CPU time (user + system) of every process of
the tree is sampled at the start and the end of the window; the figure is that time as a
percentage of one core over the window. Nothing is allocated and no fault is injected meanwhile:
what is left is heartbeats, beacons, probes and timers.
"""

from __future__ import annotations

import time

import psutil

from tests.benchmarks.bench_startup import RESOURCES
from tests.benchmarks.common import Row
from tests.harness import SimNode


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run(quick: bool) -> list[Row]:
    window = 10.0 if quick else 60.0
    with SimNode("mig-a100", args=["--mig-strategy", "mixed"]) as node:
        node.wait_listed(RESOURCES, 60)
        time.sleep(2.0)
        assert node.proc is not None
        procs = [psutil.Process(node.proc.pid), *node.workers()]
        before = _cpu(procs)
        t0 = time.monotonic()
        time.sleep(window)
        used = _cpu(procs) - before
        elapsed = time.monotonic() - t0
    pct = 100.0 * used / elapsed
    return [
        Row(
            "idle CPU, whole tree",
            pct,
            "% of a core",
            "<= 0.5 %",
            f"{len(procs)} processes over {elapsed:.0f} s",
        )
    ]
