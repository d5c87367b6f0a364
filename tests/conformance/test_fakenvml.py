"""The project's fake libnvidia-ml (tests/fakenvml) under the real `nvidia-ml-py` binding.

Each test drives the binding in a child process (`tests.fakenvml.Driver`: one call at a time, so
the test can fault the library between two calls) over a node the simulator describes, and checks
what the library answers: struct versions, MIG, events, and faults at run time. What gpuvisor makes
of these answers is tested in test_realnvml.py (the adapter) and test_realnvml_node.py (the daemon).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from supervisor.sim.nvml import load_simulator
from tests import fakenvml
from tests.fakenvml import Driver, FakeNode

NO_INSTANCE = 0xFFFFFFFF
XID = pynvml.nvmlEventTypeXidCriticalError


@pytest.fixture
def mig_node(fake_nvml_libdir: Path, tmp_path: Path) -> Iterator[tuple[FakeNode, Driver]]:
    """mig-a100 (GPUs 0-3 MIG-enabled) with an initialised binding and an event set on every GPU."""
    node = FakeNode(tmp_path, "mig-a100")
    with Driver(node.environ(fake_nvml_libdir)) as driver:
        driver.eval("pynvml.nvmlInit()")
        driver.eval("open_events()")
        yield node, driver


def test_exports_only_nvml_functions_and_calls_it_lacks_are_function_not_found(
    fake_nvml_libdir: Path, tmp_path: Path
) -> None:
    """Every exported symbol is an NVML function; one the library does not implement is absent, so
    the binding answers FUNCTION_NOT_FOUND, as on an old driver."""
    # Loaded in a child: once a process has loaded it, its soname answers every later dlopen of
    # libnvidia-ml.so.1 there, and this pytest process may go on to the gpu tier's real driver.
    probe = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]);"
        " print(hasattr(lib, 'nvmlEventSetWait_v2'), hasattr(lib, 'fake_enter'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(fake_nvml_libdir / fakenvml.SONAME)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert proc.stdout.split() == ["True", "False"]
    node = FakeNode(tmp_path, "pcie-l4")
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        assert d.code("pynvml.nvmlDeviceGetPowerUsage(gpu(0))") == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


def test_calls_before_init_are_uninitialized_and_init_counts(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """Before nvmlInit every call answers UNINITIALIZED; init/shutdown are counted, so a second
    shutdown after one init is UNINITIALIZED again."""
    node = FakeNode(tmp_path, "pcie-l4")
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml._LoadNvmlLibrary()")
        assert d.code("pynvml.nvmlDeviceGetCount()") == pynvml.NVML_ERROR_UNINITIALIZED
        d.eval("pynvml.nvmlInit()")
        d.eval("pynvml.nvmlInit()")
        d.eval("pynvml.nvmlShutdown()")
        assert d.eval("pynvml.nvmlDeviceGetCount()") == 4
        d.eval("pynvml.nvmlShutdown()")
        assert d.code("pynvml.nvmlDeviceGetCount()") == pynvml.NVML_ERROR_UNINITIALIZED


def test_system_versions_and_error_strings(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """Driver, NVML and CUDA versions come from the description; error strings read as the binding's."""
    node = FakeNode(tmp_path, "dgx-h100")
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        assert d.eval("pynvml.nvmlSystemGetDriverVersion()") == node.spec.driver_version
        assert d.eval("pynvml.nvmlSystemGetNVMLVersion()") == node.spec.nvml_version_text
        assert d.eval("pynvml.nvmlSystemGetCudaDriverVersion()") == node.spec.cuda_driver_version
        assert d.eval("pynvml.nvmlSystemGetCudaDriverVersion_v2()") == node.spec.cuda_driver_version
        assert d.eval("pynvml.nvmlErrorString(15)") == "GPU is lost"
        assert d.eval("str(pynvml.NVMLError(27))") == "Not ready"


def test_versioned_structs_are_checked_and_filled_as_the_driver_lays_them_out(
    fake_nvml_libdir: Path, tmp_path: Path
) -> None:
    """Memory in both struct versions, PCI info and PCI info ext, fabric info v1 and V (v2, v3): the
    fields land where the binding's ctypes structs read them, and a wrong `version` is refused."""
    node = FakeNode(tmp_path, "dgx-h100")
    gpu = node.spec.gpus[0]
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        v1 = d.eval("pynvml.nvmlDeviceGetMemoryInfo(gpu(0))")
        v2 = d.eval("pynvml.nvmlDeviceGetMemoryInfo(gpu(0), pynvml.nvmlMemory_v2)")
        assert v1["total"] == v2["total"] == gpu.memory_mib * 2**20 and v2["version"] == pynvml.nvmlMemory_v2
        pci = d.eval("pynvml.nvmlDeviceGetPciInfo(gpu(0))")
        assert (pci["busId"], pci["pciDeviceId"]) == (gpu.pci_bus_id, gpu.pci_device_id)
        ext = (
            "[i := pynvml.nvmlPciInfoExt_v1_t(), setattr(i, 'version', {v}),"
            " pynvml.nvmlDeviceGetPciInfoExt(gpu(0), ctypes.byref(i)), i][-1]"
        )
        info = d.eval(ext.format(v="pynvml.nvmlPciInfoExt_v1"))
        assert (info["baseClass"] << 16 | info["subClass"] << 8, info["busId"]) == (
            gpu.pci_class,
            gpu.pci_bus_id,
        )
        assert d.code(ext.format(v="1")) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        fabric = (
            "[i := pynvml.{s}(), setattr(i, 'version', {v}),"
            " pynvml.{f}(gpu(0), ctypes.byref(i)), (bytes(i.clusterUuid).hex(), i.cliqueId, i.state)][-1]"
        )
        assert gpu.fabric is not None
        want = [gpu.fabric.cluster_uuid.replace("-", ""), gpu.fabric.clique_id, gpu.fabric.state]
        for struct, version, function in (
            ("c_nvmlGpuFabricInfo_t", "0", "nvmlDeviceGetGpuFabricInfo"),
            ("c_nvmlGpuFabricInfo_v2_t", "pynvml.nvmlGpuFabricInfo_v2", "nvmlDeviceGetGpuFabricInfoV"),
            ("c_nvmlGpuFabricInfo_v3_t", "pynvml.nvmlGpuFabricInfo_v3", "nvmlDeviceGetGpuFabricInfoV"),
        ):
            assert d.eval(fabric.format(s=struct, v=version, f=function)) == want, struct
        bad = fabric.format(s="c_nvmlGpuFabricInfo_v3_t", v="7", f="nvmlDeviceGetGpuFabricInfoV")
        assert d.code(bad) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_addressing_mode_answers_as_the_simulator(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """nvmlDeviceGetAddressingMode: ATS on the coherent-memory node (gh200) as the simulator answers,
    NOT_SUPPORTED where the description gives none (as NVML on a PCIe x86 node), and a struct of
    another `version` refused with ARGUMENT_VERSION_MISMATCH, as the driver checks it."""
    sim = load_simulator("gh200")
    sim.nvmlInit()
    want = sim.nvmlDeviceGetAddressingMode(sim.nvmlDeviceGetHandleByIndex(0))
    assert want == pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
    (tmp_path / "gh200").mkdir()
    (tmp_path / "h100").mkdir()
    node = FakeNode(tmp_path / "gh200", "gh200")
    raw = (
        "[m := pynvml.c_nvmlDeviceAddressingMode_t(), setattr(m, 'version', {v}),"
        " pynvml._nvmlCheckReturn(pynvml._nvmlGetFunctionPointer('nvmlDeviceGetAddressingMode')"
        "(gpu(0), ctypes.byref(m))), m.value][-1]"
    )
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        assert d.eval("pynvml.nvmlDeviceGetAddressingMode(gpu(0))") == want
        assert d.eval(raw.format(v="pynvml.nvmlDeviceAddressingMode_v1")) == want
        assert d.code(raw.format(v="1")) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    plain = FakeNode(tmp_path / "h100", "dgx-h100")
    with Driver(plain.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        assert d.code("pynvml.nvmlDeviceGetAddressingMode(gpu(0))") == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_mig_devices_gpu_and_compute_instances_are_complete(
    mig_node: tuple[FakeNode, Driver],
) -> None:
    """On a MIG GPU: MIG handles and their parent, GI/CI ids, the GI's info and profile, the
    possible placements, the GPU instances of a profile, and the compute instance spanning each GI."""
    node, d = mig_node
    gpu = node.spec.gpus[0]
    catalogue = gpu.catalogue
    assert catalogue is not None
    assert d.eval("pynvml.nvmlDeviceGetMigMode(gpu(0))") == [1, 1]
    assert d.eval("pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(0))") == 7
    for j, mig in enumerate(gpu.mig):
        profile = catalogue[mig.profile]
        mh = f"pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), {j})"
        assert d.eval(f"pynvml.nvmlDeviceGetUUID({mh})") == mig.uuid
        assert d.eval(f"pynvml.nvmlDeviceIsMigDeviceHandle({mh})") == 1
        parent = f"pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle({mh})"
        assert d.eval(f"pynvml.nvmlDeviceGetUUID({parent})") == gpu.uuid
        assert d.eval(f"pynvml.nvmlDeviceGetGpuInstanceId({mh})") == mig.gi
        assert d.eval(f"pynvml.nvmlDeviceGetComputeInstanceId({mh})") == mig.ci
        gi = f"pynvml.nvmlDeviceGetGpuInstanceById(gpu(0), {mig.gi})"
        info = d.eval(f"pynvml.nvmlGpuInstanceGetInfo({gi})")
        assert (info["id"], info["profileId"]) == (mig.gi, profile.profile_id)
        assert info["placement"] == {"start": mig.placement, "size": profile.memory_slices}
        ci_enum = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[profile.compute_slices]
        ci_prof = d.eval(f"pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo({gi}, {ci_enum}, 0)")
        assert (ci_prof["sliceCount"], ci_prof["name"]) == (profile.compute_slices, f"MIG {mig.profile}")
        ci = d.eval(
            f"pynvml.nvmlComputeInstanceGetInfo(pynvml.nvmlGpuInstanceGetComputeInstanceById({gi}, 0))"
        )
        assert (ci["id"], ci["profileId"], ci["placement"]) == (
            0, ci_enum, {"start": 0, "size": profile.compute_slices}
        )  # fmt: skip
        attrs = d.eval(f"pynvml.nvmlDeviceGetAttributes({mh})")
        assert (attrs["memorySizeMB"], attrs["multiprocessorCount"]) == (
            profile.memory_mib,
            profile.multiprocessors,
        )
    assert d.code("pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), 6)") == pynvml.NVML_ERROR_NOT_FOUND
    one_g = catalogue["1g.10gb"]
    places = (
        "[c := ctypes.c_uint(8), p := (pynvml.c_nvmlGpuInstancePlacement_t * 8)(),"
        f" pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(0), {one_g.profile_id}, p, ctypes.byref(c)),"
        " [x.start for x in p[: c.value]]][-1]"
    )
    assert d.eval(places) == list(one_g.starts)
    instances = (
        "[c := ctypes.c_uint(7), a := (pynvml.c_nvmlGpuInstance_t * 7)(),"
        f" pynvml.nvmlDeviceGetGpuInstances(gpu(0), {one_g.profile_id}, a, ctypes.byref(c)),"
        " sorted(pynvml.nvmlGpuInstanceGetInfo(a[k]).id for k in range(c.value))][-1]"
    )
    assert d.eval(instances) == sorted(m.gi for m in gpu.mig if m.profile == "1g.10gb")
    # A GPU with MIG off answers MIG mode but has no instances; a non-MIG call on a MIG handle is refused.
    assert d.eval("pynvml.nvmlDeviceGetMigMode(gpu(4))") == [0, 0]
    assert d.code("pynvml.nvmlDeviceGetGpuInstanceById(gpu(4), 1)") == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (
        d.code(f"pynvml.nvmlDeviceGetMinorNumber(dev('{gpu.mig[0].uuid}'))")
        == pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_gpu_without_mig_answers_not_supported(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """An L4 is not MIG-capable: MIG mode and the MIG calls answer NOT_SUPPORTED."""
    node = FakeNode(tmp_path, "pcie-l4")
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        for call in ("nvmlDeviceGetMigMode(gpu(0))", "nvmlDeviceGetMaxMigDeviceCount(gpu(0))"):
            assert d.code(f"pynvml.{call}") == pynvml.NVML_ERROR_NOT_SUPPORTED, call


def test_xid_and_ecc_on_mig_devices_carry_their_instance_ids(mig_node: tuple[FakeNode, Driver]) -> None:
    """An XID or ECC event on a MIG device names the physical GPU and the device's GI/CI ids, in
    both wait versions; one on a GPU without MIG names no instance."""
    node, d = mig_node
    gpu = node.spec.gpus[2]
    mig = gpu.mig[3]
    node.control.inject_xid(mig.uuid, 43)
    assert d.eval("wait(5000)") == {
        "uuid": gpu.uuid, "eventType": XID, "eventData": 43,
        "gpuInstanceId": mig.gi, "computeInstanceId": mig.ci,
    }  # fmt: skip
    node.control.inject_ecc(mig.uuid, "double")
    event = d.eval("wait(5000, version=1)")
    assert (event["eventType"], event["gpuInstanceId"]) == (pynvml.nvmlEventTypeDoubleBitEccError, mig.gi)
    plain = node.spec.gpus[5]
    node.control.inject_ecc(plain.uuid, "single")
    event = d.eval("wait(5000)")
    assert (event["uuid"], event["eventType"], event["gpuInstanceId"], event["computeInstanceId"]) == (
        plain.uuid, pynvml.nvmlEventTypeSingleBitEccError, NO_INSTANCE, NO_INSTANCE
    )  # fmt: skip


def test_a_blocked_wait_wakes_at_once_for_an_injected_event(mig_node: tuple[FakeNode, Driver]) -> None:
    """A wait already blocked when the fault is written returns it well before its timeout: the
    library is woken by the control file, it does not poll at an interval."""
    node, d = mig_node
    d.start("wait(20000)")
    time.sleep(0.3)  # let the child block in the wait (the point of this test)
    start = time.monotonic()
    node.control.inject_xid(node.spec.gpus[6].uuid, 94)
    d.answer(timeout=30)
    assert time.monotonic() - start < 5


def test_a_lost_gpu_answers_gpu_is_lost_from_the_next_call_until_restored(
    mig_node: tuple[FakeNode, Driver],
) -> None:
    """Lost: the next call on the GPU (or one of its MIG devices) answers GPU_IS_LOST, its handle by
    index too, and an XID 79 arrives; the other GPUs answer; restored, it answers again."""
    node, d = mig_node
    gpu = node.spec.gpus[1]
    node.control.lose(gpu.uuid)
    for call in (
        "pynvml.nvmlDeviceGetMemoryInfo(gpu(1))",
        f"pynvml.nvmlDeviceGetUUID(dev('{gpu.mig[0].uuid}'))",
        f"pynvml.nvmlDeviceGetHandleByUUID('{gpu.uuid}')",
    ):
        assert d.code(call) == pynvml.NVML_ERROR_GPU_IS_LOST, call
    assert d.eval("pynvml.nvmlDeviceGetMemoryInfo(gpu(2))")["total"] > 0
    assert d.eval("wait(5000)")["eventData"] == 79
    node.control.restore(gpu.uuid)
    assert d.eval("pynvml.nvmlDeviceGetUUID(gpu(1))") == gpu.uuid


def test_remapped_rows_and_retired_pages_follow_the_control_file(mig_node: tuple[FakeNode, Driver]) -> None:
    """Pending retirement, pending remapping (an uncorrectable row counted) and a failed remapping
    show in the next query; a reset clears what a reset clears, not a failed remapping."""
    node, d = mig_node
    uuid = node.spec.gpus[7].uuid
    node.control.set_pending_retirement(uuid)
    node.control.set_remapped_rows_pending(uuid)
    node.control.set_row_remap_failure(uuid)
    assert d.eval("pynvml.nvmlDeviceGetRetiredPagesPendingStatus(gpu(7))") == 1
    assert d.eval("pynvml.nvmlDeviceGetRemappedRows(gpu(7))") == [0, 1, 1, 1]
    node.control.reset(uuid)
    assert d.eval("pynvml.nvmlDeviceGetRetiredPagesPendingStatus(gpu(7))") == 0
    assert d.eval("pynvml.nvmlDeviceGetRemappedRows(gpu(7))") == [0, 1, 0, 1]


def test_a_failing_event_wait_fails_a_blocked_wait_then_clears(mig_node: tuple[FakeNode, Driver]) -> None:
    """`fail nvmlEventSetWait_v2` ends a wait already blocked with the code; a count limits it; once
    cleared, waits time out again."""
    node, d = mig_node
    d.start("wait(20000)")
    time.sleep(0.3)  # the wait is blocked before the fault arrives (the point of this test)
    node.control.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN)
    assert d.code(timeout=30) == pynvml.NVML_ERROR_UNKNOWN
    assert d.code("wait(10)") == pynvml.NVML_ERROR_UNKNOWN
    node.control.clear_failures("nvmlEventSetWait_v2")
    assert d.code("wait(10)") == pynvml.NVML_ERROR_TIMEOUT
    node.control.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_GPU_IS_LOST, count=2)
    assert [d.code("wait(10)") for _ in range(3)] == [15, 15, pynvml.NVML_ERROR_TIMEOUT]


def test_init_failing_then_cleared(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """With the driver "not loaded", nvmlInit fails with DRIVER_NOT_LOADED, in a process started
    after the fault too; cleared, the next nvmlInit succeeds."""
    node = FakeNode(tmp_path, "pcie-l4")
    node.control.fail_init()
    with Driver(node.environ(fake_nvml_libdir)) as d:
        assert d.code("pynvml.nvmlInit()") == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        node.control.clear_failures()
        assert d.code("pynvml.nvmlInit()") == 0
        assert d.eval("pynvml.nvmlDeviceGetCount()") == 4


def test_a_bad_node_file_fails_init_naming_the_line(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """A node file the library cannot read fails nvmlInit with UNKNOWN and says file, line and why
    on stderr; a bad control line is reported and skipped, the next ones still apply."""
    node = FakeNode(tmp_path, "pcie-l4")
    text = node.node_file.read_text().replace("minor 2\n", "minor two\n")
    node.node_file.write_text(text)
    line = text.splitlines().index("minor two") + 1
    with Driver(node.environ(fake_nvml_libdir)) as d:
        assert d.code("pynvml.nvmlInit()") == pynvml.NVML_ERROR_UNKNOWN
    assert f"{node.node_file}:{line}: a field is not a number" in d.stderr

    (tmp_path / "good").mkdir()
    good = FakeNode(tmp_path / "good", "pcie-l4")
    with Driver(good.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        good.control.send("explode GPU-0")
        good.control.lose(good.spec.gpus[0].uuid)
        assert d.code("pynvml.nvmlDeviceGetCount()") == 0
        assert d.code("gpu(0)") == pynvml.NVML_ERROR_GPU_IS_LOST
    assert f"{good.control.path}:1: unknown command (line skipped)" in d.stderr


def test_a_control_line_longer_than_the_buffer_is_skipped_whole(
    fake_nvml_libdir: Path, tmp_path: Path
) -> None:
    """The control file is read through a 4 KiB buffer: a line of 10,005 characters, appended in
    two parts with an NVML call between them (so its end comes in a later read), is reported once,
    as line 1, and skipped to its newline: no piece of it is read as a command, the next line is
    line 2 (a bad command, reported as such), and the one after it still applies."""
    node = FakeNode(tmp_path, "pcie-l4")
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        with open(node.control.path, "a", encoding="ascii") as fh:
            fh.write("lose " + "x" * 5_000)
        assert d.eval("pynvml.nvmlDeviceGetCount()") == 4  # reads the first part, no newline yet
        with open(node.control.path, "a", encoding="ascii") as fh:
            fh.write("x" * 5_000 + "\n")
        node.control.send("explode GPU-0")
        node.control.lose(node.spec.gpus[0].uuid)
        assert d.code("gpu(0)") == pynvml.NVML_ERROR_GPU_IS_LOST
    skipped = [line for line in d.stderr.splitlines() if "(line skipped)" in line]
    assert skipped == [
        f"fakenvml: {node.control.path}:1: a line of 4095 characters or more (line skipped)",
        f"fakenvml: {node.control.path}:2: unknown command (line skipped)",
    ], skipped


def test_a_line_of_4094_characters_still_applies(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """The longest line the buffer holds (4094 characters and its newline) is read as a command:
    a `lose` padded with spaces to that length loses the GPU, and nothing is reported."""
    node = FakeNode(tmp_path, "pcie-l4")
    command = f"lose {node.spec.gpus[0].uuid}"
    with Driver(node.environ(fake_nvml_libdir)) as d:
        d.eval("pynvml.nvmlInit()")
        node.control.send(command + " " * (4094 - len(command)))
        assert d.code("gpu(0)") == pynvml.NVML_ERROR_GPU_IS_LOST
    assert "(line skipped)" not in d.stderr


def test_environ_puts_a_tests_path_then_the_checkout_then_the_callers_path() -> None:
    """fakenvml.environ's PYTHONPATH: the test's own folders first (an older pynvml), then the
    checkout, then what the calling environment's PYTHONPATH held (packages carried beside the
    checkout), with the checkout not named twice."""
    from tests.helpers import REPO

    env = fakenvml.environ(
        None, base={"PYTHONPATH": os.pathsep.join(["/a", REPO, "/b"])}, pythonpath=["/old"]
    )
    assert env["PYTHONPATH"].split(os.pathsep) == ["/old", REPO, "/a", "/b"]


def test_no_node_file_is_driver_not_loaded(fake_nvml_libdir: Path) -> None:
    """Loaded without FAKENVML_NODE, the library describes no GPU: nvmlInit answers DRIVER_NOT_LOADED."""
    env = fakenvml.environ(fake_nvml_libdir)
    proc = subprocess.run(
        [sys.executable, "-c", "import pynvml\ntry:\n pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n print(e.value)"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert proc.stdout.strip() == str(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert "FAKENVML_NODE names no node file" in proc.stderr


def test_gpuvisors_own_fabric_structs_are_laid_out_as_nvml_h(tmp_path: Path) -> None:
    """gpuvisor's FabricInfo / FabricInfoV2 (used instead of old bindings' wrong ones) have nvml.h's
    size and field offsets, as the system C compiler lays out NVIDIA's header."""
    from supervisor.node.facts import FABRIC_INFO_V2, FabricInfo, FabricInfoV2

    cc, headers = fakenvml.compiler(), fakenvml.header_dir()
    if cc is None or headers is None:
        pytest.skip(fakenvml.skip_reason() or "no compiler")
    program = tmp_path / "layout.c"
    fields = {"nvmlGpuFabricInfo_t": FabricInfo, "nvmlGpuFabricInfo_v2_t": FabricInfoV2}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <nvml.h>", "int main(void) {"]
    for ctype, struct in fields.items():
        lines.append(f'printf("{ctype} %zu\\n", sizeof({ctype}));')
        for name, *_ in struct._fields_:
            lines.append(f'printf("{ctype}.{name} %zu\\n", offsetof({ctype}, {name}));')
    lines.append('printf("version %u\\n", (unsigned)nvmlGpuFabricInfo_v2);')
    program.write_text("\n".join([*lines, "return 0; }"]) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{headers}", "-o", str(exe), str(program)], check=True, timeout=120)
    got = dict(line.rsplit(" ", 1) for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True, timeout=30
    ).stdout.splitlines())  # fmt: skip
    want = {"version": str(FABRIC_INFO_V2)}
    for ctype, struct in fields.items():
        want[ctype] = str(ctypes.sizeof(struct))
        for name, *_ in struct._fields_:
            want[f"{ctype}.{name}"] = str(getattr(struct, name).offset)
    assert got == want
