"""Allocate beside extra ListAndWatch streams: unary calls must keep their threads.

A real supervisor on `pcie-l4` beside the kubelet stand-in. Allocate is timed through the
stand-in (as the kubelet calls it) with the worker idle, then with 16 extra ListAndWatch streams
open on the worker's socket (a buggy client, a monitoring tool). The worker admits a few streams
and refuses the rest at once, so Allocate keeps most of its RPC threads: its p99 should stay
within 2x of idle (before: every call ran into its deadline). The kubelet's own stream must be
untouched: still connected, and the only registration.
"""

from __future__ import annotations

from tests.benchmarks.common import Row, Timer, p50, p99
from tests.harness import ExtraStreams, SimNode

GPU = "nvidia.com/gpu"


def _allocate(node: SimNode, calls: int) -> list[float]:
    ids = sorted(node.kubelet.devices(GPU))
    timer = Timer()
    for i in range(calls):
        with timer:
            node.kubelet.allocate_ids(GPU, [ids[i % len(ids)]])
    return timer.ms()


def run(quick: bool) -> list[Row]:
    calls = 200 if quick else 1000
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU], 60)
        idle = _allocate(node, calls)
        extras = ExtraStreams(node.kubelet.endpoint_socket(GPU), 16)
        try:
            busy = _allocate(node, calls)
            refused = extras.outcomes.count("RESOURCE_EXHAUSTED")
        finally:
            extras.close()
        untouched = node.kubelet.connected(GPU) and len(node.kubelet.registrations) == 1
    note = f"{calls} calls each; extras refused: {refused}/16; kubelet's stream untouched: {untouched}"
    return [
        Row("allocate idle p50", p50(idle), "ms", "", note),
        Row("allocate idle p99", p99(idle), "ms", "", note),
        Row("allocate with 16 extra streams p50", p50(busy), "ms", "", note),
        Row("allocate with 16 extra streams p99", p99(busy), "ms", "", note),
        Row("allocate p99 ratio, extra streams / idle", p99(busy) / p99(idle), "x", "<= 2x", note),
    ]
