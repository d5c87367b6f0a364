"""Partitionable GPUs in the ResourceSlices (KEP-4815, gpuvisor.dra.migOnDemand): pure functions.

A GPU whose MIG options discovery read (`Gpu.mig_options`, supervisor/node/migplace.py) is
published as NVIDIA's DRA driver publishes it with its DynamicMIG gate
(kubernetes-sigs/dra-driver-nvidia-gpu at 9593204, cmd/gpu-kubelet-plugin/partitions.go, and
nvlib.go `inspectMigProfilesAndPlacements`), so that DeviceClasses and selectors written for that
driver pick the same devices and the scheduler does the arithmetic of what fits:

- one counter set per GPU, `gpu-<minor>-counter-set` (`GetSharedCounterSetName`), holding one
  counter per capacity, named as the capacity in DNS form (`capacitiesToCounters`:
  `multiprocessors`, `copy-engines`, `decoders`, `encoders`, `jpeg-engines`, `ofa-engines`,
  `memory`), each the largest value of any profile at any placement, and one counter
  `memory-slice-<i>` = 1 for each memory slice (`addCountersForMemSlices`; as many as the largest
  placement's size, `maxMemSlicesConsumed`);
- the full GPU, `gpu-<minor>`, with a full GPU's attributes, those largest values as its capacity
  (`PartCapacities`) and consuming every counter of its set (`PartConsumesCounters`): once it is
  allocated nothing else of the GPU fits, and once any placement is, it does not;
- each placement of each profile, `gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>`
  (`MigSpec.PartGetDevice`): a MIG device's attributes without a `uuid` (`CommonAttributesMig`:
  it does not exist yet), its profile's sizes as capacity (`CommonCapacitiesMig`: no memory
  slices) and consuming them and the memory slices of its placement.

Where the slices go depends on the API server's version, as NVIDIA's driver decides it
(driver.go `shouldUseSplitResourceSlices`): before 1.35 each GPU's counter set and devices share
one slice (`COMBINED`); from 1.35 the counter sets go in one slice of their own, before the
devices (at most 8 sets a slice, 1.35's limit; NVIDIA's driver puts all in one, which a node of
more than 8 GPUs cannot have), and each GPU's devices in a slice of theirs (`SPLIT`).

Health: the full GPU carries every condition of its GPU as a taint; a placement whose instance
exists carries the GPU's and that instance's; one not made yet only the GPU's own (a condition of
another instance does not touch it).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from common.model import Gpu, MigDevice, MigOption, Node
from supervisor.dra.devices import common_attributes, device_taints, gpu_device
from supervisor.dra.memshare import binary
from supervisor.health.book import ConditionView
from supervisor.node.draplan import gpu_device_name, partitions

COMBINED = "combined"  # Kubernetes 1.34: a GPU's counter set in the slice of its devices
SPLIT = "split"  # 1.35 and later: the counter sets in a slice of their own
LAYOUTS = (COMBINED, SPLIT)
FIRST_SPLIT = (1, 35)
MAX_COUNTER_SETS = 8  # 1.35: ResourceSliceMaxCounterSets, so a node of 16 GPUs needs two such slices

# A profile's sizes: capacity name (NVIDIA's CommonCapacitiesMig) -> its counter's name.
CAPACITIES = (
    ("multiprocessors", "multiprocessors"),
    ("copyEngines", "copy-engines"),
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpegEngines", "jpeg-engines"),
    ("ofaEngines", "ofa-engines"),
    ("memory", "memory"),
)


def layout_for(version: tuple[int, int]) -> str:
    """The slice layout for an API server of this (major, minor) version."""
    return SPLIT if version >= FIRST_SPLIT else COMBINED


def counter_set_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}-counter-set"


def sizes(option: MigOption) -> dict[str, int]:
    """A profile's sizes by capacity name (memory in bytes)."""
    return {
        "multiprocessors": option.multiprocessors,
        "copyEngines": option.copy_engines,
        "decoders": option.decoders,
        "encoders": option.encoders,
        "jpegEngines": option.jpeg_engines,
        "ofaEngines": option.ofa_engines,
        "memory": option.memory_mib << 20,
    }


def largest(gpu: Gpu) -> tuple[dict[str, int], int]:
    """The largest size of each capacity over every option, and the memory slice count."""
    top = dict.fromkeys((name for name, _ in CAPACITIES), 0)
    for option in gpu.mig_options:
        for name, value in sizes(option).items():
            top[name] = max(top[name], value)
    return top, max((o.placement_size for o in gpu.mig_options), default=0)


def _quantities(values: dict[str, int]) -> dict[str, dict[str, str]]:
    return {name: {"value": binary(value)} for name, value in values.items()}


def _counters(values: dict[str, int], start: int, size: int) -> dict[str, dict[str, str]]:
    out = {counter: {"value": binary(values[name])} for name, counter in CAPACITIES}
    for i in range(start, start + size):
        out[f"memory-slice-{i}"] = {"value": "1"}
    return out


def counter_set(gpu: Gpu) -> dict[str, Any]:
    top, slices = largest(gpu)
    return {"name": counter_set_name(gpu), "counters": _counters(top, 0, slices)}


def full_device(gpu: Gpu, node: Node) -> dict[str, Any]:
    top, slices = largest(gpu)
    device = gpu_device(gpu, node, gpu_device_name(gpu))
    device["capacity"] = _quantities(top)
    device["consumesCounters"] = [
        {"counterSet": counter_set_name(gpu), "counters": _counters(top, 0, slices)}
    ]
    return device


def partition_device(gpu: Gpu, option: MigOption, node: Node, name: str) -> dict[str, Any]:
    values = sizes(option)
    return {
        "name": name,
        "attributes": {
            "type": {"string": "mig"},
            "parentUUID": {"string": gpu.uuid},
            "profile": {"string": option.profile},
            **common_attributes(gpu, node),
        },
        "capacity": _quantities(values),
        "consumesCounters": [
            {
                "counterSet": counter_set_name(gpu),
                "counters": _counters(values, option.placement_start, option.placement_size),
            }
        ],
    }


@dataclass(frozen=True)
class Part:
    """One partitionable GPU's share of the pool: its counter set and its devices (tainted)."""

    counter_set: dict[str, Any]
    devices: list[dict[str, Any]]


def _gpu_wide(conditions: Sequence[ConditionView]) -> list[ConditionView]:
    return [c for c in conditions if c.gi is None]


def parts(
    node: Node,
    conditions: Sequence[ConditionView],
    *,
    taints: bool = True,
    exclude: Container[str] = (),
) -> list[Part]:
    """Each partitionable GPU's part, in index order. A GPU any of whose devices is in `exclude`
    (held by a device-plugin container) is left out whole: what is held of it is not known
    finely enough to offer the rest. `taints=False` leaves unhealthy devices out instead."""
    out: list[Part] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        if not gpu.mig_options:
            continue
        placements = partitions(gpu)
        if gpu_device_name(gpu) in exclude or any(name in exclude for _, _, name in placements):
            continue
        mine = [c for c in conditions if c.gpu_uuid == gpu.uuid]
        devices: list[dict[str, Any]] = []
        candidates: list[tuple[dict[str, Any], MigDevice | None, bool]] = [
            (full_device(gpu, node), None, False)
        ]
        candidates += [(partition_device(gpu, o, node, n), made, made is None) for o, made, n in placements]
        for device, made, abstract in candidates:
            marks = device_taints(gpu, made, _gpu_wide(mine) if abstract else mine)
            if marks and not taints:
                continue
            if marks:
                device["taints"] = marks
            devices.append(device)
        out.append(Part(counter_set(gpu), devices))
    return out


def part_specs(found: Sequence[Part], layout: str) -> list[dict[str, Any]]:
    """The slices' `spec` parts for the partitionable GPUs (sharedCounters and/or devices)."""
    if layout == SPLIT:  # no `devices` key at all beside them: 1.35 refuses even an empty list
        sets = [p.counter_set for p in found]
        heads = [
            {"sharedCounters": sets[i : i + MAX_COUNTER_SETS]} for i in range(0, len(sets), MAX_COUNTER_SETS)
        ]
        return heads + [{"devices": p.devices} for p in found]
    return [{"sharedCounters": [p.counter_set], "devices": p.devices} for p in found]
