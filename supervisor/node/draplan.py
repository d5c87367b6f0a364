"""The DRA driver's devices and the DRA worker's plan: a pure function of the node and the config.

In `--mode dra` a node is one DRA pool of driver `gpu.nvidia.com`, named after the node, and its
devices are named as NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu v25.12.0) names
them, so a claim allocated against either driver's ResourceSlices names the same device:

- a GPU without MIG mode is one device, `gpu-<minor>`;
- a MIG-enabled GPU is its MIG devices (static MIG: the instances that exist), each
  `gpu-<parent minor>-mig-<profile>-<GPU instance profile id>-<placement start>`, the profile
  without its dots and in RFC 1123 form (`1g.10gb+me` -> `1g10gb-me`); the GPU itself is not a
  device then. Two compute instances of one GPU instance would get one name: those names get
  `-ci<id>` appended (NVIDIA's driver has no name for them);
- with gpuvisor.dra.migOnDemand, a GPU whose MIG options discovery read (`Gpu.mig_options`) is
  partitionable, whatever its MIG mode: the full GPU `gpu-<minor>` and every placement of every
  profile (`partitions`), named as above (NVIDIA's DynamicMIG names them so, partitions.go
  `ToCanonicalName`). A placement whose instance exists is listed with it (its UUID and
  instances, for its health); one without is made by the DRA worker at prepare.

The plan is a `ResourcePlan` for the DRA worker: `resource` is the driver's name, each device's
`id` its DRA device name (what health deltas, ResourceSlices and claims name), its `uuid` and
`index` what the CDI spec names (the `cdi-cri` strategy: the supervisor writes the spec for
these devices as for any plan, and the worker answers with those CDI names). `dra` carries the
pool and the sockets' directories.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from common.model import (
    AllocatableDevice,
    AllocateSettings,
    DraSettings,
    Gpu,
    MigDevice,
    MigOption,
    Node,
    ResourcePlan,
)
from supervisor.config import DRA_DRIVER, Config

DRIVER = DRA_DRIVER
MAX_NAME = 63  # a device name is a DNS label
_NOT_RFC1123 = re.compile(r"[^a-z0-9.-]")


def gpu_device_name(gpu: Gpu) -> str:
    """`gpu-<minor>`: NVIDIA's name for a full GPU (by minor number, not index)."""
    return f"gpu-{gpu.minor}"


def profile_label(profile: str) -> str:
    """A MIG profile as a name part: dots dropped, then RFC 1123 (NVIDIA's toRFC1123Compliant)."""
    name = _NOT_RFC1123.sub("-", profile.replace(".", "").lower()).strip("-")
    return name.removesuffix(".")


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    """`gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>`, or, where NVML did not tell
    the profile id and placement, `gpu-<minor>-mig-<profile>-gi<gi>-ci<ci>`."""
    base = f"gpu-{gpu.minor}-mig-{profile_label(mig.profile)}"
    if mig.gi_profile_id >= 0 and mig.placement_start >= 0:
        return f"{base}-{mig.gi_profile_id}-{mig.placement_start}"
    return f"{base}-gi{mig.gi_id}-ci{mig.ci_id}"


def partitions(gpu: Gpu) -> list[tuple[MigOption, MigDevice | None, str]]:
    """A partitionable GPU's placements (gpuvisor.dra.migOnDemand), in `mig_options` order: (the
    option, the instance at it or None, its DRA device name)."""
    made = {(m.gi_profile_id, m.placement_start): m for m in gpu.mig_devices}
    return [
        (
            option,
            made.get((option.gi_profile_id, option.placement_start)),
            f"gpu-{gpu.minor}-mig-{profile_label(option.profile)}-{option.gi_profile_id}-"
            f"{option.placement_start}"[:MAX_NAME].rstrip("-"),
        )
        for option in gpu.mig_options
    ]


def dra_devices(node: Node) -> list[tuple[Gpu, MigDevice | None, str]]:
    """Every device of the pool, in the node's order: (GPU, MIG device or None, DRA device name).
    A partitionable GPU (gpuvisor.dra.migOnDemand) is its full GPU here; its placements are
    `partitions(gpu)`'s."""
    out: list[tuple[Gpu, MigDevice | None, str]] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        if not gpu.mig_enabled or gpu.mig_options:
            out.append((gpu, None, gpu_device_name(gpu)))
            continue
        out += [(gpu, mig, name) for mig, name in static_migs(gpu)]
    return out


def static_migs(gpu: Gpu) -> list[tuple[MigDevice, str]]:
    """The GPU's MIG devices that exist, each with its DRA device name (see the module docstring)."""
    migs = sorted(gpu.mig_devices, key=lambda m: m.index)
    names = [mig_device_name(gpu, m) for m in migs]
    return [
        (mig, (f"{name}-ci{mig.ci_id}" if names.count(name) > 1 else name)[:MAX_NAME].rstrip("-"))
        for mig, name in zip(migs, names, strict=True)
    ]


def _static(node: Node) -> list[AllocatableDevice]:
    return [
        gpu_record(gpu, name) if mig is None else mig_record(gpu, mig, name)
        for gpu, mig, name in dra_devices(node)
        if not gpu.mig_options
    ]


def _partitionable(node: Node) -> list[AllocatableDevice]:
    """The devices of partitionable GPUs (gpuvisor.dra.migOnDemand: discovery reads a GPU's MIG
    options only with it): each full GPU, then its placements."""
    out: list[AllocatableDevice] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        if not gpu.mig_options:
            continue
        whole = gpu_record(gpu, gpu_device_name(gpu))
        out.append(dataclasses.replace(whole, partitionable=True))
        for option, made, name in partitions(gpu):
            record = (
                mig_record(gpu, made, name)
                if made is not None
                else dataclasses.replace(whole, id=name, uuid="", index="", memory_mib=option.memory_mib)
            )
            out.append(
                dataclasses.replace(
                    record,
                    partitionable=True,
                    mig_profile=option.profile,
                    mig_gi_profile_id=option.gi_profile_id,
                    mig_placement_start=option.placement_start,
                )
            )
    return out


def gpu_record(gpu: Gpu, device_id: str) -> AllocatableDevice:
    """A full GPU as a plan lists it, under `device_id`: its UUID in a device-plugin plan
    (supervisor.node.planning), its DRA device name in the DRA worker's."""
    return AllocatableDevice(
        id=device_id,
        uuid=gpu.uuid,
        index=str(gpu.index),
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        gpu_minor=gpu.minor,
        numa_node=gpu.numa_node,
        memory_mib=gpu.memory_mib,
    )


def mig_record(gpu: Gpu, mig: MigDevice, device_id: str) -> AllocatableDevice:
    """A MIG device of `gpu` as a plan lists it, under `device_id` (as for `gpu_record`)."""
    return AllocatableDevice(
        id=device_id,
        uuid=mig.uuid,
        index=f"{gpu.index}:{mig.index}",
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        gpu_minor=gpu.minor,
        numa_node=gpu.numa_node,
        memory_mib=mig.memory_mib,
        mig_gi=mig.gi_id,
        mig_ci=mig.ci_id,
        mig_profile=mig.profile,
    )


@dataclass(frozen=True)
class DraHold:
    """What the DRA side holds while the node runs as a device plugin (planning's input).

    `settled` is False while a DRA worker may still prepare claims (a switch from mode dra is
    under way and the worker has not confirmed that it drains): then nothing is offered through
    the device plugin yet. `devices` are the DRA device names that prepared claims hold (the DRA
    worker's checkpoint): they stay with their pods, out of the device plugin's plans, and a
    draining DRA worker keeps serving their unprepare. `waiting` is why nothing may be offered
    through the device plugin yet although the hold is settled (the pool an earlier DRA life
    published is being withdrawn: supervisor/dra/earlier.py); the held devices' draining DRA plan
    runs meanwhile.
    """

    settled: bool = True
    devices: frozenset[str] = frozenset()
    waiting: str = ""


@dataclass(frozen=True)
class HeldUuids:
    """The device-plugin devices that DRA-held devices make unavailable, by UUID."""

    gpus: frozenset[str]  # full GPUs held: every device of the GPU (replicas, MIG devices) goes
    migs: frozenset[str]  # MIG devices held: each goes...
    mig_parents: frozenset[str]  # ...and so does the full GPU they are part of

    def blocks(self, device: AllocatableDevice) -> bool:
        """Is this device-plugin device (or replica) in use through DRA?"""
        if device.gpu_uuid in self.gpus or device.uuid in self.migs:
            return True
        whole = device.mig_gi is None  # the full GPU (mig strategy none on a MIG-enabled GPU)
        return whole and device.gpu_uuid in self.mig_parents


def held_uuids(node: Node, names: frozenset[str]) -> HeldUuids:
    """The UUIDs behind DRA device names (names this node no longer has are skipped)."""
    gpus: set[str] = set()
    migs: set[str] = set()
    parents: set[str] = set()
    for gpu, mig, name in dra_devices(node):
        if name not in names:
            continue
        if mig is None:
            gpus.add(gpu.uuid)
        else:
            migs.add(mig.uuid)
            parents.add(gpu.uuid)
    for gpu in node.gpus:  # a placement held (MIG on demand): its instance and its GPU
        for _, made, name in partitions(gpu):
            if name in names:
                parents.add(gpu.uuid)
                if made is not None:
                    migs.add(made.uuid)
    return HeldUuids(frozenset(gpus), frozenset(migs), frozenset(parents))


def dra_plan(
    node: Node, config: Config, *, drain: bool = False, only: frozenset[str] | None = None
) -> ResourcePlan:
    """The DRA worker's plan for this node (see the module docstring). `drain`: the node runs as
    a device plugin, and the worker only finishes the claims it prepared, whose devices are
    `only` (the plan lists those that still exist)."""
    devices = tuple(d for d in (*_static(node), *_partitionable(node)) if only is None or d.id in only)
    allocate = AllocateSettings(
        # The claims' devices reach containers through CDI only: the supervisor's spec names them.
        device_list_strategies=("cdi-cri",),
        device_id_strategy=config.device_id_strategy,
        driver_root=config.driver_root,
        dev_root=config.dev_root,
        nvidia_ctk_path=config.nvidia_cdi_hook_path,
        mig_minors_path=config.mig_minors_path,
    )
    step, default, minimum = _memory_sharing(config)
    return ResourcePlan(
        resource=DRIVER,
        devices=devices,
        allocate=allocate,
        links=node.links,
        dra=DraSettings(
            driver=DRIVER,
            pool=config.node_name,
            plugin_dir=os.path.join(config.kubelet_plugins_dir, DRIVER),
            registry_dir=config.kubelet_registry_dir,
            claims_dir=config.dra_claims_dir,
            drain=drain,
            cdi_spec_dir=config.cdi_spec_dir,
            driver_root_ctr_path=config.driver_root_ctr_path,
            driver_version=node.driver_version,
            mig_on_demand=config.dra_mig_on_demand,
            memory_step=step,
            memory_default=default,
            memory_minimum=minimum,
        ),
    )


def _memory_sharing(config: Config) -> tuple[int, int, int]:
    """gpuvisor.dra.memorySharing in the plan (bytes: step, default, minimum; step 0: off)."""
    policy = config.dra_memory_sharing
    if policy is None:
        return 0, 0, 0
    return policy.step, policy.default, policy.minimum
