"""The fake API server's tally (tests/kubeapi/tally.py): the fleet benchmark's counts by verb,
resource and node rest on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.kube.errors import ApiError
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer
from tests.kubeapi.tally import resource_of, verb_of


@pytest.mark.parametrize(
    ("method", "path", "query", "verb", "resource"),
    [
        ("GET", "/api/v1/nodes", {}, "list", "nodes"),
        ("GET", "/api/v1/nodes", {"watch": "true"}, "watch", "nodes"),
        ("GET", "/api/v1/nodes/n1", {}, "get", "nodes"),
        ("PATCH", "/api/v1/nodes/n1/status", {}, "patch", "nodes/status"),
        ("POST", "/api/v1/namespaces/default/events", {}, "create", "events"),
        ("PATCH", "/api/v1/namespaces/default/events/e1", {}, "patch", "events"),
        ("PUT", "/apis/resource.k8s.io/v1/resourceslices/s1", {}, "update", "resourceslices"),
        ("DELETE", "/apis/resource.k8s.io/v1/resourceslices", {}, "deletecollection", "resourceslices"),
        ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/s1", {}, "delete", "resourceslices"),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1", {}, "get", "resourceclaims"),
        ("PUT", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1/status", {}, "update", "resourceclaims/status"),
        ("GET", "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/ns/nodefeatures/f", {}, "get", "nodefeatures"),
        ("GET", "/api/v1/namespaces/ns", {}, "get", "namespaces"),
    ],
)  # fmt: skip
def test_verb_and_resource_are_the_api_servers_names(
    method: str, path: str, query: dict[str, str], verb: str, resource: str
) -> None:
    """As k8s.io/apiserver's requestinfo.go names them: GET of a collection is `list`, with
    watch=true `watch`, of one object `get`; DELETE of a collection `deletecollection`; a
    subresource follows its resource after "/"."""
    assert verb_of(method, path, query) == verb
    assert resource_of(path)[0] == resource


def test_requests_and_open_watches_are_counted_per_user(api: RunningApiServer, tmp_path: Path) -> None:
    """Each node's token names its user: its list, get and watch are counted apart from the other
    node's, an open watch is counted while it streams and no more once it ended, and a request with
    a token the server does not know is counted under no user (and refused)."""
    api.state.add_node("n1")
    api.state.bookmark_s = 0.2  # the server finds a stream's client gone when it next writes to it
    clients = {
        name: KubeClient(
            load_credentials(str(api.kubeconfig_for(name, tmp_path / name)), {}), component="t", version="0"
        )
        for name in ("node-1", "node-2")
    }
    try:
        clients["node-1"].get("/api/v1/nodes", what="list")
        clients["node-2"].get("/api/v1/nodes/n1", what="get")
        stream = clients["node-1"].stream(
            "/api/v1/nodes",
            what="watch",
            query={"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "30"},
            timeout=30,
        )
        assert next(stream)["type"] == "ADDED"
        counts, watches = api.state.tally.snapshot()
        assert counts[("list", "nodes", "node-1")] == 1 and counts[("get", "nodes", "node-2")] == 1
        assert counts[("watch", "nodes", "node-1")] == 1 and watches == {("nodes", "node-1"): 1}
        stream.close()
        assert wait_until(lambda: not api.state.tally.snapshot()[1], 10)
        (tmp_path / "bad").write_text(api.kubeconfig_text(api.ca_data, "not-a-token"))
        stranger = KubeClient(load_credentials(str(tmp_path / "bad"), {}), component="t", version="0")
        with pytest.raises(ApiError):
            stranger.get("/api/v1/nodes", what="list")
        stranger.close()
        assert api.state.tally.snapshot()[0][("list", "nodes", "")] == 1
    finally:
        for client in clients.values():
            client.close()
