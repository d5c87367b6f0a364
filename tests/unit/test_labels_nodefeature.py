"""GFD's NodeFeature output against a local HTTPS endpoint that answers as the API server does.

The endpoint (`tests/kubeapi/`) serves the documented REST paths over TLS with a bearer token,
and checks every object sent against NFD v0.19.0's NodeFeature CRD schema; the labeller reaches
it through gpuvisor's API-server layer (supervisor/kube) and a kubeconfig, as on a cluster. What
GFD v0.20.0 sends is in internal/lm/output.go:115-218. The last tests pin what a real
kube-apiserver v1.34 showed wrong in the old client: a frozen server held a pass (and a stop),
a missing CRD was reported as a bare 404 after a create attempt, and the user agent was the
Python client's.
"""

from __future__ import annotations

import http
import threading
import time
from pathlib import Path

import pytest

from supervisor.kube.credentials import load_credentials
from supervisor.kube.errors import CredentialsError
from supervisor.labels.nodefeature import (
    NodeFeaturePublisher,
    PublishConfigError,
    PublishError,
    node_feature_object,
)
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
    """A refused call is a PublishError naming the object, the status and the server's message."""
    api.state.add_daemonset_pod(NS, POD)
    pub = publisher(api)
    pub.owners = []  # owners resolved already: the injected failure hits the NodeFeature call
    api.state.fail_next[method] = (code, reason)
    with pytest.raises(PublishError) as err:
        pub.publish(LABELS)
    assert http.HTTPStatus(code)
    assert (
        str(err.value)
        == f"failed to {what} NodeFeature object {NS}/{NAME}: {code} {reason}: injected {reason}"
    )


def test_conflict_on_update_is_an_error(api: RunningApiServer) -> None:
    """A PUT with a stale resourceVersion gets the server's 409 Conflict, reported (output.go:166-169)."""
    pub = publisher(api, pod="")
    pub.publish(LABELS)
    api.state.fail_next["PUT"] = (409, "Conflict")
    with pytest.raises(PublishError, match=r"failed to update NodeFeature object .*: 409 Conflict"):
        pub.publish({**LABELS, "nvidia.com/gpu.count": "7"})


def test_untrusted_server_certificate_is_refused(api: RunningApiServer, tmp_path: Path) -> None:
    """A kubeconfig whose CA did not sign the server's certificate fails TLS verification."""
    (tmp_path / "other").mkdir()
    other = RunningApiServer(tmp_path / "other")
    try:
        config = tmp_path / "wrong-ca"
        config.write_text(api.kubeconfig_text(other.ca_data))  # api's address, the other server's CA
        pub = NodeFeaturePublisher(node_name=NODE, namespace=NS, kubeconfig=str(config))
        with pytest.raises(
            PublishError, match=r"failed to get NodeFeature object .*CERTIFICATE_VERIFY_FAILED"
        ):
            pub.publish(LABELS)
        assert api.state.calls() == []  # the handshake failed before any request
    finally:
        other.close()


def test_client_configuration_errors_are_clear(tmp_path: Path) -> None:
    """No kubeconfig and not in a pod, or an unreadable kubeconfig: an error saying which source
    failed; at the first publish it is a PublishError; no node name is refused at once."""
    with pytest.raises(CredentialsError, match="not in a pod: KUBERNETES_SERVICE_HOST"):
        load_credentials("", {})
    with pytest.raises(CredentialsError, match=f"kubeconfig {tmp_path / 'missing'}: cannot read file"):
        load_credentials(str(tmp_path / "missing"), {})
    pub = NodeFeaturePublisher(node_name=NODE, namespace=NS, kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(PublishError, match="cannot read file"):
        pub.publish(LABELS)
    with pytest.raises(PublishConfigError, match="node name"):
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


def test_a_missing_crd_is_named_and_nothing_is_created(api: RunningApiServer) -> None:
    """Without NFD's CRD the real server answers the GET with a plain-text `404 page not found`:
    the error says the CRD is not installed, no create is tried, and nothing counts as published."""
    api.state.crds.clear()
    pub = publisher(api, pod="")
    with pytest.raises(PublishError, match="is node-feature-discovery's NodeFeature CRD installed") as err:
        pub.publish(LABELS)
    assert "404 page not found" in str(err.value)
    assert err.value.published is False
    assert api.state.calls("POST") == []


def test_an_object_deleted_with_its_crd_is_no_longer_called_published(api: RunningApiServer) -> None:
    """Published, then the CRD (and with it the object) is deleted: the next failure says the labels
    are gone (published False), not that they stay in place."""
    pub = publisher(api, pod="")
    pub.publish(LABELS)
    assert pub.published is True
    api.state.crds.clear()
    api.state.node_features.clear()
    with pytest.raises(PublishError) as err:
        pub.publish(LABELS)
    assert err.value.published is False


def test_requests_name_gpuvisor_as_user_agent_and_field_manager(api: RunningApiServer) -> None:
    """Every request carries gpuvisor's user agent; writes name gpuvisor as field manager."""
    api.state.add_daemonset_pod(NS, POD)
    publisher(api).publish(LABELS)
    calls = api.state.calls()
    assert calls and all(
        r.user_agent.startswith("gpuvisor/") and r.user_agent.endswith(" labels") for r in calls
    )
    assert [r.query.get("fieldManager") for r in api.state.calls("POST")] == ["gpuvisor"]
    assert {r.manager for r in calls} == {"gpuvisor"}


def test_a_frozen_server_holds_a_publish_only_until_abort(api: RunningApiServer) -> None:
    """Against a server that accepts and never answers, abort() (a stop) ends the call at once:
    no read timeout, no retries."""
    pub = publisher(api, pod="")
    pub.publish(LABELS)
    api.state.freeze()
    started = time.monotonic()
    threading.Timer(0.3, pub.abort).start()
    with pytest.raises(PublishError, match="stopped"):
        pub.publish({**LABELS, "nvidia.com/gpu.count": "7"})
    assert time.monotonic() - started < 3.0
