"""Tests of supervisor.dra.slices: the node's ResourceSlices as NVIDIA's DRA driver publishes them,
validated against the resource.k8s.io/v1 schema (kubernetes-validate's bundled 1.34 schema, strict)
and the API server's own rules, with health from a real health book as device taints."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from common.model import Node
from supervisor.config import config_from_data
from supervisor.dra.devices import MAX_TAINTS, cuda_version, pci_bus_id, semver
from supervisor.dra.memshare import binary as binary_quantity
from supervisor.dra.slices import MAX_DEVICES_WITH_TAINTS, build_slices, slice_problems
from supervisor.health.book import ConditionView, HealthBook, Recovery
from supervisor.health.policy import HealthPolicy
from supervisor.node.draplan import DRIVER
from supervisor.node.nvml import Nvml
from supervisor.node.planning import plan_resources
from supervisor.sim.nvml import load_simulator
from tests import nodes

NOW = 1_800_000_000.0
GPU_ATTRIBUTES = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "resource.kubernetes.io/pciBusID": "string",
}
MIG_CAPACITIES = {
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
    "memory",
}


def discovered(profile: str) -> Node:
    nvml = Nvml(load_simulator(profile), sysfs_root=None)
    nvml.init()
    return nvml.discover()


def schema_valid(obj: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(obj, "1.34.0", strict=True)  # raises ValidationError


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def book_for(node: Node) -> HealthBook:
    config = config_from_data(
        {"version": "v1", "gpuvisor": {"mode": "dra"}}, flags={"node_name": "node-a"}, source="test"
    )
    policy = HealthPolicy.from_settings(None, None, {}, 60.0)
    return HealthBook(plan_resources(node, config), policy, NOW)


@pytest.mark.parametrize("profile", ["dgx-h100", "dgx-a100", "pcie-l4", "mig-a100"])
def test_every_builtin_profile_gives_valid_slices(profile: str) -> None:
    """Each simulated node's slices pass the v1 schema strictly (an unknown field fails) and the API
    server's rules; one pool named after the node, generation and slice count consistent."""
    slices = build_slices(discovered(profile), [], node_name="node-a", generation=3)
    assert slices
    for obj in slices:
        schema_valid(obj)
        assert slice_problems(obj) == []
        spec = obj["spec"]
        assert spec["driver"] == DRIVER and spec["nodeName"] == "node-a"
        assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": len(slices)}
        assert obj["metadata"] == {"generateName": "node-a-gpu.nvidia.com-"}


def test_a_gpu_is_described_with_nvidias_attribute_names_and_types() -> None:
    """A full GPU: NVIDIA's attribute names with their types (string / version), versions in
    semver, the PCI bus id as go-nvlib writes it, and `memory` as a binary quantity of bytes."""
    node = discovered("dgx-h100")
    gpu0 = devices(build_slices(node, [], node_name="n"))["gpu-0"]
    attrs = gpu0["attributes"]
    assert {k: next(iter(v)) for k, v in attrs.items()} == GPU_ATTRIBUTES
    assert attrs["type"]["string"] == "gpu" and attrs["uuid"]["string"] == node.gpus[0].uuid
    assert attrs["productName"]["string"] == "NVIDIA H100 80GB HBM3"
    assert attrs["brand"]["string"] == "Nvidia"  # the simulator's NVML answers NVML_BRAND_NVIDIA
    assert attrs["architecture"]["string"] == "Hopper"
    assert attrs["cudaComputeCapability"]["version"] == "9.0.0"
    assert attrs["driverVersion"]["version"] == "550.54.15"
    assert attrs["cudaDriverVersion"]["version"] == "12.4.0"
    assert attrs["resource.kubernetes.io/pciBusID"]["string"] == pci_bus_id(node.gpus[0].pci_bus_id)
    assert gpu0["capacity"] == {"memory": {"value": binary_quantity(node.gpus[0].memory_mib << 20)}}
    assert "taints" not in gpu0


def test_a_known_brand_is_published() -> None:
    """A brand NVML named (go-nvlib's string) is an attribute; an unknown one is left out."""
    node = nodes.pcie_l4()
    branded = Node(gpus=tuple(dataclasses.replace(g, brand="Nvidia") for g in node.gpus))
    assert devices(build_slices(branded, [], node_name="n"))["gpu-0"]["attributes"]["brand"] == {
        "string": "Nvidia"
    }
    assert "brand" not in devices(build_slices(node, [], node_name="n"))["gpu-0"]["attributes"]


def test_a_mig_device_carries_its_parent_its_profile_and_its_instance_capacities() -> None:
    """A MIG device: type mig, parentUUID, profile, the parent's attributes, its GPU instance
    profile's engine counts, `memory`, and one `memorySlice<i>` per memory slice it occupies."""
    node = discovered("mig-a100")
    gpu0 = node.gpus[0]
    mig = gpu0.mig_devices[0]  # 3g.40gb at memory slices 4-7
    device = devices(build_slices(node, [], node_name="n"))["gpu-0-mig-3g40gb-9-4"]
    attrs, capacity = device["attributes"], device["capacity"]
    assert attrs["type"] == {"string": "mig"} and attrs["uuid"] == {"string": mig.uuid}
    assert attrs["parentUUID"] == {"string": gpu0.uuid} and attrs["profile"] == {"string": "3g.40gb"}
    assert attrs["productName"] == {"string": gpu0.name}
    assert set(capacity) == MIG_CAPACITIES | {f"memorySlice{i}" for i in range(4, 8)}
    assert capacity["multiprocessors"] == {"value": "42"} and capacity["copyEngines"] == {"value": "3"}
    assert capacity["memory"] == {"value": "40192Mi"} and capacity["memorySlice4"] == {"value": "1"}
    assert "gpu-0" not in devices(
        build_slices(node, [], node_name="n")
    )  # MIG mode: the GPU is its MIG devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"), ("9.0", "9.0.0"), ("12", "12.0.0"),
     ("", None), ("550.54.15.1", None), ("r550", None)],
)  # fmt: skip
def test_versions_are_read_as_nvidias_driver_reads_them(text: str, expected: str | None) -> None:
    """Masterminds' lenient parsing: missing parts 0, leading zeros dropped; not a version: None."""
    assert semver(text) == expected


def test_cuda_version_quantities_and_bus_ids() -> None:
    """NVML's 12040 is CUDA 12.4; byte counts take the largest binary suffix that divides them;
    an 8-digit PCI domain is cut to 4 and the id lower-cased, as go-nvlib does."""
    assert (cuda_version(12040), cuda_version(11080), cuda_version(0)) == ("12.4.0", "11.8.0", None)
    assert (binary_quantity(80 << 30), binary_quantity(40192 << 20), binary_quantity(1000)) == (
        "80Gi",
        "40192Mi",
        "1000",
    )
    assert pci_bus_id("00000000:BD:00.0") == "0000:bd:00.0"
    assert pci_bus_id("0001:3b:00.0") == "0001:3b:00.0"


def test_an_xid_and_a_lost_gpu_become_nvidias_taints() -> None:
    """XID 48 taints the GPU gpu.nvidia.com/xid=48, a lost GPU gpu.nvidia.com/gpu-lost, both
    NoSchedule with the condition's start as timeAdded; the slice stays valid; other GPUs untainted."""
    node = discovered("dgx-h100")
    book = book_for(node)
    book.apply_xid(node.gpus[1].uuid, 48, now=NOW + 5)
    book.mark_lost(node.gpus[2].uuid, NOW + 6, "fell off the bus")
    slices = build_slices(node, book.conditions(), node_name="n")
    for obj in slices:
        schema_valid(obj)
        assert slice_problems(obj) == []
    got = devices(slices)
    assert got["gpu-1"]["taints"] == [
        {
            "key": "gpu.nvidia.com/xid",
            "value": "48",
            "effect": "NoSchedule",
            "timeAdded": "2027-01-15T08:00:05Z",
        }
    ]
    assert got["gpu-2"]["taints"] == [
        {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule", "timeAdded": "2027-01-15T08:00:06Z"}
    ]
    assert "taints" not in got["gpu-0"]


def test_a_mig_instance_event_taints_that_instance_a_gpu_event_every_instance() -> None:
    """An XID naming a GPU instance taints only that MIG device; one naming the GPU taints all its MIG devices."""
    node = discovered("mig-a100")
    book = book_for(node)
    mig = node.gpus[0].mig_devices[1]
    book.apply_xid(node.gpus[0].uuid, 95, mig.gi_id, mig.ci_id, now=NOW)
    book.apply_xid(node.gpus[1].uuid, 79, now=NOW)
    got = devices(build_slices(node, book.conditions(), node_name="n"))
    tainted = sorted(name for name, d in got.items() if "taints" in d)
    gpu1 = sorted(name for name in got if name.startswith("gpu-1-"))
    assert tainted == sorted(["gpu-0-mig-2g20gb-14-0", *gpu1])
    assert got["gpu-0-mig-2g20gb-14-0"]["taints"][0]["value"] == "95"


def test_several_conditions_most_severe_first_at_most_four_each_once() -> None:
    """A device with more conditions than 1.34 allows taints keeps the four most severe; a repeated
    XID is one taint; the event wait, ECC and a failed probe get their own keys."""
    gpu = nodes.pcie_l4().gpus[0]
    c = [
        ConditionView(gpu.uuid, None, None, "xid:94", Recovery.TRANSIENT, "r", NOW, NOW),
        ConditionView(gpu.uuid, None, None, "event-wait", Recovery.TRANSIENT, "r", NOW + 1, NOW),
        ConditionView(gpu.uuid, None, None, "probe", Recovery.UNTIL_PROBE_PASSES, "r", NOW, NOW),
        ConditionView(gpu.uuid, None, None, "ecc:double-bit", Recovery.UNTIL_RESET, "r", NOW, NOW),
        ConditionView(gpu.uuid, None, None, "lost", Recovery.UNTIL_FOUND, "r", NOW, NOW),
    ]
    taints = devices(build_slices(Node(gpus=(gpu,)), c, node_name="n"))["gpu-0"]["taints"]
    assert len(taints) == MAX_TAINTS
    assert [(t["key"], t.get("value")) for t in taints] == [
        ("gpu.nvidia.com/gpu-lost", None),
        ("gpu.nvidia.com/ecc", "double-bit"),
        ("gpu.nvidia.com/unhealthy", "probe"),
        ("gpu.nvidia.com/xid", "94"),
    ]


def test_without_taint_support_unhealthy_devices_are_left_out() -> None:
    """Where the API server drops device taints, an unhealthy device is not published at all."""
    node = discovered("pcie-l4")
    book = book_for(node)
    book.apply_xid(node.gpus[3].uuid, 79, now=NOW)
    names = devices(build_slices(node, book.conditions(), node_name="n", taints=False))
    assert sorted(names) == ["gpu-0", "gpu-1", "gpu-2"]


def test_a_pool_over_one_slice_is_split_and_says_so() -> None:
    """More devices than a slice holds (64 once taints are used) go into several slices of one pool,
    each saying how many there are; device names stay unique across them."""
    node = nodes.mig_uniform(gpus=12, per_gpu=7)  # 84 MIG devices
    names = devices(build_slices(node, [], node_name="n"))
    assert len(names) == 84
    gpu = node.gpus[0]
    lost = [ConditionView(gpu.uuid, None, None, "lost", Recovery.UNTIL_FOUND, "r", NOW, NOW)]
    slices = build_slices(node, lost, node_name="n")
    assert [len(s["spec"]["devices"]) for s in slices] == [
        MAX_DEVICES_WITH_TAINTS,
        84 - MAX_DEVICES_WITH_TAINTS,
    ]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}


def test_a_node_without_gpus_publishes_one_empty_slice() -> None:
    """A pool has at least one slice: an empty one says the node has no device (not "unknown")."""
    slices = build_slices(Node(gpus=()), [], node_name="n")
    assert len(slices) == 1 and slices[0]["spec"]["devices"] == []
    schema_valid(slices[0])


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: d.update(name="GPU_0"), "is not a DNS label"),
        (lambda d: d["attributes"].update(driverVersion={"version": "550.54"}), "is not semver"),
        (lambda d: d["attributes"].update(productName={"string": "x" * 65}), "longer than 64"),
        (lambda d: d["attributes"].update(productName={"string": "a", "version": "1.0.0"}), "exactly one"),
        (lambda d: d["capacity"].update({f"c{i}": {"value": "1"} for i in range(30)}), "at most 32 together"),
        (lambda d: d["attributes"].update({"bad-name": {"string": "a"}}), "is not a C identifier"),
        (
            lambda d: d.update(taints=[{"key": "gpu.nvidia.com/xid", "effect": "None"}]),
            "NoSchedule or NoExecute",
        ),
        (
            lambda d: d.update(
                taints=[{"key": "gpu.nvidia.com/xid", "value": "a b", "effect": "NoSchedule"}]
            ),
            "label value",
        ),
    ],
)
def test_slice_problems_names_what_the_api_server_would_reject(mutate: Any, problem: str) -> None:
    """Each rule beyond the JSON schema is caught, with the field and the reason."""
    obj = copy.deepcopy(build_slices(nodes.pcie_l4(), [], node_name="n")[0])
    mutate(obj["spec"]["devices"][0])
    found = slice_problems(obj)
    assert any(problem in p and p.startswith("spec.devices[0]") for p in found), found


def test_slice_problems_counts_devices_and_duplicate_names() -> None:
    """Over 128 devices, or one name twice, is refused."""
    obj = build_slices(nodes.pcie_l4(), [], node_name="n")[0]
    obj["spec"]["devices"] = [dict(obj["spec"]["devices"][0], name=f"gpu-{i}") for i in range(129)]
    assert any("129 devices, at most 128" in p for p in slice_problems(obj))
    obj["spec"]["devices"] = [obj["spec"]["devices"][0]] * 2
    assert any("appears twice" in p for p in slice_problems(obj))
