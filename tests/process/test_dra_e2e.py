"""gpuvisor as a DRA driver on real processes: a supervisor in `--mode dra` on a simulated node, its
DRA worker, the DRA kubelet stand-in (plugin watcher, v1 and v1beta1 clients, health stream) and
claims in a claims dir standing in for the API server.

Each test pins one behaviour end to end: prepare and unprepare in both API versions with the CDI
names of the claim's own spec; a worker killed, and the supervisor killed, between prepare
and unprepare; an XID reaching the kubelet's health stream; and the mode switch through SIGHUP.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from common.draapi import V1_SERVICE, V1BETA1_SERVICE
from common.model import ResourcePlan
from supervisor.sim.drakubelet import DraKubeletStandin
from tests.dranode import DRIVER, POOL, DraNode
from tests.harness import sighup_and_wait
from tests.helpers import gone, sockets_in, wait_until

GPU = "nvidia.com/gpu"


def gpu_uuid(node: DraNode, device: str) -> str:
    """The GPU UUID behind a DRA device name, from the DRA worker's plan file."""
    with open(os.path.join(node.run_dir, "plans", f"{DRIVER}.json"), encoding="utf-8") as fh:
        text = fh.read()
    return next(d.gpu_uuid for d in ResourcePlan.from_json(text).devices if d.id == device)


def test_claims_are_prepared_and_unprepared_through_v1_and_v1beta1() -> None:
    """The node registers as gpu.nvidia.com and is ready; a claim prepares through v1 with the CDI
    names of its own spec (written before the answer, gone after unprepare), unprepares; a
    v1beta1-only kubelet does the same."""
    with DraNode("pcie-l4") as node:
        node.wait_registered()
        status = node.wait_ready()
        assert [w["resource"] for w in status["workers"]] == [DRIVER]
        assert node.kubelet.resource_names() == []  # no extended resource is advertised
        plugin = node.dra.plugin(DRIVER)
        assert plugin is not None and plugin.service == V1_SERVICE
        assert plugin.endpoint == os.path.join(node.plugins_dir, DRIVER, "dra.sock")
        ref = node.claims.allocate("default", "c1", POOL, ["gpu-0", "gpu-2"])
        prepared = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert prepared.error == ""
        assert [d.device_name for d in prepared.devices] == ["gpu-0", "gpu-2"]
        cdi = {i for d in prepared.devices for i in d.cdi_device_ids}
        assert len(cdi) == 2 and cdi == node.claim_cdi_names(ref[2])
        assert node.prepared_uids() == {ref[2]}
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert node.prepared_uids() == set()
        assert not os.path.exists(node.claim_spec_path(ref[2]))

        node.dra.stop()  # a kubelet that speaks v1beta1 only
        node.dra = DraKubeletStandin(node.registry_dir, versions=(V1BETA1_SERVICE,), scan_interval=0.02)
        node.dra.start()
        node.wait_registered()
        plugin = node.dra.plugin(DRIVER)
        assert plugin is not None and plugin.service == V1BETA1_SERVICE
        ref = node.claims.allocate("default", "c2", POOL, ["gpu-1"])
        response = node.dra.prepare(DRIVER, [ref])
        assert [d.device_name for d in response.claims[ref[2]].devices] == ["gpu-1"]
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""


def test_a_killed_worker_comes_back_and_the_claim_still_unprepares() -> None:
    """SIGKILL the DRA worker between prepare and unprepare: the supervisor restarts it, it clears its
    stale sockets and registers again, re-preparing answers the same from the checkpoint (the claim
    is gone from the API server by then), and unprepare works."""
    with DraNode("pcie-l4") as node:
        node.wait_registered()
        ref = node.claims.allocate("default", "c1", POOL, ["gpu-3"])
        first = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert first.error == ""
        pid = node.dra_worker_pid()
        before = node.registrations()
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: node.dra_worker_pid() not in (0, pid), 30), node.log()[-4000:]
        node.wait_registered(more_than=before)
        node.claims.delete("default", "c1")
        again = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert again == first
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert node.prepared_uids() == set()


def test_a_killed_supervisor_is_followed_by_one_that_unprepares_the_claim() -> None:
    """SIGKILL the supervisor between prepare and unprepare (its worker follows it): a new supervisor
    on the same run dir and node registers the driver again and the claim unprepares from the
    checkpoint on disk."""
    with DraNode("pcie-l4") as node:
        node.wait_registered()
        ref = node.claims.allocate("default", "c1", POOL, ["gpu-1"])
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error == ""
        old = [p.pid for p in node.workers()]
        before = node.registrations()
        node.stop_supervisor(signal.SIGKILL)
        assert wait_until(lambda: gone(old), 15), "the workers outlived their supervisor"
        node.start_supervisor()
        node.wait_registered(more_than=before)
        assert node.prepared_uids() == {ref[2]}
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert node.prepared_uids() == set()


def test_an_xid_reaches_the_kubelets_health_stream_and_recovers() -> None:
    """XID 48 on a GPU: its device turns UNHEALTHY in the kubelet's health stream with the reason,
    a new claim on it is refused saying why, and after a GPU reset it is HEALTHY again."""
    with DraNode("pcie-l4") as node:
        node.wait_registered()
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-2") == "HEALTHY", 15)
        uuid = gpu_uuid(node, "gpu-2")
        node.sim("xid", device=uuid, xid=48)
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-2") == "UNHEALTHY", 15)
        seen = node.dra.health_seen(DRIVER)
        assert "XID 48" in seen[(POOL, "gpu-2")].message
        assert seen[(POOL, "gpu-1")].health == "HEALTHY"
        ref = node.claims.allocate("default", "c1", POOL, ["gpu-2"])
        assert "device gpu-2 is unhealthy" in node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error
        node.sim("reset", device=uuid)
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-2") == "HEALTHY", 15)
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error == ""


def test_sighup_switches_the_node_between_device_plugin_and_dra(tmp_path: Path) -> None:
    """A node in device-plugin mode with a container holding a GPU switches to dra by its config and
    SIGHUP: nvidia.com/gpu goes to 0 allocatable at the kubelet (the container keeps its Allocate
    answer), gpu.nvidia.com registers and prepares claims. Switching back while a claim holds gpu-3:
    nvidia.com/gpu returns for the 3 other GPUs only, the DRA worker stays registered to finish
    (the prepared claim answers as before, a new one is refused), and once the kubelet unprepares
    the claim gpu-3 is the device plugin's again and the DRA registration goes."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    with DraNode("pcie-l4", args=("--config-file", str(config))) as node:
        node.wait_listed([GPU])
        assert node.kubelet.allocatable(GPU) == 4
        held, answer = node.kubelet.allocate(GPU, 1)
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == held[0]
        assert not node.dra.registered(DRIVER)

        config.write_text("version: v1\ngpuvisor: {mode: dra}\n")
        sighup_and_wait(node)
        node.wait_registered()
        assert wait_until(lambda: node.kubelet.allocatable(GPU) == 0, 15)
        assert node.wait_ready()["workers"][0]["resource"] == DRIVER
        ref = node.claims.allocate("default", "c1", POOL, ["gpu-3"])
        first = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert first.error == ""

        config.write_text("version: v1\ngpuvisor: {mode: device-plugin}\n")
        sighup_and_wait(node)
        node.wait_listed([GPU])
        assert wait_until(lambda: node.kubelet.allocatable(GPU) == 3, 15), node.log()[-4000:]
        assert gpu_uuid(node, "gpu-3") not in node.kubelet.devices(GPU)
        assert node.dra.registered(DRIVER) and node.prepared_uids() == {ref[2]}
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]] == first  # a kubelet restart re-prepares
        late = node.claims.allocate("default", "c2", POOL, ["gpu-1"])
        refused = node.dra.prepare(DRIVER, [late]).claims[late[2]].error
        assert "serves its GPUs through the device plugin now" in refused

        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert wait_until(lambda: node.kubelet.allocatable(GPU) == 4, 15), node.log()[-4000:]
        assert node.dra.wait_for(lambda: not node.dra.registered(DRIVER), 15)
        assert sockets_in(node.registry_dir) == []
        assert node.prepared_uids() == set()
