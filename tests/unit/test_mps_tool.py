"""The compute mode an MPS control daemon's GPUs are put in (supervisor/mps/tool.py
`ControlTool.set_compute_mode`), on the NVML simulator's mig-a100 node."""

from __future__ import annotations

import pynvml
import pytest

from supervisor.mps.claims import ClaimDaemonSettings
from supervisor.mps.tool import ControlTool
from supervisor.sim.nvml import load_simulator


def test_a_daemon_of_full_gpus_and_mig_devices_sets_the_full_gpus_mode_only() -> None:
    """EXCLUSIVE_PROCESS goes on the full GPU and back to DEFAULT; a MIG device (which NVML gives
    no compute mode: NotSupported) is left alone, as NVIDIA's kubelet plugin sets the mode on the
    daemon's full GPUs only (v0.4.1 sharing.go: `MpsControlDaemon.Start` over its `GpuUUIDs` list)."""
    sim = load_simulator("mig-a100")
    sim.nvmlInit()
    full = sim.nvmlDeviceGetHandleByIndex(4)  # mig-a100: GPUs 4-7 without MIG
    parent = sim.nvmlDeviceGetHandleByIndex(0)
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    uuids = (sim.nvmlDeviceGetUUID(full), sim.nvmlDeviceGetUUID(mig))
    spec = ClaimDaemonSettings("uid", "uid-00000", "/nonexistent", uuids, None, ())
    assert spec.gpu_uuids[1].startswith("MIG-")
    with pytest.raises(pynvml.NVMLError_NotSupported):  # as NVML answers for a MIG device
        sim.nvmlDeviceSetComputeMode(mig, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    tool = ControlTool(
        binary_name="nvidia-cuda-mps-control", driver_root="/", environ={}, nvml_module=sim,
        command_timeout=1.0, quit_timeout=1.0,
    )  # fmt: skip
    assert tool.set_compute_mode(spec, exclusive=True) == ""
    assert sim.nvmlDeviceGetComputeMode(full) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert sim.nvmlDeviceGetComputeMode(parent) == pynvml.NVML_COMPUTEMODE_DEFAULT
    assert tool.set_compute_mode(spec, exclusive=False) == ""
    assert sim.nvmlDeviceGetComputeMode(full) == pynvml.NVML_COMPUTEMODE_DEFAULT
