"""The MPS layout and settings (supervisor/mps/layout.py, supervisor/mps/daemons.py's checks): where the control binary is found, what a plan asks of its daemon, and what is refused before any daemon starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supervisor.mps import daemons as mps
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.mpsfake import RESOURCE, Recorder, cfg, manager, mps_plans


def test_settings_follow_replica_counts(tmp_path: Path) -> None:
    """Pinned-memory limits are per GPU from that GPU's replicas; the thread share is 100 / the largest count."""
    plan = mps_plans(tmp_path)[RESOURCE]
    settings = mps.daemon_settings(plan)
    memory = nodes.pcie_l4().gpus[0].memory_mib
    assert settings.pinned_limits == ((0, memory // 2), (1, memory // 4))
    assert settings.thread_percentage == 25
    assert settings.commands() == [
        f"set_default_device_pinned_mem_limit 0 {memory // 2}M",
        f"set_default_device_pinned_mem_limit 1 {memory // 4}M",
        "set_default_active_thread_percentage 25",
    ]
    even = mps.daemon_settings(
        mps_plans(tmp_path, "sharing: {mps: {resources: [{name: gpu, replicas: 3}]}}")["nvidia.com/gpu"]
    )
    assert even.thread_percentage == 33 and len(even.pinned_limits) == 4
    assert even.gpu_uuids == tuple(g.uuid for g in nodes.pcie_l4().gpus)


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    """A missing control binary fails set_plans with where it looked and how to fix it; non-MPS plans need none."""
    daemons = mps.MpsDaemons(
        Recorder(), environ={"PATH": str(tmp_path / "empty")}, driver_root=str(tmp_path / "drv")
    )
    with pytest.raises(mps.MpsError) as err:
        daemons.set_plans(mps_plans(tmp_path / "mps"))
    text = str(err.value)
    assert text.startswith(
        "MPS sharing needs the CUDA MPS control binary nvidia-cuda-mps-control, but it is neither on PATH"
    )
    assert f"{tmp_path}/drv/usr/bin/nvidia-cuda-mps-control" in text and "--mps-control-binary" in text
    daemons.set_plans(plan_resources(nodes.pcie_l4(), cfg()))  # no MPS: fine
    with pytest.raises(
        mps.MpsError, match=r"^MPS sharing needs the CUDA MPS control binary, but /nope/x does not exist"
    ):
        mps.MpsDaemons(Recorder(), binary="/nope/x").set_plans(mps_plans(tmp_path / "mps"))


def test_binary_found_on_path_or_under_driver_root(tmp_path: Path, fake: Path) -> None:
    """The bare name is looked up on PATH first, then in the driver root's bin directories."""
    assert mps.find_control_binary(path=str(fake.parent)) == str(fake)
    driver = tmp_path / "driver"
    (driver / "usr" / "bin").mkdir(parents=True)
    target = driver / "usr" / "bin" / "nvidia-cuda-mps-control"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    assert mps.find_control_binary(driver_root=str(driver), path=str(tmp_path / "empty")) == str(target)


def test_mps_plan_without_root_is_refused(tmp_path: Path, fake: Path) -> None:
    """A hand-made MPS plan with no MPS root is refused before anything starts."""
    plan = mps_plans(tmp_path / "mps")[RESOURCE]
    broken = dataclasses.replace(plan, allocate=dataclasses.replace(plan.allocate, mps_root=""))
    with pytest.raises(
        mps.MpsError, match=r"^resource nvidia.com/gpu-mps is shared with MPS but has no MPS root"
    ):
        manager(fake, Recorder()).set_plans({RESOURCE: broken})
