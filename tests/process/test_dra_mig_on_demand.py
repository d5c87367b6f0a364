"""MIG devices made on demand (gpuvisor.dra.migOnDemand), end to end: the real supervisor and DRA
worker, the DRA kubelet stand-in, the fake API server (tests/kubeapi/) and the scheduler stand-in
(tests/drascheduler.py), on a simulated node of two H100-80GB GPUs with MIG mode off (Hopper turns MIG mode on without a reset), whose MIG
layout the simulator keeps in a state file across supervisor restarts (as the driver keeps it).

The rules the stand-ins keep, from their sources:
- the fake API server checks the slices against the resource.k8s.io/v1 schema and the validation
  rules of partitionable devices of the version it serves (tests/kubeapi/partitions.py, from
  validation.go of 1.34 and 1.35), and drops `sharedCounters` and `consumesCounters` without the
  DRAPartitionableDevices gate (strategy.go dropDisabledDRAPartitionableDevicesFields; alpha and
  off in 1.34 and 1.35);
- the scheduler stand-in allocates a device that consumes counters only where what its counter
  set has left covers it (dynamic-resource-allocation structured/internal/experimental
  allocator_experimental.go `checkAvailableCounters`: the device's slice in 1.34, the pool in
  1.35), counting every allocated claim the server holds;
- NVML's rules for creating and destroying instances are the simulator's (supervisor/sim/nvml/
  migcreate.py: an overlapping placement is NVML_ERROR_INSUFFICIENT_RESOURCES).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import supervisor.sim.nvml as simulator_package
from supervisor.sim.nvml import load_simulator
from tests.dranode import DRIVER, POOL, DraNode
from tests.drascheduler import Allocator, Unschedulable
from tests.helpers import wait_until, write_mig_minors
from tests.kubeapi import RunningApiServer

ARGS = ("--mode", "dra", "--dra-mig-on-demand")
CLASSES = {DRIVER: {"metadata": {"name": DRIVER}, "spec": {}}}
ATTRS = "device.attributes['gpu.nvidia.com']"


@pytest.fixture
def two_h100(tmp_path: Path) -> Iterator[str]:
    """A node description: the first two GPUs of the built-in dgx-h100 profile (H100 80GB), MIG mode off."""
    data = yaml.safe_load(
        (Path(simulator_package.__file__).parent / "profiles" / "dgx-h100.yaml").read_text()
    )
    gpus = [{k: v for k, v in g.items() if k != "mig"} for g in data["gpus"][:2]]
    path = tmp_path / "two-h100.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "two-h100",
                "driver_version": data["driver_version"],
                "gpus": gpus,
                "topology": {"default_ancestor": "MULTIPLE"},
            }
        )
    )
    yield str(path)


def _claim(name: str, profile: str, gpu_uuid: str) -> dict[str, Any]:
    expr = f"{ATTRS}.type == 'mig' && {ATTRS}.profile == '{profile}' && {ATTRS}.parentUUID == '{gpu_uuid}'"
    if profile == "gpu":
        expr = f"{ATTRS}.type == 'gpu' && {ATTRS}.uuid == '{gpu_uuid}'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": str(uuidlib.uuid4())},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": DRIVER, "selectors": [{"cel": {"expression": expr}}]}}]}},
    }  # fmt: skip


def _allocate(api: RunningApiServer, name: str, profile: str, gpu_uuid: str) -> tuple[str, str, str]:
    """Allocated as the scheduler allocates it against the published slices, and stored."""
    obj = Allocator.from_state(api.state, POOL, CLASSES).allocate(
        _claim(name, profile, gpu_uuid), (f"pod-{name}", str(uuidlib.uuid4()))
    )
    api.state.put_claim(obj)
    return ("default", name, obj["metadata"]["uid"])


def _device(api: RunningApiServer, name: str) -> str:
    with api.state.lock:
        obj = api.state.resource_claims[("default", name)]
    (result,) = obj["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def _instances(node: DraNode, gpu_uuid: str) -> list[dict[str, Any]]:
    return list(node.command("sim", {"action": "instances", "device": gpu_uuid})["instances"])


def _made(node: DraNode) -> dict[str, dict[str, Any]]:
    """claim UID -> the madeMig record of its one device, from the DRA worker's checkpoint."""
    with open(node.checkpoint_path) as f:
        claims = json.load(f)["claims"]
    return {uid: d["madeMig"] for uid, c in claims.items() for d in c["devices"] if "madeMig" in d}


def _prepare(node: DraNode, ref: tuple[str, str, str]) -> str:
    return str(node.dra.prepare(DRIVER, [ref], timeout=40).claims[ref[2]].error)


def _unprepare(node: DraNode, ref: tuple[str, str, str]) -> str:
    return str(node.dra.unprepare(DRIVER, [ref], timeout=40).claims[ref[2]].error)


def _start(api: RunningApiServer, profile: str, version: str = "1.34.0") -> DraNode:
    """The node, its MIG minors file (what the claims' specs' capability nodes come from) beside
    its description."""
    api.state.partitionable_devices = True
    api.state.kube_version = version
    minors = Path(profile).with_name("mig-minors")
    write_mig_minors(minors)
    return DraNode(profile, args=(*ARGS, "--mig-minors-path", str(minors)), api=api)


def _up(node: DraNode, profile: str, index: int) -> str:
    """Wait until the node serves and its partitionable slices are published; GPU `index`'s UUID."""
    node.wait_registered()
    assert wait_until(lambda: _published(node), 30), node.log()[-3000:]
    return str(load_simulator(profile).gpu_uuids()[index])


def _published(node: DraNode) -> bool:
    return any("consumesCounters" in d for s in node.slices() for d in s["spec"].get("devices", []))


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
def test_two_claims_for_different_profiles_share_one_gpu_and_go_with_their_unprepare(
    api: RunningApiServer, two_h100: str, version: str
) -> None:
    """The GPUs are published partitionable in the layout of the served version (the fake server
    finds no fault); the scheduler stand-in places a 3g.40gb and a 1g.10gb claim on GPU 0 at
    placements that do not overlap; each prepare makes its MIG device (MIG mode turned on first),
    its CDI spec names the instance and the checkpoint records it; a full-GPU claim of that GPU no
    longer fits; each unprepare destroys its instance."""
    with _start(api, two_h100, version) as node:
        gpu = _up(node, two_h100, 0)
        big = _allocate(api, "big", "3g.40gb", gpu)
        small = _allocate(api, "small", "1g.10gb", gpu)
        with pytest.raises(Unschedulable):
            _allocate(api, "whole", "gpu", gpu)
        assert _prepare(node, big) == "" and _prepare(node, small) == ""
        made = _made(node)
        assert set(made) == {big[2], small[2]}
        there = {m["uuid"] for m in _instances(node, gpu)}
        assert there == {m["uuid"] for m in made.values()}
        spec = node.claim_spec(big[2])
        assert made[big[2]]["uuid"] in json.dumps(spec) or any(
            "nvidia-cap" in n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
        )
        for device, name in ((_device(api, "big"), "3g40gb"), (_device(api, "small"), "1g10gb")):
            assert device.startswith(f"gpu-0-mig-{name}-")
        assert _unprepare(node, big) == "" and _unprepare(node, small) == ""
        assert _instances(node, gpu) == []
        assert api.state.errors == []


def test_a_placement_taken_by_hand_is_refused_naming_the_instance(
    api: RunningApiServer, two_h100: str
) -> None:
    """An instance made by hand at placement 0 of GPU 1 (the scheduler does not know it): a claim
    allocated the overlapping 1g.10gb placement 0 gets an error that names the instance in the
    way, and nothing is left made for it."""
    with _start(api, two_h100) as node:
        gpu = _up(node, two_h100, 1)
        node.command("sim", {"action": "create-instance", "device": gpu, "gi_profile": 9, "placement": 0})
        (hand,) = _instances(node, gpu)
        ref = api.state.add_claim("default", "race", POOL, ["gpu-1-mig-1g10gb-19-0"])
        error = _prepare(node, ref)
        assert "taken" in error and str(hand["uuid"]) in error, error
        assert [m["uuid"] for m in _instances(node, gpu)] == [hand["uuid"]]
        assert _made(node) == {}


def _dra_worker(node: DraNode) -> int:
    try:
        return node.dra_worker_pid()
    except Exception:  # between two workers
        return 0


def _try_prepare(node: DraNode, ref: tuple[str, str, str]) -> None:
    with contextlib.suppress(Exception):  # the worker it asked was killed under it: the point
        node.dra.prepare(DRIVER, [ref], timeout=20)


def test_what_a_crash_leaves_is_destroyed_and_what_a_claim_holds_is_kept(
    api: RunningApiServer, two_h100: str
) -> None:
    """A prepared claim's instance, and an instance no claim records (what a kill between an
    instance's creation and its checkpoint write leaves: made here by hand, so the state is
    certain): when the DRA worker is killed and replaced, the unrecorded instance is destroyed and
    the claim's kept; the same after the supervisor is killed and started again (the simulator
    keeps the layout, as the driver does). Then a prepare interrupted by a kill of the DRA worker,
    wherever the kill lands, leaves exactly the instances checkpointed claims hold."""
    with _start(api, two_h100) as node:
        gpu = _up(node, two_h100, 0)
        kept = _allocate(api, "kept", "2g.20gb", gpu)
        assert _prepare(node, kept) == ""
        held = _made(node)[kept[2]]["uuid"]

        def only_held() -> bool:
            return [m["uuid"] for m in _instances(node, gpu)] == [held]

        for kill in ("worker", "supervisor"):
            seen = node.registrations()
            node.command(
                "sim", {"action": "create-instance", "device": gpu, "gi_profile": 19, "placement": 6}
            )
            assert len(_instances(node, gpu)) == 2
            if kill == "worker":
                dead = _dra_worker(node)
                os.kill(dead, signal.SIGKILL)
                assert wait_until(lambda d=dead: _dra_worker(node) not in (0, d), 60), node.log()[-3000:]  # type: ignore[misc]
            else:
                node.stop_supervisor(signal.SIGKILL)  # its workers end with it (they watch their parent)
                node.start_supervisor()
            node.wait_registered(60, more_than=seen)  # the new DRA worker serves
            assert wait_until(only_held, 60), (kill, _instances(node, gpu), node.log()[-3000:])
        assert _prepare(node, kept) == ""  # a re-prepare answers from the checkpoint

        racing = _allocate(api, "racing", "1g.10gb", gpu)
        pid, seen = _dra_worker(node), node.registrations()
        call = threading.Thread(target=lambda: _try_prepare(node, racing), daemon=True)
        call.start()
        os.kill(pid, signal.SIGKILL)
        call.join(60)
        node.wait_registered(60, more_than=seen)
        assert _dra_worker(node) not in (0, pid)

        def settled() -> bool:
            return {m["uuid"] for m in _instances(node, gpu)} == {m["uuid"] for m in _made(node).values()}

        assert wait_until(settled, 60), (_instances(node, gpu), _made(node), node.log()[-3000:])
        assert held in {m["uuid"] for m in _instances(node, gpu)}


def test_an_unprepare_after_a_restart_destroys_the_instance(api: RunningApiServer, two_h100: str) -> None:
    """A claim prepared before the supervisor restarts (SIGTERM, as an upgrade does) is unprepared
    after it: its instance, read from the checkpoint's record, is destroyed."""
    with _start(api, two_h100) as node:
        gpu = _up(node, two_h100, 0)
        ref = _allocate(api, "after", "4g.40gb", gpu)
        assert _prepare(node, ref) == ""
        made = _made(node)[ref[2]]
        seen = node.registrations()
        node.stop_supervisor()
        node.start_supervisor()
        node.wait_registered(60, more_than=seen)
        assert [m["uuid"] for m in _instances(node, gpu)] == [made["uuid"]]
        assert _unprepare(node, ref) == ""
        assert _instances(node, gpu) == []
        assert _made(node) == {}


def _health(api: RunningApiServer, name: str) -> tuple[str, str] | None:
    """(status, reason) of the Healthy condition of claim `name`'s one device in its status."""
    with api.state.lock:
        claim = api.state.resource_claims.get(("default", name)) or {}
    entries = (claim.get("status") or {}).get("devices") or []
    conditions = entries[0].get("conditions") if entries else None
    return (conditions[0]["status"], conditions[0]["reason"]) if conditions else None


def _taints(node: DraNode) -> dict[str, set[str]]:
    return {
        d["name"]: {t["key"] for t in d.get("taints", [])}
        for s in node.slices()
        for d in s["spec"].get("devices", [])
    }


def test_a_made_devices_xid_taints_its_placement_and_shows_in_its_claim(
    api: RunningApiServer, two_h100: str
) -> None:
    """An XID 48 on the MIG device made for a claim: its placement is tainted in the slices (the
    full GPU too, the other placements not), and its claim's status turns its Healthy condition
    False (XID 48 holds until the GPU is reset, which a GPU with instances in use does not get)."""
    with _start(api, two_h100) as node:
        gpu = _up(node, two_h100, 0)
        ref = _allocate(api, "sick", "1g.10gb", gpu)
        assert _prepare(node, ref) == ""
        device, made = _device(api, "sick"), _made(node)[ref[2]]["uuid"]
        assert wait_until(lambda: _health(api, "sick") == ("True", "DeviceHealthy"), 30), node.log()[-3000:]
        node.sim("xid", device=made, xid=48)
        assert wait_until(lambda: (_health(api, "sick") or ("",))[0] == "False", 30), _health(api, "sick")
        assert wait_until(lambda: "gpu.nvidia.com/xid" in _taints(node).get(device, set()), 30)
        taints = _taints(node)
        assert "gpu.nvidia.com/xid" in taints["gpu-0"]
        assert not any(taints[n] for n in taints if n.startswith("gpu-0-mig-") and n != device)


def test_an_api_server_without_the_gate_gets_the_gpus_whole_and_says_so(
    api: RunningApiServer, two_h100: str
) -> None:
    """DRAPartitionableDevices off (1.34's and 1.35's default): the server would drop the counters
    and let the scheduler hand out a GPU and its MIG devices at once, so the GPUs are published
    whole, status says `dropped`, the log names the gate, and a claim of a whole GPU prepares."""
    api.state.kube_version = "1.34.0"
    minors = Path(two_h100).with_name("mig-minors")
    write_mig_minors(minors)
    with DraNode(two_h100, args=(*ARGS, "--mig-minors-path", str(minors)), api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ["gpu-0", "gpu-1"], 30), node.log()[-3000:]
        status = node.command("status")["cluster"]["dra"]["slices"]
        assert wait_until(
            lambda: node.command("status")["cluster"]["dra"]["slices"]["partitions"] == "dropped", 30
        )
        assert status["server_version"] == "1.34"
        assert "DRAPartitionableDevices" in node.log()
        assert not _published(node)
        ref = api.state.add_claim("default", "whole", POOL, ["gpu-1"])
        assert _prepare(node, ref) == ""
        assert api.state.errors == []
