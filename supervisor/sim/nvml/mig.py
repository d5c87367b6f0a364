"""MIG profile catalogues and placement rules for the simulator.

A MIG-capable GPU is split into 8 memory slices and 7 compute slices. A GPU-instance profile
takes a fixed number of each and may only start at certain memory-slice positions; a layout is
valid when its instances can be placed without overlap (and, for the `+me` profile, when it
appears at most once). The tables below follow NVIDIA's MIG user guide for the 80 GB parts:
profile names, NVML profile enum values (`NVML_GPU_INSTANCE_PROFILE_*`), profile ids as
`nvidia-smi mig -lgip` shows them, and placements. Memory sizes and SM counts are close to what
a real GPU reports; they only need to round to the profile's name.

GPU-instance ids are derived from the placement the way the driver numbers them on an A100
(7g: 0; 3g/4g: 1-2; 2g: 3-5; 1g: 7-13), so a layout always yields the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.node.migplace import go_round

MEMORY_SLICES = 8
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a GPU model."""

    name: str  # "1g.10gb", "1g.10gb+me", ...
    enum: int  # NVML_GPU_INSTANCE_PROFILE_* value: the `profile` argument of GetGpuInstanceProfileInfo
    profile_id: int  # the `id` NVML reports for it (nvmlGpuInstanceInfo_t.profileId)
    compute_slices: int
    memory_slices: int
    memory_mib: int
    multiprocessors: int
    starts: tuple[int, ...]  # allowed memory-slice start positions
    max_instances: int
    copy_engines: int
    decoders: int
    jpegs: int
    ofas: int


def _a100_80gb() -> dict[str, MigProfile]:
    # (name, enum, id, compute, memory slices, MiB, SMs, starts, max, CE, NVDEC, JPEG, OFA)
    rows = [
        ("1g.10gb", 0x0, 19, 1, 1, 9728, 14, tuple(range(7)), 7, 1, 0, 0, 0),
        ("1g.10gb+me", 0x7, 20, 1, 1, 9728, 14, tuple(range(7)), 1, 1, 1, 1, 1),
        ("1g.20gb", 0x9, 15, 1, 2, 19968, 14, (0, 2, 4, 6), 4, 1, 1, 0, 0),
        ("2g.20gb", 0x1, 14, 2, 2, 19968, 28, (0, 2, 4), 3, 2, 1, 0, 0),
        ("3g.40gb", 0x2, 9, 3, 4, 40192, 42, (0, 4), 2, 3, 2, 0, 0),
        ("4g.40gb", 0x3, 5, 4, 4, 40192, 56, (0,), 1, 4, 2, 0, 0),
        ("7g.80gb", 0x4, 0, 7, 8, 80640, 98, (0,), 1, 7, 5, 1, 1),
    ]
    return {r[0]: MigProfile(*r) for r in rows}


def _h100_80gb() -> dict[str, MigProfile]:
    rows = [
        ("1g.10gb", 0x0, 19, 1, 1, 9984, 16, tuple(range(7)), 7, 1, 1, 1, 0),
        ("1g.10gb+me", 0x7, 20, 1, 1, 9984, 16, tuple(range(7)), 1, 1, 1, 1, 1),
        ("1g.20gb", 0x9, 15, 1, 2, 20096, 26, (0, 2, 4, 6), 4, 1, 1, 1, 0),
        ("2g.20gb", 0x1, 14, 2, 2, 20096, 32, (0, 2, 4), 3, 2, 2, 2, 0),
        ("3g.40gb", 0x2, 9, 3, 4, 40320, 60, (0, 4), 2, 3, 3, 3, 0),
        ("4g.40gb", 0x3, 5, 4, 4, 40320, 64, (0,), 1, 4, 4, 4, 0),
        ("7g.80gb", 0x4, 0, 7, 8, 80896, 132, (0,), 1, 8, 7, 7, 1),
    ]
    return {r[0]: MigProfile(*r) for r in rows}


# GPU name (as nvmlDeviceGetName returns it) -> its MIG profiles. GPUs not listed are not
# MIG-capable in the simulator: the MIG functions raise NotSupported on them, as on an L4.
CATALOGUES: dict[str, dict[str, MigProfile]] = {
    "NVIDIA A100-SXM4-80GB": _a100_80gb(),
    "NVIDIA A100 80GB PCIe": _a100_80gb(),
    "NVIDIA H100 80GB HBM3": _h100_80gb(),
    "NVIDIA H100 PCIe": _h100_80gb(),
}

# First GPU-instance id for an instance of this many memory slices (see module docstring).
_GI_BASE = {8: 0, 4: 1, 2: 3, 1: 7}


def catalogue_for(gpu_name: str) -> dict[str, MigProfile] | None:
    """The tabled profiles of a GPU model, None for a model not in CATALOGUES."""
    return CATALOGUES.get(gpu_name)


def catalogue_of(gpu_name: str, memory_mib: int) -> dict[str, MigProfile]:
    """The MIG profiles of a MIG-capable GPU: its model's table, or ones derived from its memory.

    A model without a table (an A100 40GB, a Blackwell part in NVIDIA's mock profiles) gets the
    80 GB parts' geometry, engines, ids and placements with memory in eighths of its own, named
    as NVML names a profile by its share of the GPU's memory ("1g.5gb" on a 40 GB GPU); the SM
    counts are illustrative.
    """
    return CATALOGUES.get(gpu_name) or _derived(memory_mib)


_DERIVED: dict[int, dict[str, MigProfile]] = {}


def _derived(memory_mib: int) -> dict[str, MigProfile]:
    if memory_mib not in _DERIVED:
        total_gb = -(-memory_mib // 1024)
        out: dict[str, MigProfile] = {}
        for p in _a100_80gb().values():
            gb = go_round(p.memory_slices * total_gb / 8)  # as go-nvlib names it (migplace)
            name = f"{p.compute_slices}g.{gb}gb" + ("+me" if p.name.endswith("+me") else "")
            # Below the profile's share by a little, as a real GPU keeps some for itself; the share
            # still rounds up to the profile's number of memory slices.
            memory = max(1, memory_mib * p.memory_slices // 8 - min(256, memory_mib // 64))
            out[name] = MigProfile(
                name, p.enum, p.profile_id, p.compute_slices, p.memory_slices, memory,
                16 * p.compute_slices, p.starts, p.max_instances, p.copy_engines, p.decoders, p.jpegs, p.ofas,
            )  # fmt: skip
        _DERIVED[memory_mib] = out
    return _DERIVED[memory_mib]


def gi_id_for(profile: MigProfile, start: int) -> int:
    return _GI_BASE[profile.memory_slices] + start // profile.memory_slices


def check_placements(profiles: list[MigProfile], starts: list[int]) -> str | None:
    """Why these (profile, start) pairs are not a valid layout, or None when they are."""
    used = [False] * MEMORY_SLICES
    for prof, start in zip(profiles, starts, strict=True):
        if start not in prof.starts:
            return f"{prof.name} cannot start at memory slice {start} (allowed: {list(prof.starts)})"
        for s in range(start, start + prof.memory_slices):
            if used[s]:
                return f"{prof.name} at memory slice {start} overlaps another instance"
            used[s] = True
    return _check_counts(profiles)


def _check_counts(profiles: list[MigProfile]) -> str | None:
    compute = sum(p.compute_slices for p in profiles)
    if compute > COMPUTE_SLICES:
        return f"layout needs {compute} compute slices, a GPU has {COMPUTE_SLICES}"
    memory = sum(p.memory_slices for p in profiles)
    if memory > MEMORY_SLICES:
        return f"layout needs {memory} memory slices, a GPU has {MEMORY_SLICES}"
    for prof in {p.name: p for p in profiles}.values():
        n = sum(1 for p in profiles if p.name == prof.name)
        if n > prof.max_instances:
            return f"{prof.name} may appear at most {prof.max_instances} time(s), found {n}"
    return None


def place(profiles: list[MigProfile]) -> list[int] | None:
    """Memory-slice starts for these profiles (in order), or None if they do not fit.

    A small backtracking search: at most 7 instances over 8 slices, so it is instant. Trying
    the lowest start first makes the answer deterministic.
    """
    if _check_counts(profiles) is not None:
        return None
    used = [False] * MEMORY_SLICES
    starts: list[int] = []

    def fits(prof: MigProfile, start: int) -> bool:
        return all(not used[s] for s in range(start, start + prof.memory_slices))

    def mark(prof: MigProfile, start: int, value: bool) -> None:
        for s in range(start, start + prof.memory_slices):
            used[s] = value

    def search(i: int) -> bool:
        if i == len(profiles):
            return True
        prof = profiles[i]
        for start in prof.starts:
            if fits(prof, start):
                mark(prof, start, True)
                starts.append(start)
                if search(i + 1):
                    return True
                starts.pop()
                mark(prof, start, False)
        return False

    return starts if search(0) else None


# The compute-instance profile (NVML_COMPUTE_INSTANCE_PROFILE_*) of a compute instance spanning
# a GPU instance of this many compute slices: the only one the simulator creates.
CI_PROFILE_FOR_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}

_FNV_OFFSET, _FNV_PRIME, _MASK64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def _fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


def created_mig_uuid(gpu_uuid: str, created: int, gi: int, ci: int, profile: str) -> str:
    """The UUID of the `created`-th compute instance made at run time on a GPU (1, 2, ...).

    FNV-1a (64 bit) of "A<key>" and "B<key>", key "<gpu uuid>/<created>/<gi>/<ci>/<profile>":
    a hash simple enough that the fake libnvidia-ml (tests/fakenvml/mig.c, `created_uuid`)
    computes the very same one, so both doubles name a created MIG device alike; a new one for
    every creation, as a real driver gives.
    """
    key = f"{gpu_uuid}/{created}/{gi}/{ci}/{profile}".encode()
    digest = f"{_fnv1a64(b'A' + key):016x}{_fnv1a64(b'B' + key):016x}"
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
