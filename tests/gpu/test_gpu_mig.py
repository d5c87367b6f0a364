"""MIG on demand on a real GPU: one GPU instance and its compute instance created, seen, destroyed.

Runs only on a GPU whose MIG mode is already enabled (current and pending), and skips with the
reason elsewhere: without a driver or GPU (tests/gpu/conftest.py), on GPUs without MIG or with MIG
mode off, without the privilege NVML requires to create instances (NO_PERMISSION), or where no
MIG-enabled GPU has room for one more instance. It never changes MIG mode or any other setting:
it creates one instance of the smallest profile with room, checks that NVML and gpuvisor's
adapter see it as a MIG device, destroys it (compute instance first), and checks that the GPU's
MIG devices and mode are as before. The same calls are checked against NVML's rules on both
doubles in tests/conformance/test_mig_on_demand.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from supervisor.node.nvml import Nvml
from tests.gpu.conftest import DriverGpu

# NVML_COMPUTE_INSTANCE_PROFILE_* of the compute instance spanning a GPU instance of n slices.
SPANNING_CI = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}
NOT_PERMITTED = "NVML refuses to create MIG instances here (NO_PERMISSION: it needs a privileged user)"


@pytest.fixture
def nvml() -> Iterator[None]:
    pynvml.nvmlInit()
    try:
        yield
    finally:
        pynvml.nvmlShutdown()


def mig_uuids(h: Any) -> set[str]:
    found = set()
    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            found.add(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)))
        except pynvml.NVMLError_NotFound:
            continue
    return found


def smallest_with_room(h: Any) -> Any:
    """The GPU-instance profile with the fewest slices (then the least memory) that still has room
    on the GPU, or None."""
    best = None
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
            room = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id)
        except pynvml.NVMLError_NoPermission:
            pytest.skip(NOT_PERMITTED)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        if room > 0 and int(info.sliceCount) in SPANNING_CI:
            key = (int(info.sliceCount), int(info.memorySizeMB), int(info.id))
            if best is None or key < best[0]:
                best = (key, info)
    return None if best is None else best[1]


def test_one_smallest_instance_is_created_seen_and_destroyed(driver: list[DriverGpu], nvml: None) -> None:
    """On a GPU with MIG mode already enabled: a GPU instance of the smallest profile with room and
    its spanning compute instance are created; the compute instance's device is a new MIG device
    that NVML finds by UUID and gpuvisor's discovery lists with its GPU instance id and profile;
    destroying the compute instance then the GPU instance leaves the MIG devices and the MIG mode
    as they were."""
    candidates = [g for g in driver if g.mig_enabled]
    if not candidates:
        pytest.skip("no GPU here has MIG mode enabled (this test never enables it)")
    for g in sorted(candidates, key=lambda c: c.index):
        h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
        mode = pynvml.nvmlDeviceGetMigMode(h)
        if mode != [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]:
            continue  # enabled with a change pending: leave it alone
        profile = smallest_with_room(h)
        if profile is None:
            continue
        before = mig_uuids(h)
        try:
            gi = pynvml.nvmlDeviceCreateGpuInstance(h, profile.id)
        except pynvml.NVMLError_NoPermission:
            pytest.skip(NOT_PERMITTED)
        try:
            gi_info = pynvml.nvmlGpuInstanceGetInfo(gi)
            assert gi_info.profileId == profile.id
            ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, SPANNING_CI[int(profile.sliceCount)])
            try:
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlComputeInstanceGetInfo(ci).device)
                assert uuid.startswith("MIG-") and uuid not in before
                assert pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == gi_info.id
                adapter = Nvml(pynvml)
                adapter.init()
                try:
                    gpu = next(x for x in adapter.discover().gpus if x.uuid == g.uuid)
                finally:
                    adapter.shutdown()
                seen = [m for m in gpu.mig_devices if m.uuid == uuid]
                assert len(seen) == 1
                assert (seen[0].gi_id, seen[0].gi_profile_id) == (gi_info.id, profile.id)
                assert (seen[0].placement_start, seen[0].placement_size) == (
                    gi_info.placement.start,
                    gi_info.placement.size,
                )
            finally:
                pynvml.nvmlComputeInstanceDestroy(ci)
        finally:
            pynvml.nvmlGpuInstanceDestroy(gi)
        assert mig_uuids(h) == before
        assert pynvml.nvmlDeviceGetMigMode(h) == mode
        return
    pytest.skip("no GPU with MIG mode enabled (and none pending) has room for one more instance")


def test_mig_on_demand_makes_and_destroys_a_device_at_a_free_placement(
    driver: list[DriverGpu], nvml: None
) -> None:
    """MIG on demand's NVML side on a real GPU with MIG mode already enabled (never enabled here):
    the GPU's options (supervisor.node.migplace) include a placement that no instance overlaps;
    MigMaker creates the device there, lists it among the GPU's instances, and destroys it,
    leaving the MIG devices and the MIG mode as they were. Prints how long the create took."""
    import time

    from supervisor.node.migmaker import MigError, MigMaker
    from supervisor.node.migplace import mig_options

    candidates = [g for g in driver if g.mig_enabled]
    if not candidates:
        pytest.skip("no GPU here has MIG mode enabled (this test never enables it)")
    maker = MigMaker(pynvml)
    for g in sorted(candidates, key=lambda c: c.index):
        h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
        mode = pynvml.nvmlDeviceGetMigMode(h)
        if mode != [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]:
            continue
        before = mig_uuids(h)
        for option in sorted(mig_options(pynvml, h), key=lambda o: o.placement_size):
            start = time.monotonic()
            try:
                made = maker.create(g.uuid, option.gi_profile_id, option.placement_start)
            except MigError as exc:
                if exc.kind == "taken":
                    continue  # an instance there: the next placement
                if exc.code == pynvml.NVML_ERROR_NO_PERMISSION:
                    pytest.skip(NOT_PERMITTED)
                raise
            took = (time.monotonic() - start) * 1000
            try:
                assert made.uuid.startswith("MIG-") and made.uuid not in before
                assert made.uuid in {m.uuid for m in maker.instances(g.uuid)}
            finally:
                maker.destroy(g.uuid, made.gi_id, made.ci_id)
            print(f"MIG {option.profile} at placement {option.placement_start} made in {took:.0f} ms")
            assert mig_uuids(h) == before
            assert pynvml.nvmlDeviceGetMigMode(h) == mode
            return
    pytest.skip("no GPU with MIG mode enabled has a free placement")
