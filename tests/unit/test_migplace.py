"""Every MIG device a GPU could have (supervisor/node/migplace.py), read from the NVML simulator.

The expected profiles and placements are NVIDIA's MIG user guide's tables for the A100-SXM4-80GB
and H100-SXM5-80GB ("Supported MIG Profiles": profile name, id, instance count and placements),
which the simulator's catalogues (supervisor/sim/nvml/mig.py, `_a100_80gb`, `_h100_80gb`) follow;
the rules of which profiles are kept are NVIDIA's DRA driver's (v25.12.0
cmd/gpu-kubelet-plugin/nvlib.go inspectMigProfilesAndPlacements over go-nvlib VisitMigProfiles).
"""

from __future__ import annotations

from collections import Counter

import pynvml
import pytest

from common.model import MigOption, node_from_json, node_to_json
from supervisor.node import migplace
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import Simulator, load_simulator

# (profile, GPU instance profile id) -> placement starts, as the MIG user guide lists them for the
# 80 GB A100 and H100 (the same geometry on both).
GUIDE_80GB = {
    ("1g.10gb", 19): [0, 1, 2, 3, 4, 5, 6],
    ("1g.10gb+me", 20): [0, 1, 2, 3, 4, 5, 6],
    ("1g.20gb", 15): [0, 2, 4, 6],
    ("2g.20gb", 14): [0, 2, 4],
    ("3g.40gb", 9): [0, 4],
    ("4g.40gb", 5): [0],
    ("7g.80gb", 0): [0],
}


def started(profile: str) -> Simulator:
    sim = load_simulator(profile)
    sim.nvmlInit()
    return sim


def options(sim: Simulator, index: int = 0) -> tuple[MigOption, ...]:
    return migplace.mig_options(sim, sim.nvmlDeviceGetHandleByIndex(index))


@pytest.mark.parametrize("profile", ["mig-a100", "dgx-h100"])
def test_every_profile_at_every_placement_of_the_guide(profile: str) -> None:
    """An 80 GB A100 (MIG on, with a layout) and an H100 (MIG off) both offer the guide's 7
    profiles at their 25 placements, whatever MIG mode and instances the GPU has now."""
    got = options(started(profile))
    by_profile: dict[tuple[str, int], list[int]] = {}
    for o in got:
        by_profile.setdefault((o.profile, o.gi_profile_id), []).append(o.placement_start)
    assert by_profile == GUIDE_80GB
    assert len(got) == 25


def test_sizes_are_the_gpu_instance_profiles_and_the_compute_instance_spans_it() -> None:
    """Each option carries its profile info's sizes (what NVIDIA's partitions.go PartCapacities
    publishes), its placement's size in memory slices and the compute instance profile of its
    whole slice count (C == G); 1g.10gb+me is the REV1 profile, with its media engines."""
    sim = started("mig-a100")
    got = {(o.profile, o.placement_start): o for o in options(sim)}
    three = got[("3g.40gb", 4)]
    assert three == MigOption(
        profile="3g.40gb", gi_profile_id=9, ci_profile_id=pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        placement_start=4, placement_size=4, memory_mib=40192, multiprocessors=42, copy_engines=3,
        decoders=2, encoders=0, jpeg_engines=0, ofa_engines=0,
    )  # fmt: skip
    me = got[("1g.10gb+me", 6)]
    assert (me.ci_profile_id, me.placement_size, me.jpeg_engines, me.ofa_engines) == (0, 1, 1, 1)
    full = got[("7g.80gb", 0)]
    assert (full.ci_profile_id, full.placement_size) == (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 8)


def test_sorted_by_profile_id_then_placement() -> None:
    """The order is deterministic: GPU instance profile id, then placement start."""
    got = options(started("dgx-h100"))
    assert [(o.gi_profile_id, o.placement_start) for o in got] == sorted(
        (o.gi_profile_id, o.placement_start) for o in got
    )
    assert options(started("dgx-h100")) == got


def test_a_gpu_without_mig_offers_none() -> None:
    """An L4 (nvmlDeviceGetMigMode NotSupported: go-nvlib IsMigCapable false) has no options."""
    assert options(started("pcie-l4")) == ()


def test_a_profile_nvml_refuses_is_skipped() -> None:
    """NotSupported from nvmlDeviceGetGpuInstanceProfileInfo, or InvalidArgument from the
    placements, skips that one profile (NVIDIA: `continue`); the others stay."""
    sim = started("dgx-h100")
    sim.fail(
        "nvmlDeviceGetGpuInstanceProfileInfo", pynvml.NVML_ERROR_NOT_SUPPORTED, count=1
    )  # enum 0: 1g.10gb
    assert {o.profile for o in options(sim)} == {p for p, _ in GUIDE_80GB} - {"1g.10gb"}
    sim.fail("nvmlDeviceGetGpuInstancePossiblePlacements", pynvml.NVML_ERROR_INVALID_ARGUMENT, count=1)
    counts = Counter(o.profile for o in options(sim))
    assert "1g.10gb" not in counts and counts["1g.10gb+me"] == 7


def test_another_failure_is_raised() -> None:
    """Any other NVML answer (here Unknown) is the binding's NVMLError, not an empty answer."""
    sim = started("dgx-h100")
    sim.fail("nvmlDeviceGetGpuInstanceProfileInfo", pynvml.NVML_ERROR_UNKNOWN, count=1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        options(sim)


@pytest.mark.parametrize(
    ("slices", "mib", "gpu_mib", "suffix", "expected"),
    [
        (
            3,
            71424,
            144384,
            "",
            "3g.71gb",
        ),  # an H200's 4 eighths of 141 GB: 70.5 rounds up, as Go's math.Round
        (1, 9728, 81920, "+me.all", "1g.10gb+me.all"),
        (2, 19968, 81920, "-me", "2g.20gb-me"),
        (1, 4864, 40960, "+gfx", "1g.5gb+gfx"),
    ],
)
def test_names_round_half_away_from_zero_and_carry_the_attribute(
    slices: int, mib: int, gpu_mib: int, suffix: str, expected: str
) -> None:
    """go-nvlib's getMigMemorySizeGB rounds with math.Round (half away from zero, not Python's half
    to even) and its String() appends the profile enum's attribute."""
    assert migplace.mig_profile_name(slices, mib, gpu_mib, suffix=suffix) == expected


def test_the_attribute_comes_from_the_profile_enum() -> None:
    """The enums go-nvlib's NewMigProfile names: REV1 "+me", ALL_ME "+me.all", GFX "+gfx", NO_ME
    "-me", REV2 (1g.20gb) none."""
    enums = migplace.GI_PROFILE_ENUMS
    assert enums[pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1] == (1, "+me")
    assert enums[pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME] == (2, "+me.all")
    assert enums[pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX] == (4, "+gfx")
    assert enums[pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME] == (1, "-me")
    assert enums[pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2] == (1, "")
    assert migplace.spanning_ci_profile(7) == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE


def test_discovery_fills_mig_options_only_when_asked() -> None:
    """Nvml's default discovery is unchanged (no options); with mig_options=True every
    MIG-capable GPU has them, MIG mode on or off, and a GPU without MIG has none."""
    sim = started("mig-a100")
    assert all(g.mig_options == () for g in Nvml(sim, sysfs_root=None).discover().gpus)
    node = Nvml(sim, sysfs_root=None, mig_options=True).discover()
    assert [len(g.mig_options) for g in node.gpus] == [25] * len(node.gpus)
    assert node.gpus[0].mig_options == options(sim)
    l4 = Nvml(started("pcie-l4"), sysfs_root=None, mig_options=True).discover()
    assert all(g.mig_options == () for g in l4.gpus)


def test_discovery_survives_a_failed_read_with_no_options() -> None:
    """A failure other than a lost GPU leaves that GPU without options (with a warning) rather
    than failing the node's discovery."""
    sim = started("dgx-h100")
    sim.fail("nvmlDeviceGetGpuInstancePossiblePlacements", pynvml.NVML_ERROR_UNKNOWN, count=1)
    node = Nvml(sim, sysfs_root=None, mig_options=True).discover()
    assert [len(g.mig_options) for g in node.gpus] == [0] + [25] * (len(node.gpus) - 1)


def test_mig_options_round_trip_through_the_node_json() -> None:
    """node_to_json writes Gpu.mig_options and node_from_json reads them back equal."""
    node = Nvml(started("dgx-h100"), sysfs_root=None, mig_options=True).discover()
    again = node_from_json(node_to_json(node))
    assert again == node
    assert again.gpus[0].mig_options[0] == node.gpus[0].mig_options[0]
