"""The child side of the real-binding tier: gpuvisor's NVML adapter over the real `pynvml`.

Run as `python -m tests.fakenvml.child [options]` in an environment from `tests.fakenvml.environ`
(the library loads when the process first calls NVML), it drives `supervisor.node.nvml.Nvml` over
`import pynvml` and prints one JSON document on stdout for the test (or benchmark) to judge: the
binding it loaded, the discovered node, GPU Feature Discovery's facts, the event-set registration,
how long event waits took and what they returned, and, when asked, the health thread's CPU time
while idle. It judges nothing itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from typing import Any

import pynvml

from common.model import node_to_json
from supervisor.health.monitor import HealthMonitor
from supervisor.health.policy import HealthPolicy
from supervisor.node.events import EventWatch
from supervisor.node.facts import facts_from_nvml
from supervisor.node.nvml import Nvml


def thread_cpu_s(tid: int) -> float:
    """CPU time of one thread of this process, from schedstat (ns resolution, unlike /stat's ticks)."""
    with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as fh:
        return int(fh.read().split()[0]) / 1e9


def process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def idle_health_loop(seconds: float, probe_interval: float) -> dict[str, Any]:
    """Run the supervisor's health thread over the real binding, idle, for `seconds`."""
    node = Nvml(pynvml).discover()
    applied: list[object] = []
    monitor = HealthMonitor(
        pynvml,
        node,
        HealthPolicy.from_settings(None, None, {}, 60.0),
        report=applied.append,
        probe_interval=probe_interval,
    )
    monitor.start()
    try:
        tid = monitor.thread_id
        assert tid is not None
        time.sleep(0.2)  # past the set's creation: measure the steady state
        thread0, process0, wall0 = thread_cpu_s(tid), process_cpu_s(), time.monotonic()
        threading.Event().wait(seconds)
        thread1, process1, wall1 = thread_cpu_s(tid), process_cpu_s(), time.monotonic()
    finally:
        monitor.stop()
    return {
        "seconds": wall1 - wall0,
        "health_thread_cpu_s": thread1 - thread0,
        "process_cpu_s": process1 - process0,
        "probes": monitor.probes,
        "errors": monitor.errors,
        "events": monitor.events,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.fakenvml.child")
    p.add_argument("--sysfs", default="/sys", help="sysfs root for NUMA and PCI class; 'none': NVML only")
    p.add_argument("--wait-ms", default="", help="comma list of event-wait timeouts to time, in ms")
    p.add_argument("--discover-rounds", type=int, default=1, help="time this many discoveries")
    p.add_argument("--idle-seconds", type=float, default=0.0, help="measure the idle health thread this long")
    p.add_argument("--probe-interval", type=float, default=1.0)
    args = p.parse_args()

    out: dict[str, Any] = {
        "binding": pynvml.__file__,
        "has_numa_function": hasattr(pynvml, "nvmlDeviceGetNumaNodeId"),
    }
    nvml = Nvml(pynvml, sysfs_root=None if args.sysfs == "none" else args.sysfs)
    start = time.perf_counter()
    nvml.init()
    out["init_ms"] = (time.perf_counter() - start) * 1000
    durations = []
    for _ in range(max(1, args.discover_rounds)):
        start = time.perf_counter()
        node = nvml.discover()
        durations.append((time.perf_counter() - start) * 1000)
    out["discover_ms"] = durations
    out["node"] = json.loads(node_to_json(node))
    out["facts"] = dataclasses.asdict(facts_from_nvml(nvml))
    out["probes"] = {
        uuid: dataclasses.asdict(nvml.probe(uuid))
        for uuid in [g.uuid for g in node.gpus] + [m.uuid for g in node.gpus for m in g.mig_devices]
    }

    with EventWatch.open(nvml) as watch:
        out["registered"] = watch.registered
        out["skipped"] = watch.skipped
        waits = []
        for timeout in (int(t) for t in args.wait_ms.split(",") if t.strip()):
            start = time.monotonic()
            event = watch.wait(timeout)
            waits.append(
                {
                    "timeout_ms": timeout,
                    "elapsed_ms": (time.monotonic() - start) * 1000,
                    "event": None if event is None else dataclasses.asdict(event),
                }
            )
        out["waits"] = waits
    out["wanted_mask"] = int(
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
    )
    out["supported_masks"] = {
        gpu.uuid: int(pynvml.nvmlDeviceGetSupportedEventTypes(pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)))
        for gpu in node.gpus
    }
    if args.idle_seconds > 0:
        out["idle"] = idle_health_loop(args.idle_seconds, args.probe_interval)
    nvml.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
