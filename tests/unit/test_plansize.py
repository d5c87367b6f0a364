"""Tests of plan sizes: a ListAndWatch answer's size computed from counts, and plans refused by it."""

from __future__ import annotations

import dataclasses
import resource
import time

import pytest

from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.node.planning import MAX_PLANNED_DEVICES, PlanningError, plan_resources
from supervisor.node.plansize import (
    KUBELET_MAX_RECEIVE_BYTES,
    LIST_AND_WATCH_BUDGET,
    device_entry_size,
    replicas_size,
)
from tests import nodes
from worker.devicebook import DeviceBook
from worker.healthboard import Health


def cfg(replicas: int, devices: str = "all") -> Config:
    text = (
        f"sharing: {{timeSlicing: {{resources: [{{name: gpu, devices: {devices}, replicas: {replicas}}}]}}}}"
    )
    return config_from_data(parse_config_text(text, "t.yaml"), source="t.yaml")


@pytest.mark.parametrize("replicas", [2, 9, 10, 11, 101, 1234])
def test_size_is_the_workers_real_message(replicas: int) -> None:
    """The computed size equals the protobuf size of the worker's own ListAndWatch answer, all devices Unhealthy."""
    plan = plan_resources(nodes.dgx_h100(), cfg(replicas))["nvidia.com/gpu"]
    book = DeviceBook(plan)
    book.set_health([(d.id, Health(False, "test")) for d in plan.devices])
    _, message = book.current()
    expected = sum(replicas_size(len(g.uuid), replicas, g.numa_node) for g in nodes.dgx_h100().gpus)
    assert message.ByteSize() == expected


def test_entry_size_covers_numa_forms() -> None:
    """No NUMA node, node 0 (omitted by proto3) and larger nodes each add what protobuf encodes."""
    assert device_entry_size(40, None) == 2 + (2 + 40) + (2 + 9)
    assert device_entry_size(40, 0) == device_entry_size(40, None) + 4
    assert device_entry_size(40, 1) == device_entry_size(40, None) + 6
    assert device_entry_size(200, None) == 3 + (3 + 200) + (2 + 9)  # lengths past 127 take two bytes


def test_budget_keeps_a_margin_under_the_kubelets_limit() -> None:
    """gpuvisor plans at most 7/8 of the kubelet's 4 MiB receive limit."""
    assert KUBELET_MAX_RECEIVE_BYTES == 4 * 1024 * 1024
    assert LIST_AND_WATCH_BUDGET == KUBELET_MAX_RECEIVE_BYTES * 7 // 8


def test_plan_over_the_list_and_watch_limit_is_refused() -> None:
    """replicas: 10000 on 8 GPUs (80,000 devices, 5.1 MiB) is refused, naming the resource, the count and the limits."""
    with pytest.raises(PlanningError) as info:
        plan_resources(nodes.dgx_h100(), cfg(10_000))
    text = str(info.value)
    assert text.startswith(
        "resource nvidia.com/gpu would have 80000 devices, a ListAndWatch answer of up to "
    )
    assert (
        f"over gpuvisor's limit of {LIST_AND_WATCH_BUDGET} bytes (the kubelet accepts at most 4194304)"
        in text
    )


def test_largest_plan_under_the_limit_is_accepted() -> None:
    """The biggest replica count that fits is planned; one more is refused."""
    gpus = nodes.dgx_h100().gpus
    fits = max(
        n
        for n in range(5000, 9000)
        if sum(replicas_size(len(g.uuid), n, g.numa_node) for g in gpus) <= LIST_AND_WATCH_BUDGET
    )
    assert len(plan_resources(nodes.dgx_h100(), cfg(fits))["nvidia.com/gpu"].devices) == 8 * fits
    with pytest.raises(PlanningError):
        plan_resources(nodes.dgx_h100(), cfg(fits + 1))


def test_huge_replicas_refused_from_counts_alone() -> None:
    """A billion replicas of one GPU (a Config built without the loader's bound) is refused in milliseconds, without building a device list."""
    config = cfg(2, devices="[0]")
    entry = dataclasses.replace(config.sharing.resources[0], replicas=1_000_000_000)
    config = dataclasses.replace(config, sharing=dataclasses.replace(config.sharing, resources=(entry,)))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(PlanningError, match=r"would have 1000000007 devices"):
        plan_resources(nodes.dgx_h100(), config)
    assert time.perf_counter() - start < 5  # generous: the work is a few dozen sums
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024
    )  # KiB: no list was built


def test_node_total_is_bounded() -> None:
    """Resources each under the message limit but together past MAX_PLANNED_DEVICES are refused."""
    node = nodes.mig_uniform(gpus=8, per_gpu=7)  # 56 MIG devices, one resource each under rename
    entries = ", ".join(
        f"{{name: gpu, devices: ['{g}:{m}'], replicas: 3000, rename: r{g}-{m}}}"
        for g in range(8)
        for m in range(7)
    )
    text = f"flags: {{migStrategy: single}}\nsharing: {{timeSlicing: {{resources: [{entries}]}}}}"
    config = config_from_data(parse_config_text(text, "t.yaml"), source="t.yaml")
    with pytest.raises(
        PlanningError,
        match=rf"^the node would advertise 168000 devices .* over gpuvisor's limit of {MAX_PLANNED_DEVICES}",
    ):
        plan_resources(node, config)
