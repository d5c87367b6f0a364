"""CPU of the whole tree (supervisor, zygote, workers) while the node is idle, beside the floor.

After every resource is registered and listed, the CPU time of every thread of the tree
(/proc/<pid>/task/<tid>/schedstat, nanoseconds) is taken at the start and the end of the window;
the figure is that time as a percentage of one core. Nothing is allocated and no fault is
injected meanwhile: what is left is heartbeats, beacons, probes and timers. Beside it, the same
figure of a bare gRPC plugin in the same run (`floors`), and NVIDIA's reference.
"""

from __future__ import annotations

import time

import psutil

from tests.benchmarks import floors, node
from tests.benchmarks.common import NVIDIA_IDLE_CPU_PCT, Row
from tests.harness import SimNode


def _idle(sim: SimNode, resources: list[str], window: float) -> tuple[float, int]:
    sim.wait_listed(resources, 60)
    time.sleep(2.0)
    assert sim.proc is not None
    procs = [psutil.Process(sim.proc.pid), *sim.workers()]
    return floors.idle_cpu_pct(procs, window), len(procs)


def run(quick: bool) -> list[Row]:
    window = 10.0 if quick else 30.0
    kind = node.one_resource()  # first: under --real-gpu, a node without a driver fails before the floors
    floor = floors.measure(quick)
    with kind.node() as sim:
        one, one_procs = _idle(sim, [node.GPU], window)
    with node.mig_node() as sim:
        five, five_procs = _idle(sim, node.MIG_RESOURCES, window)
    return [
        Row(
            "1 resource: idle CPU, whole tree", one, "% of a core",
            f"<= {NVIDIA_IDLE_CPU_PCT:.2f} % (NVIDIA's)",
            f"{one_procs} processes over {window:.0f} s, {kind.what}; bare gRPC plugin "
            f"{floor.bare_idle_cpu_pct:.3f} % over {floor.idle_window_s:.0f} s, same run",
        ),
        Row(
            "5 resources: idle CPU, whole tree", five, "% of a core", "",
            f"{five_procs} processes over {window:.0f} s, {node.five_resources().what}",
        ),
    ]  # fmt: skip
