"""GFD's NodeFeature output against a local HTTPS endpoint that answers as the API server does.

The endpoint (`tests/kubeapi.py`) serves the documented REST paths over TLS with a bearer token,
and checks every object sent against NFD v0.19.0's NodeFeature CRD schema; the labeller reaches
it with the Kubernetes project's Python client through a kubeconfig, as on a cluster. What GFD
v0.20.0 sends is in internal/lm/output.go:115-218.
"""

from __future__ import annotations

import http
from pathlib import Path

import pytest

from supervisor.labels.nodefeature import ApiError, NodeFeaturePublisher, api_client_for, node_feature_object
from tests.kubeapi import RunningApiServer, node_feature_problems

NS, NODE, POD = "gpuvisor", "gpu-node-1", "gpuvisor-labels-x7k2p"
NAME = "nvidia-features-for-gpu-node-1"  # output.go:115, 130


def publisher(api: RunningApiServer, pod: str = POD, **kw: object) -> NodeFeaturePublisher:
    return NodeFeaturePublisher(
        node_name=NODE,
        namespace=NS,
        pod_name=pod,
        kubeconfig=str(api.kubeconfig),
        **kw,  # type: ignore[arg-type]
    )


LABELS = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_create_sends_gfds_object(api: RunningApiServer) -> None:
    """First publish: GET 404, then POST of GFD's object: name, node-name label, owners DaemonSet (controller) and Pod."""
    pod = api.state.add_daemonset_pod(NS, POD)
    assert publisher(api).publish(LABELS) == "created"
    assert [(r.method, r.path) for r in api.state.calls()] == [
        ("GET", f"/api/v1/namespaces/{NS}/pods/{POD}"),  # output.go:182 owner references
        ("GET", f"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{NS}/nodefeatures/{NAME}"),  # output.go:132
        ("POST", f"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{NS}/nodefeatures"),  # output.go:147
    ]
    sent = api.state.calls("POST")[0].body
    daemonset = pod["metadata"]["ownerReferences"][0]
    assert sent == {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
        "kind": "NodeFeature",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "labels": {"nfd.node.kubernetes.io/node-name": NODE},  # output.go:142
            "ownerReferences": [  # output.go:200-215
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": daemonset["name"],
                    "uid": daemonset["uid"],
                    "controller": True,
                },
                {"apiVersion": "v1", "kind": "Pod", "name": POD, "uid": pod["metadata"]["uid"]},
            ],
        },
        "spec": {
            "features": {"flags": {}, "attributes": {}, "instances": {}},
            "labels": LABELS,
        },  # output.go:145
    }
    assert api.state.errors == []


def test_same_labels_send_nothing_more(api: RunningApiServer) -> None:
    """Unchanged labels: one GET and no write (output.go:160-163); the owner lookup is done once."""
    api.state.add_daemonset_pod(NS, POD)
    pub = publisher(api)
    pub.publish(LABELS)
    before = len(api.state.calls())
    assert pub.publish(dict(LABELS)) == "unchanged"
    assert [r.method for r in api.state.calls()[before:]] == ["GET"]


def test_changed_labels_replace_the_object_with_its_resource_version(api: RunningApiServer) -> None:
    """Changed labels: PUT of the object read, with its resourceVersion, new labels and the same owners (output.go:155-169)."""
    api.state.add_daemonset_pod(NS, POD)
    pub = publisher(api)
    pub.publish(LABELS)
    stored = api.state.node_features[(NS, NAME)]
    new = {**LABELS, "nvidia.com/gpu.replicas": "4"}
    assert pub.publish(new) == "updated"
    put = api.state.calls("PUT")[-1]
    assert put.path == f"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{NS}/nodefeatures/{NAME}"
    assert put.body["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert api.state.node_features[(NS, NAME)]["spec"]["labels"] == new
    assert api.state.errors == []


def test_an_object_changed_by_someone_else_is_put_back(api: RunningApiServer) -> None:
    """Another writer's labels or owners differ from ours: GFD's comparison sees it and replaces them."""
    api.state.add_daemonset_pod(NS, POD)
    pub = publisher(api)
    pub.publish(LABELS)
    api.state.node_features[(NS, NAME)]["metadata"]["labels"]["extra"] = "x"
    assert pub.publish(LABELS) == "updated"
    assert api.state.node_features[(NS, NAME)]["metadata"]["labels"] == {
        "nfd.node.kubernetes.io/node-name": NODE
    }


@pytest.mark.parametrize("case", ["no pod name", "pod not found", "not a DaemonSet's"])
def test_no_owner_references_when_they_cannot_be_resolved(api: RunningApiServer, case: str) -> None:
    """No POD_NAME, an unknown pod or a pod no DaemonSet owns: the object has no owners (output.go:177-198)."""
    if case == "not a DaemonSet's":
        api.state.add_daemonset_pod(NS, POD)["metadata"]["ownerReferences"][0]["kind"] = "ReplicaSet"
    pub = publisher(api, pod="" if case == "no pod name" else POD)
    assert pub.publish(LABELS) == "created"
    assert "ownerReferences" not in api.state.calls("POST")[0].body["metadata"]
    assert api.state.errors == []


@pytest.mark.parametrize(
    ("method", "code", "reason", "what"),
    [("GET", 403, "Forbidden", "get"), ("POST", 500, "InternalError", "create")],
)
def test_api_errors_are_one_line(
    api: RunningApiServer, method: str, code: int, reason: str, what: str
) -> None:
    """A refused call is an ApiError naming the object, the status and the server's message."""
    api.state.add_daemonset_pod(NS, POD)
    pub = publisher(api)
    pub.owners = []  # owners resolved already: the injected failure hits the NodeFeature call
    api.state.fail_next[method] = (code, reason)
    with pytest.raises(ApiError) as err:
        pub.publish(LABELS)
    phrase = http.HTTPStatus(code).phrase
    assert (
        str(err.value)
        == f"failed to {what} NodeFeature object {NS}/{NAME}: {code} {phrase}: injected {reason}"
    )


def test_conflict_on_update_is_an_error(api: RunningApiServer) -> None:
    """A PUT with a stale resourceVersion gets the server's 409 Conflict, reported (output.go:166-169)."""
    pub = publisher(api, pod="")
    pub.publish(LABELS)
    api.state.fail_next["PUT"] = (409, "Conflict")
    with pytest.raises(ApiError, match=r"failed to update NodeFeature object .*: 409 Conflict"):
        pub.publish({**LABELS, "nvidia.com/gpu.count": "7"})


def test_untrusted_server_certificate_is_refused(api: RunningApiServer, tmp_path: Path) -> None:
    """A kubeconfig whose CA did not sign the server's certificate fails TLS verification."""
    (tmp_path / "other").mkdir()
    other = RunningApiServer(tmp_path / "other")
    try:
        config = tmp_path / "wrong-ca"
        config.write_text(api.kubeconfig_text(other.ca_data))  # api's address, the other server's CA
        pub = NodeFeaturePublisher(node_name=NODE, namespace=NS, kubeconfig=str(config))
        with pytest.raises(ApiError, match="failed to get NodeFeature object"):
            pub.publish(LABELS)
        assert api.state.calls() == []  # the handshake failed before any request
    finally:
        other.close()


def test_client_configuration_errors_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kubeconfig and not in a pod, or an unreadable kubeconfig: an ApiError saying which source failed."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ApiError, match="in-cluster service account"):
        api_client_for("")
    with pytest.raises(ApiError, match=f"kubeconfig {tmp_path / 'missing'}"):
        api_client_for(str(tmp_path / "missing"))
    with pytest.raises(ApiError, match="node name"):
        NodeFeaturePublisher(node_name="", namespace=NS)


def test_the_schema_check_can_fail() -> None:
    """The CRD check really refuses what the API server would: a wrong type, an unknown field, a bad name."""
    good = node_feature_object(NODE, NS, LABELS, [])
    assert node_feature_problems(good, NS, None) == []
    wrong_type = node_feature_object(NODE, NS, {"a": 1}, [])  # type: ignore[dict-item]
    assert any("spec.labels.a" in p for p in node_feature_problems(wrong_type, NS, None))
    unknown = node_feature_object(NODE, NS, LABELS, [])
    unknown["spec"]["lables"] = {}
    assert any("lables" in p for p in node_feature_problems(unknown, NS, None))
    no_spec = {k: v for k, v in good.items() if k != "spec"}
    assert any("'spec' is a required property" in p for p in node_feature_problems(no_spec, NS, None))
    assert node_feature_problems(node_feature_object("Bad_Node", NS, LABELS, []), NS, None)
