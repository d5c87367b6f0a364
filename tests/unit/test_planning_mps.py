"""Tests of the planner's MPS checks: MPS root, MIG strategy and MIG GPUs, and the replica limit
that depends on the GPU's compute capability."""

from __future__ import annotations

import dataclasses

import pytest

from common.model import Node
from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.node.planning import PlanningError, mps_max_clients, plan_resources
from tests import nodes


def cfg(text: str = "", **flags: object) -> Config:
    return config_from_data(parse_config_text(text, "test.yaml"), flags=flags, source="test.yaml")


def mps(replicas: int, devices: str = "all") -> str:
    return f"sharing: {{mps: {{resources: [{{name: gpu, devices: {devices}, replicas: {replicas}}}]}}}}"


def with_capability(node: Node, capability: tuple[int, int], indexes: set[int] | None = None) -> Node:
    gpus = tuple(
        dataclasses.replace(g, compute_capability=capability) if indexes is None or g.index in indexes else g
        for g in node.gpus
    )
    return dataclasses.replace(node, gpus=gpus)


@pytest.mark.parametrize(
    ("capability", "limit"),
    [((6, 0), 16), ((7, 0), 16), ((7, 2), 16), ((7, 5), 48), ((8, 0), 48), ((9, 0), 48), ((10, 0), 48)],
)
def test_mps_client_limit_by_compute_capability(capability: tuple[int, int], limit: int) -> None:
    """MPS serves 48 clients per GPU from compute capability 7.5 on, 16 before."""
    assert mps_max_clients(capability) == limit


@pytest.mark.parametrize(
    ("capability", "replicas", "ok"),
    [((8, 9), 48, True), ((8, 9), 49, False), ((7, 0), 16, True), ((7, 0), 17, False), ((7, 5), 48, True)],
)
def test_replica_limit_at_the_boundary(capability: tuple[int, int], replicas: int, ok: bool) -> None:
    """Replicas up to the limit plan; one more is refused with the GPU, its capability, the count and the limit."""
    node = with_capability(nodes.pcie_l4(), capability)
    config = cfg(mps(replicas), mps_root="/run/nvidia/mps")
    if ok:
        plans = plan_resources(node, config)
        assert len(plans["nvidia.com/gpu"].devices) == 4 * replicas
        return
    limit = mps_max_clients(capability)
    major, minor = capability
    with pytest.raises(PlanningError) as err:
        plan_resources(node, config)
    text = str(err.value)
    assert text.startswith(
        f"GPU 0 (NVIDIA L4, compute capability {major}.{minor}) cannot be split into {replicas} MPS replicas "
        f"for nvidia.com/gpu: MPS serves at most {limit} clients per GPU"
    )
    # Every offending GPU is named in one error, so the user fixes them in one go.
    assert all(f"GPU {i} (NVIDIA L4" in text for i in range(4))


def test_limit_is_checked_per_gpu() -> None:
    """Only the GPUs that are both old and over 16 replicas are named; a newer GPU may take more."""
    node = with_capability(nodes.pcie_l4(), (7, 0), indexes={1})
    text = "sharing: {mps: {resources: [{name: gpu, devices: [0, 1], replicas: 20}]}}"
    with pytest.raises(PlanningError) as err:
        plan_resources(node, cfg(text, mps_root="/mps"))
    assert str(err.value).startswith(
        "GPU 1 (NVIDIA L4, compute capability 7.0) cannot be split into 20 MPS replicas"
    )
    assert "GPU 0" not in str(err.value)


def test_time_slicing_has_no_mps_limit() -> None:
    """The MPS client limit does not apply to time-slicing."""
    text = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 100}]}}"
    plans = plan_resources(with_capability(nodes.pcie_l4(), (7, 0)), cfg(text))
    assert len(plans["nvidia.com/gpu"].devices) == 400


def test_missing_mps_root_is_refused() -> None:
    """A Config built without the loader and with MPS but no root gets a planning error naming the setting."""
    config = dataclasses.replace(cfg(mps(2), mps_root="/mps"), mps_root="")
    with pytest.raises(
        PlanningError, match=r"^MPS sharing needs an MPS root: set --mps-root, MPS_ROOT or flags.mpsRoot$"
    ):
        plan_resources(nodes.pcie_l4(), config)


def test_mixed_strategy_is_refused() -> None:
    """MPS with the mixed MIG strategy is refused even when the Config did not come through the loader."""
    config = dataclasses.replace(cfg(mps(2), mps_root="/mps"), mig_strategy="mixed")
    with pytest.raises(PlanningError, match=r"^MPS sharing is not supported with the mixed MIG strategy"):
        plan_resources(nodes.pcie_l4(), config)


def test_mig_enabled_gpu_under_none_is_refused() -> None:
    """Under strategy none a MIG-enabled GPU is a full-GPU device, but MPS still cannot share it."""
    with pytest.raises(PlanningError) as err:
        plan_resources(nodes.mig_a100(), cfg(mps(2, "[0, 5]"), mps_root="/mps"))
    text = str(err.value)
    assert text.startswith(f"GPU 0 ({nodes.mig_a100().gpus[0].uuid}) has MIG mode enabled: MPS cannot share")
    assert "GPU 5" not in text


def test_mig_device_under_single_is_refused() -> None:
    """MIG devices advertised as nvidia.com/gpu by the single strategy cannot be MPS-shared."""
    with pytest.raises(PlanningError, match=r"^MPS sharing is not supported for MIG devices"):
        plan_resources(nodes.mig_uniform(), cfg(mps(2), mig_strategy="single", mps_root="/mps"))


def test_unshared_gpus_beside_mps_are_not_checked() -> None:
    """GPUs left whole beside an MPS resource are neither limited nor refused for MIG mode."""
    plans = plan_resources(nodes.mig_a100(), cfg(mps(4, "[6, 7]"), mps_root="/mps"))
    assert len(plans["nvidia.com/gpu"].devices) == 6 + 8
    assert plans["nvidia.com/gpu"].sharing == "mps"
