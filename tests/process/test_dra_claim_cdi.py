"""Each DRA claim's own CDI spec, end to end: the real supervisor in `--mode dra` on a simulated
node whose driver root is a driver install laid out on disk (supervisor/sim/drivertree.py), its
DRA worker, and the DRA kubelet stand-in.

NVIDIA's kubelet plugin v0.4.1 writes `k8s.gpu.nvidia.com-claim_<uid>.yaml` before it answers
(cmd/gpu-kubelet-plugin/device_state.go Prepare: CreateClaimSpecFile before the checkpoint's
PrepareCompleted) and deletes it at unprepare (Unprepare: DeleteClaimSpecFile); the kubelet
stand-in answers nothing of its own here, it only carries the calls.
"""

from __future__ import annotations

import os
import signal

from common.cdispec import spec_problems
from supervisor.sim.drivertree import VERSION, write_driver_tree
from tests.dranode import DRIVER, POOL, DraNode
from tests.helpers import gone, wait_until


def _node() -> DraNode:
    node = DraNode("pcie-l4")
    root = os.path.join(node.base, "driver")
    write_driver_tree(root)
    node.args = [*node.args, "--driver-root", root, "--nvidia-cdi-hook-path", "/usr/bin/nvidia-ctk"]
    return node


def test_a_claims_spec_carries_its_devices_and_the_driver_and_no_other_claims() -> None:
    """Two claims: each answered with its own spec's IDs, the spec on disk before the answer came
    back, valid, with only its own devices, the driver's libcuda and hooks spec-wide; unprepare of
    one removes its spec and leaves the other's."""
    with _node() as node:
        node.wait_registered()
        a = node.claims.allocate("default", "a", POOL, ["gpu-0"])
        b = node.claims.allocate("default", "b", POOL, ["gpu-1", "gpu-2"])
        answered = node.dra.prepare(DRIVER, [a, b]).claims
        spec_a, spec_b = node.claim_spec(a[2]), node.claim_spec(b[2])
        assert spec_problems(spec_a) == [] and spec_problems(spec_b) == []
        assert {i for d in answered[a[2]].devices for i in d.cdi_device_ids} == node.claim_cdi_names(a[2])
        assert [d["name"] for d in spec_a["devices"]] == [f"{a[2]}-gpu-0"]
        assert [d["name"] for d in spec_b["devices"]] == [f"{b[2]}-gpu-1", f"{b[2]}-gpu-2"]
        assert spec_a["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia0"
        edits = spec_a["containerEdits"]
        assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]
        assert "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu" in edits["env"]
        libcuda = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"
        assert libcuda in {m["containerPath"] for m in edits["mounts"]}
        assert [h["args"][2] for h in edits["hooks"]][:1] == ["create-symlinks"]
        assert node.dra.unprepare(DRIVER, [a]).claims[a[2]].error == ""
        assert not os.path.exists(node.claim_spec_path(a[2]))
        assert node.claim_spec(b[2]) == spec_b


def test_a_worker_restart_between_prepare_and_unprepare_keeps_the_spec() -> None:
    """SIGKILL the DRA worker after a prepare: its successor leaves the claim's spec in place,
    answers a re-prepare with the same IDs, and its unprepare removes the spec."""
    with _node() as node:
        node.wait_registered()
        ref = node.claims.allocate("default", "c", POOL, ["gpu-3"])
        first = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert first.error == ""
        spec = node.claim_spec(ref[2])
        pid, before = node.dra_worker_pid(), node.registrations()
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: node.dra_worker_pid() not in (0, pid), 30), node.log()[-4000:]
        node.wait_registered(more_than=before)
        assert node.claim_spec(ref[2]) == spec
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]] == first
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert not os.path.exists(node.claim_spec_path(ref[2]))


def test_a_supervisor_restart_keeps_the_spec_until_unprepare() -> None:
    """SIGKILL the supervisor (its worker follows it) after a prepare: the spec stays through the
    new supervisor's start, and the new worker's unprepare removes it."""
    with _node() as node:
        node.wait_registered()
        ref = node.claims.allocate("default", "c", POOL, ["gpu-1"])
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error == ""
        spec = node.claim_spec(ref[2])
        old, before = [p.pid for p in node.workers()], node.registrations()
        node.stop_supervisor(signal.SIGKILL)
        assert wait_until(lambda: gone(old), 15), "the workers outlived their supervisor"
        node.start_supervisor()
        node.wait_registered(more_than=before)
        assert node.claim_spec(ref[2]) == spec
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert not os.path.exists(node.claim_spec_path(ref[2]))
