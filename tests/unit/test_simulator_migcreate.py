"""The simulator's MIG on demand (supervisor/sim/nvml/migcreate.py): one rule, one return code per
test. The rules' sources (nvml.h, NVIDIA's DRA driver v0.4.1) are cited in migcreate's docstrings;
the same scenarios run through the real binding over the C library in
tests/conformance/test_mig_on_demand.py."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import pynvml
import pytest

from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import Simulator
from supervisor.sim.nvml.config import parse_spec
from supervisor.sim.nvml.mig import created_mig_uuid

A100_UUID = "GPU-00000000-0000-0000-0000-0000000000a1"
H100_UUID = "GPU-00000000-0000-0000-0000-0000000000b1"
L4_UUID = "GPU-00000000-0000-0000-0000-0000000000c1"


def node(a100_mig: str = "{enabled: true}") -> Simulator:
    """GPU 0 an A100 (MIG as given), GPU 1 an H100 with MIG off, GPU 2 an L4; NVML initialised."""
    sim = Simulator(
        parse_spec(
            f"""
driver_version: "550.54.15"
topology: {{default_ancestor: SYSTEM}}
gpus:
  - {{name: NVIDIA A100-SXM4-80GB, uuid: {A100_UUID}, minor: 0, pci_bus_id: "0000:07:00.0",
      memory_mib: 81920, numa_node: 0, compute_capability: [8, 0], mig: {a100_mig}}}
  - {{name: NVIDIA H100 80GB HBM3, uuid: {H100_UUID}, minor: 1, pci_bus_id: "0000:08:00.0",
      memory_mib: 81559, numa_node: 0, compute_capability: [9, 0]}}
  - {{name: NVIDIA L4, uuid: {L4_UUID}, minor: 2, pci_bus_id: "0000:09:00.0",
      memory_mib: 23034, numa_node: 0, compute_capability: [8, 9]}}
""",
            "test",
        )
    )
    sim.nvmlInit()
    return sim


def where(start: int, size: int) -> Any:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return ctypes.byref(p)


def code(fn: Any, *args: Any) -> int:
    try:
        fn(*args)
    except pynvml.NVMLError as exc:
        return int(exc.value)
    return 0


def mig_uuids(sim: Simulator, h: Any) -> list[str]:
    return sim.mig_uuids(sim.nvmlDeviceGetIndex(h))


def make(sim: Simulator, h: Any, profile_id: int, start: int, ci_profile: int) -> tuple[Any, Any]:
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(
        h, profile_id, where(start, {19: 1, 14: 2, 9: 4}[profile_id])
    )
    return gi, sim.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)


# ------------------------------------------------------------------ placements and capacity


def test_placements_count_query_then_fill_and_too_small_an_array() -> None:
    """A None array asks for the count; the array is filled with {start, size}; one shorter than
    the count answers INSUFFICIENT_SIZE with the count set; MIG off does not matter."""
    sim = node("{enabled: false}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, 14, None, ctypes.byref(count))
    assert count.value == 3
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    count.value = 2
    assert code(sim.nvmlDeviceGetGpuInstancePossiblePlacements, h, 14, small, ctypes.byref(count)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    )
    assert count.value == 3
    full = (pynvml.c_nvmlGpuInstancePlacement_t * 3)()
    sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, 14, full, ctypes.byref(count))
    assert [(p.start, p.size) for p in full] == [(0, 2), (2, 2), (4, 2)]


def test_placements_refuse_unknown_profiles_gpus_without_mig_and_a_bad_count() -> None:
    """Unknown profile id or a count that is not a c_uint by reference: INVALID_ARGUMENT; an L4:
    NOT_SUPPORTED."""
    sim = node()
    a100, l4 = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(2)
    count = ctypes.c_uint(0)
    assert code(sim.nvmlDeviceGetGpuInstancePossiblePlacements, a100, 77, None, ctypes.byref(count)) == (
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert (
        code(sim.nvmlDeviceGetGpuInstancePossiblePlacements, a100, 19, None, 3)
        == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert code(sim.nvmlDeviceGetGpuInstancePossiblePlacements, l4, 19, None, ctypes.byref(count)) == (
        pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_remaining_capacity_counts_what_fits_beside_the_instances() -> None:
    """Empty: 7 x 1g.10gb, 1 x 1g.10gb+me; after a 4g.40gb at 0: 3 x 1g.10gb (compute slices), 0
    x 4g; MIG off: NOT_SUPPORTED."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 20) == 1
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 5, where(0, 4))
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 3
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 5) == 0
    off = sim.nvmlDeviceGetHandleByIndex(1)
    assert code(sim.nvmlDeviceGetGpuInstanceRemainingCapacity, off, 19) == pynvml.NVML_ERROR_NOT_SUPPORTED


# ------------------------------------------------------------------ GPU instances


def test_create_with_placement_gets_the_drivers_gi_id_and_reports_its_placement() -> None:
    """A 2g.20gb at slice 4 is GPU instance 5 (3 + 4/2), profile id 14, placement {4, 2}, its
    parent the GPU."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    info = sim.nvmlGpuInstanceGetInfo(sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, where(4, 2)))
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (5, 14, 4, 2)
    assert info.device is h
    assert sim.nvmlGpuInstanceGetInfo(sim.nvmlDeviceGetGpuInstanceById(h, 5)).id == 5


def test_overlap_and_used_up_resources_are_insufficient_resources() -> None:
    """Overlapping an instance, a second 1g.10gb+me (at most 1), or the 8th compute slice:
    INSUFFICIENT_RESOURCES."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, where(0, 4))
    assert code(sim.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, where(2, 2)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, where(4, 1))
    assert code(sim.nvmlDeviceCreateGpuInstanceWithPlacement, h, 20, where(5, 1)) == (
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(5, 1))
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(6, 1))  # 3 + 1 + 1 + 1 compute slices
    full = sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)
    assert full == 0
    assert code(sim.nvmlDeviceCreateGpuInstance, h, 19) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_a_placement_the_profile_lacks_or_a_bad_argument_is_invalid_argument() -> None:
    """A start not among the profile's, a wrong size, an unknown profile id, or a placement not
    passed by reference: INVALID_ARGUMENT."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    bare = pynvml.c_nvmlGpuInstancePlacement_t()
    for args in ((9, where(2, 4)), (9, where(0, 2)), (88, where(0, 4)), (9, bare), (9, None)):
        assert (
            code(sim.nvmlDeviceCreateGpuInstanceWithPlacement, h, *args) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        ), args


def test_creation_needs_mig_mode_enabled_on_a_mig_gpu() -> None:
    """MIG mode off (current), a GPU without MIG, or a MIG device handle: NOT_SUPPORTED."""
    sim = node()
    a100 = sim.nvmlDeviceGetHandleByIndex(0)
    _, ci = make(sim, a100, 19, 0, 0)
    mig_handle = sim.nvmlComputeInstanceGetInfo(ci).device
    for h in (sim.nvmlDeviceGetHandleByIndex(1), sim.nvmlDeviceGetHandleByIndex(2), mig_handle):
        assert code(sim.nvmlDeviceCreateGpuInstance, h, 19) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_create_without_placement_takes_the_lowest_free_one() -> None:
    """nvmlDeviceCreateGpuInstance places at the lowest free start of the profile."""
    sim = node("{enabled: true, devices: [{profile: 2g.20gb, placement: 0}]}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlGpuInstanceGetInfo(sim.nvmlDeviceCreateGpuInstance(h, 14)).placement.start == 2


def test_gpu_instances_of_a_profile_fill_a_list_with_the_count() -> None:
    """nvmlDeviceGetGpuInstances fills the list and the count, layout-made and created alike."""
    sim = node("{enabled: true, devices: [{profile: 1g.10gb, placement: 0}]}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(3, 1))
    found: list[Any] = []
    count = ctypes.c_uint(7)
    sim.nvmlDeviceGetGpuInstances(h, 19, found, ctypes.byref(count))
    assert count.value == 2
    assert sorted(sim.nvmlGpuInstanceGetInfo(g).id for g in found) == [7, 10]


def test_a_gpu_instance_holding_a_compute_instance_is_in_use() -> None:
    """nvmlGpuInstanceDestroy with a compute instance on it: IN_USE; after the CI goes, it goes,
    its handle is INVALID_ARGUMENT and its id NOT_FOUND."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    gi, ci = make(sim, h, 14, 0, 1)
    assert code(sim.nvmlGpuInstanceDestroy, gi) == pynvml.NVML_ERROR_IN_USE
    sim.nvmlComputeInstanceDestroy(ci)
    sim.nvmlGpuInstanceDestroy(gi)
    assert code(sim.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(sim.nvmlGpuInstanceDestroy, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(sim.nvmlDeviceGetGpuInstanceById, h, 3) == pynvml.NVML_ERROR_NOT_FOUND


# ------------------------------------------------------------------ compute instances


def test_only_the_spanning_compute_instance_profile_is_offered() -> None:
    """On a 3g.40gb the 3-slice CI profile (2) answers; 1-slice: NOT_SUPPORTED; past the count or
    another engine profile: INVALID_ARGUMENT; version 3: FUNCTION_NOT_FOUND, as the binding."""
    sim = node()
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(sim.nvmlDeviceGetHandleByIndex(0), 9, where(4, 4))
    info = sim.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0)
    assert (info.id, info.sliceCount, info.multiprocessorCount, info.name) == (2, 3, 42, "MIG 3g.40gb")
    assert sim.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0, 1).sliceCount == 3
    assert code(sim.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 0, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (
        code(sim.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 9, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert (
        code(sim.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 2, 1) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert (
        code(sim.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 2, 0, 3)
        == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    assert code(sim.nvmlGpuInstanceCreateComputeInstance, gi, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert code(sim.nvmlGpuInstanceCreateComputeInstance, gi, 9) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_a_second_compute_instance_is_insufficient_resources() -> None:
    """One compute instance spans the GPU instance: a second is INSUFFICIENT_RESOURCES, and the
    remaining capacity goes from 1 to 0."""
    sim = node()
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(sim.nvmlDeviceGetHandleByIndex(0), 19, where(0, 1))
    assert sim.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 1
    sim.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert sim.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 0
    assert code(sim.nvmlGpuInstanceCreateComputeInstance, gi, 0) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_a_compute_instance_with_processes_is_in_use_and_a_destroyed_one_is_stale() -> None:
    """nvmlComputeInstanceDestroy while processes run on its MIG device: IN_USE; once they are gone
    it goes, its handle is INVALID_ARGUMENT and its MIG device handle NOT_FOUND."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    _, ci = make(sim, h, 19, 2, 0)
    device = sim.nvmlComputeInstanceGetInfo(ci).device
    uuid = sim.nvmlDeviceGetUUID(device)
    sim.set_processes(uuid, 3)
    assert code(sim.nvmlComputeInstanceDestroy, ci) == pynvml.NVML_ERROR_IN_USE
    sim.set_processes(uuid, 0)
    sim.nvmlComputeInstanceDestroy(ci)
    assert code(sim.nvmlComputeInstanceGetInfo, ci) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(sim.nvmlDeviceGetUUID, device) == pynvml.NVML_ERROR_NOT_FOUND
    assert code(sim.nvmlDeviceGetHandleByUUID, uuid) == pynvml.NVML_ERROR_NOT_FOUND


def test_created_instances_are_mig_devices_in_gpu_instance_order_with_new_uuids() -> None:
    """MIG devices list GPU instances in creation order (layout first), whatever order their compute
    instances came in; each compute instance made gets a new UUID (`created_mig_uuid`)."""
    sim = node(
        "{enabled: true, devices: [{profile: 1g.10gb, placement: 6, uuid: MIG-00000000-0000-0000-0000-000000000001}]}"
    )
    h = sim.nvmlDeviceGetHandleByIndex(0)
    first = sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(0, 1))
    second = sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(1, 1))
    sim.nvmlGpuInstanceCreateComputeInstance(second, 0)
    sim.nvmlGpuInstanceCreateComputeInstance(first, 0)
    assert mig_uuids(sim, h) == [
        "MIG-00000000-0000-0000-0000-000000000001",
        created_mig_uuid(A100_UUID, 2, 7, 0, "1g.10gb"),
        created_mig_uuid(A100_UUID, 1, 8, 0, "1g.10gb"),
    ]
    assert len(set(mig_uuids(sim, h))) == 3


def test_discovery_sees_a_created_instance_as_a_layout_made_one() -> None:
    """What gpuvisor's NVML adapter discovers of a created 3g.40gb at slice 4 equals what it finds
    of the same instance from a node description, but for the UUID."""
    made = node()
    _, ci = make(made, made.nvmlDeviceGetHandleByIndex(0), 9, 4, 2)
    uuid = made.nvmlDeviceGetUUID(made.nvmlComputeInstanceGetInfo(ci).device)
    laid = node("{enabled: true, devices: [{profile: 3g.40gb, placement: 4}]}")
    found = Nvml(made).discover().gpus[0].mig_devices
    expected = Nvml(laid).discover().gpus[0].mig_devices
    assert len(found) == len(expected) == 1
    assert found[0] == dataclasses.replace(expected[0], uuid=uuid)


def test_fault_injection_reaches_created_instances() -> None:
    """An XID on a created MIG device carries its GI/CI ids; an injected failure fails the new
    calls like any other; a lost GPU answers GPU_IS_LOST to creation."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    _, ci = make(sim, h, 14, 2, 1)
    events = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
    sim.inject_xid(sim.nvmlDeviceGetUUID(sim.nvmlComputeInstanceGetInfo(ci).device), 43)
    event = sim.nvmlEventSetWait_v2(events, 1000)
    assert (event.eventData, event.gpuInstanceId, event.computeInstanceId) == (43, 4, 0)
    sim.fail("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN, count=1)
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, where(0, 1))
    assert code(sim.nvmlGpuInstanceCreateComputeInstance, gi, 0) == pynvml.NVML_ERROR_UNKNOWN
    sim.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    sim.lose(A100_UUID)
    assert code(sim.nvmlDeviceCreateGpuInstance, h, 19) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert code(sim.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_GPU_IS_LOST


# ------------------------------------------------------------------ MIG mode


def test_ampere_mig_mode_is_pending_until_a_reset() -> None:
    """On an A100: SetMigMode answers activationStatus RESET_REQUIRED, GetMigMode [current,
    pending] shows it pending, creation stays NOT_SUPPORTED; `reset` makes it current."""
    sim = node("{enabled: false}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert sim.nvmlDeviceGetMigMode(h) == [0, 1]
    assert code(sim.nvmlDeviceCreateGpuInstance, h, 19) == pynvml.NVML_ERROR_NOT_SUPPORTED
    sim.reset(A100_UUID)
    assert sim.nvmlDeviceGetMigMode(h) == [1, 1]
    sim.nvmlDeviceCreateGpuInstance(h, 19)


def test_hopper_mig_mode_changes_at_once_when_idle() -> None:
    """On an H100 with no process: SUCCESS and the mode is current at once, both ways."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(1)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetMigMode(h) == [1, 1]
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetMigMode(h) == [0, 0]


def test_processes_leave_a_mig_mode_change_pending_with_in_use() -> None:
    """Processes on the GPU or on one of its MIG devices: activationStatus IN_USE, the change
    pending; a reset is refused while they run, and applies the change once they are gone."""
    sim = node("{enabled: true, devices: [{profile: 1g.10gb, placement: 0}]}")
    h = sim.nvmlDeviceGetHandleByIndex(1)
    sim.set_processes(H100_UUID, 1)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert sim.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(ValueError, match="in use"):
        sim.reset(H100_UUID)
    sim.set_processes(H100_UUID, 0)
    sim.reset(H100_UUID)
    assert sim.nvmlDeviceGetMigMode(h) == [1, 1]
    a100 = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlComputeInstanceDestroy(
        sim.nvmlGpuInstanceGetComputeInstanceById(sim.nvmlDeviceGetGpuInstanceById(a100, 7), 0)
    )
    sim.nvmlGpuInstanceDestroy(sim.nvmlDeviceGetGpuInstanceById(a100, 7))
    sim.nvmlGpuInstanceCreateComputeInstance(sim.nvmlDeviceCreateGpuInstance(a100, 19), 0)
    sim.set_processes(mig_uuids(sim, a100)[0], 1)
    assert sim.nvmlDeviceSetMigMode(a100, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS  # no change


def test_disabling_with_gpu_instances_is_in_use_and_changes_nothing() -> None:
    """SetMigMode(DISABLE) while a GPU instance exists: IN_USE, the mode stays [1, 1]."""
    sim = node("{enabled: true, devices: [{profile: 7g.80gb}]}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert code(sim.nvmlDeviceSetMigMode, h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_ERROR_IN_USE
    assert sim.nvmlDeviceGetMigMode(h) == [1, 1]


def test_a_pending_change_asked_back_is_no_change() -> None:
    """Asking for the current mode while a change is pending clears it: SUCCESS, [c, c]."""
    sim = node("{enabled: false}")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetMigMode(h) == [0, 0]


def test_mig_mode_refuses_bad_modes_and_gpus_without_mig() -> None:
    """A mode other than 0/1: INVALID_ARGUMENT; an L4: NOT_SUPPORTED."""
    sim = node()
    assert (
        code(sim.nvmlDeviceSetMigMode, sim.nvmlDeviceGetHandleByIndex(0), 2)
        == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert (
        code(sim.nvmlDeviceSetMigMode, sim.nvmlDeviceGetHandleByIndex(2), 1)
        == pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_a_reset_that_activates_a_mode_drops_the_instances_and_their_handles() -> None:
    """A pending disable made current by a reset: the MIG devices and GPU instances are gone and
    their handles stale; a later enable starts with none."""
    sim = node()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    gi = sim.nvmlDeviceCreateGpuInstance(h, 19)
    sim.nvmlGpuInstanceDestroy(gi)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    gi = sim.nvmlDeviceCreateGpuInstance(h, 19)  # still enabled until the reset
    sim.reset(A100_UUID)
    assert sim.nvmlDeviceGetMigMode(h) == [0, 0]
    assert code(sim.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    sim.reset(A100_UUID)
    assert mig_uuids(sim, h) == []
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7


def test_set_processes_checks_its_arguments() -> None:
    """A negative or non-int count, or a UUID of no device: ValueError naming it."""
    sim = node()
    with pytest.raises(ValueError, match="process count"):
        sim.set_processes(A100_UUID, -1)
    with pytest.raises(ValueError, match="no GPU or MIG device"):
        sim.set_processes("GPU-nope", 1)
