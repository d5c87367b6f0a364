"""The device and resource model shared by the supervisor and the workers.

Everything here is plain, immutable, typed data with no NVML handles in it: discovery turns NVML
into a `Node`, planning turns a `Node` and a config into one `ResourcePlan` per resource, and a
plan is what a worker receives (as JSON, written by the supervisor, read by the worker at start).

Serialisation is canonical (sorted keys, no whitespace) so that the same plan always gives the
same bytes: a reload compares old and new plans by their JSON, resource by resource.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# NVML's topology levels (nvmlGpuTopologyLevel_t), nearest first.
TOPOLOGY_INTERNAL = 0  # same board
TOPOLOGY_SINGLE = 10  # one PCIe switch
TOPOLOGY_MULTIPLE = 20  # several PCIe switches
TOPOLOGY_HOSTBRIDGE = 30  # same host bridge
TOPOLOGY_NODE = 40  # same NUMA node
TOPOLOGY_SYSTEM = 50  # across NUMA nodes (SMP interconnect)


@dataclass(frozen=True)
class MigDevice:
    """A MIG device (GPU instance + compute instance) on a MIG-enabled GPU."""

    uuid: str
    parent_uuid: str
    parent_index: int
    index: int  # position among the parent's MIG devices: the `j` of the `i:j` index
    gi_id: int
    ci_id: int
    profile: str  # "1g.10gb", "1g.10gb+me", ...
    memory_mib: int
    # From the GPU instance (nvmlGpuInstanceGetInfo) and its profile (the parent's
    # nvmlDeviceGetGpuInstanceProfileInfo entry): what NVIDIA's DRA driver names and describes a
    # MIG device by. -1 (or 0 for the counts) where NVML would not tell.
    gi_profile_id: int = -1
    placement_start: int = -1
    placement_size: int = 0
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class MigOption:
    """One MIG device a GPU could have (gpuvisor.dra.migOnDemand): a GPU instance profile whose
    compute instance spans it, at one of its possible placements (nvmlDeviceGetGpuInstanceProfileInfo,
    nvmlDeviceGetGpuInstancePossiblePlacements), with that profile's sizes."""

    profile: str  # "1g.10gb", "1g.10gb+me"
    gi_profile_id: int  # the profile info's `id`: what the device name and the create call take
    ci_profile_id: int  # the compute instance profile spanning it (NVML_COMPUTE_INSTANCE_PROFILE_*)
    placement_start: int
    placement_size: int  # memory slices
    memory_mib: int
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class Gpu:
    """A physical GPU as NVML describes it."""

    index: int
    uuid: str
    minor: int
    name: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int | None
    compute_capability: tuple[int, int]
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    # As go-nvlib names NVML's enums ("Nvidia", "Hopper"); "" where NVML would not tell.
    brand: str = ""
    architecture: str = ""
    # What NVIDIA's DRA driver reads beside NVML, "" / None where it would find none: the PCIe
    # root complex ("pci0000:00") and the NUMA node of the PCI device in sysfs (which may differ
    # from NVML's `numa_node` where the GPU's memory is a NUMA node of its own), and NVML's
    # addressing mode on coherent-memory systems ("ATS", "HMM", "None").
    pcie_root: str = ""
    pci_numa_node: int | None = None
    addressing_mode: str = ""
    # Every MIG device the GPU could have, read only where MIG on demand is on (and the GPU
    # supports MIG): what its partitionable DRA devices are (supervisor.dra.partitions).
    mig_options: tuple[MigOption, ...] = ()


@dataclass(frozen=True)
class GpuPair:
    """How two GPUs (by index, a < b) are connected: common PCI ancestor and NVLink count."""

    a: int
    b: int
    ancestor: int  # one of the TOPOLOGY_* levels
    nvlinks: int = 0


@dataclass(frozen=True)
class Node:
    """What discovery found on this node."""

    gpus: tuple[Gpu, ...]
    links: tuple[GpuPair, ...] = ()
    driver_version: str = ""
    cuda_driver_version: int = 0

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None


@dataclass(frozen=True)
class AllocatableDevice:
    """One device ID the kubelet sees: a full GPU, a MIG device, or a replica of either.

    `id` is what is advertised (a UUID, or `<uuid>::<n>` for replica n); `uuid` is the backing
    GPU or MIG device, `index` its index-strategy name (`i` or `i:j`).
    """

    id: str
    uuid: str
    index: str
    gpu_uuid: str
    gpu_index: int
    gpu_minor: int
    numa_node: int | None
    memory_mib: int
    replica: int | None = None
    replicas: int = 1  # how many replicas the backing device is split into (1: not shared)
    mig_gi: int | None = None
    mig_ci: int | None = None
    mig_profile: str | None = None
    # gpuvisor.dra.migOnDemand: a device of a GPU published as partitionable, the full GPU or one
    # of its MIG placements (GPU instance profile id and placement start >= 0). The DRA worker has
    # a placement's MIG device made at prepare; `uuid` is "" until one is there (then `mig_gi`,
    # `mig_ci` and `uuid` are the instance's, for its health).
    partitionable: bool = False
    mig_gi_profile_id: int = -1
    mig_placement_start: int = -1

    @property
    def on_demand(self) -> bool:
        """A MIG placement whose device is made at prepare (gpuvisor.dra.migOnDemand)."""
        return self.partitionable and self.mig_placement_start >= 0

    @property
    def is_mig(self) -> bool:
        """A MIG device: one that exists, or a placement of one made on demand."""
        return self.mig_gi is not None or self.on_demand


@dataclass(frozen=True)
class AllocateSettings:
    """What shapes an Allocate response (NVIDIA's plugin flags, per resource)."""

    device_list_strategies: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    pass_device_specs: bool = False
    driver_root: str = "/"
    dev_root: str = "/"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    cdi_vendor: str = "k8s.device-plugin.nvidia.com"
    cdi_class: str = "gpu"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    gds_enabled: bool = False
    mofed_enabled: bool = False
    gdrcopy_enabled: bool = False
    imex_channel_ids: tuple[int, ...] = ()
    imex_required: bool = False
    mps_root: str = ""
    mig_minors_path: str = "/proc/driver/nvidia-caps/mig-minors"


@dataclass(frozen=True)
class DraSettings:
    """What only a DRA worker needs (a plan with these is served as a DRA kubelet plugin).

    The plan's `resource` is then the DRA driver's name and each device's `id` its DRA device
    name (`gpu-0`, `gpu-0-mig-1g10gb-19-0`), the name the ResourceSlices publish and a claim's
    allocation names.
    """

    driver: str  # "gpu.nvidia.com"
    pool: str  # this node's pool: the node's name
    plugin_dir: str  # <kubelet plugins dir>/<driver>: the service socket and the checkpoint
    registry_dir: str  # the kubelet's plugins_registry: the registration socket
    claims_dir: str = ""  # ResourceClaims read from JSON files here; "" for the API server
    # The node runs as a device plugin now: this worker only finishes what it prepared (answers
    # re-prepares from its checkpoint, unprepares) and refuses new claims.
    drain: bool = False
    # Each claim's own CDI spec is written here ("": none; claims are answered with the node-wide
    # spec's IDs, as before); where this process reads the driver root, and NVML's driver version.
    cdi_spec_dir: str = ""
    driver_root_ctr_path: str = ""
    driver_version: str = ""
    # gpuvisor.dra.memorySharing (bytes; step 0: off): full GPUs published for several claims by
    # the memory each asks for (consumable capacity), each claim's share enforced through MPS.
    memory_step: int = 0
    memory_default: int = 0
    memory_minimum: int = 0
    # gpuvisor.dra.migOnDemand: MIG-capable GPUs published as partitionable (the full GPU and every
    # placement of every profile); a claim's MIG device is made at prepare and destroyed after.
    mig_on_demand: bool = False


@dataclass(frozen=True)
class ResourcePlan:
    """Everything a worker needs to serve one resource. Same input, same plan, same bytes."""

    resource: str  # fully qualified, e.g. "nvidia.com/gpu"
    devices: tuple[AllocatableDevice, ...]
    sharing: str = "none"  # "none", "time-slicing" or "mps"
    fail_requests_greater_than_one: bool = False
    shared_policy: str = "distributed"  # or "packed"
    allocate: AllocateSettings = field(default_factory=AllocateSettings)
    links: tuple[GpuPair, ...] = ()  # topology between the GPUs backing this resource
    dra: DraSettings | None = None  # set: served as a DRA kubelet plugin (worker/dra/)

    @property
    def name(self) -> str:
        """The resource name without its domain: `gpu`, `mig-1g.10gb`, `gpu.shared`."""
        return self.resource.split("/", 1)[-1]

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        if raw["dra"] is None:
            del raw["dra"]  # a device-plugin plan keeps the bytes it had before DRA existed
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ResourcePlan:
        raw = json.loads(text)
        return plan_from_dict(raw)


def _tuple_of_str(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def plan_from_dict(raw: dict[str, Any]) -> ResourcePlan:
    """Rebuild a plan from `dataclasses.asdict` output (lists back into tuples)."""
    alloc_raw = dict(raw.get("allocate", {}))
    alloc_raw["device_list_strategies"] = _tuple_of_str(alloc_raw.get("device_list_strategies", ("envvar",)))
    alloc_raw["imex_channel_ids"] = tuple(int(v) for v in alloc_raw.get("imex_channel_ids", ()))
    return ResourcePlan(
        resource=str(raw["resource"]),
        devices=tuple(AllocatableDevice(**d) for d in raw["devices"]),
        sharing=str(raw.get("sharing", "none")),
        fail_requests_greater_than_one=bool(raw.get("fail_requests_greater_than_one", False)),
        shared_policy=str(raw.get("shared_policy", "distributed")),
        allocate=AllocateSettings(**alloc_raw),
        links=tuple(GpuPair(**link) for link in raw.get("links", ())),
        dra=DraSettings(**raw["dra"]) if raw.get("dra") is not None else None,
    )


def node_to_json(node: Node) -> str:
    return json.dumps(dataclasses.asdict(node), sort_keys=True, separators=(",", ":"))


def node_from_json(text: str) -> Node:
    raw = json.loads(text)
    gpus = []
    for g in raw["gpus"]:
        g = dict(g)
        g["compute_capability"] = tuple(g["compute_capability"])
        g["mig_devices"] = tuple(MigDevice(**m) for m in g.get("mig_devices", ()))
        g["mig_options"] = tuple(MigOption(**o) for o in g.get("mig_options", ()))
        gpus.append(Gpu(**g))
    return Node(
        gpus=tuple(gpus),
        links=tuple(GpuPair(**link) for link in raw.get("links", ())),
        driver_version=str(raw.get("driver_version", "")),
        cuda_driver_version=int(raw.get("cuda_driver_version", 0)),
    )
