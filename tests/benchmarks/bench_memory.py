"""Memory of the supervisor and each worker (USS and PSS), on `mig-a100` with the mixed strategy.

PSS shares each shared page among the processes that map it, so the PSS figures add up to what
the tree really costs the node; USS is what each process alone would free. Measured after the
node has settled (every resource registered and listed, a few heartbeats later).
"""

from __future__ import annotations

import time

import psutil

from tests.benchmarks.bench_startup import RESOURCES
from tests.benchmarks.common import Row
from tests.harness import SimNode


def _label(proc: psutil.Process, supervisor_pid: int) -> str:
    if proc.pid == supervisor_pid:
        return "supervisor"
    cmd = proc.cmdline()
    if "--resource" in cmd:
        return "worker " + cmd[cmd.index("--resource") + 1]
    if "worker.zygote" in " ".join(cmd):
        return "zygote"
    return "other " + " ".join(cmd[1:3])


def run(quick: bool) -> list[Row]:
    rows: list[Row] = []
    with SimNode("mig-a100", args=["--mig-strategy", "mixed"]) as node:
        node.wait_listed(RESOURCES, 60)
        time.sleep(1.0 if quick else 3.0)
        assert node.proc is not None
        procs = [psutil.Process(node.proc.pid), *node.workers()]
        total_pss = 0.0
        total_uss = 0.0
        for proc in procs:
            try:
                mem = proc.memory_full_info()
                label = _label(proc, node.proc.pid)
            except psutil.NoSuchProcess:
                continue
            total_pss += mem.pss
            total_uss += mem.uss
            rows.append(
                Row(
                    f"{label} PSS",
                    mem.pss / 2**20,
                    "MiB",
                    "",
                    f"USS {mem.uss / 2**20:.1f} MiB, pid {proc.pid}",
                )
            )
        rows.append(
            Row(
                "total PSS (supervisor + workers)",
                total_pss / 1e6,
                "MB",
                "<= 120 MB",
                f"{len(procs)} processes; USS total {total_uss / 1e6:.1f} MB",
            )
        )
    return rows
