"""A GPU shared by memory (gpuvisor.dra.memorySharing), end to end: the real supervisor and DRA
worker, the DRA kubelet stand-in, the fake API server (tests/kubeapi/) and the fake MPS control
daemon and client (tests/mpsfake.py).

The rules the stand-ins keep, from their sources:
- the fake API server checks the slices against the resource.k8s.io/v1 schema of 1.34
  (kubernetes-validate, strict) and validation.go's consumable-capacity rules
  (tests/kubeapi/capacity.py: validateMultiAllocatableDeviceCapacity / validateRequestPolicyRange),
  and drops `allowMultipleAllocations` and `requestPolicy` without the DRAConsumableCapacity gate
  (pkg/registry/resource/resourceslice/strategy.go dropDisabledFields; the gate is alpha and off in
  1.34 and 1.35, beta and on in 1.36);
- a claim sharing a device carries a `shareID` and `consumedCapacity` in its result (kubernetes/api
  v0.34.0 resource/v1/types.go:1560-1580), its status entry is keyed by the shareID too
  (validateResourceClaimStatusUpdate), and the fake checks both;
- the fake MPS client honours CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as NVIDIA's MPS documentation
  describes it ("<ordinal>=<limit>" entries): an allocation past the limit fails in that client.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tests import draconfigs as dc
from tests import mpsfake
from tests.dranode import DRIVER, POOL, DraNode
from tests.helpers import short_tmpdir, wait_until
from tests.kubeapi import RunningApiServer

SHARES = {"share-a": "4Gi", "share-b": "8Gi", "share-c": "2Gi"}
SETTING = "step=1Gi,default=4Gi,minimum=1Gi"


def _edits(node: DraNode, uid: str) -> tuple[dict[str, str], dict[str, str]]:
    """A claim's CDI spec: its env (name -> value) and mounts (container path -> host path)."""
    spec = node.claim_spec(uid)
    edits: dict[str, Any] = {"env": [], "mounts": []}
    for part in [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec["devices"]]:
        edits["env"] += part.get("env") or []
        edits["mounts"] += part.get("mounts") or []
    env = dict(e.split("=", 1) for e in edits["env"])
    return env, {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}


def _status_share(api: RunningApiServer, name: str) -> Any:
    with api.state.lock:
        claim = api.state.resource_claims.get(("default", name)) or {}
        entries = (claim.get("status") or {}).get("devices") or []
    return entries[0].get("data", {}).get("memoryShare") if entries else None


def _daemons(node: DraNode) -> dict[str, Any]:
    mps = node.command("status")["cluster"]["dra"].get("mps_claims") or {}
    return dict(mps.get("daemons") or {})


def test_three_claims_share_one_gpu_by_memory_each_held_to_its_share(api: RunningApiServer) -> None:
    """With the setting and an API server that keeps consumable capacity, gpu-0 is published with
    allowMultipleAllocations and a memory request policy (the fake finds no fault); three claims
    for 4Gi, 8Gi and 2Gi of it prepare as clients of one MPS daemon, each CDI spec carrying the
    daemon's pipe and its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; a client allocating within its
    share succeeds and one allocating past it fails on its own; each claim's status shows its
    share; unpreparing two keeps the daemon, unpreparing the last stops it."""
    api.state.consumable_capacity = True
    with short_tmpdir("gvms") as base:
        fake = mpsfake.install(Path(base))
        client = mpsfake.install_client(Path(base))
        args = (
            "--mode", "dra", "--dra-memory-sharing", SETTING,
            "--mps-root", f"{base}/mps", "--mps-control-binary", str(fake),
        )  # fmt: skip
        try:
            with DraNode("pcie-l4", args=args, api=api) as node:
                node.wait_registered()

                def gpu0() -> dict[str, Any]:
                    devices = [d for s in node.slices() for d in s["spec"]["devices"] if d["name"] == "gpu-0"]
                    return devices[0] if devices else {}

                assert wait_until(lambda: gpu0().get("allowMultipleAllocations") is True, 30), node.log()[
                    -3000:
                ]
                policy = gpu0()["capacity"]["memory"]["requestPolicy"]
                assert policy["default"] == "4Gi" and policy["validRange"]["min"] == "1Gi"
                assert policy["validRange"]["step"] == "1Gi"
                status = node.command("status")["cluster"]["dra"]["slices"]
                assert status["memory_sharing"] == "kept"

                refs = {}
                for name, memory in SHARES.items():
                    obj = dc.memory_share("default", name, "gpu-0", memory, POOL)
                    api.state.put_claim(obj)
                    refs[name] = ("default", name, obj["metadata"]["uid"])
                for ref in refs.values():
                    answer = node.dra.prepare(DRIVER, [ref], timeout=40).claims[ref[2]]
                    assert answer.error == "", answer.error
                pipes = set()
                for name, ref in refs.items():
                    env, mounts = _edits(node, ref[2])
                    mib = int(SHARES[name][:-2]) * 1024
                    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}M"
                    pipe = mounts[env["CUDA_MPS_PIPE_DIRECTORY"]]
                    pipes.add(pipe)
                    run_env = {**os.environ, **env, "CUDA_MPS_PIPE_DIRECTORY": pipe}
                    within = subprocess.run([str(client), str(mib // 2), str(mib // 2)], env=run_env,
                                            capture_output=True, text=True, timeout=30)  # fmt: skip
                    assert within.returncode == 0, within.stdout
                    past = subprocess.run([str(client), str(mib // 2), str(mib // 2 + 1)], env=run_env,
                                          capture_output=True, text=True, timeout=30)  # fmt: skip
                    assert past.returncode == 2 and "CUDA_ERROR_OUT_OF_MEMORY" in past.stdout, past.stdout
                assert len(pipes) == 1  # one daemon serves the GPU's shares
                assert len(_daemons(node)) == 1
                shown = {name: memory for name, memory in SHARES.items()}
                assert wait_until(lambda: {n: _status_share(api, n) for n in SHARES} == shown, 30), (
                    node.log()[-3000:]
                )

                for name in ("share-a", "share-b"):
                    ref = refs[name]
                    assert node.dra.unprepare(DRIVER, [ref], timeout=40).claims[ref[2]].error == ""
                (daemon,) = _daemons(node).values()
                assert daemon["up"] and daemon["pid"]
                pid = daemon["pid"]
                ref = refs["share-c"]
                assert node.dra.unprepare(DRIVER, [ref], timeout=40).claims[ref[2]].error == ""
                assert wait_until(lambda: _daemons(node) == {} and mpsfake.dead(pid), 30), node.log()[-3000:]
                assert not os.path.exists(next(iter(pipes)))
                assert api.state.errors == []
        finally:
            mpsfake.kill_daemons(Path(base))


def test_an_api_server_without_the_gate_gets_the_gpus_whole_and_says_so(api: RunningApiServer) -> None:
    """DRAConsumableCapacity off (1.34's and 1.35's default): the server would drop the fields, so
    the GPUs are published whole as without the setting, status says `dropped` and the log says
    why, loudly."""
    with DraNode("pcie-l4", args=("--mode", "dra", "--dra-memory-sharing", SETTING), api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], 30)
        assert wait_until(
            lambda: node.command("status")["cluster"]["dra"]["slices"]["memory_sharing"] == "dropped", 30
        )
        assert not any("allowMultipleAllocations" in d for s in node.slices() for d in s["spec"]["devices"])
        assert "DRAConsumableCapacity" in node.log()
        assert api.state.errors == []


def test_a_reload_turns_memory_sharing_on_and_off(api: RunningApiServer, tmp_path: Path) -> None:
    """The setting is the node's config: a changed config file and SIGHUP publish the GPUs shared
    by memory (a new pool generation), and the next reload without it publishes them whole again,
    with no restart of the DRA worker."""
    from tests.harness import sighup_and_wait

    api.state.consumable_capacity = True
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\ngpuvisor: {mode: dra}\n")
    with DraNode("pcie-l4", args=("--config-file", str(config)), api=api) as node:
        node.wait_registered()
        worker = node.dra_worker_pid()

        def shared() -> set[bool]:
            return {
                d.get("allowMultipleAllocations") is True for s in node.slices() for d in s["spec"]["devices"]
            }

        assert wait_until(lambda: shared() == {False}, 30)
        config.write_text(
            "version: v1\ngpuvisor: {mode: dra, dra: {memorySharing: {step: 1Gi, default: 2Gi}}}\n"
        )
        sighup_and_wait(node)
        assert wait_until(lambda: shared() == {True}, 30), node.log()[-3000:]
        config.write_text("version: v1\ngpuvisor: {mode: dra}\n")
        sighup_and_wait(node)
        assert wait_until(lambda: shared() == {False}, 30), node.log()[-3000:]
        assert node.dra_worker_pid() == worker
        assert api.state.errors == []
