"""Tests of the NVML simulator: profiles, fidelity to the real binding, blocking waits, faults."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from supervisor.sim.nvml import Simulator, SimulatorConfigError, list_profiles, load_simulator
from supervisor.sim.nvml import mig as migdefs
from tests.helpers import wait_until

XID = pynvml.nvmlEventTypeXidCriticalError
SBE = pynvml.nvmlEventTypeSingleBitEccError
DBE = pynvml.nvmlEventTypeDoubleBitEccError

MINIMAL = """
driver_version: "550.54.15"
gpus:
  - name: NVIDIA A100-SXM4-80GB
    uuid: GPU-00000000-0000-0000-0000-000000000001
    minor: 0
    pci_bus_id: "0000:07:00.0"
    memory_mib: 81920
    numa_node: 0
    compute_capability: [8, 0]
  - name: NVIDIA L4
    uuid: GPU-00000000-0000-0000-0000-000000000002
    minor: 1
    pci_bus_id: "0000:08:00.0"
    memory_mib: 23034
    numa_node: null
    compute_capability: [8, 9]
    supports: {ecc_events: false, retired_pages: false}
topology:
  default_ancestor: NODE
  nvlinks: [[0, 1, 4]]
"""


def started(profile: str) -> Simulator:
    sim = load_simulator(profile)
    sim.nvmlInit()
    return sim


def write(tmp_path: Path, text: str, name: str = "node.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


class Waiter:
    """Runs nvmlEventSetWait_v2 in a thread and keeps what it returned or raised."""

    def __init__(self, sim: Simulator, event_set: Any, timeout_ms: int) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.started_at = time.monotonic()
        self.finished_at = 0.0

        def run() -> None:
            try:
                self.result = sim.nvmlEventSetWait_v2(event_set, timeout_ms)
            except BaseException as exc:
                self.error = exc
            self.finished_at = time.monotonic()
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        assert self.done.wait(15), "waiter did not finish"
        self.thread.join(5)


def test_builtin_profile_names() -> None:
    """The five built-in profiles exist under exactly their documented names."""
    assert list_profiles() == ["dgx-a100", "dgx-h100", "gh200", "mig-a100", "pcie-l4"]


@pytest.mark.parametrize(
    ("profile", "name", "count", "numa", "links"),
    [
        ("dgx-h100", "NVIDIA H100 80GB HBM3", 8, [0, 0, 0, 0, 1, 1, 1, 1], 18),
        ("dgx-a100", "NVIDIA A100-SXM4-80GB", 8, [0, 0, 0, 0, 1, 1, 1, 1], 12),
        ("mig-a100", "NVIDIA A100-SXM4-80GB", 8, [0, 0, 0, 0, 1, 1, 1, 1], 12),
        ("pcie-l4", "NVIDIA L4", 4, [0, 0, 1, 1], 0),
    ],
)
def test_profile_shape(profile: str, name: str, count: int, numa: list[int], links: int) -> None:
    """Each profile has its GPU model, count, NUMA layout and NVLink count per GPU."""
    sim = started(profile)
    assert sim.nvmlDeviceGetCount() == count
    handles = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    assert [sim.nvmlDeviceGetName(h) for h in handles] == [name] * count
    assert [sim.nvmlDeviceGetNumaNodeId(h) for h in handles] == numa
    assert [sim.nvmlDeviceGetMinorNumber(h) for h in handles] == list(range(count))
    for h in handles:
        active = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            with contextlib.suppress(pynvml.NVMLError_NotSupported):
                active += sim.nvmlDeviceGetNvLinkState(h, link)
        assert active == links
    uuids = [sim.nvmlDeviceGetUUID(h) for h in handles]
    assert len(set(uuids)) == count and all(u.startswith("GPU-") and len(u) == 40 for u in uuids)


def test_pcie_l4_ancestors() -> None:
    """pcie-l4: GPUs 0,1 and 2,3 share a PCIe switch (SINGLE); pairs across NUMA are SYSTEM."""
    sim = started("pcie-l4")
    h = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    level = sim.nvmlDeviceGetTopologyCommonAncestor
    assert level(h[0], h[1]) == level(h[2], h[3]) == pynvml.NVML_TOPOLOGY_SINGLE
    for a, b in [(0, 2), (0, 3), (1, 2), (1, 3)]:
        assert level(h[a], h[b]) == level(h[b], h[a]) == pynvml.NVML_TOPOLOGY_SYSTEM


def test_mig_a100_layouts() -> None:
    """mig-a100: GPUs 0-3 MIG-enabled with valid layouts covering every required profile; 4-7 not."""
    sim = started("mig-a100")
    seen: set[str] = set()
    for i in range(8):
        h = sim.nvmlDeviceGetHandleByIndex(i)
        mode = sim.nvmlDeviceGetMigMode(h)
        assert mode[0] == (pynvml.NVML_DEVICE_MIG_ENABLE if i < 4 else pynvml.NVML_DEVICE_MIG_DISABLE)
        if i >= 4:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                sim.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
            continue
        profiles = []
        for j in range(sim.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = sim.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except pynvml.NVMLError_NotFound:
                continue
            assert sim.nvmlDeviceIsMigDeviceHandle(m).value == 1
            assert sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m) is h
            assert sim.nvmlDeviceGetUUID(m).startswith("MIG-")
            profiles.append(sim.nvmlDeviceGetName(m).split(" MIG ")[1])
        cat = migdefs.catalogue_for("NVIDIA A100-SXM4-80GB")
        assert cat is not None
        assert sum(cat[p].compute_slices for p in profiles) <= 7
        assert migdefs.place([cat[p] for p in profiles]) is not None
        seen.update(profiles)
    assert {"1g.10gb", "2g.20gb", "3g.40gb", "1g.10gb+me"} <= seen


def test_signatures_match_real_binding() -> None:
    """Every simulated NVML function has the real binding's parameter names, order and defaults."""
    sim = load_simulator("pcie-l4")
    names = sim.nvml_functions()
    assert len(names) > 40
    for name in names:
        real = inspect.signature(getattr(pynvml, name))
        fake = inspect.signature(getattr(sim, name))
        assert [(p.name, p.default) for p in fake.parameters.values()] == [
            (p.name, p.default) for p in real.parameters.values()
        ], name


@pytest.mark.parametrize(
    "name",
    [
        "NVMLError",
        "NVMLError_Uninitialized",
        "NVMLError_NotFound",
        "NVMLError_GpuIsLost",
        "NVMLError_Timeout",
        "NVMLError_InvalidArgument",
        "NVMLError_NotSupported",
        "NVMLError_InUse",  # not spelled out on the class: forwarded from pynvml
        "NVML_TOPOLOGY_SINGLE",
        "NVML_TOPOLOGY_SYSTEM",
        "NVML_NVLINK_MAX_LINKS",
        "NVML_DEVICE_MIG_ENABLE",
        "NVML_ERROR_UNKNOWN",
        "NVML_ERROR_LIBRARY_NOT_FOUND",
        "nvmlEventTypeXidCriticalError",
        "nvmlEventTypeSingleBitEccError",
        "nvmlEventTypeDoubleBitEccError",
        "c_nvmlMemory_t",
    ],
)
def test_constants_and_errors_are_the_bindings(name: str) -> None:
    """Constants and error classes on the simulator are the real binding's own objects."""
    assert getattr(load_simulator("pcie-l4"), name) is getattr(pynvml, name)


def test_unsimulated_function_is_an_attribute_error() -> None:
    """A binding function the simulator lacks fails loudly instead of calling the real library."""
    with pytest.raises(AttributeError, match="does not implement"):
        _ = load_simulator("pcie-l4").nvmlDeviceGetPowerUsage


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("nvmlDeviceGetCount", ()),
        ("nvmlSystemGetDriverVersion", ()),
        ("nvmlDeviceGetHandleByIndex", (0,)),
        ("nvmlEventSetCreate", ()),
        ("nvmlShutdown", ()),
    ],
)
def test_calls_before_init_raise_uninitialized(call: str, args: tuple[Any, ...]) -> None:
    """Before nvmlInit every NVML call raises the real NVMLError_Uninitialized (code 1)."""
    sim = load_simulator("dgx-h100")
    with pytest.raises(pynvml.NVMLError_Uninitialized) as info:
        getattr(sim, call)(*args)
    assert info.value.value == pynvml.NVML_ERROR_UNINITIALIZED


def test_init_is_reference_counted() -> None:
    """Two nvmlInit calls need two nvmlShutdown calls before NVML is uninitialized."""
    sim = load_simulator("pcie-l4")
    sim.nvmlInit()
    sim.nvmlInit()
    sim.nvmlShutdown()
    assert sim.nvmlDeviceGetCount() == 4
    sim.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()


@pytest.mark.parametrize(
    ("call", "args", "error"),
    [
        ("nvmlDeviceGetHandleByIndex", (9,), pynvml.NVMLError_InvalidArgument),
        (
            "nvmlDeviceGetHandleByUUID",
            ("GPU-00000000-0000-0000-0000-000000000000",),
            pynvml.NVMLError_NotFound,
        ),
        ("nvmlDeviceGetName", ("not a handle",), pynvml.NVMLError_InvalidArgument),
    ],
)
def test_bad_arguments_raise_binding_errors(call: str, args: tuple[Any, ...], error: type[Exception]) -> None:
    """Bad indexes, unknown UUIDs and foreign handles raise the errors NVML documents."""
    with pytest.raises(error):
        getattr(started("pcie-l4"), call)(*args)


def test_value_types_match_binding() -> None:
    """Names/UUIDs are str, memory/PCI info are the binding's structs, event data has its fields."""
    sim = started("dgx-h100")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(sim.nvmlSystemGetDriverVersion(), str)
    mem = sim.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and mem.total == 81559 * 1024 * 1024
    pci = sim.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert (pci.busId, pci.busIdLegacy, pci.bus) == ("00000000:18:00.0", "0000:18:00.0", 0x18)
    assert sim.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    es = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(h, XID, es)
    sim.inject_xid(sim.nvmlDeviceGetUUID(h), 48)
    data = sim.nvmlEventSetWait(es, 1000)
    assert (data.device, data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId) == (
        h,
        XID,
        48,
        0xFFFFFFFF,
        0xFFFFFFFF,
    )


def test_wait_times_out_without_spinning() -> None:
    """With no event, the wait raises NVMLError_Timeout after its timeout, using little CPU."""
    sim = started("pcie-l4")
    es = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(sim.nvmlDeviceGetHandleByIndex(0), XID, es)
    start, cpu = time.monotonic(), time.thread_time()
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait_v2(es, 300)
    assert time.monotonic() - start >= 0.25
    assert time.thread_time() - cpu < 0.2  # a busy loop would burn the whole 300 ms


def test_wait_wakes_on_injection() -> None:
    """A blocked wait returns the injected event long before its timeout."""
    sim = started("dgx-a100")
    es = sim.nvmlEventSetCreate()
    h = sim.nvmlDeviceGetHandleByIndex(3)
    sim.nvmlDeviceRegisterEvents(h, XID | DBE, es)
    waiter = Waiter(sim, es, 60_000)
    assert wait_until(lambda: waiter.thread.is_alive())
    sim.inject_ecc(sim.gpu_uuids()[3], "double")
    waiter.join()
    assert waiter.error is None and waiter.result.eventType == DBE and waiter.result.device is h
    assert waiter.finished_at - waiter.started_at < 15


def test_injected_failure_wakes_blocked_wait() -> None:
    """fail() on nvmlEventSetWait_v2 reaches a wait already blocked, and repeats until cleared."""
    sim = started("pcie-l4")
    es = sim.nvmlEventSetCreate()
    waiter = Waiter(sim, es, 60_000)
    assert wait_until(lambda: sim.call_count("nvmlEventSetWait_v2") == 1)
    sim.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN)
    waiter.join()
    assert isinstance(waiter.error, pynvml.NVMLError_Unknown)
    with pytest.raises(pynvml.NVMLError_Unknown):
        sim.nvmlEventSetWait_v2(es, 10)
    sim.clear_failures("nvmlEventSetWait_v2")
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait_v2(es, 10)


def test_shutdown_wakes_blocked_wait() -> None:
    """A wait blocked when NVML shuts down raises NVMLError_Uninitialized at once."""
    sim = started("pcie-l4")
    es = sim.nvmlEventSetCreate()
    waiter = Waiter(sim, es, 60_000)
    assert wait_until(lambda: sim.call_count("nvmlEventSetWait_v2") == 1)
    sim.nvmlShutdown()
    waiter.join()
    assert isinstance(waiter.error, pynvml.NVMLError_Uninitialized)


def test_failure_with_count() -> None:
    """fail(name, code, count) raises that code count times, then the function works again."""
    sim = load_simulator("pcie-l4")
    sim.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, count=2)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_LibraryNotFound):
            sim.nvmlInit()
    sim.nvmlInit()
    assert sim.initialized


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("nvmlNoSuchThing", 999), "no NVML function"),
        (("nvmlInit", 0), "non-zero"),
        (("nvmlInit", 999, 0), "count"),
    ],
)
def test_fail_rejects_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    """fail() refuses unknown functions, success codes and non-positive counts."""
    with pytest.raises(ValueError, match=match):
        load_simulator("pcie-l4").fail(*args)


def test_events_follow_registration() -> None:
    """Events reach only the sets that registered that event type on that GPU."""
    sim = started("dgx-h100")
    xid_set, ecc_set = sim.nvmlEventSetCreate(), sim.nvmlEventSetCreate()
    h0 = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceRegisterEvents(h0, XID, xid_set)
    sim.nvmlDeviceRegisterEvents(h0, SBE | DBE, ecc_set)
    uuid0, uuid1 = sim.gpu_uuids()[:2]
    sim.inject_ecc(uuid0, "single")
    sim.inject_xid(uuid1, 31)  # GPU 1 is registered nowhere
    assert sim.nvmlEventSetWait_v2(ecc_set, 0).eventType == SBE
    for es in (xid_set, ecc_set):
        with pytest.raises(pynvml.NVMLError_Timeout):
            sim.nvmlEventSetWait_v2(es, 0)


def test_mig_xid_carries_instance_ids() -> None:
    """An XID injected on a MIG UUID arrives on the parent GPU with that instance's GI/CI ids."""
    sim = started("mig-a100")
    es = sim.nvmlEventSetCreate()
    parent = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceRegisterEvents(parent, XID, es)
    mig_uuid = sim.mig_uuids(0)[2]
    mig_handle = sim.nvmlDeviceGetHandleByUUID(mig_uuid)
    sim.inject_xid(mig_uuid, 43)
    data = sim.nvmlEventSetWait_v2(es, 1000)
    assert data.device is parent
    assert (data.gpuInstanceId, data.computeInstanceId) == (
        sim.nvmlDeviceGetGpuInstanceId(mig_handle),
        sim.nvmlDeviceGetComputeInstanceId(mig_handle),
    )


def test_lose_and_restore() -> None:
    """A lost GPU raises GpuIsLost on its handle and lookups, sends XID 79, and comes back on restore."""
    sim = started("dgx-h100")
    es = sim.nvmlEventSetCreate()
    h = sim.nvmlDeviceGetHandleByIndex(5)
    sim.nvmlDeviceRegisterEvents(h, XID, es)
    uuid = sim.nvmlDeviceGetUUID(h)
    sim.lose(uuid)
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (sim.nvmlDeviceGetUUID, (h,)),
        (sim.nvmlDeviceGetMemoryInfo, (h,)),
        (sim.nvmlDeviceGetHandleByIndex, (5,)),
        (sim.nvmlDeviceGetHandleByUUID, (uuid,)),
    ]
    for call, args in calls:
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(*args)
    assert sim.nvmlDeviceGetCount() == 8
    data = sim.nvmlEventSetWait_v2(es, 1000)
    assert (data.device, data.eventData) == (h, 79)
    sim.restore(uuid)
    assert sim.nvmlDeviceGetUUID(h) == uuid
    assert sim.nvmlDeviceGetHandleByIndex(5) is h


def test_reset_clears_pending_memory_repairs() -> None:
    """Pending page retirement and row remapping show up in NVML and a reset clears them."""
    sim = started("dgx-a100")
    uuid = sim.gpu_uuids()[1]
    h = sim.nvmlDeviceGetHandleByUUID(uuid)
    sim.set_pending_retirement(uuid, True)
    sim.set_remapped_rows_pending(uuid, True)
    assert sim.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED
    assert sim.nvmlDeviceGetRemappedRows(h)[2] == 1
    sim.reset(uuid)
    assert sim.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_DISABLED
    assert sim.nvmlDeviceGetRemappedRows(h)[2] == 0


def test_fault_api_rejects_unknown_and_mig_uuids() -> None:
    """Fault injection names the problem for an unknown UUID or a MIG UUID where a GPU is needed."""
    sim = started("mig-a100")
    with pytest.raises(ValueError, match="no GPU or MIG device"):
        sim.inject_xid("GPU-nope", 48)
    with pytest.raises(ValueError, match="needs a GPU UUID"):
        sim.lose(sim.mig_uuids(0)[0])
    with pytest.raises(ValueError, match="'single' or 'double'"):
        sim.inject_ecc(sim.gpu_uuids()[0], "triple")


def test_set_mig_layout() -> None:
    """A MIG reconfiguration replaces the instances (old handles go stale) with deterministic UUIDs."""
    sims = [started("mig-a100"), started("mig-a100")]
    old = sims[0].nvmlDeviceGetHandleByUUID(sims[0].mig_uuids(3)[0])
    new_uuids = [s.set_mig_layout(3, ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]) for s in sims]
    assert new_uuids[0] == new_uuids[1] and len(new_uuids[0]) == 4
    sim = sims[0]
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetUUID(old)
    parent = sim.nvmlDeviceGetHandleByIndex(3)
    names = [sim.nvmlDeviceGetName(sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)) for j in range(4)]
    assert [n.split(" MIG ")[1] for n in names] == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    again = sim.set_mig_layout(3, ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"])
    assert again != new_uuids[0]  # re-created instances get new UUIDs
    # Enable on a full GPU, then disable.
    assert len(sim.set_mig_layout(5, ["7g.80gb"])) == 1
    assert sim.nvmlDeviceGetMigMode(sim.nvmlDeviceGetHandleByIndex(5))[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    assert sim.set_mig_layout(5, None) == []
    assert sim.nvmlDeviceGetMigMode(sim.nvmlDeviceGetHandleByIndex(5))[0] == pynvml.NVML_DEVICE_MIG_DISABLE


@pytest.mark.parametrize(
    ("profile", "gpu", "layout", "match"),
    [
        ("mig-a100", 0, ["3g.40gb", "3g.40gb", "1g.10gb"], "does not fit"),
        ("mig-a100", 0, ["1g.10gb+me", "1g.10gb+me"], "does not fit"),
        ("mig-a100", 0, ["9g.90gb"], "unknown MIG profile"),
        ("mig-a100", 8, ["1g.10gb"], "no GPU with index"),
        ("pcie-l4", 0, ["1g.10gb"], "not MIG-capable"),
    ],
)
def test_set_mig_layout_rejects_invalid(profile: str, gpu: int, layout: list[str], match: str) -> None:
    """Layouts that a real GPU would refuse are refused with the reason."""
    with pytest.raises(ValueError, match=match):
        load_simulator(profile).set_mig_layout(gpu, layout)


def test_l4_has_no_mig_or_nvlink() -> None:
    """MIG and NVLink calls on an L4 raise NotSupported, as on the real card."""
    sim = started("pcie-l4")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (sim.nvmlDeviceGetMigMode, (h,)),
        (sim.nvmlDeviceGetMaxMigDeviceCount, (h,)),
        (sim.nvmlDeviceGetNvLinkState, (h, 0)),
    ]
    for call, args in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(*args)


def test_custom_description_defaults(tmp_path: Path) -> None:
    """A YAML path loads; default ancestors, direct NVLinks and support switches apply."""
    sim = load_simulator(write(tmp_path, MINIMAL))
    sim.nvmlInit()
    h0, h1 = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    assert sim.nvmlDeviceGetTopologyCommonAncestor(h0, h1) == pynvml.NVML_TOPOLOGY_NODE
    assert sim.nvmlDeviceGetNvLinkRemotePciInfo(h0, 3).busId == "00000000:08:00.0"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetNvLinkState(h0, 4)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetNumaNodeId(h1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceRegisterEvents(h1, XID | DBE, sim.nvmlEventSetCreate())
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetRetiredPagesPendingStatus(h1)
    assert sim.nvmlDeviceGetSupportedEventTypes(h1) == XID


def test_mig_devices_without_placement_are_placed(tmp_path: Path) -> None:
    """MIG devices listed without placement, GI ids or UUIDs get valid, deterministic ones."""
    text = MINIMAL.replace(
        "    compute_capability: [8, 0]\n",
        "    compute_capability: [8, 0]\n    mig:\n      devices: [{profile: 4g.40gb}, {profile: 3g.40gb}]\n",
        1,
    )
    path = write(tmp_path, text)
    a, b = load_simulator(path), load_simulator(path)
    assert a.mig_uuids(0) == b.mig_uuids(0) and len(a.mig_uuids(0)) == 2
    a.nvmlInit()
    m = a.nvmlDeviceGetHandleByUUID(a.mig_uuids(0)[1])
    assert a.nvmlDeviceGetGpuInstanceId(m) == 2  # 3g.40gb placed on the upper half


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('driver_version: "550.54.15"', "driver_version: [", "line"),
        ('driver_version: "550.54.15"\n', "", "driver_version"),
        ("    uuid: GPU-00000000-0000-0000-0000-000000000002", "    uuid: GPU-1234", "gpus[1].uuid"),
        ("    minor: 1", "    minor: 0", "gpus[1].minor"),
        ('    pci_bus_id: "0000:08:00.0"', '    pci_bus_id: "08:00"', "gpus[1].pci_bus_id"),
        ("    memory_mib: 23034", "    memory_mib: lots", "gpus[1].memory_mib"),
        ("    compute_capability: [8, 9]", "    compute_capability: [8]", "gpus[1].compute_capability"),
        ("  default_ancestor: NODE\n", "", "topology.ancestors"),
        ("  default_ancestor: NODE", "  default_ancestor: NEAR", "topology.default_ancestor"),
        ("  nvlinks: [[0, 1, 4]]", "  nvlinks: [[0, 2, 4]]", "topology.nvlinks[0][1]"),
        ("  nvlinks: [[0, 1, 4]]", "  nvlinks: [[0, 1, 40]]", "topology"),
        ("gpus:", "colour: blue\ngpus:", "colour"),
        (
            "    numa_node: null",
            "    numa_node: null\n    mig: {devices: [{profile: 1g.10gb}]}",
            "gpus[1].mig.enabled",
        ),
        (
            "    numa_node: 0",
            "    numa_node: 0\n    mig: {devices: [{profile: 1g.5gb}]}",
            "gpus[0].mig.devices[0].profile",
        ),
        (
            "    numa_node: 0",
            "    numa_node: 0\n    mig: {devices: [{profile: 3g.40gb}, {profile: 3g.40gb}, {profile: 2g.20gb}]}",
            "gpus[0].mig.devices",
        ),
        (
            "    numa_node: 0",
            "    numa_node: 0\n    mig: {devices: [{profile: 2g.20gb, placement: 1}]}",
            "gpus[0].mig.devices",
        ),
        (
            "topology:",
            "faults: {lost: [GPU-00000000-0000-0000-0000-000000000009]}\ntopology:",
            "faults.lost[0]",
        ),
    ],
)
def test_bad_description_is_a_clear_error(tmp_path: Path, old: str, new: str, key: str) -> None:
    """A broken node description raises SimulatorConfigError naming the file, the key and why."""
    assert old in MINIMAL
    path = write(tmp_path, MINIMAL.replace(old, new, 1))
    with pytest.raises(SimulatorConfigError) as info:
        load_simulator(path)
    err = info.value
    assert err.file == path
    assert err.key.startswith(key), err
    assert err.reason and str(err).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("arg", "key"), [("no-such-profile", "(profile)"), ("/nonexistent/node.yaml", "(file)")]
)
def test_unknown_profile_or_missing_file(arg: str, key: str) -> None:
    """An unknown profile name or a missing file is a SimulatorConfigError, not a traceback."""
    with pytest.raises(SimulatorConfigError) as info:
        load_simulator(arg)
    assert info.value.key == key


def test_empty_description(tmp_path: Path) -> None:
    """An empty file is reported as empty."""
    with pytest.raises(SimulatorConfigError, match="empty"):
        load_simulator(write(tmp_path, "# nothing\n"))


def test_initial_faults(tmp_path: Path) -> None:
    """faults: in the description set the state the node starts in."""
    text = MINIMAL + (
        "faults:\n  lost: [GPU-00000000-0000-0000-0000-000000000002]\n"
        "  pending_retirement: [GPU-00000000-0000-0000-0000-000000000001]\n"
    )
    sim = load_simulator(write(tmp_path, text))
    sim.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetHandleByIndex(1)
    assert sim.nvmlDeviceGetRetiredPagesPendingStatus(sim.nvmlDeviceGetHandleByIndex(0)) == 1


def test_concurrent_injection_loses_nothing() -> None:
    """Events injected from another thread while one thread waits all arrive, in order."""
    sim = started("dgx-h100")
    es = sim.nvmlEventSetCreate()
    for i in range(8):
        sim.nvmlDeviceRegisterEvents(sim.nvmlDeviceGetHandleByIndex(i), XID, es)
    received: list[int] = []

    def consume() -> None:
        while len(received) < 200:
            received.append(sim.nvmlEventSetWait_v2(es, 10_000).eventData)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    uuids = sim.gpu_uuids()
    for n in range(200):
        sim.inject_xid(uuids[n % 8], 1000 + n)
    consumer.join(15)
    assert received == [1000 + n for n in range(200)]


def test_compute_mode() -> None:
    """Compute mode can be read and set; the removed exclusive-thread mode is refused."""
    sim = started("pcie-l4")
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_DEFAULT
    sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert sim.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
