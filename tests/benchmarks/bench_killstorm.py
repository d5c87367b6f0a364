"""A kill storm: the registered `nvidia.com/gpu` worker SIGKILLed again 1 s after each recovery.

As an OOM killer or a chaos tool does it, against `gpuvisor run --simulate dgx-h100` with its
default settings. Each recovery is timed from the kill until the kubelet stand-in has a new
endpoint, connected, with 8 healthy devices allocatable. A worker that registered and served
proved itself, so none of these deaths may grow a backoff, and the worker must never be FATAL
(before: recoveries of 51, 293, 546, 1053, 2040 ms, then FATAL for good).
"""

from __future__ import annotations

import os
import signal
import time

from tests.benchmarks.common import Row, p50
from tests.harness import SimNode
from tests.helpers import wait_until

RESOURCE = "nvidia.com/gpu"


def storm(node: SimNode, kills: int, gap: float) -> list[float]:
    """Kill the worker `kills` times, `gap` seconds after each recovery; the recoveries in ms."""
    node.wait_listed([RESOURCE], 60)
    recoveries: list[float] = []
    for _ in range(kills):
        time.sleep(gap)  # the storm's rhythm: each kill comes `gap` after the last recovery
        wait_until(lambda: node.worker_pid(RESOURCE) > 0, 10)
        pid = node.worker_pid(RESOURCE)
        if pid <= 0:  # never signal 0 or a negative PID: that would hit the whole group
            break
        before = node.kubelet.endpoint_socket(RESOURCE)
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)

        def back(before: str = before) -> bool:
            res = node.kubelet.resource(RESOURCE)
            ep = res.endpoint if res is not None else None
            return bool(
                ep
                and ep.socket_path != before
                and ep.connected
                and ep.updates
                and res
                and res.allocatable == 8
            )

        if not node.kubelet.wait_for(back, 60):
            break
        recoveries.append((time.perf_counter() - t0) * 1000)
    return recoveries


def run(quick: bool) -> list[Row]:
    kills = 6 if quick else 12
    with SimNode("dgx-h100") as node:
        recoveries = storm(node, kills, 1.0)
        fatal = node.log().count("-> FATAL")
    within = sum(1 for r in recoveries if r <= 300)
    note = f"{len(recoveries)}/{kills} kills 1 s after each recovery, dgx-h100, default settings; FATAL seen {fatal}x"
    return [
        Row("kill storm: recovery p50", p50(recoveries), "ms", "<= 60 ms", note),
        Row(
            "kill storm: recovery max",
            max(recoveries) if recoveries else float("nan"),
            "ms",
            "<= 300 ms",
            note,
        ),
        Row("kill storm: recoveries <= 300 ms", float(within), "count", f"{kills}", note),
        Row("kill storm: FATAL transitions", float(fatal), "count", "0", note),
    ]
