"""A GPU shared by memory on the DRA worker's side (worker/dra/memshare.py through the Preparer):
claims whose results carry `consumedCapacity.memory` (and a `shareID`, kubernetes/api v0.34.0
resource/v1/types.go:1560-1580) prepared on a simulated pcie-l4 node, MPS handed to the recording
ClaimMps of tests/unit/test_dra_sharing.py; and the checkpoint's owners of a GPU's shared daemon
(common/dracheckpoint.py `daemon_owners`), which the supervisor's claim daemons keep it for."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from common.dracheckpoint import MEMORY_SHARE, daemon_owners, memory_share_uid, read_claims
from tests import draconfigs as dc
from tests.unit.test_dra_prepare import POOL
from tests.unit.test_dra_sharing import GPUS, Node
from worker.dra.claims import ClaimRef
from worker.dra.memshare import pinned_env


@pytest.fixture
def n(tmp_path: Path) -> Node:
    return Node(tmp_path)


def put(n: Node, name: str, memory: str, device: str = "gpu-0", **change: Any) -> ClaimRef:
    obj = dc.memory_share("default", name, device, memory, POOL)
    for key, value in change.items():
        obj["status"]["allocation"]["devices"]["results"][0][key] = value
    n.store.put(obj)
    return ClaimRef("default", name, obj["metadata"]["uid"])


def env_of(n: Node, ref: ClaimRef) -> tuple[str, ...]:
    return n.preparer.prepare([ref])[ref.uid].edits.env


def test_shares_of_one_gpu_join_its_one_daemon_each_with_its_own_limit(n: Node) -> None:
    """Each claim with a share of gpu-0 asks for the GPU's one daemon (owner memshare-<GPU UUID>,
    that GPU only, no daemon-wide limit) and gets its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, in whole
    MiB for device 0; the checkpoint records the share as the device's sharing."""
    a, b = put(n, "a", "4Gi"), put(n, "b", "1536Mi")
    env_a, env_b = env_of(n, a), env_of(n, b)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M" in env_a
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1536M" in env_b
    owner = memory_share_uid(GPUS[0])
    assert [(uid, gpus) for uid, gpus, _ in n.mps.started] == [(owner, (GPUS[0],)), (owner, (GPUS[0],))]
    assert all(limits.pinned_memory_limit is None for _, _, limits in n.mps.started)
    assert f"CUDA_MPS_PIPE_DIRECTORY=/mps/{owner}/pipe" in env_a
    claims = read_claims(n.preparer._checkpoint.path)
    (device,) = claims[a.uid].devices
    assert device.sharing is not None and device.sharing.strategy == MEMORY_SHARE
    assert device.sharing.pinned_memory_limit == 4 << 30 and device.share_id


def test_the_daemon_stops_with_the_gpus_last_share_only(n: Node) -> None:
    """Unpreparing one of two shares of a GPU leaves its daemon; unpreparing the last stops it."""
    a, b = put(n, "a", "4Gi"), put(n, "b", "2Gi")
    env_of(n, a), env_of(n, b)
    assert n.preparer.unprepare([a]) == {a.uid: ""}
    assert n.mps.stopped == []
    assert n.preparer.unprepare([b]) == {b.uid: ""}
    assert n.mps.stopped == [memory_share_uid(GPUS[0])]


def test_the_checkpoint_names_the_gpus_daemon_owner_while_a_share_is_prepared(n: Node) -> None:
    """daemon_owners: the claim UIDs, plus memshare-<GPU> while any prepared claim shares that GPU
    by memory; none once the last share is unprepared."""
    a = put(n, "a", "4Gi")
    env_of(n, a)
    path = n.preparer._checkpoint.path
    assert daemon_owners(path) == {a.uid, memory_share_uid(GPUS[0])}
    n.preparer.unprepare([a])
    assert daemon_owners(path) == frozenset()


@pytest.mark.parametrize(
    ("claim", "words"),
    [
        (lambda n: put(n, "tiny", "512Ki"), "under 1Mi"),
        (lambda n: put(n, "bad", "lots"), "consumedCapacity.memory"),
    ],
)
def test_a_bad_share_is_the_claims_error(n: Node, claim: Any, words: str) -> None:
    """A share under 1 MiB, or one that is no quantity, fails the claim saying why; nothing starts."""
    ref = claim(n)
    result = n.preparer.prepare([ref])[ref.uid]
    assert words in result.error and n.mps.started == []


def test_a_share_beside_a_gpuconfig_sharing_or_of_two_gpus_is_refused(n: Node) -> None:
    """A device shared by memory takes no GpuConfig sharing as well, and a claim shares one GPU's
    memory (its containers reach one MPS daemon)."""
    obj = dc.memory_share("default", "ts", "gpu-0", "4Gi", POOL)
    config = dc.Config(dc.gpu_config(dc.time_slicing("Long")))
    obj["spec"]["devices"]["config"] = [{"opaque": config.to_json()["opaque"]}]
    obj["status"]["allocation"]["devices"]["config"] = [config.to_json()]
    n.store.put(obj)
    ref = ClaimRef("default", "ts", obj["metadata"]["uid"])
    assert "cannot apply to it as well" in n.preparer.prepare([ref])[ref.uid].error
    two = dc.memory_share("default", "two", "gpu-0", "4Gi", POOL)
    results = two["status"]["allocation"]["devices"]["results"]
    results.append(
        {**copy.deepcopy(results[0]), "device": "gpu-1", "shareID": "1b0e7c6e-3f4a-4b7e-9a55-6c1f0d2e8a11"}
    )
    two["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    n.store.put(two)
    ref = ClaimRef("default", "two", two["metadata"]["uid"])
    assert "one GPU" in n.preparer.prepare([ref])[ref.uid].error
    assert n.mps.started == [] and n.timeslices() == [0, 0, 0, 0]


def test_a_failed_daemon_start_fails_the_share_and_records_nothing(n: Node) -> None:
    """The GPU's daemon not coming up is the claim's error; the claim is not recorded."""
    n.mps.fail = "MPS control daemon: not up within 25s"
    ref = put(n, "a", "4Gi")
    assert "not up" in n.preparer.prepare([ref])[ref.uid].error
    assert n.recorded() == set()


def test_the_pinned_limit_is_whole_mib_for_device_0() -> None:
    """NVIDIA's MPS format, `<ordinal>=<limit>`: the share in MiB, rounded down."""
    assert pinned_env((3 << 30) + 1000) == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M"
