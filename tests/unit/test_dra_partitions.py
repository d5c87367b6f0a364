"""Tests of supervisor.dra.partitions and the partitionable part of the DRA plan (MIG on demand):
devices, counters and names as NVIDIA's DynamicMIG publishes them, the slice layout by
Kubernetes version, health taints of placements, and what the plan tells the DRA worker."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.model import MigDevice, MigOption, Node
from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.dra.partitions import COMBINED, SPLIT, counter_set_name, layout_for
from supervisor.dra.slices import build_slices
from supervisor.health.book import ConditionView, Recovery
from supervisor.node.draplan import dra_plan, partitions
from tests import nodes
from tests.kubeapi.validation import resource_slice_problems

GIB = 1024


def _options() -> tuple[MigOption, ...]:
    """A100-80GB's 1g.10gb at its seven placements and 7g.80gb at its one (sizes from NVIDIA's MIG
    user guide's A100-80GB table: 1g.10gb 14 SMs and 1 copy engine; 7g.80gb 98 SMs, 7 copy
    engines, 5 decoders, 1 JPEG and 1 OFA engine)."""
    small = [MigOption("1g.10gb", 19, 0, start, 1, 9856, 14, 1) for start in range(7)]
    return (*small, MigOption("7g.80gb", 0, 7, 0, 8, 80 * GIB, 98, 7, 5, 0, 1, 1))


def _node(made: tuple[MigDevice, ...] = ()) -> Node:
    base = nodes.pcie_l4()
    gpu = dataclasses.replace(
        base.gpus[0],
        mig_options=_options(),
        mig_enabled=bool(made),
        mig_devices=made,
        name="NVIDIA A100-SXM4-80GB",
    )
    return dataclasses.replace(base, gpus=(gpu, *base.gpus[1:]))


def _made(gpu_uuid: str, start: int, gi: int) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-made-{start}", parent_uuid=gpu_uuid, parent_index=0, index=0, gi_id=gi, ci_id=0,
        profile="1g.10gb", memory_mib=9856, gi_profile_id=19, placement_start=start, placement_size=1,
    )  # fmt: skip


def _devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def _counter_sets(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c["counters"] for s in slices for c in s["spec"].get("sharedCounters", [])}


def test_a_partitionable_gpu_is_its_full_gpu_and_every_placement_named_as_nvidia_names_them() -> None:
    """gpu-<minor> and gpu-<minor>-mig-<profile without dots>-<GI profile id>-<start> for each option
    (NVIDIA partitions.go ToCanonicalName); placements carry type mig, parentUUID and profile and
    no uuid; the node's other GPUs stay plain full GPUs."""
    node = _node()
    devices = _devices(build_slices(node, [], node_name="n", layout=COMBINED))
    minor = node.gpus[0].minor
    names = [f"gpu-{minor}-mig-1g10gb-19-{s}" for s in range(7)] + [f"gpu-{minor}-mig-7g80gb-0-0"]
    assert set(names) | {f"gpu-{minor}"} <= set(devices)
    placement = devices[names[3]]
    assert placement["attributes"]["type"] == {"string": "mig"}
    assert placement["attributes"]["parentUUID"] == {"string": node.gpus[0].uuid}
    assert placement["attributes"]["profile"] == {"string": "1g.10gb"}
    assert "uuid" not in placement["attributes"]
    assert all("consumesCounters" not in devices[f"gpu-{g.minor}"] for g in node.gpus[1:])


def test_counters_are_the_largest_sizes_and_one_per_memory_slice() -> None:
    """The counter set gpu-<minor>-counter-set holds each capacity's largest value over the options
    in DNS form and memory-slice-0..7 = 1 (partitions.go capacitiesToCounters,
    addCountersForMemSlices); the full GPU consumes all of it, a placement its sizes and the memory
    slices of its placement."""
    node = _node()
    gpu = node.gpus[0]
    slices = build_slices(node, [], node_name="n", layout=COMBINED)
    counters = _counter_sets(slices)[counter_set_name(gpu)]
    assert counters["multiprocessors"] == {"value": "98"}
    assert counters["copy-engines"] == {"value": "7"}
    assert counters["memory"] == {"value": "80Gi"}
    assert [k for k in counters if k.startswith("memory-slice-")] == [f"memory-slice-{i}" for i in range(8)]
    devices = _devices(slices)
    whole = devices[f"gpu-{gpu.minor}"]["consumesCounters"]
    assert whole == [{"counterSet": counter_set_name(gpu), "counters": counters}]
    small = devices[f"gpu-{gpu.minor}-mig-1g10gb-19-5"]["consumesCounters"][0]["counters"]
    assert small["multiprocessors"] == {"value": "14"} and small["memory"] == {"value": "9856Mi"}
    assert [k for k in small if k.startswith("memory-slice-")] == ["memory-slice-5"]
    assert devices[f"gpu-{gpu.minor}-mig-1g10gb-19-5"]["capacity"]["memory"] == {"value": "9856Mi"}


def test_the_layout_follows_the_api_servers_version() -> None:
    """Before 1.35 one slice per GPU carries its counter set and its devices; from 1.35 the counter
    sets are a slice of their own, without a devices key (1.35 refuses sharedCounters beside
    devices, even an empty list), and the GPU's devices another (NVIDIA shouldUseSplitResourceSlices)."""
    assert layout_for((1, 34)) == COMBINED and layout_for((1, 35)) == SPLIT and layout_for((2, 0)) == SPLIT
    node = _node()
    combined = [s["spec"] for s in build_slices(node, [], node_name="n", layout=COMBINED)]
    shared = [s for s in combined if "sharedCounters" in s]
    assert len(shared) == 1 and len(shared[0]["devices"]) == 1 + 8
    split = [s["spec"] for s in build_slices(node, [], node_name="n", layout=SPLIT)]
    heads = [s for s in split if "sharedCounters" in s]
    assert len(heads) == 1 and "devices" not in heads[0]
    assert all(s["pool"]["resourceSliceCount"] == len(split) for s in split)
    assert not any("consumesCounters" in d for d in _devices(build_slices(node, [], node_name="n")).values())


def test_more_than_eight_gpus_spread_their_counter_sets_over_slices_of_eight() -> None:
    """1.35 holds at most 8 counter sets in a slice (ResourceSliceMaxCounterSets): a node of 10
    partitionable GPUs gets two counter slices, 8 and 2."""
    gpu = _node().gpus[0]
    many = Node(gpus=tuple(dataclasses.replace(gpu, index=i, minor=i, uuid=f"GPU-{i}") for i in range(10)))
    heads = [
        s["spec"]
        for s in build_slices(many, [], node_name="n", layout=SPLIT)
        if "sharedCounters" in s["spec"]
    ]
    assert [len(h["sharedCounters"]) for h in heads] == [8, 2]


def _condition(gpu_uuid: str, gi: int | None, name: str) -> ConditionView:
    return ConditionView(gpu_uuid, gi, None if gi is None else 0, name, Recovery.UNTIL_RESET, "x", 1.0, 1.0)


def test_a_placement_not_made_yet_carries_only_its_gpus_own_conditions() -> None:
    """An XID on a made instance taints that placement and the full GPU, not the other placements;
    a condition of the whole GPU taints every device of it."""
    gpu_uuid = _node().gpus[0].uuid
    node = _node(made=(_made(gpu_uuid, 2, 9),))
    minor = node.gpus[0].minor
    devices = _devices(
        build_slices(node, [_condition(gpu_uuid, 9, "xid:48")], node_name="n", layout=COMBINED)
    )
    tainted = {name for name, d in devices.items() if d.get("taints")}
    assert tainted == {f"gpu-{minor}", f"gpu-{minor}-mig-1g10gb-19-2"}
    devices = _devices(
        build_slices(node, [_condition(gpu_uuid, None, "lost")], node_name="n", layout=COMBINED)
    )
    assert {name for name, d in devices.items() if d.get("taints")} == {f"gpu-{minor}"} | {
        n for _, _, n in partitions(node.gpus[0])
    }


def _config() -> Config:
    text = "version: v1\ngpuvisor: {mode: dra, dra: {migOnDemand: true}}\n"
    return config_from_data(parse_config_text(text, "t.yaml"), flags={"node_name": "node-a"}, source="t.yaml")


def test_the_dra_plan_marks_partitionable_devices_and_what_is_made_already() -> None:
    """The setting is read from the config file (gpuvisor.dra.migOnDemand); the plan lists the
    full GPU and every placement as partitionable, a placement not made with no UUID (the worker
    makes it at prepare), a made one with its instance's UUID and IDs (for its health)."""
    config = _config()
    assert config.dra_mig_on_demand is True
    gpu_uuid = _node().gpus[0].uuid
    plan = dra_plan(_node(made=(_made(gpu_uuid, 4, 11),)), config)
    assert plan.dra is not None and plan.dra.mig_on_demand
    by_id = {d.id: d for d in plan.devices if d.gpu_uuid == gpu_uuid}
    minor = _node().gpus[0].minor
    assert by_id[f"gpu-{minor}"].partitionable and not by_id[f"gpu-{minor}"].on_demand
    waiting = by_id[f"gpu-{minor}-mig-1g10gb-19-0"]
    assert (
        waiting.on_demand
        and waiting.uuid == ""
        and (waiting.mig_gi_profile_id, waiting.mig_placement_start) == (19, 0)
    )
    made = by_id[f"gpu-{minor}-mig-1g10gb-19-4"]
    assert made.on_demand and (made.uuid, made.mig_gi, made.mig_ci) == ("MIG-made-4", 11, 0)
    others = [d for d in plan.devices if d.gpu_uuid != gpu_uuid]
    assert others and not any(d.partitionable for d in others)


def test_the_slices_pass_the_api_servers_rules_of_the_version_they_are_laid_out_for() -> None:
    """Each layout passes the schema and validation rules of the release it is for (the fake API
    server's: tests/kubeapi/partitions.py, from validation.go of 1.34 and 1.35), and each fails
    the other's: combined is refused by 1.35 (sharedCounters beside devices), split by 1.34 (a
    device consuming a counter set its slice does not define)."""
    node = _node()
    for layout, good, bad in ((COMBINED, "1.34.0", "1.35.0"), (SPLIT, "1.35.0", "1.34.0")):
        slices = build_slices(node, [], node_name="node-a", layout=layout)
        for i, obj in enumerate(slices):
            obj["metadata"] = {"name": f"node-a-gpu.nvidia.com-{i}"}
        assert [p for s in slices for p in resource_slice_problems(s, good)] == []
        assert [p for s in slices for p in resource_slice_problems(s, bad)] != []
