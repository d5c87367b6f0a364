"""MIG on demand through NVML (supervisor/node/migmaker.py), over the NVML simulator.

The steps and their order are NVIDIA's DRA driver's (v25.12.0 cmd/gpu-kubelet-plugin/nvlib.go
createMigDevice: MIG mode, GetGpuInstanceProfileInfo, CreateGpuInstanceWithPlacement, the compute
instance, its UUID from the CI's info; deleteMigDevice: CI then GI, NOT_FOUND as done); the NVML
answers are the simulator's (supervisor/sim/nvml/migcreate.py, which cites nvml.h). The same
scenarios run through the real binding over the C library in
tests/conformance/test_migmaker_fakenvml.py.
"""

from __future__ import annotations

import pynvml
import pytest

from supervisor.node.migmaker import MadeMig, MigError, MigMaker, MigMode
from supervisor.sim.nvml import Simulator, load_simulator
from supervisor.sim.nvml.mig import created_mig_uuid


def started(profile: str) -> tuple[Simulator, MigMaker, str]:
    """A simulator of `profile`, NVML up, a MigMaker over it and its first GPU's UUID."""
    sim = load_simulator(profile)
    sim.nvmlInit()
    return sim, MigMaker(sim), sim.gpu_uuids()[0]


def test_create_turns_mig_on_and_makes_the_device_at_the_placement() -> None:
    """On an idle H100 with MIG off, create enables MIG (Hopper switches without a reset), makes the
    GPU instance at the asked placement and its compute instance, and returns the new MIG device,
    which NVML then lists."""
    sim, maker, gpu = started("dgx-h100")
    assert maker.mig_mode(gpu) == MigMode(False, False)
    made = maker.create(gpu, 9, 4)
    assert made == MadeMig(gpu, 2, 0, created_mig_uuid(gpu, 1, 2, 0, "3g.40gb"), "3g.40gb", 9, 4, 4)
    assert maker.mig_mode(gpu) == MigMode(True, True)
    assert sim.mig_uuids(0) == [made.uuid]
    assert maker.instances(gpu) == [made]


def test_an_overlapping_placement_is_taken_and_names_the_instance_in_the_way() -> None:
    """INSUFFICIENT_RESOURCES on the GPU instance is kind "taken"; the message names the placement
    and the instance overlapping it (id, profile, profile id, memory slices, MIG device)."""
    sim, maker, gpu = started("dgx-h100")
    held = maker.create(gpu, 9, 4)
    with pytest.raises(MigError) as err:
        maker.create(gpu, 14, 4)
    assert err.value.kind == "taken"
    assert err.value.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    text = str(err.value)
    assert "MIG 2g.20gb (profile id 14) at placement 4" in text and gpu in text
    assert f"GPU instance 2 (3g.40gb, profile id 9, memory slices 4-7) with MIG device {held.uuid}" in text
    assert sim.mig_uuids(0) == [held.uuid]  # nothing else was made


def test_taken_without_overlap_says_the_gpu_is_used_up() -> None:
    """A placement nothing overlaps can still be refused (here the profile's single +me instance
    exists): the message says no instance overlaps and lists what is there."""
    _, maker, gpu = started("dgx-h100")
    maker.create(gpu, 20, 0)
    with pytest.raises(MigError) as err:
        maker.create(gpu, 20, 3)
    assert err.value.kind == "taken"
    assert "no instance overlaps it" in str(err.value) and "1g.10gb+me" in str(err.value)


def test_unknown_profile_and_placement_are_unsupported() -> None:
    """A profile id the GPU lacks, a placement its profile lacks, and a GPU without MIG are kind
    "unsupported", with the choices named; nothing is made."""
    sim, maker, gpu = started("dgx-h100")
    with pytest.raises(MigError, match=r"no MIG profile with id 99 .*9 \(3g.40gb\)") as err:
        maker.create(gpu, 99, 0)
    assert err.value.kind == "unsupported"
    with pytest.raises(MigError, match=r"not a placement of 3g.40gb \(they start at \[0, 4\]\)") as err:
        maker.create(gpu, 9, 2)
    assert err.value.kind == "unsupported"
    assert maker.mig_mode(gpu) == MigMode(False, False)  # refused before MIG mode was touched
    l4_sim, l4, l4_gpu = started("pcie-l4")
    with pytest.raises(MigError) as err:
        l4.create(l4_gpu, 9, 0)
    assert err.value.kind == "unsupported"
    with pytest.raises(MigError, match="does not support MIG"):
        l4.mig_mode(l4_gpu)
    assert sim.mig_uuids(0) == [] and l4_sim.call_count("nvmlDeviceCreateGpuInstanceWithPlacement") == 0


def test_a100_mig_mode_needs_a_reset_and_the_pending_change_is_set_back() -> None:
    """On an A100 SetMigMode answers activationStatus RESET_REQUIRED: kind "reset-required", and the
    pending mode the call set is set back so a later reset does not switch the GPU unasked."""
    sim, maker, gpu = started("dgx-a100")
    with pytest.raises(MigError) as err:
        maker.create(gpu, 9, 0)
    assert err.value.kind == "reset-required"
    assert err.value.code == pynvml.NVML_ERROR_RESET_REQUIRED
    assert "needs a GPU reset" in str(err.value) and "set back" in str(err.value)
    assert maker.mig_mode(gpu) == MigMode(False, False)
    sim.reset(gpu)
    assert maker.mig_mode(gpu) == MigMode(False, False)


def test_a_pending_change_asked_for_before_is_left_alone() -> None:
    """Where MIG was already pending on (an operator's `nvidia-smi -mig 1` awaiting a reset), the
    refusal says so and leaves it pending: only the change this call made is undone."""
    sim, maker, gpu = started("dgx-a100")
    assert sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(0), 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    with pytest.raises(MigError, match="pending before this call is left as it was") as err:
        maker.create(gpu, 9, 0)
    assert err.value.kind == "reset-required"
    assert maker.mig_mode(gpu) == MigMode(False, True)


def test_hopper_in_use_cannot_switch_and_is_busy() -> None:
    """An H100 with processes running answers activationStatus IN_USE: kind "busy", MIG left off
    and not pending."""
    sim, maker, gpu = started("dgx-h100")
    sim.set_processes(gpu, 1)
    with pytest.raises(MigError, match="in use") as err:
        maker.create(gpu, 19, 0)
    assert err.value.kind == "busy"
    assert maker.mig_mode(gpu) == MigMode(False, False)


def test_a_failed_compute_instance_leaves_no_gpu_instance() -> None:
    """A failure after the GPU instance exists (here the compute instance's creation) destroys the
    GPU instance before raising, and says so: the placement is free again."""
    sim, maker, gpu = started("dgx-h100")
    sim.fail("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN, count=1)
    with pytest.raises(
        MigError, match=r"creating its compute instance failed.*what was made is destroyed"
    ) as err:
        maker.create(gpu, 9, 0)
    assert err.value.kind == "nvml" and err.value.code == pynvml.NVML_ERROR_UNKNOWN
    assert maker.instances(gpu) == []
    assert maker.create(gpu, 9, 0).placement_start == 0


def test_a_failed_uuid_read_destroys_both_instances() -> None:
    """A failure once the compute instance exists (reading the MIG device's UUID) destroys the
    compute instance and then the GPU instance."""
    sim, maker, gpu = started("dgx-h100")
    sim.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, count=1)
    with pytest.raises(MigError, match="reading the new MIG device's UUID failed"):
        maker.create(gpu, 19, 3)
    assert maker.instances(gpu) == [] and sim.mig_uuids(0) == []


def test_a_failed_cleanup_is_said() -> None:
    """Where destroying the half-made device fails too, the error says what is left on the GPU."""
    sim, maker, gpu = started("dgx-h100")
    sim.fail("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN, count=1)
    sim.fail("nvmlGpuInstanceDestroy", pynvml.NVML_ERROR_UNKNOWN, count=1)
    with pytest.raises(MigError, match="it is left on the GPU"):
        maker.create(gpu, 9, 0)
    left = maker.instances(gpu)
    assert [(m.gi_id, m.ci_id, m.uuid) for m in left] == [(1, -1, "")]


def test_destroy_takes_the_compute_then_the_gpu_instance_and_is_idempotent() -> None:
    """destroy removes the MIG device and frees its placement; a second destroy, or one of an
    instance never made, succeeds (NOT_FOUND is done), as a retried unprepare needs."""
    sim, maker, gpu = started("dgx-h100")
    made = maker.create(gpu, 9, 4)
    maker.destroy(gpu, made.gi_id, made.ci_id)
    assert maker.instances(gpu) == [] and sim.mig_uuids(0) == []
    maker.destroy(gpu, made.gi_id, made.ci_id)
    maker.destroy(gpu, 13, 0)
    assert maker.mig_mode(gpu) == MigMode(True, True)  # MIG stays on
    assert maker.create(gpu, 9, 4).gi_id == 2


def test_destroy_with_mig_off_is_done() -> None:
    """With MIG off there is no GPU instance (NOT_SUPPORTED): NVIDIA treats it as deleted."""
    _, maker, gpu = started("dgx-h100")
    maker.destroy(gpu, 2, 0)


def test_destroy_of_a_device_in_use_is_busy_and_keeps_it() -> None:
    """Processes on the MIG device make the compute instance's destroy IN_USE: kind "busy", the
    device stays; once they are gone destroy succeeds."""
    sim, maker, gpu = started("dgx-h100")
    made = maker.create(gpu, 15, 2)
    sim.set_processes(made.uuid, 1)
    with pytest.raises(MigError, match="processes run on its MIG device") as err:
        maker.destroy(gpu, made.gi_id, made.ci_id)
    assert err.value.kind == "busy"
    assert maker.instances(gpu) == [made]
    sim.set_processes(made.uuid, 0)
    maker.destroy(gpu, made.gi_id, made.ci_id)


def test_destroying_only_the_gpu_instance_under_a_compute_instance_is_busy() -> None:
    """destroy(ci_id=-1) destroys just the GPU instance; with a compute instance on it NVML answers
    IN_USE, kind "busy"."""
    _, maker, gpu = started("dgx-h100")
    made = maker.create(gpu, 9, 0)
    with pytest.raises(MigError, match="compute instances or processes remain") as err:
        maker.destroy(gpu, made.gi_id, -1)
    assert err.value.kind == "busy"


def test_instances_lists_the_layout_and_hand_made_ones_by_placement() -> None:
    """instances() lists a description's layout, devices made since and a GPU instance without a
    compute instance (found by id), sorted by placement."""
    sim, maker, gpu = started("mig-a100")
    before = maker.instances(gpu)
    assert [(m.profile, m.placement_start, m.placement_size) for m in before] == [
        ("2g.20gb", 0, 2), ("1g.10gb", 2, 1), ("1g.10gb", 3, 1), ("3g.40gb", 4, 4),
    ]  # fmt: skip
    assert sorted(m.uuid for m in before) == sorted(sim.mig_uuids(0))
    h = sim.nvmlDeviceGetHandleByIndex(0)
    maker.destroy(gpu, before[1].gi_id, before[1].ci_id)
    gi = sim.nvmlDeviceCreateGpuInstance(h, 19)  # a GPU instance without a compute instance
    after = maker.instances(gpu)
    alone = [m for m in after if m.ci_id == -1]
    assert [(m.gi_id, m.placement_start, m.uuid) for m in alone] == [
        (sim.nvmlGpuInstanceGetInfo(gi).id, 2, "")
    ]


def test_instances_with_mig_off_are_none() -> None:
    """A GPU with MIG off has no instances."""
    _, maker, gpu = started("dgx-h100")
    assert maker.instances(gpu) == []


def test_set_mig_mode_off_with_instances_is_busy_and_off_when_empty() -> None:
    """Turning MIG off while GPU instances exist is NVML's IN_USE: kind "busy", naming them; once
    they are destroyed it is turned off at once on a Hopper GPU."""
    _, maker, gpu = started("dgx-h100")
    made = maker.create(gpu, 19, 0)
    with pytest.raises(MigError, match=r"instances exist .*GPU instance 7 \(1g.10gb") as err:
        maker.set_mig_mode(gpu, False)
    assert err.value.kind == "busy"
    maker.destroy(gpu, made.gi_id, made.ci_id)
    assert maker.set_mig_mode(gpu, False) == MigMode(False, False)
    assert maker.set_mig_mode(gpu, False) == MigMode(False, False)  # already so: nothing asked


def test_an_unknown_gpu_is_an_nvml_error() -> None:
    """A UUID NVML does not know is kind "nvml", naming it."""
    _, maker, _ = started("dgx-h100")
    with pytest.raises(MigError, match="GPU GPU-00000000-0000-0000-0000-000000000000: no such GPU") as err:
        maker.create("GPU-00000000-0000-0000-0000-000000000000", 9, 0)
    assert err.value.kind == "nvml" and err.value.code == pynvml.NVML_ERROR_NOT_FOUND


def test_create_on_a_gpu_with_mig_on_leaves_its_pending_mode_alone() -> None:
    """With MIG on and an operator's disable pending (an H100 in use when asked), create makes the
    device without touching the mode: the pending change is the operator's."""
    sim, maker, gpu = started("dgx-h100")
    maker.set_mig_mode(gpu, True)
    sim.set_processes(gpu, 1)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_ERROR_IN_USE
    assert maker.mig_mode(gpu) == MigMode(True, False)
    maker.create(gpu, 19, 0)
    assert maker.mig_mode(gpu) == MigMode(True, False)
    assert sim.call_count("nvmlDeviceSetMigMode") == 2  # set_mig_mode's and the operator's only
