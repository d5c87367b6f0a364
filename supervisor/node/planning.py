"""The resource planner: a pure function from what discovery found (`Node`) and the config to one
`ResourcePlan` per resource the node advertises.

Same input, same output, byte for byte: devices are sorted by (GPU index, MIG index, replica),
plans are returned ordered by resource name, and nothing here reads the clock, the environment
or the disk. A reload compares old and new plans by their JSON.

The steps follow NVIDIA's plugin (docs/compatibility.md, "What is the same"), with three deliberate differences that
NVIDIA parses but ignores and gpuvisor honours: custom `resources` names, `rename`, and per-GPU
`devices` selectors (so replica counts can differ per GPU, NVIDIA #1786).

1. Base devices: every GPU, or its MIG devices, under the resource name the MIG strategy and
   `resources.gpus` / `resources.mig` give it.
2. Sharing: each `sharing.<strategy>.resources[]` entry, in file order, takes the devices of its
   resource that its `devices` selector picks and that no earlier entry took, and splits each into
   `replicas` replicas (`<id>::<n>`), advertised under `rename` (or `<name>.shared` with
   `renameByDefault`) or the original name. Devices no entry took stay whole under the original
   name. A `count` selector takes the first N remaining devices (fewer if the node has fewer), and
   references that match no device on this node are ignored, so one DaemonSet config can serve
   nodes of different shapes.
3. MPS checks: an MPS root is set, the MIG strategy is not `mixed`, no MIG device and no
   MIG-enabled GPU is shared, and no GPU is split into more replicas than MPS allows clients on
   it (48 from compute capability 7.5 on, 16 before). The config loader checks the first two
   too; they are repeated here because a `Config` can also be built without the loader.
4. Sizes, from counts before any replica is built: a resource whose ListAndWatch answer would
   not fit the kubelet's 4 MiB receive limit (with a margin, see supervisor.node.plansize) is refused,
   and so is a node past MAX_PLANNED_DEVICES. NVIDIA accepts such configs and then fails at
   the kubelet; a PlanningError here is a config error at start and a refused reload later.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from common.model import AllocatableDevice, AllocateSettings, Gpu, GpuPair, Node, ResourcePlan
from supervisor.config import RESOURCE_DOMAIN, Config, DeviceSelector, ResourcePattern
from supervisor.node.draplan import DRIVER, DraHold, dra_plan, gpu_record, held_uuids, mig_record
from supervisor.node.plansize import (
    KUBELET_MAX_RECEIVE_BYTES,
    LIST_AND_WATCH_BUDGET,
    device_entry_size,
    replicas_size,
)

GPU_RESOURCE = f"{RESOURCE_DOMAIN}/gpu"
# Devices one node may advertise over all its resources. Each costs about 1 KiB across the
# supervisor and its worker (measured: 320 B for a plan's device in each process, as much again
# for its JSON, plus the health book and the protobuf message), so 131,072 keep that near
# 128 MiB; no real node needs more than a few thousand.
MAX_PLANNED_DEVICES = 131_072
NO_HOLD = DraHold()

# How many MPS clients one GPU serves: 48 from compute capability 7.5 on, 16 before (the MPS
# server's per-device client limit). A replica is a client slot, so replicas may not exceed it.
MPS_MAX_CLIENTS_NEW = 48
MPS_MAX_CLIENTS_OLD = 16
MPS_NEW_LIMIT_FROM = (7, 5)


def mps_max_clients(compute_capability: tuple[int, int]) -> int:
    """The most MPS replicas a GPU of this compute capability can be split into."""
    return MPS_MAX_CLIENTS_NEW if tuple(compute_capability) >= MPS_NEW_LIMIT_FROM else MPS_MAX_CLIENTS_OLD


class PlanningError(Exception):
    """The node and the config cannot be turned into plans (e.g. `single` on mixed MIG profiles)."""


@dataclass(frozen=True)
class _Placed:
    """A device with the resource it is advertised under and the resource it came from."""

    resource: str
    origin: str
    device: AllocatableDevice


def plan_resources(node: Node, config: Config, hold: DraHold = NO_HOLD) -> dict[str, ResourcePlan]:
    """One plan per advertised resource, keyed by the full resource name, ordered by name.

    In `--mode dra` the node advertises no extended resource: its one plan is the DRA worker's
    (supervisor/node/draplan.py), so no GPU is ever offered through both APIs. In mode
    device-plugin, `hold` is what DRA claims prepared before still hold (a node switched from
    mode dra): while a DRA worker may still prepare claims, its draining plan is the only plan;
    once settled, the held devices stay out of the device plugin's plans (every replica, and a
    full GPU whose MIG device is held) and a draining DRA plan keeps serving their unprepare.
    While `hold.waiting` (an earlier life's pool is being withdrawn) the device plugin gets nothing."""
    if config.mode == "dra":
        return {DRIVER: dra_plan(node, config)}
    if not hold.settled:
        return {DRIVER: dra_plan(node, config, drain=True)}
    plans = _device_plugin_plans(node, config)  # planned even while waiting: a bad config shows now
    if hold.waiting:
        return {DRIVER: dra_plan(node, config, drain=True, only=hold.devices)} if hold.devices else {}
    if not hold.devices:
        return plans
    blocked = held_uuids(node, hold.devices)
    out = {DRIVER: dra_plan(node, config, drain=True, only=hold.devices)}
    for resource, plan in plans.items():
        kept = tuple(d for d in plan.devices if not blocked.blocks(d))
        if kept:  # a resource whose every device is held is not advertised until one comes back
            out[resource] = dataclasses.replace(plan, devices=kept)
    return dict(sorted(out.items()))


def device_plugin_resources(node: Node, config: Config) -> frozenset[str]:
    """The resources this node would advertise as a device plugin under `config`, whatever its
    mode (empty where that config cannot be planned as one)."""
    try:
        return frozenset(_device_plugin_plans(node, dataclasses.replace(config, mode="device-plugin")))
    except PlanningError:
        return frozenset()


def _device_plugin_plans(node: Node, config: Config) -> dict[str, ResourcePlan]:
    if config.sharing.strategy == "mps":
        _check_mps_config(config)
    base = _base_devices(node, config)
    chosen = _choose_shared(base, config)
    if config.sharing.strategy == "mps":
        _check_mps_devices(base, chosen, node)
    _check_sizes(base, chosen)  # before a single replica is built
    placed = _expand(base, chosen)

    by_resource: dict[str, list[AllocatableDevice]] = defaultdict(list)
    origins: dict[str, set[str]] = defaultdict(set)
    for item in placed:
        by_resource[item.resource].append(item.device)
        origins[item.resource].add(item.origin)
    for resource, sources in origins.items():
        if len(sources) > 1:
            raise PlanningError(
                f"resource {resource} would mix devices of {', '.join(sorted(sources))}: "
                "rename the shared resource to a name of its own"
            )

    plans: dict[str, ResourcePlan] = {}
    for resource in sorted(by_resource):
        devices = tuple(sorted(by_resource[resource], key=_device_order))
        plans[resource] = _plan(resource, devices, node, config)
    return plans


# --- step 1: base devices ---------------------------------------------------------------------


def _gpu_resource(gpu: Gpu, patterns: tuple[ResourcePattern, ...]) -> str:
    # The configured patterns, first match wins, then NVIDIA's default `* -> gpu`.
    for pattern in patterns:
        if pattern.matches(gpu.name):
            return pattern.name
    return GPU_RESOURCE


def _mig_resource(profile: str, patterns: tuple[ResourcePattern, ...]) -> str:
    for pattern in patterns:
        if pattern.matches(profile):
            return pattern.name
    return f"{RESOURCE_DOMAIN}/mig-{profile.replace('+', '.')}"


def _indexes(gpus: Iterable[Gpu]) -> str:
    return ", ".join(str(g.index) for g in gpus)


def _check_single(gpus: list[Gpu]) -> None:
    """NVIDIA's `single` rules: MIG devices all alike, on every MIG-enabled GPU, no full GPU beside.

    Every broken rule is named in one error, so a user fixes the node in one go.
    """
    mig_gpus = [g for g in gpus if g.mig_enabled]
    if not mig_gpus:
        return  # no MIG anywhere: `single` is the same as `none`
    problems: list[str] = []
    by_profile: dict[str, list[int]] = defaultdict(list)
    for gpu in mig_gpus:
        for mig in gpu.mig_devices:
            if gpu.index not in by_profile[mig.profile]:
                by_profile[mig.profile].append(gpu.index)
    if len(by_profile) > 1:
        found = "; ".join(
            f"{profile} on GPU(s) {', '.join(str(i) for i in indexes)}"
            for profile, indexes in sorted(by_profile.items())
        )
        problems.append(f"MIG devices must all have the same profile, found {found}")
    empty = [g for g in mig_gpus if not g.mig_devices]
    if empty:
        problems.append(f"MIG-enabled GPU(s) {_indexes(empty)} have no MIG devices")
    full = [g for g in gpus if not g.mig_enabled]
    if full:
        problems.append(
            f"GPU(s) {_indexes(full)} are not MIG-enabled beside MIG-enabled GPU(s) {_indexes(mig_gpus)}"
        )
    if problems:
        raise PlanningError(
            f"MIG strategy single: {'; and '.join(problems)} (the mixed strategy allows this)"
        )


def _base_devices(node: Node, config: Config) -> list[_Placed]:
    gpus = sorted(node.gpus, key=lambda g: g.index)
    strategy = config.mig_strategy
    if strategy == "single":
        _check_single(gpus)
    out: list[_Placed] = []
    for gpu in gpus:
        if not gpu.mig_enabled or strategy == "none":
            name = _gpu_resource(gpu, config.resources.gpus)
            out.append(_Placed(name, name, gpu_record(gpu, gpu.uuid)))
            continue
        for mig in sorted(gpu.mig_devices, key=lambda m: m.index):
            if strategy == "single":
                name = _gpu_resource(gpu, config.resources.gpus)
            else:
                name = _mig_resource(mig.profile, config.resources.mig)
            out.append(_Placed(name, name, mig_record(gpu, mig, mig.uuid)))
    return out


# --- step 2: sharing --------------------------------------------------------------------------


def _selects(ref: str, device: AllocatableDevice) -> bool:
    if ref in (device.index, device.uuid):
        return True
    # A GPU's index or UUID also picks every MIG device on it.
    return device.is_mig and ref in (str(device.gpu_index), device.gpu_uuid)


def _select(selector: DeviceSelector, candidates: list[AllocatableDevice]) -> list[AllocatableDevice]:
    if selector.all:
        return candidates
    if selector.count:
        return candidates[: selector.count]
    return [d for d in candidates if any(_selects(ref, d) for ref in selector.refs)]


def _replicas(device: AllocatableDevice, replicas: int) -> list[AllocatableDevice]:
    return [
        AllocatableDevice(
            id=f"{device.id}::{n}",
            uuid=device.uuid,
            index=device.index,
            gpu_uuid=device.gpu_uuid,
            gpu_index=device.gpu_index,
            gpu_minor=device.gpu_minor,
            numa_node=device.numa_node,
            memory_mib=device.memory_mib,
            replica=n,
            replicas=replicas,
            mig_gi=device.mig_gi,
            mig_ci=device.mig_ci,
            mig_profile=device.mig_profile,
        )
        for n in range(replicas)
    ]


def _choose_shared(base: list[_Placed], config: Config) -> dict[str, tuple[str, int]]:
    """Device uuid -> (resource to advertise its replicas under, replicas), entry by entry in file order."""
    sharing = config.sharing
    chosen: dict[str, tuple[str, int]] = {}
    if sharing.strategy == "none":
        return chosen
    for entry in sharing.resources:
        candidates = sorted(
            (p.device for p in base if p.resource == entry.name and p.device.uuid not in chosen),
            key=_device_order,
        )
        for device in _select(entry.devices, candidates):
            if sharing.strategy == "mps" and device.is_mig:
                raise PlanningError(
                    f"MPS sharing is not supported for MIG devices: {entry.name} holds MIG device "
                    f"{device.index} ({device.uuid}) under MIG strategy {config.mig_strategy}"
                )
            chosen[device.uuid] = (entry.rename or entry.name, entry.replicas)
    return chosen


def _check_sizes(base: list[_Placed], chosen: dict[str, tuple[str, int]]) -> None:
    """Refuse a plan the kubelet could never receive, and a node past MAX_PLANNED_DEVICES, from
    counts alone: no replica list is built for a config that asks for a billion."""
    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    for placed in base:
        device = placed.device
        id_bytes = len(device.id.encode())
        pick = chosen.get(device.uuid)
        if pick is None:
            counts[placed.resource] += 1
            sizes[placed.resource] += device_entry_size(id_bytes, device.numa_node)
        else:
            resource, replicas = pick
            counts[resource] += replicas
            sizes[resource] += replicas_size(id_bytes, replicas, device.numa_node)
    for resource in sorted(counts):
        if sizes[resource] > LIST_AND_WATCH_BUDGET:
            raise PlanningError(
                f"resource {resource} would have {counts[resource]} devices, a ListAndWatch answer of up to "
                f"{sizes[resource]} bytes: over gpuvisor's limit of {LIST_AND_WATCH_BUDGET} bytes (the kubelet "
                f"accepts at most {KUBELET_MAX_RECEIVE_BYTES}); lower its replicas"
            )
    total = sum(counts.values())
    if total > MAX_PLANNED_DEVICES:
        raise PlanningError(
            f"the node would advertise {total} devices ({', '.join(f'{r}: {n}' for r, n in sorted(counts.items()))}): "
            f"over gpuvisor's limit of {MAX_PLANNED_DEVICES} devices per node; lower the replicas"
        )


def _expand(base: list[_Placed], chosen: dict[str, tuple[str, int]]) -> list[_Placed]:
    out: list[_Placed] = []
    for placed in base:
        pick = chosen.get(placed.device.uuid)
        if pick is None:
            out.append(placed)
            continue
        resource, replicas = pick
        out.extend(_Placed(resource, placed.resource, d) for d in _replicas(placed.device, replicas))
    return out


# --- step 3: MPS checks -----------------------------------------------------------------------


def _check_mps_config(config: Config) -> None:
    if not config.mps_root:
        raise PlanningError("MPS sharing needs an MPS root: set --mps-root, MPS_ROOT or flags.mpsRoot")
    if config.mig_strategy == "mixed":
        raise PlanningError(
            "MPS sharing is not supported with the mixed MIG strategy: use --mig-strategy none or single "
            "(and no MIG devices under MPS), or time-slicing"
        )


def _check_mps_devices(base: list[_Placed], chosen: dict[str, tuple[str, int]], node: Node) -> None:
    """Every MPS-shared GPU: not MIG-enabled, and no more replicas than MPS clients it can serve."""
    problems: list[str] = []
    for placed in base:
        pick = chosen.get(placed.device.uuid)
        if pick is None:
            continue  # not shared by this strategy: a whole device
        resource, replicas = pick
        gpu = node.gpu_by_uuid(placed.device.gpu_uuid)
        if gpu is None:
            continue
        if gpu.mig_enabled:
            problems.append(
                f"GPU {gpu.index} ({gpu.uuid}) has MIG mode enabled: MPS cannot share a MIG-enabled GPU "
                f"(resource {resource}); disable MIG on it or leave it out of sharing.mps"
            )
            continue
        limit = mps_max_clients(gpu.compute_capability)
        if replicas > limit:
            major, minor = gpu.compute_capability
            problems.append(
                f"GPU {gpu.index} ({gpu.name}, compute capability {major}.{minor}) cannot be split into "
                f"{replicas} MPS replicas for {resource}: MPS serves at most {limit} clients per GPU "
                f"{'from' if limit == MPS_MAX_CLIENTS_NEW else 'below'} compute capability 7.5"
            )
    if problems:
        raise PlanningError("; ".join(problems))


# --- step 4: plans ----------------------------------------------------------------------------


def _device_order(device: AllocatableDevice) -> tuple[int, int, int]:
    _, _, mig_index = device.index.partition(":")
    return (
        device.gpu_index,
        int(mig_index) if mig_index else -1,
        device.replica if device.replica is not None else -1,
    )


def _plan(resource: str, devices: tuple[AllocatableDevice, ...], node: Node, config: Config) -> ResourcePlan:
    shared = any(d.replicas > 1 for d in devices)
    sharing = config.sharing.strategy if shared else "none"
    gpu_indexes = {d.gpu_index for d in devices}
    links: tuple[GpuPair, ...] = tuple(
        sorted(
            (link for link in node.links if link.a in gpu_indexes and link.b in gpu_indexes),
            key=lambda link: (link.a, link.b),
        )
    )
    allocate = AllocateSettings(
        device_list_strategies=config.device_list_strategy,
        device_id_strategy=config.device_id_strategy,
        pass_device_specs=config.pass_device_specs,
        driver_root=config.driver_root,
        dev_root=config.dev_root,
        cdi_annotation_prefix=config.cdi_annotation_prefix,
        nvidia_ctk_path=config.nvidia_cdi_hook_path,
        gds_enabled=config.gds_enabled,
        mofed_enabled=config.mofed_enabled,
        gdrcopy_enabled=config.gdrcopy_enabled,
        imex_channel_ids=config.imex_channel_ids,
        imex_required=config.imex_required,
        # Only MPS plans carry the MPS root, so that setting MPS_ROOT fleet-wide (as NVIDIA's
        # chart does) leaves every other plan byte-identical and its worker untouched on reload.
        mps_root=config.mps_root if sharing == "mps" else "",
        mig_minors_path=config.mig_minors_path,
    )
    return ResourcePlan(
        resource=resource,
        devices=devices,
        sharing=sharing,
        fail_requests_greater_than_one=config.sharing.fail_requests_greater_than_one if shared else False,
        shared_policy=config.shared_devices_allocation_policy,
        allocate=allocate,
        links=links,
    )
