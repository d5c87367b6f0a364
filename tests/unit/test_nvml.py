"""Tests of the NVML adapter (supervisor.node.nvml) over the simulator (real NVML: tests/gpu)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pynvml
import pytest

from common.model import (
    TOPOLOGY_MULTIPLE,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
    node_from_json,
    node_to_json,
)
from supervisor.node.events import EventWatch
from supervisor.node.nvml import (
    ARCHITECTURES,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_UNKNOWN,
    Nvml,
    NvmlCallError,
    architecture_of,
    mig_profile_name,
    sysfs_bus_id,
)
from supervisor.sim.nvml import Simulator, load_simulator
from supervisor.sim.nvml.config import architecture_for
from tests.helpers import wait_until

CUSTOM = """
driver_version: "535.104.05"
cuda_driver_version: 12020
gpus:
  - name: NVIDIA A100-SXM4-80GB
    uuid: GPU-00000000-0000-0000-0000-0000000000a0
    minor: 4
    pci_bus_id: "0000:07:00.0"
    memory_mib: 81920
    numa_node: null
    compute_capability: [8, 0]
  - name: NVIDIA A100-SXM4-80GB
    uuid: GPU-00000000-0000-0000-0000-0000000000a1
    minor: 5
    pci_bus_id: "0000:0f:00.0"
    memory_mib: 81920
    numa_node: null
    compute_capability: [8, 0]
    supports: {ecc_events: false}
  - name: NVIDIA L4
    uuid: GPU-00000000-0000-0000-0000-0000000000a2
    minor: 6
    pci_bus_id: "0000:b1:00.0"
    memory_mib: 23034
    numa_node: 1
    compute_capability: [8, 9]
topology:
  default_ancestor: SYSTEM
  ancestors: [[0, 1, HOSTBRIDGE]]
  nvlinks: [[0, 1, 4]]
"""


def adapter(profile: str) -> tuple[Simulator, Nvml]:
    sim = load_simulator(profile)
    nvml = Nvml(sim)
    nvml.init()
    return sim, nvml


def custom(tmp_path: Path, sysfs: Path | None = None) -> tuple[Simulator, Nvml]:
    path = tmp_path / "node.yaml"
    path.write_text(CUSTOM)
    sim = load_simulator(str(path))
    nvml = Nvml(sim, sysfs_root=sysfs or tmp_path / "no-sysfs")
    nvml.init()
    return sim, nvml


@pytest.mark.parametrize(
    ("profile", "count", "name", "memory", "cc", "nvlinks"),
    [
        ("dgx-h100", 8, "NVIDIA H100 80GB HBM3", 81559, (9, 0), 18),
        ("dgx-a100", 8, "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 12),
        ("mig-a100", 8, "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 12),
        ("pcie-l4", 4, "NVIDIA L4", 23034, (8, 9), 0),
    ],
)
def test_discover_profile(
    profile: str, count: int, name: str, memory: int, cc: tuple[int, int], nvlinks: int
) -> None:
    """discover() reports every GPU as the profile describes it and a link for every pair."""
    sim, nvml = adapter(profile)
    node = nvml.discover()
    assert node.driver_version == sim.spec.driver_version and node.cuda_driver_version == 12040
    assert len(node.gpus) == count
    for gpu, spec in zip(node.gpus, sim.spec.gpus, strict=True):
        assert (gpu.index, gpu.uuid, gpu.minor, gpu.pci_bus_id, gpu.numa_node) == (
            spec.index,
            spec.uuid,
            spec.minor,
            spec.pci_bus_id,
            spec.numa_node,
        )
        assert (gpu.name, gpu.memory_mib, gpu.compute_capability) == (name, memory, cc)
    assert [(link.a, link.b) for link in node.links] == [
        (a, b) for a in range(count) for b in range(a + 1, count)
    ]
    assert {link.nvlinks for link in node.links} == {nvlinks}
    for link in node.links:
        assert link.ancestor == sim.spec.ancestors[(link.a, link.b)]


@pytest.mark.parametrize(
    ("profile", "same_pair", "same_numa", "across"),
    [
        ("dgx-h100", TOPOLOGY_NODE, TOPOLOGY_NODE, TOPOLOGY_SYSTEM),
        ("dgx-a100", TOPOLOGY_MULTIPLE, TOPOLOGY_NODE, TOPOLOGY_SYSTEM),
        ("pcie-l4", TOPOLOGY_SINGLE, None, TOPOLOGY_SYSTEM),
    ],
)
def test_discover_ancestors(profile: str, same_pair: int, same_numa: int | None, across: int) -> None:
    """Common ancestors: by switch pair, by NUMA node, and across NUMA nodes."""
    node = adapter(profile)[1].discover()
    levels = {(link.a, link.b): link.ancestor for link in node.links}
    assert levels[(0, 1)] == same_pair
    if same_numa is not None:
        assert levels[(0, 2)] == same_numa
    assert levels[(1, 2) if profile == "pcie-l4" else (0, 4)] == across


def test_discover_mig() -> None:
    """mig-a100: MIG devices carry parent, index j, GI/CI ids, profile name and memory."""
    sim, nvml = adapter("mig-a100")
    node = nvml.discover()
    assert [g.mig_enabled for g in node.gpus] == [True] * 4 + [False] * 4
    for gpu, spec in zip(node.gpus, sim.spec.gpus, strict=True):
        assert [(m.uuid, m.index, m.gi_id, m.ci_id, m.profile) for m in gpu.mig_devices] == [
            (m.uuid, j, m.gi, m.ci, m.profile) for j, m in enumerate(spec.mig)
        ]
        assert all((m.parent_uuid, m.parent_index) == (gpu.uuid, gpu.index) for m in gpu.mig_devices)
    gpu0 = node.gpus[0]
    assert [(m.profile, m.memory_mib) for m in gpu0.mig_devices] == [
        ("3g.40gb", 40192),
        ("2g.20gb", 19968),
        ("1g.10gb", 9728),
        ("1g.10gb", 9728),
    ]
    assert node.gpus[2].mig_devices[0].profile == "1g.10gb+me"


def test_mig_profile_fallback_without_gpu_instance_access() -> None:
    """When GPU-instance queries are refused, profile names are rebuilt from the attributes."""
    sim, nvml = adapter("mig-a100")
    sim.fail("nvmlDeviceGetGpuInstanceById", pynvml.NVML_ERROR_NO_PERMISSION)
    node = nvml.discover()
    assert [m.profile for m in node.gpus[0].mig_devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    # Without the GPU-instance profile the media extensions cannot be seen: a known limit.
    assert node.gpus[2].mig_devices[0].profile == "1g.10gb"


def test_discover_mig_instance_profile_and_placement() -> None:
    """A MIG device carries its GPU instance's profile id, placement and the profile's engine
    counts (what NVIDIA's DRA driver names and describes it by); refused GPU-instance queries leave
    them unknown (-1 / 0), not wrong."""
    sim, nvml = adapter("mig-a100")
    first = nvml.discover().gpus[0].mig_devices[0]  # a 3g.40gb at memory slice 4
    assert (first.gi_profile_id, first.placement_start, first.placement_size) == (9, 4, 4)
    assert (first.multiprocessors, first.copy_engines, first.decoders, first.jpeg_engines) == (42, 3, 2, 0)
    sim.fail("nvmlDeviceGetGpuInstanceById", pynvml.NVML_ERROR_NO_PERMISSION)
    refused = nvml.discover().gpus[0].mig_devices[0]
    assert (refused.gi_profile_id, refused.placement_start, refused.multiprocessors) == (-1, -1, 0)


class _BrandCalls:
    """The simulator with NVML's brand and architecture calls answering `brand` and `arch`, or
    missing (an old driver or binding) where those are None."""

    def __init__(self, sim: Simulator, brand: int | None, arch: int | None) -> None:
        self._sim, self._answers = sim, {"nvmlDeviceGetBrand": brand, "nvmlDeviceGetArchitecture": arch}

    def __getattr__(self, name: str) -> object:
        if name in self._answers:
            value = self._answers[name]
            if value is None:
                raise AttributeError(name)
            return lambda handle: value
        return getattr(self._sim, name)


def test_brand_and_architecture_are_named_as_go_nvlib_names_them() -> None:
    """NVML's brand and architecture enums become go-nvlib's strings; without the calls the
    architecture comes from the compute capability and the brand stays unknown ("")."""
    nvml = Nvml(
        _BrandCalls(load_simulator("dgx-h100"), pynvml.NVML_BRAND_TESLA, pynvml.NVML_DEVICE_ARCH_HOPPER)
    )
    nvml.init()
    gpu = nvml.discover().gpus[0]
    assert (gpu.brand, gpu.architecture) == ("Tesla", "Hopper")
    bare = Nvml(_BrandCalls(load_simulator("pcie-l4"), None, None))
    bare.init()
    gpu = bare.discover().gpus[0]
    assert (gpu.brand, gpu.architecture) == ("", "Ada Lovelace")


@pytest.mark.parametrize(
    ("cc", "arch"),
    [((7, 0), "Volta"), ((7, 5), "Turing"), ((8, 0), "Ampere"), ((8, 6), "Ampere"), ((8, 9), "Ada Lovelace"),
     ((9, 0), "Hopper"), ((10, 0), "Blackwell"), ((12, 0), "Blackwell"), ((6, 1), "Pascal"), ((42, 0), "")],
)  # fmt: skip
def test_architecture_from_compute_capability(cc: tuple[int, int], arch: str) -> None:
    """CUDA's table of compute capabilities; an unknown one gives no architecture rather than a guess."""
    assert architecture_of(cc) == arch


def test_the_simulator_gives_the_architecture_the_adapter_would_derive() -> None:
    """A simulated GPU described without an architecture answers nvmlDeviceGetArchitecture with
    the one the adapter derives from its compute capability where NVML lacks the call (one
    table for both), and NVML's "unknown" where that names none (CC 13, before an answer said
    which architecture it is)."""
    for major in range(1, 15):
        for minor in (0, 5, 9):
            name = ARCHITECTURES.get(architecture_for((major, minor)), "")
            assert (name if name != "Unknown" else "") == architecture_of((major, minor)), (major, minor)


@pytest.mark.parametrize(
    ("slices", "mib", "gpu_mib", "me", "expected"),
    [
        (1, 9728, 81920, False, "1g.10gb"),
        (1, 9728, 81920, True, "1g.10gb+me"),
        (2, 19968, 81920, False, "2g.20gb"),
        (3, 40192, 81920, False, "3g.40gb"),
        (7, 80640, 81920, False, "7g.80gb"),
        (1, 9984, 81559, False, "1g.10gb"),
        (1, 4864, 40960, False, "1g.5gb"),
    ],
)
def test_mig_profile_name(slices: int, mib: int, gpu_mib: int, me: bool, expected: str) -> None:
    """Rebuilt MIG profile names round memory to the GPU's eighths, like NVIDIA's names."""
    assert mig_profile_name(slices, mib, gpu_mib, me) == expected


def test_discover_follows_mig_reconfiguration() -> None:
    """A new discover() after a MIG layout change reports the new instances, no restart needed."""
    sim, nvml = adapter("mig-a100")
    new = sim.set_mig_layout(3, ["4g.40gb", "2g.20gb", "1g.10gb"])
    gpu = nvml.discover().gpus[3]
    assert [(m.uuid, m.profile) for m in gpu.mig_devices] == list(
        zip(new, ["4g.40gb", "2g.20gb", "1g.10gb"], strict=True)
    )
    sim.set_mig_layout(3, None)
    gpu = nvml.discover().gpus[3]
    assert not gpu.mig_enabled and gpu.mig_devices == ()


@pytest.mark.parametrize("profile", ["dgx-h100", "dgx-a100", "mig-a100", "pcie-l4"])
def test_discover_is_deterministic(profile: str) -> None:
    """The same profile discovered twice gives equal Nodes and the same JSON, which round-trips."""
    first = adapter(profile)[1].discover()
    second = adapter(profile)[1].discover()
    assert first == second
    assert node_to_json(first) == node_to_json(second)
    assert node_from_json(node_to_json(first)) == first


def test_direct_nvlinks_numa_fallback_and_versions(tmp_path: Path) -> None:
    """Direct links count per pair; NUMA falls back to sysfs; driver and CUDA versions are read."""
    sysfs = tmp_path / "sys"
    numa_file = sysfs / "bus/pci/devices/0000:07:00.0/numa_node"
    numa_file.parent.mkdir(parents=True)
    numa_file.write_text("1\n")
    neg = sysfs / "bus/pci/devices/0000:0f:00.0/numa_node"
    neg.parent.mkdir(parents=True)
    neg.write_text("-1\n")
    node = custom(tmp_path, sysfs)[1].discover()
    assert [g.numa_node for g in node.gpus] == [1, None, 1]
    assert [(link.a, link.b, link.ancestor, link.nvlinks) for link in node.links] == [
        (0, 1, 30, 4),
        (0, 2, TOPOLOGY_SYSTEM, 0),
        (1, 2, TOPOLOGY_SYSTEM, 0),
    ]
    assert (node.driver_version, node.cuda_driver_version) == ("535.104.05", 12020)


def test_discover_leaves_out_lost_gpu() -> None:
    """A GPU lost before discovery is left out; the others and their links are still reported."""
    sim, nvml = adapter("pcie-l4")
    sim.lose(sim.gpu_uuids()[1])
    node = nvml.discover()
    assert [g.index for g in node.gpus] == [0, 2, 3]
    assert [(link.a, link.b) for link in node.links] == [(0, 2), (0, 3), (2, 3)]


def test_discover_propagates_other_errors() -> None:
    """An NVML error other than a lost GPU surfaces as NvmlCallError with the code and the NVMLError."""
    sim, nvml = adapter("pcie-l4")
    sim.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlCallError) as info:
        nvml.discover()
    err = info.value
    assert (err.function, err.code) == ("nvmlDeviceGetMemoryInfo", NVML_ERROR_UNKNOWN)
    assert isinstance(err.error, pynvml.NVMLError_Unknown)


def test_init_failure_and_uninitialized() -> None:
    """init() reports a missing library by its NVML code; calls before init report Uninitialized."""
    sim = load_simulator("pcie-l4")
    nvml = Nvml(sim)
    with pytest.raises(NvmlCallError) as info:
        nvml.discover()
    assert info.value.code == pynvml.NVML_ERROR_UNINITIALIZED
    sim.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, count=1)
    with pytest.raises(NvmlCallError) as info:
        nvml.init()
    assert info.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with nvml:
        assert sim.initialized
    assert not sim.initialized


def open_watch(profile: str) -> tuple[Simulator, Nvml, EventWatch]:
    sim, nvml = adapter(profile)
    return sim, nvml, EventWatch.open(nvml)


def test_watch_registers_every_gpu() -> None:
    """The event set covers XID and both ECC kinds on every GPU."""
    sim, _, watch = open_watch("dgx-h100")
    mask = (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
    )
    assert watch.registered == dict.fromkeys(sim.gpu_uuids(), mask)
    assert watch.skipped == {}


def test_watch_tolerates_unsupported_and_lost(tmp_path: Path) -> None:
    """A GPU without ECC events gets XID only; a lost GPU is skipped, not fatal."""
    sim, nvml = custom(tmp_path)
    sim.lose("GPU-00000000-0000-0000-0000-0000000000a2")
    with EventWatch.open(nvml) as watch:
        assert (
            watch.registered["GPU-00000000-0000-0000-0000-0000000000a1"]
            == pynvml.nvmlEventTypeXidCriticalError
        )
        assert "GPU-00000000-0000-0000-0000-0000000000a0" in watch.registered
        assert watch.skipped == {"index 2": "GPU is lost"}


def test_watch_falls_back_to_per_type_registration() -> None:
    """If NVML refuses the combined mask, each event type is registered on its own."""
    sim, nvml = adapter("pcie-l4")
    sim.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED, count=1)
    watch = EventWatch.open(nvml)
    assert len(watch.registered) == 4
    assert sim.call_count("nvmlDeviceRegisterEvents") == 4 + 3


@pytest.mark.parametrize(
    ("function", "key"),
    [
        ("nvmlDeviceRegisterEvents", "uuid"),
        ("nvmlDeviceGetSupportedEventTypes", "uuid"),
        ("nvmlDeviceGetUUID", "index"),
    ],
)
def test_watch_skips_a_gpu_whose_calls_fail(function: str, key: str) -> None:
    """A per-GPU error other than GPU lost skips that GPU with the reason; the others are watched."""
    sim, nvml = adapter("pcie-l4")
    gpus = sim.gpu_uuids()
    sim.fail(function, NVML_ERROR_UNKNOWN, count=1)
    with EventWatch.open(nvml) as watch:
        assert set(watch.registered) == set(gpus[1:])
        name = gpus[0] if key == "uuid" else "index 0"
        assert list(watch.skipped) == [name]
        assert watch.skipped[name].startswith(f"cannot register its events: {function} failed: ")
        sim.inject_xid(gpus[2], 48)
        event = watch.wait(1000)
        assert event is not None and event.gpu_uuid == gpus[2]


def test_watch_fails_whole_when_every_gpu_fails() -> None:
    """When every GPU fails registration (NVML broken, not one GPU) the watch raises and frees its set."""
    sim, nvml = adapter("pcie-l4")
    sim.fail("nvmlDeviceRegisterEvents", NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlCallError) as info:
        EventWatch.open(nvml)
    assert (info.value.function, info.value.code) == ("nvmlDeviceRegisterEvents", NVML_ERROR_UNKNOWN)
    assert sim.call_count("nvmlEventSetFree") == 1


@pytest.mark.parametrize(
    ("inject", "kind", "data"),
    [
        ("xid", "xid", 48),
        ("single", "single-bit-ecc", 0),
        ("double", "double-bit-ecc", 0),
    ],
)
def test_wait_returns_typed_events(inject: str, kind: str, data: int) -> None:
    """Injected XIDs and ECC errors come back as NvmlEvent with the GPU UUID and kind."""
    sim, _, watch = open_watch("dgx-a100")
    uuid = sim.gpu_uuids()[6]
    if inject == "xid":
        sim.inject_xid(uuid, 48)
    else:
        sim.inject_ecc(uuid, inject)
    event = watch.wait(1000)
    assert event is not None
    assert (event.gpu_uuid, event.kind, event.data, event.gi_id, event.ci_id) == (
        uuid,
        kind,
        data,
        None,
        None,
    )
    assert event.xid == (48 if kind == "xid" else None)


def test_wait_timeout_returns_none() -> None:
    """No event within the timeout gives None."""
    assert open_watch("pcie-l4")[2].wait(50) is None


def test_wait_mig_event() -> None:
    """An XID on a MIG device names the parent GPU and the instance's GI/CI ids."""
    sim, nvml, watch = open_watch("mig-a100")
    mig = nvml.discover().gpus[1].mig_devices[2]
    sim.inject_xid(mig.uuid, 43)
    event = watch.wait(1000)
    assert event is not None
    assert (event.gpu_uuid, event.xid, event.gi_id, event.ci_id) == (
        mig.parent_uuid,
        43,
        mig.gi_id,
        mig.ci_id,
    )


def test_wait_reports_lost_gpu() -> None:
    """A GPU falling off the bus arrives as XID 79 with its UUID, though its handle now fails."""
    sim, _, watch = open_watch("dgx-h100")
    uuid = sim.gpu_uuids()[2]
    sim.lose(uuid)
    event = watch.wait(1000)
    assert event is not None and (event.gpu_uuid, event.xid) == (uuid, 79)


def test_wait_propagates_other_errors() -> None:
    """A wait error other than a timeout raises NvmlCallError carrying the code and NVMLError."""
    sim, _, watch = open_watch("pcie-l4")
    sim.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlCallError) as info:
        watch.wait(1000)
    assert info.value.code == NVML_ERROR_UNKNOWN and isinstance(info.value.error, pynvml.NVMLError_Unknown)


def test_wait_in_thread_wakes_on_injection() -> None:
    """The health loop's blocking wait returns as soon as another thread injects an event."""
    sim, _, watch = open_watch("pcie-l4")
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(watch.wait(60_000)), daemon=True)
    thread.start()
    assert wait_until(lambda: sim.call_count("nvmlEventSetWait_v2") == 1)
    sim.inject_xid(sim.gpu_uuids()[0], 94)
    assert wait_until(lambda: bool(got), timeout=15)
    thread.join(5)


def test_close_after_shutdown_is_quiet() -> None:
    """Closing an event watch after NVML shut down does not raise."""
    _, nvml, watch = open_watch("pcie-l4")
    nvml.shutdown()
    watch.close()
    watch.close()


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        (None, "ok"),
        ("lose", "lost"),
        ("pending", "pending-retirement"),
        ("remap", "remapped-rows-pending"),
    ],
)
def test_probe(fault: str | None, status: str) -> None:
    """probe() tells ok, lost, pending page retirement and pending row remapping apart."""
    sim, nvml = adapter("dgx-h100")
    uuid = sim.gpu_uuids()[4]
    if fault == "lose":
        sim.lose(uuid)
    elif fault == "pending":
        sim.set_pending_retirement(uuid, True)
    elif fault == "remap":
        sim.set_remapped_rows_pending(uuid, True)
    result = nvml.probe(uuid)
    assert (result.uuid, result.status, result.ok) == (uuid, status, status == "ok")
    if fault == "lose":
        assert result.code == NVML_ERROR_GPU_IS_LOST
    sim.reset(uuid)
    assert nvml.probe(uuid).ok


def test_probe_mig_unknown_and_errors(tmp_path: Path) -> None:
    """probe() follows a MIG device to its parent, and reports unknown UUIDs and other errors by code."""
    sim, nvml = adapter("mig-a100")
    mig_uuid = sim.mig_uuids(0)[0]
    assert nvml.probe(mig_uuid).ok
    sim.set_pending_retirement(sim.gpu_uuids()[0], True)
    assert nvml.probe(mig_uuid).status == "pending-retirement"
    assert nvml.probe("GPU-00000000-0000-0000-0000-00000000ffff").status == "not-found"
    sim.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN, count=1)
    result = nvml.probe(sim.gpu_uuids()[5])
    assert (result.status, result.code) == ("error", NVML_ERROR_UNKNOWN)
    # A GPU without page retirement support still probes fine.
    csim, cnvml = custom(tmp_path)
    assert cnvml.probe(csim.gpu_uuids()[1]).ok


def test_sysfs_bus_id() -> None:
    """NVML bus ids map to sysfs names (4-digit domain, lower case)."""
    assert sysfs_bus_id("00000000:B7:00.0") == "0000:b7:00.0"
    assert sysfs_bus_id("0001:3A:00.1") == "0001:3a:00.1"


def test_a_lost_gpu_is_reported_once_not_at_every_rediscovery(caplog: pytest.LogCaptureFixture) -> None:
    """Discovery leaves a lost GPU out with one warning; later rediscoveries say nothing more, and
    after it came back and was lost again, it is said again."""
    sim = load_simulator("pcie-l4")
    nvml = Nvml(sim)
    nvml.init()
    lost = nvml.discover().gpus[1].uuid
    sim.lose(lost)
    with caplog.at_level(logging.WARNING, logger="gpuvisor.nvml"):
        for _ in range(3):
            assert len(nvml.discover().gpus) == 3
        assert sum("is lost" in r.getMessage() for r in caplog.records) == 1
        sim.restore(lost)
        assert len(nvml.discover().gpus) == 4
        sim.lose(lost)
        nvml.discover()
        assert sum("is lost" in r.getMessage() for r in caplog.records) == 2
