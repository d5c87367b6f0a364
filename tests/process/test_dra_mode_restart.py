"""A restart that changes the mode between DRA and the device plugin: never both APIs for one GPU.

On a real v1.34 node, a SIGTERM in DRA mode followed by a start in device-plugin mode offered all
8 GPUs to the kubelet at once while the old ResourceSlices stayed at the API server for about
30 s, until the kubelet wiped them (it deletes a driver's slices 30 s after its plugin went).
These tests run the real supervisor twice on one simulated node (the same plugin, registry and
run dirs, as a DaemonSet pod's host paths), with the fake API server and the kubelet stand-ins:

- DRA, then device plugin: the pool is withdrawn before the kubelet hears of any device;
- the same with the API server away: the device plugin waits no longer than the bound, then
  offers the GPUs, and the pool goes once the API server is back;
- DRA, then DRA again (a rolling update): the pool is not withdrawn.
"""

from __future__ import annotations

import os

from supervisor.control.commands import CommandError
from supervisor.dra.earlier import BOUND_S
from tests.dranode import DRIVER, DraNode
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

GPU = "nvidia.com/gpu"
ALL = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _first_life_in_dra_mode(node: DraNode) -> list[str]:
    """Run the node in DRA mode until its pool is published, then SIGTERM it: the slices' names."""
    node.wait_registered()
    assert wait_until(lambda: sorted(node.published()) == ALL, 30), node.log()[-4000:]
    names = [s["metadata"]["name"] for s in node.slices()]
    assert node.stop_supervisor() == 0
    assert [s["metadata"]["name"] for s in node.slices()] == names  # a stop leaves the pool
    return names


def _ready_detail(node: DraNode) -> str:
    """The supervisor's readiness line, or "" while its control socket is not up yet."""
    try:
        return str(node.command("status").get("ready_detail"))
    except CommandError:
        return ""


def _registered_at(node: DraNode, resource: str) -> float | None:
    endpoint = node.kubelet.resource(resource)
    return endpoint.endpoint.registered_at if endpoint is not None and endpoint.endpoint else None


def test_a_start_in_device_plugin_mode_withdraws_the_earlier_pool_before_offering_a_gpu(
    api: RunningApiServer,
) -> None:
    """DRA, SIGTERM, then device-plugin mode on the same node: every slice of the earlier pool is
    deleted (with its UID as a precondition) before the device plugin registers with the kubelet,
    and then every GPU is offered; the evidence (the DRA worker's empty dir) is cleaned up, so a
    further start asks the API server nothing."""
    with DraNode("pcie-l4", api=api) as node:
        names = _first_life_in_dra_mode(node)
        assert os.path.isdir(os.path.join(node.plugins_dir, DRIVER))
        restarted = len(api.state.requests)
        node.args = []  # the next life runs as a device plugin
        node.start_supervisor()
        node.wait_listed([GPU])
        assert node.kubelet.capacity(GPU) == 4
        assert node.slices() == []
        deletes = [
            r for r in api.state.requests[restarted:] if r.method == "DELETE" and r.path.startswith(SLICES)
        ]
        assert sorted(r.path.rsplit("/", 1)[1] for r in deletes) == sorted(names)
        assert all(r.body["preconditions"]["uid"] for r in deletes)
        registered = _registered_at(node, GPU)
        assert registered is not None and max(r.at for r in deletes) < registered
        status = node.command("status")
        assert status["earlier_dra_pool"]["state"] == "withdrawn", status["earlier_dra_pool"]
        assert status["earlier_dra_pool"]["deleted"] == len(names)
        assert not os.path.exists(os.path.join(node.plugins_dir, DRIVER))
        # A third life in device-plugin mode finds no evidence: not one request before it registers.
        assert node.stop_supervisor() == 0
        third = len(api.state.requests)
        node.start_supervisor()
        node.wait_listed([GPU])
        assert node.command("status")["earlier_dra_pool"] is None
        assert [r for r in api.state.requests[third:] if r.path.startswith(SLICES)] == []


def test_with_the_api_server_away_the_device_plugin_waits_only_the_bound(api: RunningApiServer) -> None:
    """The API server is away when the node comes back in device-plugin mode: the GPUs are not kept
    from the kubelet past the bound (BOUND_S), status says why it waited and what failed, and the
    earlier pool is withdrawn once the API server answers again."""
    with DraNode("pcie-l4", api=api) as node:
        _first_life_in_dra_mode(node)
        api.stop()
        node.args = []
        node.start_supervisor()
        assert wait_until(lambda: "withdrawing the DRA pool" in _ready_detail(node), 15), node.log()[-3000:]
        node.wait_listed([GPU], timeout=BOUND_S + 20)
        status = node.command("status")["earlier_dra_pool"]
        assert status["state"] == "withdrawing" and status["error"], status
        assert "offers the GPUs now" in node.log()
        api.start()
        assert wait_until(lambda: node.slices() == [], 45), node.log()[-4000:]
        assert wait_until(lambda: node.command("status")["earlier_dra_pool"]["state"] == "withdrawn", 15)
        assert node.kubelet.capacity(GPU) == 4


def test_a_restart_that_stays_in_dra_mode_keeps_the_pool(api: RunningApiServer) -> None:
    """A rolling update in DRA mode: the new life never deletes the pool's slices (it publishes the
    same pool again), and status says the earlier pool was kept."""
    with DraNode("pcie-l4", api=api) as node:
        _first_life_in_dra_mode(node)
        restarted = len(api.state.requests)
        node.start_supervisor()
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30), node.log()[-4000:]
        assert node.command("status")["earlier_dra_pool"]["state"] == "kept"
        assert [r for r in api.state.requests[restarted:] if r.method == "DELETE"] == []
