"""Worker SIGKILL to re-registered and listing, on a simulated node.

A real supervisor on `dgx-h100` (one resource, one worker) beside the kubelet stand-in. Each
round SIGKILLs the worker and times from the kill until the kubelet stand-in has a *new*
registration for the resource that is connected and has sent its device list. The supervisor
notices the death (SIGCHLD wakes its loop), removes the dead worker's socket and starts a new
worker (through the zygote when that is enabled), which gets the health snapshot, serves and
registers. Beside it, the floor of a restart by exec: a bare gRPC plugin's start to registered
in the same run (`floors`).
"""

from __future__ import annotations

import os
import signal
import time

from tests.benchmarks import floors
from tests.benchmarks.common import Row, p50, ratio
from tests.harness import SimNode
from tests.helpers import wait_until

RESOURCE = "nvidia.com/gpu"


def run(quick: bool) -> list[Row]:
    rounds = 5 if quick else 20
    floor = floors.measure(quick)
    samples: list[float] = []
    # Each kill comes after the worker has run longer than --start-seconds, so every restart is
    # the first of its kind (immediate): the figure is the restart path, not the backoff policy.
    with SimNode("dgx-h100", args=["--start-seconds", "0.5"]) as node:
        node.wait_listed([RESOURCE], 60)
        for _ in range(rounds):
            wait_until(lambda: node.worker_pid(RESOURCE) > 0, 10)
            pid = node.worker_pid(RESOURCE)
            if pid <= 0:  # never signal 0 or a negative PID: that would hit the whole group
                continue
            before = len(node.kubelet.registrations)
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)

            def back(before: int = before) -> bool:
                regs = node.kubelet.registrations[before:]
                return any(not r.error for r in regs) and node.kubelet.connected(RESOURCE)

            ok = node.kubelet.wait_for(back, 30)
            if ok:
                samples.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.7)  # settle past --start-seconds: the next kill starts from a quiet node
    note = f"{len(samples)}/{rounds} rounds, dgx-h100, SIGKILL -> new registration connected and listed"
    return [
        Row("worker kill -> re-registered p50", p50(samples), "ms", "<= 50 ms", note),
        Row("worker kill -> re-registered max", max(samples) if samples else float("nan"), "ms", "", note),
        Row(
            "worker kill, x a bare plugin's start", ratio(p50(samples), floor.bare_start_ms), "x", "",
            f"bare gRPC plugin start -> registered p50 {floor.bare_start_ms:.0f} ms: a restart by exec, same run",
        ),
    ]  # fmt: skip
