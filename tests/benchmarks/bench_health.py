"""Benchmark: fault injection to Unhealthy at the kubelet stand-in, on a simulated node.

Each round injects XID 48 (until-reset, so every injection is a real change) on one GPU of a
pcie-l4 node and measures from just before `send_command` until the stand-in receives the
ListAndWatch message that shows the device Unhealthy (timestamped in the stand-in's listener).
The path covered: CLI client -> supervisor ROUTER -> simulator -> NVML event thread -> health
book on the main loop -> ZeroMQ PUB -> worker -> gRPC ListAndWatch -> stand-in. Then `sim
reset` brings the device back and that direction is measured the same way (reset to Healthy).
"""

from __future__ import annotations

import threading
import time

from supervisor.sim.kubelet import DeviceState
from supervisor.sim.nvml import load_simulator
from tests.benchmarks.common import Row, p50, p99
from tests.harness import SimNode

GPU = "nvidia.com/gpu"
PROFILE = "pcie-l4"
EVENTS = 200
EVENTS_QUICK = 40
TARGET_P99_MS = 5.0  # issue 30: nothing given back while starting faster and staying smaller
WAIT_S = 10.0


class Arrival:
    """Timestamps the first ListAndWatch message that shows `device` with `health`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._want: tuple[str, str] | None = None
        self._at = 0.0
        self._event = threading.Event()

    def expect(self, device: str, health: str) -> None:
        with self._lock:
            self._want = (device, health)
            self._event.clear()

    def __call__(self, resource: str, devices: list[DeviceState]) -> None:
        now = time.perf_counter()
        with self._lock:
            want = self._want
            if resource != GPU or want is None:
                return
            if any(d.id == want[0] and d.health == want[1] for d in devices):
                self._at = now
                self._want = None
                self._event.set()

    def wait(self) -> float:
        if not self._event.wait(WAIT_S):
            raise RuntimeError(f"the stand-in did not see the expected health within {WAIT_S:g}s")
        return self._at


def _timed(node: SimNode, arrival: Arrival, action: str, device: str, health: str, **args: object) -> float:
    arrival.expect(device, health)
    start = time.perf_counter()
    node.sim(action, device=device, **args)
    return (arrival.wait() - start) * 1000.0


def run(quick: bool) -> list[Row]:
    events = EVENTS_QUICK if quick else EVENTS
    gpus = load_simulator(PROFILE).gpu_uuids()
    to_unhealthy: list[float] = []
    to_healthy: list[float] = []
    with SimNode(PROFILE) as node:
        node.wait_listed([GPU])
        arrival = Arrival()
        node.kubelet.listeners.append(arrival)
        for i in range(events):
            gpu = gpus[i % len(gpus)]
            to_unhealthy.append(_timed(node, arrival, "xid", gpu, "Unhealthy", xid=48))
            to_healthy.append(_timed(node, arrival, "reset", gpu, "Healthy"))
    note = f"{events} XID 48 injections on {PROFILE}, `sim` command to the stand-in's ListAndWatch"
    target = f"p99 < {TARGET_P99_MS:g} ms"
    return [
        Row("health inject->Unhealthy p50", p50(to_unhealthy), "ms", "", note),
        Row("health inject->Unhealthy p99", p99(to_unhealthy), "ms", target, note),
        Row("health inject->Unhealthy max", max(to_unhealthy), "ms", "", note),
        Row("health reset->Healthy p50", p50(to_healthy), "ms", "", "`sim reset` back to Healthy"),
        Row("health reset->Healthy p99", p99(to_healthy), "ms", "", "`sim reset` back to Healthy"),
    ]
