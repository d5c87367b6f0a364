"""resource.k8s.io/v1 at the fake API server (tests/kubeapi/) and the claim fetcher that reads it.

The fake must refuse what the real API server refuses, or the publisher's tests prove nothing: its
ResourceSlice and ResourceClaim rules are pinned here against the real server's behaviour (field
selectors it indexes, generateName, optimistic concurrency, immutable fields, preconditions,
dry runs, the DRADeviceTaints gate). Then `supervisor.dra.claims.ClaimFetcher` fetches claims
through the kube layer as the DRA worker's requests arrive. No process is started.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from common.messages import ClaimReply, ClaimRequest
from supervisor.dra.claims import ClaimFetcher
from supervisor.dra.slices import build_slices
from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.kube.errors import ApiError
from tests import nodes
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

NODE = "gpu-node-1"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def client(api: RunningApiServer) -> Iterator[KubeClient]:
    api.state.add_node(NODE)
    c = KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test")
    yield c
    c.close()


def a_slice(**spec: Any) -> dict[str, Any]:
    obj = build_slices(nodes.pcie_l4(), (), node_name=NODE)[0]
    obj["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "u-1", "controller": True}
    ]
    obj["spec"].update(spec)
    return obj


def test_a_slice_is_created_with_a_generated_name_and_listed_by_the_fields_the_server_indexes(
    api: RunningApiServer, client: KubeClient
) -> None:
    """generateName gets 5 characters appended; lists select by spec.nodeName and spec.driver (and
    both); a field the server does not index, as spec.pool.name, is a 400."""
    made = client.request("POST", SLICES, what="create", body=a_slice())
    assert made["metadata"]["name"].startswith(f"{NODE}-gpu.nvidia.com-")
    assert len(made["metadata"]["name"]) == len(f"{NODE}-gpu.nvidia.com-") + 5
    for selector, count in (
        (f"spec.nodeName={NODE}", 1),
        ("spec.nodeName=other", 0),
        (f"spec.nodeName={NODE},spec.driver=gpu.nvidia.com", 1),
        ("spec.driver!=gpu.nvidia.com", 0),
    ):
        answer = client.get(SLICES, what="list", query={"fieldSelector": selector})
        assert len(answer["items"]) == count, selector
    with pytest.raises(ApiError) as bad:
        client.get(SLICES, what="list", query={"fieldSelector": f"spec.pool.name={NODE}"})
    assert bad.value.status == 400 and "field label not supported: spec.pool.name" in bad.value.message


def test_slices_the_server_would_refuse_are_refused(api: RunningApiServer, client: KubeClient) -> None:
    """An unknown field (the strict schema), two controller owners, a device name that is no DNS
    label, a version that is no semver, no node at all: each a 422 naming it, recorded in errors."""
    owners = [{"apiVersion": "v1", "kind": "Node", "name": n, "uid": n, "controller": True} for n in "ab"]
    bad_version = a_slice()
    bad_version["spec"]["devices"][0]["attributes"]["driverVersion"] = {"version": "550.54"}
    cases = {
        "bogus": a_slice(bogus=1),
        "Only one reference": {**a_slice(), "metadata": {"generateName": "x-", "ownerReferences": owners}},
        "a DNS-1123 label": a_slice(devices=[{"name": "GPU_0"}]),
        "semantic version": bad_version,
        "exactly one of `nodeName`": a_slice(nodeName=None),
    }
    for words, body in cases.items():
        body = {k: v for k, v in body.items()}
        body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
        with pytest.raises(ApiError) as refused:
            client.request("POST", SLICES, what="create", body=body)
        assert refused.value.status == 422 and words in refused.value.message, words
    assert len(api.state.errors) >= len(cases) and api.state.resource_slices == {}


def test_updates_need_the_current_version_and_keep_what_is_immutable(
    api: RunningApiServer, client: KubeClient
) -> None:
    """A stale resourceVersion is 409; the driver, pool name and node name cannot change (422); a
    good update bumps the object's generation."""
    made = client.request("POST", SLICES, what="create", body=a_slice())
    path = f"{SLICES}/{made['metadata']['name']}"
    changed = copy.deepcopy(made)
    changed["spec"]["pool"]["generation"] = 2
    done = client.request("PUT", path, what="update", body=changed)
    assert done["metadata"]["generation"] == 2
    with pytest.raises(ApiError) as stale:
        client.request("PUT", path, what="update", body=changed)
    assert stale.value.conflict
    moved = copy.deepcopy(done)
    moved["spec"]["nodeName"] = "elsewhere"
    with pytest.raises(ApiError) as immutable:
        client.request("PUT", path, what="update", body=moved)
    assert immutable.value.status == 422 and "field is immutable" in immutable.value.message


def test_deletes_check_preconditions_and_a_collection_goes_by_selector(
    api: RunningApiServer, client: KubeClient
) -> None:
    """DELETE with a wrong UID precondition is 409 and deletes nothing; the right one deletes;
    a deletecollection by spec.nodeName (the kubelet's wipe) takes only that node's slices."""
    made = client.request("POST", SLICES, what="create", body=a_slice())
    other = a_slice(nodeName="other")
    other["spec"]["pool"]["name"] = "other"
    client.request("POST", SLICES, what="create", body=other)
    path = f"{SLICES}/{made['metadata']['name']}"
    with pytest.raises(ApiError) as wrong:
        client.request("DELETE", path, what="delete", body={"preconditions": {"uid": "nope"}})
    assert wrong.value.conflict and "Precondition failed" in wrong.value.message
    client.request("DELETE", path, what="delete", body={"preconditions": {"uid": made["metadata"]["uid"]}})
    assert api.state.slices(NODE) == []
    client.request("POST", SLICES, what="create", body=a_slice())
    client.request("DELETE", SLICES, what="wipe", query={"fieldSelector": f"spec.nodeName={NODE}"})
    assert api.state.slices(NODE) == [] and len(api.state.slices("other")) == 1


def test_a_dry_run_stores_nothing_and_a_server_without_the_gate_drops_taints(
    api: RunningApiServer, client: KubeClient
) -> None:
    """dryRun=All answers as a create would and stores nothing; with DRADeviceTaints off the
    answer (and what is stored) has no taints."""
    tainted = a_slice()
    tainted["spec"]["devices"][0]["taints"] = [
        {
            "key": "gpu.nvidia.com/xid",
            "value": "48",
            "effect": "NoSchedule",
            "timeAdded": "2026-01-01T00:00:00Z",
        }
    ]
    answer = client.request("POST", SLICES, what="probe", query={"dryRun": "All"}, body=tainted)
    assert answer["spec"]["devices"][0]["taints"][0]["value"] == "48" and api.state.resource_slices == {}
    api.state.device_taints = False
    stored = client.request("POST", SLICES, what="create", body=tainted)
    assert "taints" not in stored["spec"]["devices"][0]
    assert all("taints" not in d for s in api.state.slices(NODE) for d in s["spec"]["devices"])


def test_claims_are_served_as_allocated_and_checked_when_stored(
    api: RunningApiServer, client: KubeClient
) -> None:
    """add_claim stores an allocated claim (schema-checked); GET gives it, an absent one is a JSON
    404; a claim the API server would refuse is refused by put_claim too."""
    ns, name, uid = api.state.add_claim("default", "c1", NODE, ["gpu-0"])
    got = client.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}", what="get")
    assert got["metadata"]["uid"] == uid
    assert got["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    with pytest.raises(ApiError) as missing:
        client.get("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/nope", what="get")
    assert missing.value.not_found
    with pytest.raises(ValueError, match="unexpected"):
        api.state.put_claim({**got, "spec": {"devices": {"requests": [{"name": "x", "bogus": 1}]}}})


class Replies:
    def __init__(self) -> None:
        self.got: dict[str, ClaimReply] = {}
        self.lock = threading.Lock()

    def __call__(self, resource: str, reply: ClaimReply) -> None:
        assert resource == "gpu.nvidia.com"
        with self.lock:
            self.got[reply.request_id] = reply


def test_the_fetcher_answers_each_request_with_the_claim_or_why_not(
    api: RunningApiServer, client: KubeClient
) -> None:
    """A request queued before the API client is up waits for it; then each is answered: the claim
    as JSON, not found (flagged), or the server's refusal (RBAC) in its words."""
    replies = Replies()
    fetcher = ClaimFetcher(reply=replies)
    try:
        ns, name, uid = api.state.add_claim("default", "c1", NODE, ["gpu-1"])
        fetcher.request(ClaimRequest("gpu.nvidia.com", "1", ns, name))
        assert replies.got == {}
        fetcher.start(client)
        fetcher.request(ClaimRequest("gpu.nvidia.com", "2", "default", "absent"))
        assert wait_until(lambda: len(replies.got) == 2)
        assert json.loads(replies.got["1"].claim_json)["metadata"]["uid"] == uid
        assert replies.got["2"].not_found and "not found" in replies.got["2"].error
        api.state.allow = {("get", "nodes")}
        fetcher.request(ClaimRequest("gpu.nvidia.com", "3", ns, name))
        assert wait_until(lambda: "3" in replies.got)
        assert 'cannot get resource "resourceclaims"' in replies.got["3"].error
        assert not replies.got["3"].not_found
        assert fetcher.status()["fetched"] == 1 and fetcher.status()["failed"] == 1
    finally:
        fetcher.close()


def test_a_request_the_api_side_never_takes_up_is_answered_after_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No API client comes (no credentials): the request is answered with why once its wait is
    over, before the worker's own timeout."""
    from supervisor.dra import claims

    monkeypatch.setattr(claims, "START_WAIT_S", 0.2)
    replies = Replies()
    fetcher = ClaimFetcher(reply=replies)
    try:
        fetcher.request(ClaimRequest("gpu.nvidia.com", "1", "default", "c1"))
        assert wait_until(lambda: "1" in replies.got, 5)
        assert "link to the API server is not up" in replies.got["1"].error
    finally:
        fetcher.close()
