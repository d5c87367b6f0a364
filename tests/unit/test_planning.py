"""Tests of supervisor.node.planning: resource names per MIG strategy, sharing, selectors and determinism."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from common.model import AllocateSettings, Node, ResourcePlan
from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.node.planning import PlanningError, plan_resources
from tests import nodes


def cfg(text: str = "", **flags: object) -> Config:
    return config_from_data(parse_config_text(text, "test.yaml"), flags=flags, source="test.yaml")


def counts(plans: dict[str, ResourcePlan]) -> dict[str, int]:
    return {name: len(plan.devices) for name, plan in plans.items()}


def per_gpu_replicas(plan: ResourcePlan) -> dict[int, int]:
    return dict(Counter(d.gpu_index for d in plan.devices))


def test_full_gpus_on_a_plain_node() -> None:
    """Every GPU of a non-MIG node is one nvidia.com/gpu device with its UUID, index, minor and NUMA node."""
    node = nodes.dgx_h100()
    plans = plan_resources(node, cfg())
    assert list(plans) == ["nvidia.com/gpu"]
    plan = plans["nvidia.com/gpu"]
    assert plan.sharing == "none" and plan.fail_requests_greater_than_one is False
    assert [d.id for d in plan.devices] == [g.uuid for g in node.gpus]
    first = plan.devices[0]
    assert (first.uuid, first.index, first.gpu_index, first.gpu_minor, first.numa_node, first.memory_mib) == (
        node.gpus[0].uuid, "0", 0, 0, 0, 81559,
    )  # fmt: skip
    assert (first.replica, first.replicas, first.mig_gi, first.is_mig) == (None, 1, None, False)
    assert plan.devices[7].numa_node == 1
    assert len(plan.links) == 28  # all pairs of 8 GPUs


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("none", {"nvidia.com/gpu": 8}),
        (
            "mixed",
            {
                "nvidia.com/gpu": 4,
                "nvidia.com/mig-1g.10gb": 7,
                "nvidia.com/mig-1g.10gb.me": 1,
                "nvidia.com/mig-2g.20gb": 4,
                "nvidia.com/mig-3g.40gb": 3,
            },
        ),
    ],
)
def test_mig_strategies_on_mig_a100(strategy: str, expected: dict[str, int]) -> None:
    """none advertises MIG-enabled GPUs whole; mixed gives one nvidia.com/mig-<profile> per profile, + as '.'."""
    plans = plan_resources(nodes.mig_a100(), cfg(mig_strategy=strategy))
    assert counts(plans) == expected
    assert list(plans) == sorted(plans)


def test_mixed_mig_device_fields() -> None:
    """A MIG device carries its own UUID and memory, index i:j, its parent's index/minor/NUMA and GI/CI/profile."""
    node = nodes.mig_a100()
    plans = plan_resources(node, cfg(mig_strategy="mixed"))
    me = plans["nvidia.com/mig-1g.10gb.me"].devices[0]
    parent = node.gpus[3]
    assert (me.id, me.uuid) == (parent.mig_devices[0].uuid, parent.mig_devices[0].uuid)
    assert (me.index, me.gpu_uuid, me.gpu_index, me.gpu_minor, me.numa_node) == ("3:0", parent.uuid, 3, 3, 0)
    assert (me.mig_gi, me.mig_ci, me.mig_profile, me.memory_mib, me.is_mig) == (
        1,
        0,
        "1g.10gb+me",
        9856,
        True,
    )
    assert [d.index for d in plans["nvidia.com/mig-2g.20gb"].devices] == ["1:0", "1:1", "1:2", "3:1"]
    assert [d.index for d in plans["nvidia.com/gpu"].devices] == ["4", "5", "6", "7"]


def test_links_are_restricted_to_the_resource_gpus() -> None:
    """A plan's topology links only join GPUs that back that resource."""
    plans = plan_resources(nodes.mig_a100(), cfg(mig_strategy="mixed"))
    assert [(link.a, link.b) for link in plans["nvidia.com/gpu"].links] == [
        (4, 5), (4, 6), (4, 7), (5, 6), (5, 7), (6, 7),
    ]  # fmt: skip
    assert [(link.a, link.b) for link in plans["nvidia.com/mig-2g.20gb"].links] == [(1, 3)]
    assert plans["nvidia.com/mig-1g.10gb"].links == ()


def test_single_fails_clearly_on_mig_a100() -> None:
    """single on mixed profiles with full GPUs beside names every profile, its GPUs, and the full GPUs."""
    with pytest.raises(PlanningError) as info:
        plan_resources(nodes.mig_a100(), cfg(mig_strategy="single"))
    assert str(info.value) == (
        "MIG strategy single: MIG devices must all have the same profile, found 1g.10gb on GPU(s) 0; "
        "1g.10gb+me on GPU(s) 3; 2g.20gb on GPU(s) 1, 3; 3g.40gb on GPU(s) 2, 3; and "
        "GPU(s) 4, 5, 6, 7 are not MIG-enabled beside MIG-enabled GPU(s) 0, 1, 2, 3 (the mixed strategy allows this)"
    )


def test_single_fails_on_a_mig_gpu_without_mig_devices() -> None:
    """single refuses a MIG-enabled GPU that has no MIG devices."""
    node = Node(
        gpus=(
            nodes.make_gpu(1, 0, nodes.A100_80GB, 81920, mig_profiles=("1g.10gb",) * 2),
            nodes.make_gpu(1, 1, nodes.A100_80GB, 81920, mig_profiles=()),
        )
    )
    with pytest.raises(
        PlanningError, match=r"^MIG strategy single: MIG-enabled GPU\(s\) 1 have no MIG devices "
    ):
        plan_resources(node, cfg(mig_strategy="single"))


def test_single_on_uniform_mig_node() -> None:
    """single on a node whose MIG devices all share one profile advertises them as nvidia.com/gpu."""
    plans = plan_resources(nodes.mig_uniform(gpus=2, per_gpu=7), cfg(mig_strategy="single"))
    assert counts(plans) == {"nvidia.com/gpu": 14}
    devices = plans["nvidia.com/gpu"].devices
    assert [d.index for d in devices[:2]] == ["0:0", "0:1"] and devices[-1].index == "1:6"
    assert all(d.mig_profile == "1g.10gb" for d in devices)


def test_single_without_mig_is_like_none() -> None:
    """single on a node with no MIG-enabled GPU advertises the full GPUs."""
    assert counts(plan_resources(nodes.pcie_l4(), cfg(mig_strategy="single"))) == {"nvidia.com/gpu": 4}


def test_time_slicing_replicas() -> None:
    """Time-slicing turns each device into <uuid>::0..replicas-1, all under nvidia.com/gpu."""
    node = nodes.pcie_l4()
    plans = plan_resources(node, cfg("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}"))
    plan = plans["nvidia.com/gpu"]
    assert len(plan.devices) == 16
    assert [d.id for d in plan.devices[:5]] == [f"{node.gpus[0].uuid}::{n}" for n in range(4)] + [
        f"{node.gpus[1].uuid}::0"
    ]
    assert [(d.replica, d.replicas, d.uuid) for d in plan.devices[:2]] == [
        (0, 4, node.gpus[0].uuid), (1, 4, node.gpus[0].uuid),
    ]  # fmt: skip
    assert (plan.sharing, plan.fail_requests_greater_than_one) == ("time-slicing", False)


def test_rename_by_default_adds_shared_suffix() -> None:
    """renameByDefault advertises the replicas as <name>.shared, leaving no unshared resource behind."""
    text = "sharing: {timeSlicing: {renameByDefault: true, failRequestsGreaterThanOne: true, resources: [{name: gpu, replicas: 2}]}}"
    plans = plan_resources(nodes.pcie_l4(), cfg(text))
    assert counts(plans) == {"nvidia.com/gpu.shared": 8}
    assert plans["nvidia.com/gpu.shared"].fail_requests_greater_than_one is True


def test_rename_shares_only_the_selected_devices() -> None:
    """rename with a device list moves those GPUs' replicas to the new name; the rest stay whole as nvidia.com/gpu."""
    text = "sharing: {timeSlicing: {resources: [{name: gpu, rename: gpu-ts, devices: [1, 3], replicas: 3}]}}"
    plans = plan_resources(nodes.pcie_l4(), cfg(text))
    assert counts(plans) == {"nvidia.com/gpu": 2, "nvidia.com/gpu-ts": 6}
    assert plans["nvidia.com/gpu"].sharing == "none" and plans["nvidia.com/gpu-ts"].sharing == "time-slicing"
    assert [d.index for d in plans["nvidia.com/gpu"].devices] == ["0", "2"]
    assert [(link.a, link.b) for link in plans["nvidia.com/gpu-ts"].links] == [(1, 3)]


def test_per_gpu_selectors_give_different_replica_counts() -> None:
    """Entries apply in file order to devices not yet taken, so replica counts can differ per GPU (#1786)."""
    node = nodes.dgx_a100()
    text = f"""
sharing:
  timeSlicing:
    resources:
      - {{name: gpu, devices: [0], replicas: 2}}
      - {{name: gpu, devices: ["1", "{node.gpus[2].uuid}"], replicas: 4}}
      - {{name: gpu, devices: [0, 1], replicas: 8}}
      - {{name: gpu, devices: 2, replicas: 3}}
      - {{name: gpu, devices: all, replicas: 5}}
"""
    plan = plan_resources(node, cfg(text))["nvidia.com/gpu"]
    assert per_gpu_replicas(plan) == {0: 2, 1: 4, 2: 4, 3: 3, 4: 3, 5: 5, 6: 5, 7: 5}
    assert {d.gpu_index: d.replicas for d in plan.devices} == per_gpu_replicas(plan)


def test_partial_selection_without_rename_mixes_shared_and_whole() -> None:
    """Without rename, selected GPUs are replicated and unselected ones stay whole in the same resource."""
    node = nodes.pcie_l4()
    plan = plan_resources(
        node, cfg("sharing: {timeSlicing: {resources: [{name: gpu, devices: 1, replicas: 2}]}}")
    )["nvidia.com/gpu"]
    assert [d.id for d in plan.devices] == [
        f"{node.gpus[0].uuid}::0", f"{node.gpus[0].uuid}::1", node.gpus[1].uuid, node.gpus[2].uuid, node.gpus[3].uuid,
    ]  # fmt: skip
    assert plan.sharing == "time-slicing"


def test_count_larger_than_node_and_unknown_refs_are_tolerated() -> None:
    """A count beyond the node's devices takes them all, and references to absent devices are ignored."""
    text = "sharing: {timeSlicing: {resources: [{name: gpu, devices: [9, GPU-00000000-0000-0000-0000-000000000000], replicas: 2}, {name: gpu, devices: 99, replicas: 3}]}}"
    plan = plan_resources(nodes.pcie_l4(), cfg(text))["nvidia.com/gpu"]
    assert per_gpu_replicas(plan) == {0: 3, 1: 3, 2: 3, 3: 3}


def test_mig_selectors_by_mig_index_uuid_and_parent_gpu() -> None:
    """MIG devices are picked by i:j, by MIG UUID, or all at once by their parent GPU's index or UUID."""
    node = nodes.mig_a100()
    text = f"""
sharing:
  timeSlicing:
    resources:
      - {{name: mig-1g.10gb, devices: [0:1, "{node.gpus[0].mig_devices[5].uuid}"], replicas: 2}}
      - {{name: mig-2g.20gb, devices: [3], replicas: 3}}
      - {{name: mig-3g.40gb, devices: ["{node.gpus[2].uuid}"], replicas: 4, rename: big-shared}}
"""
    plans = plan_resources(node, cfg(text, mig_strategy="mixed"))
    one_g = plans["nvidia.com/mig-1g.10gb"]
    assert {d.index: d.replicas for d in one_g.devices} == {
        f"0:{j}": (2 if j in (1, 5) else 1) for j in range(7)
    }
    assert {d.index: d.replicas for d in plans["nvidia.com/mig-2g.20gb"].devices} == {
        "1:0": 1,
        "1:1": 1,
        "1:2": 1,
        "3:1": 3,
    }
    assert [d.id for d in plans["nvidia.com/big-shared"].devices] == [
        f"{node.gpus[2].mig_devices[j].uuid}::{n}" for j in range(2) for n in range(4)
    ]
    assert [d.index for d in plans["nvidia.com/mig-3g.40gb"].devices] == ["3:2"]


def test_mps_plan_carries_mps_root_and_fails_multi_requests() -> None:
    """An MPS plan has sharing mps, failRequestsGreaterThanOne true and the MPS root; other plans have no MPS root."""
    text = "sharing: {mps: {resources: [{name: gpu, devices: [0, 1], replicas: 2, rename: gpu-mps}]}}"
    plans = plan_resources(nodes.pcie_l4(), cfg(text, mps_root="/run/nvidia/mps"))
    mps = plans["nvidia.com/gpu-mps"]
    assert (mps.sharing, mps.fail_requests_greater_than_one, mps.allocate.mps_root) == (
        "mps",
        True,
        "/run/nvidia/mps",
    )
    whole = plans["nvidia.com/gpu"]
    assert (whole.sharing, whole.fail_requests_greater_than_one, whole.allocate.mps_root) == (
        "none",
        False,
        "",
    )
    # MPS_ROOT set fleet-wide leaves a plan without MPS byte-identical (its worker is not restarted).
    with_root = plan_resources(nodes.pcie_l4(), cfg(mps_root="/run/nvidia/mps"))["nvidia.com/gpu"]
    assert with_root.to_json() == plan_resources(nodes.pcie_l4(), cfg())["nvidia.com/gpu"].to_json()


def test_mps_refused_for_mig_devices_under_single() -> None:
    """MPS cannot share MIG devices, even when single advertises them as nvidia.com/gpu."""
    text = "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}"
    with pytest.raises(
        PlanningError,
        match=r"^MPS sharing is not supported for MIG devices: nvidia.com/gpu holds MIG device 0:0 ",
    ):
        plan_resources(nodes.mig_uniform(), cfg(text, mig_strategy="single", mps_root="/mps"))


def test_rename_onto_another_resource_is_refused() -> None:
    """Replicas renamed onto a name another resource already uses would mix device kinds: a clear error."""
    text = "sharing: {timeSlicing: {resources: [{name: mig-1g.10gb, rename: gpu, replicas: 2}]}}"
    with pytest.raises(
        PlanningError,
        match=r"^resource nvidia.com/gpu would mix devices of nvidia.com/gpu, nvidia.com/mig-1g.10gb",
    ):
        plan_resources(nodes.mig_a100(), cfg(text, mig_strategy="mixed"))


def test_custom_resource_names_first_match_wins() -> None:
    """resources.gpus / resources.mig patterns (`*` wildcard) name devices; first match wins, else the default."""
    text = """
resources:
  gpus:
    - {pattern: "NVIDIA L4", name: l4}
    - {pattern: "*A100*", name: a100}
    - {pattern: "*", name: never-reached-for-a100}
  mig:
    - {pattern: "1g.10gb", name: mig-small}
    - {pattern: "*g.*0gb", name: mig-large}
"""
    plans = plan_resources(nodes.mig_a100(), cfg(text, mig_strategy="mixed"))
    assert counts(plans) == {
        "nvidia.com/a100": 4,
        "nvidia.com/mig-1g.10gb.me": 1,  # "1g.10gb+me" matches neither pattern
        "nvidia.com/mig-large": 7,
        "nvidia.com/mig-small": 7,
    }
    assert counts(plan_resources(nodes.pcie_l4(), cfg(text))) == {"nvidia.com/l4": 4}
    assert counts(plan_resources(nodes.dgx_h100(), cfg(text))) == {"nvidia.com/never-reached-for-a100": 8}


def test_allocate_settings_come_from_config() -> None:
    """Every Allocate-shaping setting is copied into each plan."""
    config = cfg(
        "flags: {gdsEnabled: true, plugin: {deviceListStrategy: [volume-mounts, cdi-cri]}}\nimex: {channelIDs: [0], required: true}",
        device_id_strategy="index",
        pass_device_specs="true",
        driver_root="/run/nvidia/driver",
        dev_root="/",
        driver_root_ctr_path="/host-driver",
        cdi_annotation_prefix="cdi.example/",
        nvidia_cdi_hook_path="/opt/ctk",
        mofed_enabled="1",
        gdrcopy_enabled="T",
        mig_minors_path="/tmp/minors",
        shared_devices_allocation_policy="packed",
    )
    plan = plan_resources(nodes.pcie_l4(), config)["nvidia.com/gpu"]
    assert plan.shared_policy == "packed"
    assert plan.allocate == AllocateSettings(
        device_list_strategies=("volume-mounts", "cdi-cri"),
        device_id_strategy="index",
        pass_device_specs=True,
        driver_root="/run/nvidia/driver",
        dev_root="/",
        cdi_annotation_prefix="cdi.example/",
        nvidia_ctk_path="/opt/ctk",
        gds_enabled=True,
        mofed_enabled=True,
        gdrcopy_enabled=True,
        imex_channel_ids=(0,),
        imex_required=True,
        mps_root="",
        mig_minors_path="/tmp/minors",
    )


def test_plans_are_deterministic() -> None:
    """Equal input gives byte-equal JSON, whatever order discovery listed the GPUs in, and JSON round-trips."""
    text = "sharing: {timeSlicing: {resources: [{name: mig-2g.20gb, replicas: 3}, {name: gpu, devices: [5, 4], replicas: 2}]}}"
    node = nodes.mig_a100()
    shuffled = dataclasses.replace(
        node,
        gpus=tuple(
            dataclasses.replace(g, mig_devices=tuple(reversed(g.mig_devices))) for g in reversed(node.gpus)
        ),
        links=tuple(reversed(node.links)),
    )
    first = plan_resources(node, cfg(text, mig_strategy="mixed"))
    again = plan_resources(node, cfg(text, mig_strategy="mixed"))
    other_order = plan_resources(shuffled, cfg(text, mig_strategy="mixed"))
    for plans in (again, other_order):
        assert list(plans) == list(first)
        assert [p.to_json() for p in plans.values()] == [p.to_json() for p in first.values()]
    for plan in first.values():
        assert ResourcePlan.from_json(plan.to_json()) == plan


def test_empty_node_has_no_plans() -> None:
    """A node without GPUs (or whose MIG GPUs have no devices under mixed) advertises nothing."""
    assert plan_resources(Node(gpus=()), cfg()) == {}
    empty_mig = Node(gpus=(nodes.make_gpu(2, 0, nodes.A100_80GB, 81920, mig_profiles=()),))
    assert plan_resources(empty_mig, cfg(mig_strategy="mixed")) == {}
