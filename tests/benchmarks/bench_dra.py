"""Benchmark: gpuvisor as a DRA driver, on a simulated pcie-l4 node in `--mode dra`.

A real supervisor and DRA worker, the DRA kubelet stand-in (v1 client) and claims in a claims dir:
- claim prepare latency: NodePrepareResources of one new claim of one GPU, as the kubelet times
  it (the worker reads and checks the claim, writes and fsyncs its checkpoint, then answers);
  then unprepare of it (checkpoint rewritten); and a repeated prepare of a prepared claim (an
  answer from the checkpoint: what a restarted kubelet gets for running pods);
- XID -> UNHEALTHY in the kubelet's health stream: `sim xid 48` on a GPU until the stand-in holds
  the device UNHEALTHY (its receive time), then `sim reset` until HEALTHY again;
- ResourceSlice content after a health change: `build_slices` for the node with the book's
  conditions (mig-a100: 21 devices). Publishing needs the API-server layer and is not measured.
"""

from __future__ import annotations

import time

from supervisor.dra.slices import build_slices
from supervisor.health.book import ConditionView, Recovery
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import load_simulator
from tests.benchmarks.common import Row, Timer, p50, p99
from tests.dranode import DRIVER, POOL, DraNode

CLAIMS, CLAIMS_QUICK = 500, 60
EVENTS, EVENTS_QUICK = 100, 20
WAIT_S = 10.0


def run(quick: bool) -> list[Row]:
    claims = CLAIMS_QUICK if quick else CLAIMS
    events = EVENTS_QUICK if quick else EVENTS
    with DraNode("pcie-l4", args=("--mode", "dra", "--log-level", "warning")) as node:
        node.wait_registered()
        prepare, unprepare, again = _claims(node, claims)
        unhealthy, healthy = _health(node, events)
    slices = _slices(200 if quick else 2000)
    note = f"{claims} claims, one GPU each, v1"
    return [
        Row("prepare p50", p50(prepare.ms()), "ms", "", note),
        Row("prepare p99", p99(prepare.ms()), "ms", "", "claim read + checks + checkpoint fsync + answer"),
        Row("unprepare p50", p50(unprepare.ms()), "ms", "", "checkpoint rewritten and fsync'd"),
        Row("unprepare p99", p99(unprepare.ms()), "ms"),
        Row("re-prepare p50", p50(again.ms()), "ms", "", "a prepared claim again: from the checkpoint"),
        Row("xid->UNHEALTHY p50", p50(unhealthy), "ms", "", f"{events} events, at the health stream"),
        Row("xid->UNHEALTHY p99", p99(unhealthy), "ms"),
        Row("reset->HEALTHY p50", p50(healthy), "ms"),
        Row(
            "slices rebuilt p50", p50(slices.ms()), "ms", "", "build_slices, mig-a100, after a health change"
        ),
    ]


def _claims(node: DraNode, count: int) -> tuple[Timer, Timer, Timer]:
    prepare, unprepare, again = Timer(), Timer(), Timer()
    for i in range(count + 10):
        ref = node.claims.allocate("bench", f"c{i}", POOL, [f"gpu-{i % 4}"])
        warm = i < 10
        with prepare:
            result = node.dra.prepare(DRIVER, [ref], timeout=WAIT_S)
        if result.claims[ref[2]].error:
            raise RuntimeError(f"prepare failed: {result.claims[ref[2]].error}")
        with again:
            node.dra.prepare(DRIVER, [ref], timeout=WAIT_S)
        with unprepare:
            node.dra.unprepare(DRIVER, [ref], timeout=WAIT_S)
        if warm:
            for timer in (prepare, again, unprepare):
                timer.samples.pop()
        node.claims.delete("bench", f"c{i}")
    return prepare, unprepare, again


def _gpu_uuids(node: DraNode) -> list[str]:
    from common.model import ResourcePlan

    with open(f"{node.run_dir}/plans/{DRIVER}.json", encoding="utf-8") as fh:
        plan = ResourcePlan.from_json(fh.read())
    return [d.gpu_uuid for d in plan.devices]


def _until(node: DraNode, device: str, health: str) -> float:
    """The stand-in's receive time (monotonic) of the first message showing `device` as `health`."""
    if not node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, device) == health, WAIT_S):
        raise RuntimeError(f"{device} not {health} in the health stream within {WAIT_S:g}s")
    return node.dra.health_seen(DRIVER)[(POOL, device)].at


def _health(node: DraNode, events: int) -> tuple[list[float], list[float]]:
    uuids = _gpu_uuids(node)
    _until(node, "gpu-0", "HEALTHY")
    down: list[float] = []
    up: list[float] = []
    for i in range(events):
        k = i % len(uuids)
        start = time.monotonic()
        node.sim("xid", device=uuids[k], xid=48)
        down.append((_until(node, f"gpu-{k}", "UNHEALTHY") - start) * 1000.0)
        start = time.monotonic()
        node.sim("reset", device=uuids[k])
        up.append((_until(node, f"gpu-{k}", "HEALTHY") - start) * 1000.0)
    return down, up


def _slices(rounds: int) -> Timer:
    nvml = Nvml(load_simulator("mig-a100"), sysfs_root=None)
    nvml.init()
    node = nvml.discover()
    timer = Timer()
    for i in range(rounds):
        gpu = node.gpus[i % len(node.gpus)]
        conditions = [ConditionView(gpu.uuid, None, None, "xid:48", Recovery.UNTIL_RESET, "r", 1e9, 1e9)]
        with timer:
            build_slices(node, conditions, node_name=POOL, generation=i + 1)
    return timer
