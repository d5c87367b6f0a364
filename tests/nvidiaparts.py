"""ResourceSlices of MIG-capable GPUs in the shape NVIDIA's DRA driver publishes for DynamicMIG
(kubernetes-sigs/dra-driver-nvidia-gpu cmd/gpu-kubelet-plugin/partitions.go, mig.go, driver.go),
for the tests of the fake API server's and the allocator's partitionable-device rules.

Per GPU one counter set `gpu-<minor>-counter-set` (PartSharedCounterSets: one counter per
capacity dimension, camelToDNSName'd, plus `memory-slice-<i>` of value 1 per memory slice); a
full-GPU device `gpu-<minor>` consuming all of them (PartConsumesCounters); and one device per
MIG placement `gpu-<minor>-mig-<profile without dots>-<GI profile id>-<placement start>`
(MigSpecTuple.ToCanonicalName) consuming its sizes and the memory slices of its placement
(addCountersForMemSlices). Kubernetes below 1.35: one slice per GPU with its counter set and
its devices; 1.35 on: one slice with every GPU's counter set and one devices-only slice per GPU
(shouldUseSplitResourceSlices).

The profile table is an H100 80GB's placements (nvidia-smi mig -lgip / -lgipp); its per-profile
engine counts are illustrative, not a particular board's.
"""

from __future__ import annotations

from typing import Any

from tests.kubeapi.partitions import split_layout

DRIVER = "gpu.nvidia.com"
MEMORY_SLICES = 8
# profile: (GI profile id, placement starts, placement size, multiprocessors, copy engines,
# decoders, encoders, jpeg engines, ofa engines, memory MiB)
H100_PROFILES: dict[str, tuple[int, tuple[int, ...], int, int, int, int, int, int, int, int]] = {
    "1g.10gb": (19, (0, 1, 2, 3, 4, 5, 6), 1, 16, 1, 1, 0, 1, 0, 9856),
    "1g.20gb": (15, (0, 2, 4, 6), 2, 16, 1, 1, 0, 1, 0, 19968),
    "2g.20gb": (14, (0, 2, 4), 2, 32, 2, 2, 0, 2, 0, 19968),
    "3g.40gb": (9, (0, 4), 4, 60, 3, 3, 0, 3, 0, 40448),
    "4g.40gb": (5, (0,), 4, 64, 4, 4, 0, 4, 0, 40448),
    "7g.80gb": (0, (0,), 8, 132, 8, 7, 0, 7, 1, 81559),
}
FULL = {"multiprocessors": 132, "copy-engines": 8, "decoders": 7, "encoders": 0, "jpeg-engines": 7,
        "ofa-engines": 1, "memory": 81559}  # fmt: skip


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def _counters(sizes: dict[str, int], slices: range) -> dict[str, dict[str, str]]:
    out = {k: {"value": f"{v}Mi" if k == "memory" else str(v)} for k, v in sizes.items()}
    out.update({f"memory-slice-{i}": {"value": "1"} for i in slices})
    return out


def counter_set(minor: int) -> dict[str, Any]:
    return {"name": counter_set_name(minor), "counters": _counters(FULL, range(MEMORY_SLICES))}


def devices(minor: int) -> list[dict[str, Any]]:
    """The full GPU, then every MIG placement of every profile."""
    full = {
        "name": f"gpu-{minor}",
        "attributes": {"type": {"string": "gpu"}, "minor": {"int": minor}, "profile": {"string": "full"}},
        "consumesCounters": [
            {"counterSet": counter_set_name(minor), "counters": _counters(FULL, range(MEMORY_SLICES))}
        ],
    }
    out = [full]
    for profile, (gi, starts, size, sm, ce, dec, enc, jpg, ofa, mem) in H100_PROFILES.items():
        sizes = {"multiprocessors": sm, "copy-engines": ce, "decoders": dec, "encoders": enc,
                 "jpeg-engines": jpg, "ofa-engines": ofa, "memory": mem}  # fmt: skip
        for start in starts:
            out.append({
                "name": f"gpu-{minor}-mig-{profile.replace('.', '')}-{gi}-{start}",
                "attributes": {"type": {"string": "mig"}, "minor": {"int": minor}, "profile": {"string": profile},
                               "placementStart": {"int": start}},
                "consumesCounters": [{"counterSet": counter_set_name(minor),
                                      "counters": _counters(sizes, range(start, start + size))}],
            })  # fmt: skip
    return out


def _slice(name: str, node: str, count: int, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": count}, **spec},
    }  # fmt: skip


def node_slices(node: str, minors: range | list[int], version: str) -> list[dict[str, Any]]:
    """The slices NVIDIA's driver publishes for these GPUs on a server of `version`."""
    minors = list(minors)
    if not split_layout(version):
        return [
            _slice(
                f"{node}-gpu-{m}",
                node,
                len(minors),
                {"sharedCounters": [counter_set(m)], "devices": devices(m)},
            )
            for m in minors
        ]
    count = len(minors) + 1
    return [_slice(f"{node}-counters", node, count, {"sharedCounters": [counter_set(m) for m in minors]})] + [
        _slice(f"{node}-gpu-{m}", node, count, {"devices": devices(m)}) for m in minors
    ]
