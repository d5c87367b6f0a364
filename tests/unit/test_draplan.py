"""Tests of supervisor.node.draplan and `--mode dra` planning: device names as NVIDIA's DRA driver
names them, which devices a pool has, and the DRA worker's plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.model import MigDevice, Node, ResourcePlan
from supervisor.config import Config, ConfigError, config_from_data, parse_config_text
from supervisor.node.draplan import DRIVER, DraHold, dra_devices, dra_plan, mig_device_name, profile_label
from supervisor.node.nvml import Nvml
from supervisor.node.planning import PlanningError, plan_resources
from supervisor.sim.nvml import load_simulator
from tests import nodes


def cfg(text: str = "", **flags: object) -> Config:
    return config_from_data(parse_config_text(text, "test.yaml"), flags=flags, source="test.yaml")


def dra_cfg(**flags: object) -> Config:
    return cfg("version: v1\ngpuvisor: {mode: dra}\n", node_name="node-a", **flags)


def discovered(profile: str) -> Node:
    nvml = Nvml(load_simulator(profile), sysfs_root=None)
    nvml.init()
    return nvml.discover()


def test_full_gpus_are_named_by_minor_number_not_index() -> None:
    """A GPU without MIG mode is `gpu-<minor>`, whatever its index (NVIDIA names by minor)."""
    node = nodes.pcie_l4()
    swapped = Node(gpus=tuple(dataclasses.replace(g, minor=10 + g.index) for g in node.gpus))
    assert [name for _, _, name in dra_devices(swapped)] == ["gpu-10", "gpu-11", "gpu-12", "gpu-13"]


@pytest.mark.parametrize(
    ("profile", "label"),
    [("1g.10gb", "1g10gb"), ("1g.10gb+me", "1g10gb-me"), ("3g.40gb", "3g40gb"), ("1c.3g.40gb", "1c3g40gb")],
)
def test_profile_label_drops_dots_and_is_rfc1123(profile: str, label: str) -> None:
    """The profile part of a MIG name: dots dropped, anything else not [a-z0-9-] turned into '-'."""
    assert profile_label(profile) == label


def test_mig_devices_on_the_simulated_a100_are_named_by_profile_id_and_placement() -> None:
    """On mig-a100 (GPUs 0-3 MIG-enabled) a MIG-enabled GPU is only its MIG devices, each named
    gpu-<minor>-mig-<profile>-<GI profile id>-<placement start> from what NVML reports; GPUs 4-7 are gpu-<minor>."""
    node = discovered("mig-a100")
    devices = dra_devices(node)
    names = [name for _, _, name in devices]
    assert "gpu-0" not in names and names[-4:] == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    gpu0 = {name for gpu, mig, name in devices if gpu.index == 0}
    # A100's GPU-instance profile ids: 1g.10gb 19, 1g.10gb+me 20, 2g.20gb 14, 3g.40gb 9.
    assert gpu0 == {
        "gpu-0-mig-3g40gb-9-4",
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-1g10gb-19-2",
        "gpu-0-mig-1g10gb-19-3",
    }
    me = [name for _, mig, name in devices if mig is not None and mig.profile == "1g.10gb+me"]
    assert len(me) == 1 and me[0].split("-mig-")[1].startswith("1g10gb-me-20-")
    assert len(set(names)) == len(names)


def test_a_mig_device_nvml_could_not_place_gets_a_name_from_its_instance_ids() -> None:
    """Without a GPU-instance profile id and placement the name falls back to gi<gi>-ci<ci>."""
    gpu = nodes.mig_a100().gpus[0]
    mig = dataclasses.replace(gpu.mig_devices[0], gi_profile_id=-1, placement_start=-1)
    assert mig_device_name(gpu, mig) == f"gpu-0-mig-{profile_label(mig.profile)}-gi{mig.gi_id}-ci{mig.ci_id}"


def test_two_compute_instances_of_one_gpu_instance_get_distinct_names() -> None:
    """Names that would collide (one GPU instance, two compute instances) get -ci<id>; others keep theirs."""
    base = nodes.mig_a100().gpus[0]
    one = MigDevice("MIG-a", base.uuid, 0, 0, 1, 0, "1c.2g.20gb", 9856, gi_profile_id=14, placement_start=0)
    two = dataclasses.replace(one, uuid="MIG-b", index=1, ci_id=1)
    other = MigDevice("MIG-c", base.uuid, 0, 2, 2, 0, "1g.10gb", 9856, gi_profile_id=19, placement_start=4)
    gpu = dataclasses.replace(base, mig_devices=(one, two, other))
    names = [name for _, _, name in dra_devices(Node(gpus=(gpu,)))]
    assert names == ["gpu-0-mig-1c2g20gb-14-0-ci0", "gpu-0-mig-1c2g20gb-14-0-ci1", "gpu-0-mig-1g10gb-19-4"]


def test_mode_dra_plans_only_the_dra_worker() -> None:
    """In mode dra no extended resource is planned: the one plan is gpu.nvidia.com's, with every device."""
    node = discovered("mig-a100")
    plans = plan_resources(node, dra_cfg(mig_strategy="mixed"))
    assert list(plans) == [DRIVER]
    plan = plans[DRIVER]
    assert [d.id for d in plan.devices] == [name for _, _, name in dra_devices(node)]
    assert plan.dra is not None and plan.dra.pool == "node-a" and plan.dra.driver == DRIVER
    assert plan.dra.plugin_dir == "/var/lib/kubelet/plugins/gpu.nvidia.com"
    assert plan.dra.registry_dir == "/var/lib/kubelet/plugins_registry"
    assert plan.allocate.device_list_strategies == ("cdi-cri",)
    mig = next(d for d in plan.devices if d.is_mig)
    gpu0 = node.gpus[0]
    assert mig.gpu_uuid == gpu0.uuid and mig.uuid.startswith("MIG-") and mig.index.startswith("0:")


def test_the_dra_plan_round_trips_and_device_plugin_plans_keep_their_bytes() -> None:
    """A DRA plan survives JSON; a device-plugin plan's JSON has no `dra` key (its bytes did not change)."""
    plan = dra_plan(nodes.pcie_l4(), dra_cfg(device_id_strategy="index"))
    assert ResourcePlan.from_json(plan.to_json()) == plan
    assert plan.allocate.device_id_strategy == "index"
    classic = plan_resources(nodes.pcie_l4(), cfg())["nvidia.com/gpu"]
    assert "dra" not in json.loads(classic.to_json())
    assert ResourcePlan.from_json(classic.to_json()) == classic


def test_mode_dra_needs_the_node_name() -> None:
    """Mode dra without NODE_NAME is a config error that says what to set."""
    with pytest.raises(ConfigError, match="NODE_NAME") as info:
        cfg("version: v1\ngpuvisor: {mode: dra}\n")
    assert "gpuvisor.mode" in str(info.value)


def test_mode_dra_refuses_device_plugin_sharing() -> None:
    """Time-slicing replicas are a device-plugin notion: with mode dra they are refused, naming the section."""
    text = (
        "version: v1\ngpuvisor: {mode: dra}\n"
        "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n"
    )
    with pytest.raises(ConfigError, match=r"sharing\.timeSlicing"):
        cfg(text, node_name="n")


def test_mode_is_one_of_two() -> None:
    """An unknown mode is refused with the choices."""
    with pytest.raises(ConfigError, match="device-plugin, dra"):
        cfg("version: v1\ngpuvisor: {mode: both}\n")


def test_mode_dra_refuses_socket_paths_longer_than_a_unix_socket_address() -> None:
    """A plugins dir so deep that dra.sock would not fit a unix socket address is a config error
    naming the setting, not a worker retrying forever."""
    with pytest.raises(ConfigError, match=r"gpuvisor\.kubeletPluginsDir.*over the 107"):
        cfg("version: v1\ngpuvisor: {mode: dra, kubeletPluginsDir: /" + "d" * 100 + "}\n", node_name="n")


# --- a node switched from DRA to the device plugin: what DRA claims still hold -------------------


def dp_cfg(text: str = "version: v1\n") -> Config:
    return cfg(text, node_name="node-a")


def test_while_the_dra_worker_may_still_prepare_only_its_draining_plan_is_planned() -> None:
    """A switch from DRA under way (the DRA worker has not confirmed its drain): no device-plugin
    resource is planned, only the DRA worker's plan, draining, with every device."""
    plans = plan_resources(nodes.pcie_l4(), dp_cfg(), DraHold(settled=False))
    assert list(plans) == [DRIVER]
    dra = plans[DRIVER].dra
    assert dra is not None and dra.drain and len(plans[DRIVER].devices) == 4


def test_devices_of_prepared_claims_stay_out_of_the_device_plugin_with_every_replica() -> None:
    """Claims hold gpu-1 and gpu-3: nvidia.com/gpu has the other GPUs only (under time-slicing not
    one replica of the held GPUs), and the draining DRA plan has just the held devices."""
    node = nodes.pcie_l4()
    config = dp_cfg(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
    )
    plans = plan_resources(node, config, DraHold(devices=frozenset({"gpu-1", "gpu-3"})))
    assert list(plans) == [DRIVER, "nvidia.com/gpu"]
    kept = {d.gpu_uuid for d in plans["nvidia.com/gpu"].devices}
    assert kept == {node.gpus[0].uuid, node.gpus[2].uuid} and len(plans["nvidia.com/gpu"].devices) == 4
    assert [d.id for d in plans[DRIVER].devices] == ["gpu-1", "gpu-3"]
    dra = plans[DRIVER].dra
    assert dra is not None and dra.drain


def test_a_held_mig_device_takes_its_full_gpu_out_too() -> None:
    """Under mig strategy none a MIG-enabled GPU is offered whole: when a claim holds one of its
    MIG devices, the whole GPU is not offered; under mixed only that MIG device goes."""
    node = nodes.mig_a100()
    gpu = next(g for g in node.gpus if g.mig_enabled)
    held = next(name for g, m, name in dra_devices(node) if g is gpu and m is not None)
    hold = DraHold(devices=frozenset({held}))
    none = dp_cfg("version: v1\nflags: {migStrategy: none}\n")
    assert gpu.uuid in {d.gpu_uuid for p in plan_resources(node, none).values() for d in p.devices}
    whole = plan_resources(node, none, hold)
    assert gpu.uuid not in {d.gpu_uuid for p in whole.values() if p.dra is None for d in p.devices}
    mixed = plan_resources(node, dp_cfg("version: v1\nflags: {migStrategy: mixed}\n"), hold)
    offered = {d.uuid for p in mixed.values() if p.dra is None for d in p.devices}
    held_uuid = next(m.uuid for g, m, name in dra_devices(node) if name == held and m is not None)
    assert held_uuid not in offered
    assert {m.uuid for m in gpu.mig_devices} - {held_uuid} <= offered


def test_no_hold_plans_as_before_and_mode_dra_ignores_it() -> None:
    """Nothing held: the device-plugin plans are exactly those without a hold; in mode dra a hold
    changes nothing (the DRA worker owns every device)."""
    node = nodes.pcie_l4()
    assert plan_resources(node, dp_cfg(), DraHold()) == plan_resources(node, dp_cfg())
    assert plan_resources(node, dra_cfg(), DraHold(settled=False)) == plan_resources(node, dra_cfg())


def test_while_an_earlier_pool_is_withdrawn_the_device_plugin_gets_nothing() -> None:
    """`waiting` (an earlier DRA life's pool is being withdrawn): no device-plugin resource is
    planned; held devices still get their draining DRA plan; a config planning cannot take still
    fails now, not once the wait is over."""
    node = nodes.pcie_l4()
    assert plan_resources(node, dp_cfg(), DraHold(waiting="withdrawing")) == {}
    held = plan_resources(node, dp_cfg(), DraHold(devices=frozenset({"gpu-2"}), waiting="withdrawing"))
    assert list(held) == [DRIVER] and [d.id for d in held[DRIVER].devices] == ["gpu-2"]
    with pytest.raises(PlanningError, match="MIG strategy single"):
        plan_resources(
            nodes.mig_a100(), dp_cfg("version: v1\nflags: {migStrategy: single}\n"), DraHold(waiting="w")
        )
