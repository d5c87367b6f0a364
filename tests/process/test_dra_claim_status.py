"""A prepared claim's device health in the ResourceClaim's own status (KEP-4817), end to end.

Kubelet 1.34 shows a failed GPU in a pod's `allocatedResourcesStatus` only for a claim the pod
references by its own name (pkg/kubelet/cm/dra/manager.go matched the pod's claim name to the
ResourceClaim's name; kubernetes#134875, in 1.35, looks the real name up in
`pod.status.resourceClaimStatuses`), so for a claim made from a template the pod status stays
empty. The claim's `status.devices` is the driver's own to write: the fake API server checks it
as pkg/apis/resource/validation `validateResourceClaimStatusUpdate` does (an allocated device of
the claim, at most 8 valid conditions), takes it only on the status subresource with the stored
resourceVersion, and can refuse it (RBAC, the gate off).
"""

from __future__ import annotations

from typing import Any

from tests.dranode import DRIVER, POOL, DraNode
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

ALL = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]


def _devices(api: RunningApiServer, name: str) -> list[dict[str, Any]]:
    with api.state.lock:
        claim = api.state.resource_claims.get(("default", name)) or {}
        return list((claim.get("status") or {}).get("devices") or [])


def _conditions(api: RunningApiServer, name: str) -> dict[str, tuple[str, str]]:
    """Device -> (status, reason) of its Healthy condition."""
    out = {}
    for entry in _devices(api, name):
        (cond,) = entry["conditions"]
        assert cond["type"] == "Healthy"
        out[entry["device"]] = (cond["status"], cond["reason"])
    return out


def _uuid(node: DraNode, device: str) -> str:
    from tests.process.test_dra_api_e2e import plan_of

    return next(d.gpu_uuid for d in plan_of(node).devices if d.id == device)


def test_a_prepared_claim_shows_its_devices_health_until_unprepared(api: RunningApiServer) -> None:
    """Prepared: one entry per device of this driver, Healthy True; an XID 48 on one GPU turns its
    condition False with the Node's reason and the health book's words; a reset turns it True;
    an unprepare clears this driver's entries and keeps another driver's."""
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30)
        ref = node.claim("from-template-abc12", ["gpu-1", "gpu-2"])
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert wait_until(
            lambda: (
                _conditions(api, ref[1])
                == {"gpu-1": ("True", "DeviceHealthy"), "gpu-2": ("True", "DeviceHealthy")}
            ),
            30,
        ), node.log()[-3000:]
        entry = _devices(api, ref[1])[0]
        assert (entry["driver"], entry["pool"]) == (DRIVER, POOL)
        node.sim("xid", device=_uuid(node, "gpu-2"), xid=48)
        assert wait_until(lambda: _conditions(api, ref[1]).get("gpu-2") == ("False", "XidCriticalError"), 30)
        message = next(e for e in _devices(api, ref[1]) if e["device"] == "gpu-2")["conditions"][0]["message"]
        assert "48" in message, message
        assert _conditions(api, ref[1])["gpu-1"] == ("True", "DeviceHealthy")
        node.sim("reset", device=_uuid(node, "gpu-2"))
        assert wait_until(lambda: _conditions(api, ref[1]).get("gpu-2") == ("True", "DeviceHealthy"), 30)
        with api.state.lock:  # another driver's entry, as its own kubelet plugin would write it
            claim = api.state.resource_claims[("default", ref[1])]
            claim["status"]["allocation"]["devices"]["results"].append(
                {"request": "gpu", "driver": "nic.example.com", "pool": POOL, "device": "nic-0"}
            )
            claim["status"]["devices"].append({"driver": "nic.example.com", "pool": POOL, "device": "nic-0"})
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert wait_until(lambda: [e["driver"] for e in _devices(api, ref[1])] == ["nic.example.com"], 30)
        assert api.state.errors == []
        status = node.command("status")["cluster"]["dra"]["claim_status"]
        assert status["writes"] >= 3 and status["cleared"] == 1 and status["error"] is None


def test_an_api_server_that_refuses_the_status_costs_a_log_line_not_a_prepare(api: RunningApiServer) -> None:
    """Without RBAC for resourceclaims/status the claim still prepares and unprepares; the 403 is
    logged once, counted and in status."""
    api.state.allow = {
        ("get", "nodes"),
        ("get", "resourceclaims"),
        ("list", "resourceclaims"),
        ("watch", "resourceclaims"),
        *(
            (verb, "resourceslices")
            for verb in ("create", "get", "list", "watch", "update", "patch", "delete")
        ),
        ("patch", "nodes/status"),
    }
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        ref = node.claim("c1", ["gpu-0"])
        assert node.dra.prepare(DRIVER, [ref]).claims[ref[2]].error == ""
        assert wait_until(
            lambda: "forbidden" in str(node.command("status")["cluster"]["dra"]["claim_status"]["error"]), 15
        ), node.log()[-3000:]
        line = "cannot write the health of prepared claims"
        assert wait_until(lambda: line in node.log(), 30)
        failures = node.command("status")["cluster"]["dra"]["claim_status"]["failures"]
        assert wait_until(
            lambda: node.command("status")["cluster"]["dra"]["claim_status"]["failures"] > failures, 15
        )
        assert node.log().count(line) == 1  # retried, said once
        assert _devices(api, "c1") == []
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
