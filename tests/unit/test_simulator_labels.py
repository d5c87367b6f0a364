"""The simulator's answers that only the node labels need: PCI class and NVLink fabric (IMEX clique).

They go through the real binding's function names and output structures
(`nvmlDeviceGetPciInfoExt`, `nvmlDeviceGetGpuFabricInfo`, `nvmlDeviceGetGpuFabricInfoV`), which
the caller passes by reference, as with the real library.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pynvml
import pytest

from supervisor.sim.nvml import SimulatorConfigError, load_simulator

ONE_GPU = """
driver_version: "550.54.15"
gpus:
  - name: NVIDIA L4
    uuid: GPU-b7593aaf-27db-5f98-81e3-3c1d6539ac02
    minor: 0
    pci_bus_id: "0000:17:00.0"
    memory_mib: 23034
    compute_capability: [8, 9]
"""


def _one_gpu(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(ONE_GPU + extra)
    return path


def test_fabric_info_reports_the_profiles_clique() -> None:
    """dgx-h100: every GPU is registered (state completed, status success) in cluster 5b3ce1a2-…, clique 1."""
    sim = load_simulator("dgx-h100")
    sim.nvmlInit()
    for i in range(8):
        info = pynvml.c_nvmlGpuFabricInfo_t()
        assert (
            sim.nvmlDeviceGetGpuFabricInfo(sim.nvmlDeviceGetHandleByIndex(i), ctypes.byref(info))
            == pynvml.NVML_SUCCESS
        )
        assert bytes(info.clusterUuid).hex() == "5b3ce1a27d0e4c4f9a512f1d8e6c0b47"
        assert (info.cliqueId, info.state, info.status) == (1, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0)


def test_versioned_fabric_info_checks_the_version() -> None:
    """nvmlDeviceGetGpuFabricInfoV fills a v2 or v3 structure and refuses a wrong version field."""
    sim = load_simulator("dgx-h100")
    sim.nvmlInit()
    h = sim.nvmlDeviceGetHandleByIndex(3)
    for cls in (pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.c_nvmlGpuFabricInfo_v3_t):
        info = cls()
        sim.nvmlDeviceGetGpuFabricInfoV(h, ctypes.pointer(info))
        assert (info.cliqueId, info.state) == (1, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
    bad = pynvml.c_nvmlGpuFabricInfo_v2_t()
    bad.version = pynvml.nvmlGpuFabricInfo_v3
    with pytest.raises(pynvml.NVMLError) as err:
        sim.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(bad))
    assert err.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_no_fabric_is_not_supported() -> None:
    """A GPU without `fabric` in its profile (PCIe L4) answers NotSupported, as a real one does."""
    sim = load_simulator("pcie-l4")
    sim.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetGpuFabricInfo(
            sim.nvmlDeviceGetHandleByIndex(0), ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t())
        )


def test_output_structure_must_be_passed_by_reference() -> None:
    """A structure passed by value (or of the wrong type) is an invalid argument, not silently filled."""
    sim = load_simulator("dgx-h100")
    sim.nvmlInit()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetGpuFabricInfo(h, pynvml.c_nvmlGpuFabricInfo_t())
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(pynvml.c_nvmlMemory_t()))


def test_pci_class_defaults_to_a_3d_controller() -> None:
    """nvmlDeviceGetPciInfoExt: base class 0x03, subclass 0x02 (compute mode) and the GPU's bus id."""
    sim = load_simulator("mig-a100")
    sim.nvmlInit()
    info = pynvml.nvmlPciInfoExt_v1_t()
    info.version = pynvml.nvmlPciInfoExt_v1
    assert sim.nvmlDeviceGetPciInfoExt(sim.nvmlDeviceGetHandleByIndex(2), ctypes.byref(info)) is None
    assert (info.baseClass, info.subClass, info.busId) == (0x03, 0x02, "00000000:47:00.0")


def test_pci_class_from_the_profile(tmp_path: Path) -> None:
    """`pci_class: 0x030000` (a GPU in graphics mode) is what nvmlDeviceGetPciInfoExt reports."""
    path = _one_gpu(tmp_path, "    pci_class: 0x030000\n")
    sim = load_simulator(str(path))
    sim.nvmlInit()
    info = pynvml.nvmlPciInfoExt_v1_t()
    info.version = pynvml.nvmlPciInfoExt_v1
    sim.nvmlDeviceGetPciInfoExt(sim.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert (info.baseClass, info.subClass) == (0x03, 0x00)
    info.version = 0
    with pytest.raises(pynvml.NVMLError) as err:
        sim.nvmlDeviceGetPciInfoExt(sim.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert err.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("    pci_class: 0x1000000\n", "gpus[0].pci_class"),
        ("    pci_class: graphics\n", "gpus[0].pci_class"),
        ("    fabric: {clique_id: 1}\n", "gpus[0].fabric.cluster_uuid"),
        ("    fabric: {cluster_uuid: not-a-uuid, clique_id: 1}\n", "gpus[0].fabric.cluster_uuid"),
        (
            "    fabric: {cluster_uuid: 5b3ce1a2-7d0e-4c4f-9a51-2f1d8e6c0b47, clique_id: -1}\n",
            "gpus[0].fabric.clique_id",
        ),
        (
            "    fabric: {cluster_uuid: 5b3ce1a2-7d0e-4c4f-9a51-2f1d8e6c0b47, clique_id: 1, state: done}\n",
            "gpus[0].fabric.state",
        ),
        (
            "    fabric: {cluster_uuid: 5b3ce1a2-7d0e-4c4f-9a51-2f1d8e6c0b47, clique_id: 1, x: 1}\n",
            "gpus[0].fabric.x",
        ),
    ],
)
def test_bad_label_keys_are_clear_errors(tmp_path: Path, extra: str, key: str) -> None:
    """A bad pci_class or fabric entry names the file, the key and the reason."""
    with pytest.raises(SimulatorConfigError) as err:
        load_simulator(str(_one_gpu(tmp_path, extra)))
    assert err.value.key == key
