"""CPU of the whole tree (supervisor, zygote, workers) while the node is idle, beside the floor.

After every resource is registered and listed, the CPU time of every thread of the tree
(/proc/<pid>/task/<tid>/schedstat, nanoseconds) is taken at the start and the end of the window;
the figure is that time as a percentage of one core. Nothing is allocated and no fault is
injected meanwhile: what is left is heartbeats, beacons, probes and timers. Beside it, the same
figure of a bare gRPC plugin in the same run (`floors`), and NVIDIA's reference.

CPU time on a shared machine is noisy, so the same window also counts wake-ups, which the load
does not change (tests/benchmarks/wakeups.py: voluntary context switches per thread): per
process, and the busiest threads by name, per minute. They say which timer or poll an idle node
still runs.
"""

from __future__ import annotations

import time

import psutil

from tests.benchmarks import floors, node, wakeups
from tests.benchmarks.common import NVIDIA_IDLE_CPU_PCT, Row
from tests.dranode import DraNode
from tests.harness import SimNode


def _names(sim: SimNode, procs: list[psutil.Process]) -> dict[int, str]:
    names = {}
    for proc in procs:
        try:
            cmd = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if sim.proc is not None and proc.pid == sim.proc.pid:
            names[proc.pid] = "supervisor"
        elif "--resource" in cmd:
            names[proc.pid] = "worker " + cmd[cmd.index("--resource") + 1]
        else:
            names[proc.pid] = "zygote"
    return names


def _idle(
    sim: SimNode, resources: list[str], window: float
) -> tuple[float, int, list[wakeups.ThreadWakeups]]:
    sim.wait_listed(resources, 60)
    time.sleep(2.0)
    assert sim.proc is not None
    procs = [psutil.Process(sim.proc.pid), *sim.workers()]
    cpu = floors.idle_cpu_pct(procs, window)
    return cpu, len(procs), wakeups.measure(_names(sim, procs), window)


def _wakeup_rows(what: str, rows: list[wakeups.ThreadWakeups], window: float) -> list[Row]:
    total = sum(r.per_minute for r in rows)
    by_process = ", ".join(f"{name} {n:.0f}" for name, n in wakeups.per_process(rows).most_common())
    return [
        Row(
            f"{what}: idle wake-ups, whole tree",
            total,
            "/min",
            "",
            f"{window:.0f} s; per process: {by_process}",
        ),
        Row(f"{what}: busiest threads", float(len(rows)), "threads", "", wakeups.describe(rows)),
    ]


def run(quick: bool) -> list[Row]:
    window = 10.0 if quick else 30.0
    kind = node.one_resource()  # first: under --real-gpu, a node without a driver fails before the floors
    floor = floors.measure(quick)
    with kind.node() as sim:
        one, one_procs, one_wakes = _idle(sim, [node.GPU], window)
    with node.mig_node() as sim:
        five, five_procs, five_wakes = _idle(sim, node.MIG_RESOURCES, window)
    with DraNode("pcie-l4", scan_interval=1.0) as dra:  # the DRA worker and its health stream
        dra.wait_registered(60)
        dra_cpu, dra_procs, dra_wakes = _idle(dra, [], window)
    return [
        *_wakeup_rows("1 resource", one_wakes, window),
        *_wakeup_rows("5 resources", five_wakes, window),
        *_wakeup_rows("DRA node", dra_wakes, window),
        Row("DRA node: idle CPU, whole tree", dra_cpu, "% of a core", "<= 0.20 % (issue 42)",
            f"{dra_procs} processes over {window:.0f} s, simulated pcie-l4 in --mode dra, the DRA kubelet "
            "stand-in's health stream open"),
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
