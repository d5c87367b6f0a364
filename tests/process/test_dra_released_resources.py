"""A node switched from the device plugin to DRA: the kubelet's leftover `nvidia.com/gpu: 0` goes.

The kubelet stand-in here keeps the real kubelet's rules (tests/unit/test_kubelet_node_status.py
names the source of each): a gone plugin's devices are counted for a grace period (short here),
then the resource is forgotten and kept on the Node at 0, and its node-status updates reach the
fake API server. Kubernetes 1.34's scheduler serves `nvidia.com/gpu` through DRA only where the
Node lacks the key (pkg/scheduler/framework/plugins/dynamicresources `filterExtendedResources`),
so gpuvisor removes it, only once the kubelet has let go of it, with a JSON patch that tests the
value is still 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.dranode import POOL, DraNode
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

GPU = "nvidia.com/gpu"
GRACE_S = 4.0


@contextmanager
def _device_plugin_node(api: RunningApiServer) -> Iterator[DraNode]:
    """A node serving nvidia.com/gpu as a device plugin, its kubelet writing the Node's status."""
    node = DraNode("pcie-l4", args=(), api=api)
    node.kubelet.grace_s = GRACE_S
    node.kubelet.write_checkpoint = True
    with node:
        node.kubelet.node_status(lambda setter: api.state.kubelet_status(POOL, setter), interval=0.1)
        node.wait_listed([GPU])
        assert wait_until(lambda: _gpu(api) == ("4", "4"), 15)
        yield node


def _gpu(api: RunningApiServer) -> tuple[str | None, str | None]:
    with api.state.lock:
        status = api.state.nodes[POOL]["status"]
        return status.get("capacity", {}).get(GPU), status.get("allocatable", {}).get(GPU)


def _patches(api: RunningApiServer) -> list[Any]:
    return [
        r
        for r in api.state.calls("PATCH", f"/api/v1/nodes/{POOL}/status")
        if (r.content_type or "").startswith("application/json-patch+json")
    ]


def _to_dra(node: DraNode) -> None:
    node.stop_supervisor()
    node.args = ["--mode", "dra"]
    node.start_supervisor()
    node.wait_registered()


def _released(node: DraNode) -> dict[str, Any]:
    dra = node.command("status")["cluster"].get("dra") or {}
    return dra.get("released") or {}


def test_the_zero_key_goes_once_the_kubelet_lets_go_and_not_before(api: RunningApiServer) -> None:
    """Device plugin, then DRA: while the kubelet still counts the gone plugin's devices (4/0, its
    checkpoint lists the resource) nothing is patched; once it forgot the resource (0/0) gpuvisor
    removes the key from capacity and allocatable with a tested JSON patch, once, and status
    says so; the kubelet's later updates never write it back."""
    with _device_plugin_node(api) as node:
        _to_dra(node)
        assert wait_until(lambda: _gpu(api) == ("4", "0"), 15)
        assert wait_until(lambda: _released(node).get("state") == "waiting for the kubelet", 15), _released(
            node
        )
        assert _patches(api) == []
        assert wait_until(lambda: _gpu(api) == (None, None), GRACE_S + 20), node.log()[-3000:]
        (patch,) = _patches(api)
        forgotten = node.kubelet.forgotten[GPU]
        assert patch.at > forgotten
        assert patch.body == [
            {"op": "test", "path": "/status/capacity/nvidia.com~1gpu", "value": "0"},
            {"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"},
            {"op": "test", "path": "/status/allocatable/nvidia.com~1gpu", "value": "0"},
            {"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"},
        ]
        released = _released(node)
        assert released["removed"] == [GPU] and released["removals"] == 1 and released["readded"] == 0
        assert "removed nvidia.com/gpu from Node" in node.log()
        assert wait_until(lambda: node.kubelet.forgotten and len(_patches(api)) == 1, 2)
        assert _gpu(api) == (None, None)


def test_a_kubelet_restart_in_the_grace_period_holds_the_key_for_its_new_grace(api: RunningApiServer) -> None:
    """The kubelet restarts while it still has the resource (its checkpoint lists it): it writes
    0/0 for a new grace period; gpuvisor leaves the key until the kubelet forgot the resource
    again, then removes it; a resource the kubelet never had is never touched."""
    with _device_plugin_node(api) as node:
        with api.state.lock:
            api.state.nodes[POOL]["status"]["capacity"]["example.com/other"] = "0"
        _to_dra(node)
        assert wait_until(lambda: _gpu(api) == ("4", "0"), 15)
        node.kubelet.restart()
        restarted = node.kubelet.forgotten.get(GPU)
        assert wait_until(lambda: _gpu(api) == ("0", "0"), 15)
        assert _patches(api) == []
        assert wait_until(lambda: _gpu(api) == (None, None), GRACE_S + 25), node.log()[-3000:]
        assert node.kubelet.forgotten[GPU] != restarted
        (patch,) = _patches(api)
        assert patch.at > node.kubelet.forgotten[GPU]
        with api.state.lock:
            assert api.state.nodes[POOL]["status"]["capacity"]["example.com/other"] == "0"
