"""Hand-built `Node` values shaped like the simulator's built-in profiles, for pure tests.

The simulator is written in parallel and has profiles of the same names; these are built by hand
so that planner and config tests depend on nothing but `common.model`. UUIDs are deterministic
and shaped like NVML's (`GPU-`/`MIG-` + 8-4-4-4-12 hex).
"""

from __future__ import annotations

from common.model import TOPOLOGY_NODE, TOPOLOGY_SYSTEM, Gpu, GpuPair, MigDevice, Node, ResourcePlan
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources

A100_80GB = "NVIDIA A100-SXM4-80GB"
H100_80GB = "NVIDIA H100 80GB HBM3"
L4 = "NVIDIA L4"

# MiB of memory per A100-80GB MIG profile, as NVML reports them.
MIG_MEMORY = {"1g.10gb": 9856, "1g.10gb+me": 9856, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}


def gpu_uuid(node_tag: int, index: int) -> str:
    return f"GPU-{node_tag:08x}-0000-4000-8000-{index:012x}"


def mig_uuid(node_tag: int, gpu_index: int, mig_index: int) -> str:
    return f"MIG-{node_tag:08x}-{gpu_index:04x}-4000-8000-{mig_index:012x}"


def make_gpu(
    node_tag: int,
    index: int,
    name: str,
    memory_mib: int,
    *,
    numa_node: int | None = None,
    compute_capability: tuple[int, int] = (8, 0),
    mig_profiles: tuple[str, ...] | None = None,
) -> Gpu:
    """A GPU; `mig_profiles` given (even empty) makes it MIG-enabled with one MIG device per profile."""
    uuid = gpu_uuid(node_tag, index)
    migs = tuple(
        MigDevice(
            uuid=mig_uuid(node_tag, index, j),
            parent_uuid=uuid,
            parent_index=index,
            index=j,
            gi_id=j + 1,
            ci_id=0,
            profile=profile,
            memory_mib=MIG_MEMORY.get(profile, 9856),
        )
        for j, profile in enumerate(mig_profiles or ())
    )
    return Gpu(
        index=index,
        uuid=uuid,
        minor=index,
        name=name,
        memory_mib=memory_mib,
        pci_bus_id=f"00000000:{0x10 + index * 0x10:02X}:00.0",
        numa_node=numa_node,
        compute_capability=compute_capability,
        mig_enabled=mig_profiles is not None,
        mig_devices=migs,
    )


def _nvlink_mesh(count: int, nvlinks: int, per_numa: int) -> tuple[GpuPair, ...]:
    return tuple(
        GpuPair(
            a=a,
            b=b,
            ancestor=TOPOLOGY_NODE if a // per_numa == b // per_numa else TOPOLOGY_SYSTEM,
            nvlinks=nvlinks,
        )
        for a in range(count)
        for b in range(a + 1, count)
    )


def dgx_h100() -> Node:
    """8 x H100 SXM, all pairs over NVSwitch (18 NVLinks), two NUMA nodes."""
    gpus = tuple(
        make_gpu(0x100, i, H100_80GB, 81559, numa_node=i // 4, compute_capability=(9, 0)) for i in range(8)
    )
    return Node(
        gpus=gpus, links=_nvlink_mesh(8, 18, 4), driver_version="550.54.15", cuda_driver_version=12040
    )


def dgx_a100() -> Node:
    """8 x A100-SXM4-80GB, all pairs over NVSwitch (12 NVLinks), two NUMA nodes."""
    gpus = tuple(make_gpu(0xA100, i, A100_80GB, 81920, numa_node=i // 4) for i in range(8))
    return Node(
        gpus=gpus, links=_nvlink_mesh(8, 12, 4), driver_version="550.54.15", cuda_driver_version=12040
    )


def pcie_l4() -> Node:
    """4 x L4 on PCIe, no NVLink, one NUMA node."""
    gpus = tuple(make_gpu(0x14, i, L4, 23034, numa_node=0, compute_capability=(8, 9)) for i in range(4))
    links = tuple(GpuPair(a=a, b=b, ancestor=TOPOLOGY_NODE) for a in range(4) for b in range(a + 1, 4))
    return Node(gpus=gpus, links=links, driver_version="550.54.15", cuda_driver_version=12040)


# GPUs 0-3 of mig-a100 and their MIG devices; GPUs 4-7 are not MIG-enabled.
MIG_A100_LAYOUT: dict[int, tuple[str, ...]] = {
    0: ("1g.10gb",) * 7,
    1: ("2g.20gb",) * 3,
    2: ("3g.40gb",) * 2,
    3: ("1g.10gb+me", "2g.20gb", "3g.40gb"),
}


def mig_a100() -> Node:
    """8 x A100-SXM4-80GB; GPUs 0-3 MIG-enabled with mixed profiles (see MIG_A100_LAYOUT)."""
    gpus = tuple(
        make_gpu(0xA1, i, A100_80GB, 81920, numa_node=i // 4, mig_profiles=MIG_A100_LAYOUT.get(i))
        for i in range(8)
    )
    return Node(
        gpus=gpus, links=_nvlink_mesh(8, 12, 4), driver_version="550.54.15", cuda_driver_version=12040
    )


def mig_uniform(gpus: int = 2, profile: str = "1g.10gb", per_gpu: int = 7) -> Node:
    """Every GPU MIG-enabled with the same profile: what the `single` strategy accepts."""
    return Node(
        gpus=tuple(
            make_gpu(0xB1, i, A100_80GB, 81920, numa_node=0, mig_profiles=(profile,) * per_gpu)
            for i in range(gpus)
        ),
        links=_nvlink_mesh(gpus, 12, 8),
    )


def imex_plan(dev_root: str, *, required: bool, strategies: tuple[str, ...] = ("envvar",)) -> ResourcePlan:
    """pcie-l4's nvidia.com/gpu plan with IMEX channel 0 (required or not) and device specs."""
    data = {
        "flags": {
            "nvidiaDevRoot": dev_root,
            "plugin": {"passDeviceSpecs": True, "deviceListStrategy": list(strategies)},
        },
        "imex": {"channelIDs": [0], "required": required},
    }
    return plan_resources(pcie_l4(), config_from_data(data))["nvidia.com/gpu"]
