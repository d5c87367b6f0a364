"""Claims with NVIDIA's opaque configuration through the real DRA worker: a supervisor in `--mode
dra` on a simulated pcie-l4 node, its DRA worker, the DRA kubelet stand-in calling
NodePrepareResources and NodeUnprepareResources, claims in a claims dir, and a fake nvidia-smi
(tests/smifake.py) first on the worker's PATH, where the worker looks for it as on a node.

The kubelet stand-in sends a pod's claims in one call, as kubelet 1.34 does
(pkg/kubelet/cm/dra/manager.go `prepareResources`: one NodePrepareResources per driver with every
claim of the pod for it), and reads each claim's answer on its own (`PrepareResourcesResponse.claims`
by UID), so one bad claim spoils none of the others.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.model import ResourcePlan
from tests import draconfigs as dc
from tests import smifake
from tests.dranode import DRIVER, POOL, DraNode


def gpu_uuids(node: DraNode) -> dict[str, str]:
    """DRA device name -> GPU UUID, from the DRA worker's plan file."""
    with open(os.path.join(node.run_dir, "plans", f"{DRIVER}.json"), encoding="utf-8") as fh:
        return {d.id: d.gpu_uuid for d in ResourcePlan.from_json(fh.read()).devices}


def test_a_time_sliced_claim_a_bad_one_and_a_plain_one_in_one_call(tmp_path: Path) -> None:
    """One NodePrepareResources with NVIDIA's gpu-test6 claim (TimeSlicing, Long), a claim whose
    config has an unknown kind, and a plain claim: the time-sliced GPU's timeslice is 3 through
    nvidia-smi, the bad claim's answer names the entry and the kind, the plain one is prepared;
    the checkpoint holds the sharing; unprepare sets the timeslice back to Default."""
    bin_dir = tmp_path / "bin"
    smifake.install(bin_dir, [])
    with DraNode("pcie-l4", env={"PATH": smifake.path_with(bin_dir)}) as node:
        node.wait_registered()
        uuids = gpu_uuids(node)
        smifake.install(bin_dir, sorted(set(uuids.values())))
        sliced = dc.gpu_test6(["gpu-1"])
        bad = dc.Claim(
            "default",
            "bad",
            [dc.Request("gpu", ["gpu-2"])],
            [dc.Config({"apiVersion": dc.API, "kind": "TpuConfig"})],
        )
        plain = dc.gpu_test1(["gpu-3"])
        refs = []
        for claim in (sliced, bad, plain):
            node.claims.put(claim.to_json(POOL))
            refs.append((claim.namespace, claim.name, claim.uid))
        answer = node.dra.prepare(DRIVER, refs).claims
        assert answer[sliced.uid].error == "" and [d.device_name for d in answer[sliced.uid].devices] == [
            "gpu-1"
        ]
        assert answer[plain.uid].error == "" and [d.device_name for d in answer[plain.uid].devices] == [
            "gpu-3"
        ]
        assert (
            'no kind "TpuConfig" is registered for version "resource.nvidia.com/v1beta1"'
            in answer[bad.uid].error
        )
        assert "status.allocation.devices.config[0]" in answer[bad.uid].error
        assert smifake.timeslices(bin_dir)[uuids["gpu-1"]] == 3
        assert set(smifake.timeslices(bin_dir).values()) == {0, 3}
        assert node.prepared_uids() == {sliced.uid, plain.uid}
        with open(node.checkpoint_path, encoding="utf-8") as fh:
            stored = json.load(fh)["claims"][sliced.uid]["devices"][0]["sharing"]
        assert stored == {
            "strategy": "TimeSlicing",
            "uuid": uuids["gpu-1"],
            "gpuUUID": uuids["gpu-1"],
            "interval": "Long",
        }

        gone = node.dra.unprepare(DRIVER, refs).claims
        assert {uid: r.error for uid, r in gone.items()} == dict.fromkeys(
            (sliced.uid, bad.uid, plain.uid), ""
        )
        assert set(smifake.timeslices(bin_dir).values()) == {0}
        assert node.prepared_uids() == set()
