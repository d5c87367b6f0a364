"""The chart's node restriction (deploy/helm/gpuvisor/templates/admission-policy.yaml): its CEL, run.

The policy's matchConditions, variables and validations are read from the chart as Helm renders it
(not a copy) and evaluated with cel-expr-python, the Python binding of Google's cel-cpp, against
the writes gpuvisor's own code makes: the GPUUnhealthy condition patch of the Node's status
(supervisor/cluster/writer.py), its Events and their count patches (supervisor/kube/recorder.py),
the labeller's NodeFeature (supervisor/labels/nodefeature.py) and the DRA pool's ResourceSlices
(supervisor/dra/slices.py). The writers talk to `Admitting`, a client stand-in that keeps the
objects, applies each write as the fake API server does (tests/kubeapi/patch.py: strategic merge by
`type`) and hands the policy what the API server's admission hands it: `request` an
admission.k8s.io/v1 AdmissionRequest as JSON (its `omitempty` fields left out, so a user without
extra has no `extra`; a PATCH is an UPDATE; a cluster-scoped object has no namespace), `object` the
object after the write (null on DELETE), `oldObject` the one before (null on CREATE), `variables`
the policy's variables, each evaluated in order.

The admission rules applied here are Kubernetes' (staging/src/k8s.io/apiserver/pkg/admission/plugin/
policy/validating): every match condition true applies the policy; then each validation false is a
refusal with its messageExpression (its message where that fails); an evaluation error is a
refusal under failurePolicy Fail. Dialect: Kubernetes evaluates with cel-go plus its extension
libraries (strings, lists, regex, quantity, authz...); the policy keeps to CEL's core (has(), the
`all` macro, `in` on maps and lists, `?:`, string `+`), which both implementations share, and this
test compiles each expression in an environment with no extension at all, so one that slipped an
extension function in fails here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from supervisor.cluster.health import NodeCondition, NodeEvent
from supervisor.cluster.writer import NodeHealthWriter
from supervisor.dra.slices import build_slices
from supervisor.kube.client import STRATEGIC_MERGE, KubeClient
from supervisor.kube.errors import ApiError
from supervisor.labels.nodefeature import NodeFeaturePublisher
from tests import helpers, manifests, nodes
from tests.kubeapi.patch import JSON_PATCH, json_patch, strategic_merge

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")
cel = pytest.importorskip("cel_expr_python.cel", reason="cel-expr-python is not installed (test extra)")

REPO = Path(helpers.REPO)
CHART = REPO / "deploy" / "helm" / "gpuvisor"
KUSTOMIZE_POLICY = REPO / "deploy" / "kubernetes" / "base" / "node-restriction.yaml"
NAMESPACE = "gpu-system"
PLUGIN = f"system:serviceaccount:{NAMESPACE}:gpuvisor"
LABELLER = f"system:serviceaccount:{NAMESPACE}:gpuvisor-gpu-feature-discovery"
NODE_A, NODE_B = "gpu-node-a", "gpu-node-b"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"  # k8s.io/apiserver serviceaccount.NodeNameKey
# What the chart renders with both service accounts writing (the plugin with DRA, the labeller's
# NodeFeature), so that the policy names both.
VALUES: dict[str, Any] = {"gfd": {"enabled": True}, "gpuvisor": {"mode": "dra"}}


def _render(values: dict[str, Any], **capabilities: Any) -> list[dict[str, Any]]:
    """The chart's objects; `capabilities` (kube_version, api_versions) as `helm template
    --kube-version/--api-versions` give them (helm-python-sdk's render options, which its public
    render() does not expose)."""
    chart = helm_python.Chart.load(str(CHART))
    options = {"name": "gpuvisor", "namespace": NAMESPACE, **capabilities}
    from helm_python import _native

    rendered = json.loads(
        _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(options))
    )
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]  # fmt: skip


def _policy(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    found = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    return found[0] if found else None


# --- the policy, evaluated ----------------------------------------------------------------------


class Policy:
    """The rendered policy's expressions, compiled once, applied as the API server applies them."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.spec = policy["spec"]
        self.env = cel.NewEnv(
            variables={n: cel.Type.DYN for n in ("request", "object", "oldObject", "variables")}
        )
        compile_ = self.env.compile  # a syntax error or an unknown function raises here
        self.conditions = [compile_(c["expression"]) for c in self.spec.get("matchConditions", [])]
        self.variables = [(v["name"], compile_(v["expression"])) for v in self.spec.get("variables", [])]
        self.validations = [
            (compile_(v["expression"]), compile_(v["messageExpression"]) if "messageExpression" in v else None, v)
            for v in self.spec["validations"]
        ]  # fmt: skip
        assert self.spec["failurePolicy"] == "Fail"

    def matches(self, request: dict[str, Any]) -> bool:
        """The request is one of the resource rules' (group, resource[/sub], operation)."""
        resource = request["resource"]["resource"] + (
            f"/{request['subResource']}" if request.get("subResource") else ""
        )
        return any(
            request["resource"]["group"] in rule["apiGroups"]
            and resource in rule["resources"]
            and request["operation"] in rule["operations"]
            and (rule["apiVersions"] == ["*"] or request["resource"]["version"] in rule["apiVersions"])
            for rule in self.spec["matchConstraints"]["resourceRules"]
        )  # fmt: skip

    def _eval(self, expression: Any, data: dict[str, Any]) -> Any:
        value = expression.eval(data=data)
        if value.type() == cel.Type.ERROR:
            raise EvaluationError(str(value.value()))
        return value.plain_value()

    def admit(self, attributes: dict[str, Any]) -> str | None:
        """None: admitted (or not this policy's); else the refusal's message."""
        if not self.matches(attributes["request"]):
            return None
        data = {**attributes, "variables": {}}
        try:
            if not all(self._eval(c, data) is True for c in self.conditions):
                return None
            for name, expression in self.variables:
                data["variables"] = {**data["variables"], name: self._eval(expression, data)}
        except EvaluationError as exc:
            return f"policy error (failurePolicy Fail): {exc}"
        for expression, message_expression, validation in self.validations:
            try:
                if self._eval(expression, data) is True:
                    continue
            except EvaluationError as exc:
                return f"policy error (failurePolicy Fail): {exc}"
            if message_expression is not None:
                try:
                    message = self._eval(message_expression, data)
                    if isinstance(message, str) and message.strip():
                        return message
                except EvaluationError:
                    pass
            return str(validation["message"])
        return None


class EvaluationError(Exception):
    pass


def _user(username: str, node: str | None) -> dict[str, Any]:
    """userInfo as the service-account authenticator makes it for a token bound to a pod on `node`
    (pod name and uid always, node name and uid with ServiceAccountTokenPodNodeInfo: 1.30+)."""
    extra = {"authentication.kubernetes.io/pod-name": ["gpuvisor-x7k2p"], "authentication.kubernetes.io/pod-uid": ["9f3c0c5e"]}  # fmt: skip
    if node is not None:
        extra |= {NODE_NAME_KEY: [node], "authentication.kubernetes.io/node-uid": ["4b1d7a2e"]}
    return {
        "username": username,
        "uid": "0c9a8f7e",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"],
        "extra": extra,
    }


# --- gpuvisor's writes, as admission sees them ----------------------------------------------------

RESOURCES = {  # path part -> (group, version, resource, kind)
    "nodes": ("", "v1", "nodes", "Node"),
    "events": ("", "v1", "events", "Event"),
    "resourceslices": ("resource.k8s.io", "v1", "resourceslices", "ResourceSlice"),
    "nodefeatures": ("nfd.k8s-sigs.io", "v1alpha1", "nodefeatures", "NodeFeature"),
}


class Admitting:
    """A KubeClient stand-in: holds objects by path, applies each write (a PATCH as the fake API
    server applies it) and keeps each write's admission attributes in `writes`."""

    def __init__(self, user: dict[str, Any]) -> None:
        self.user = user
        self.objects: dict[str, dict[str, Any]] = {}
        self.writes: list[dict[str, Any]] = []
        self.serial = 0

    def get(self, path: str, *, what: str, query: Any = None) -> Any:
        return self.request("GET", path, what=what)

    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        body: Any = None,
        content_type: str | None = None,
        **_: Any,
    ) -> Any:
        parts = path.strip("/").split("/")
        sub = ""
        if parts[-1] == "status":
            sub, parts = "status", parts[:-1]
        kind_at = max(i for i, p in enumerate(parts) if p in RESOURCES)
        group, version, resource, kind = RESOURCES[parts[kind_at]]
        namespace = parts[kind_at - 1] if parts[kind_at - 2 : kind_at - 1] == ["namespaces"] else ""
        name = parts[kind_at + 1] if len(parts) > kind_at + 1 else ""
        if method == "GET":
            if path not in self.objects:
                raise ApiError(what, 404, "NotFound", f'{resource} "{name}" not found')
            return copy.deepcopy(self.objects[path])
        key = path.removesuffix("/status")  # the status subresource writes the object itself
        old = None if method == "POST" else copy.deepcopy(self.objects.get(key))
        if method == "POST":
            new = copy.deepcopy(body)
            meta = new.setdefault("metadata", {})
            if "name" not in meta:
                self.serial += 1
                meta["name"] = f"{meta['generateName']}{self.serial:05d}"
            name = meta["name"]
            stored_at = f"{path}/{name}"
        elif method == "PUT":
            new, stored_at = copy.deepcopy(body), key
        elif method == "PATCH":
            assert old is not None, path
            new = json_patch(old, body) if content_type == JSON_PATCH else copy.deepcopy(old)
            if content_type == STRATEGIC_MERGE:
                strategic_merge(new, body)
            stored_at = key
        else:
            assert method == "DELETE" and old is not None, path
            new, stored_at = None, key
        request = {
            "uid": f"req-{len(self.writes)}",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": name,
            "operation": {"POST": "CREATE", "PUT": "UPDATE", "PATCH": "UPDATE", "DELETE": "DELETE"}[method],
            "userInfo": self.user,
            "object": new,
            "oldObject": old,
            "dryRun": False,
        }
        if sub:
            request["subResource"] = request["requestSubResource"] = sub
        if namespace:
            request["namespace"] = namespace
        self.writes.append({"request": {k: v for k, v in request.items() if v is not None}, "object": new, "oldObject": old})  # fmt: skip
        if new is None:
            del self.objects[stored_at]
        else:
            self.objects[stored_at] = new
        return copy.deepcopy(new) if new is not None else {"kind": "Status", "status": "Success"}


def _client(user: dict[str, Any], *, nodes_held: tuple[str, ...] = (NODE_A, NODE_B)) -> Admitting:
    client = Admitting(user)
    for name in nodes_held:
        client.objects[f"/api/v1/nodes/{name}"] = {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": f"uid-{name}"},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
        }  # fmt: skip
    return client


def health_writes(client: Admitting, node: str) -> list[dict[str, Any]]:
    """What NodeHealthWriter writes for `node`: the GPUUnhealthy condition (a strategic-merge PATCH of
    nodes/status), an Event about the Node (a POST) and the same Event again (a count PATCH)."""
    writer = NodeHealthWriter(cast(KubeClient, client), node=node)
    writer.want(NodeCondition("True", "GpuXid", "1 of 8 GPU devices Unhealthy (GPU-0: XID 79)"))
    writer.event(NodeEvent("Warning", "GpuXid", "GPU-0: XID 79, taken out until reset"))
    writer.sync()
    writer.event(NodeEvent("Warning", "GpuXid", "GPU-0: XID 79, taken out until reset"))
    writer.sync()
    ops = [(w["request"]["operation"], w["request"]["resource"]["resource"], w["request"].get("subResource", "")) for w in client.writes]  # fmt: skip
    assert ops == [("UPDATE", "nodes", "status"), ("CREATE", "events", ""), ("UPDATE", "events", "")], ops
    return client.writes


def node_feature_writes(client: Admitting, node: str) -> list[dict[str, Any]]:
    """What the labeller writes for `node`: its NodeFeature created, then updated with new labels."""
    publisher = NodeFeaturePublisher(node_name=node, namespace=NAMESPACE)
    publisher.client = cast(KubeClient, client)
    publisher.owners = []
    assert publisher.publish({"nvidia.com/gpu.count": "8"}) == "created"
    assert publisher.publish({"nvidia.com/gpu.count": "7"}) == "updated"
    return client.writes


def slice_writes(client: Admitting, node: str) -> list[dict[str, Any]]:
    """The DRA pool of `node` (build_slices on a simulated 4-GPU L4 node): created, updated to the
    next generation, deleted (as SlicePublisher's create/update/delete send them)."""
    path = "/apis/resource.k8s.io/v1/resourceslices"
    (first,) = build_slices(nodes.pcie_l4(), [], node_name=node, generation=1)
    created = client.request("POST", path, what="create", body=first)
    (second,) = build_slices(nodes.pcie_l4(), [], node_name=node, generation=2)
    updated = {**copy.deepcopy(created), "spec": second["spec"]}
    client.request("PUT", f"{path}/{created['metadata']['name']}", what="update", body=updated)
    client.request(
        "DELETE", f"{path}/{created['metadata']['name']}", what="delete", body={"kind": "DeleteOptions"}
    )
    return client.writes


WRITERS = {"node status and events": health_writes, "node feature": node_feature_writes, "resource slices": slice_writes}  # fmt: skip
WRITER_USER = {"node status and events": PLUGIN, "node feature": LABELLER, "resource slices": PLUGIN}


@pytest.fixture(scope="module")
def policy() -> Iterator[Policy]:
    found = _policy(_render(VALUES))
    assert found is not None
    yield Policy(found)


@pytest.mark.parametrize("kind", WRITERS)
def test_a_node_writes_its_own_objects(policy: Policy, kind: str) -> None:
    """Every write gpuvisor makes for its own node, with that node's bound token, is admitted; each
    one is matched by the policy (so the admission is the policy's, not a miss)."""
    writes = WRITERS[kind](_client(_user(WRITER_USER[kind], NODE_A)), NODE_A)
    assert writes
    for write in writes:
        assert policy.matches(write["request"]), write["request"]
        assert policy.admit(write) is None, (write["request"]["operation"], write["request"]["resource"])


@pytest.mark.parametrize("kind", WRITERS)
def test_a_node_cannot_write_another_nodes_objects(policy: Policy, kind: str) -> None:
    """The same code run for node A with node B's token (node B compromised, acting for A): every
    write is refused, the message naming node B and what it may write."""
    writes = WRITERS[kind](_client(_user(WRITER_USER[kind], NODE_B)), NODE_A)
    for write in writes:
        message = policy.admit(write)
        assert message is not None and f"gpuvisor on node {NODE_B} may write only" in message, (
            write["request"]["operation"], write["request"]["resource"], message
        )  # fmt: skip


@pytest.mark.parametrize("kind", WRITERS)
def test_a_token_without_a_node_is_refused(policy: Policy, kind: str) -> None:
    """A token naming no node (not bound to a pod, or a server before 1.30 or with
    ServiceAccountTokenPodNodeInfo off; `extra` without the key, or no `extra` at all) may write
    nothing: refused as NodeRestriction refuses a node identity it cannot place."""
    for user in (
        _user(WRITER_USER[kind], None),
        {"username": WRITER_USER[kind], "groups": ["system:serviceaccounts"]},
    ):
        for write in WRITERS[kind](_client(user), NODE_A):
            message = policy.admit(write)
            assert message is not None and "this token names none" in message, message


def test_other_users_are_not_the_policys(policy: Policy) -> None:
    """The kubelet, NFD's master or an operator writing any node's objects: not matched (RBAC and
    NodeRestriction are theirs); another namespace's service account named gpuvisor neither."""
    for username in ("system:node:gpu-node-a", "system:serviceaccount:node-feature-discovery:nfd-master",
                     "kubernetes-admin", "system:serviceaccount:other:gpuvisor"):  # fmt: skip
        for writer in WRITERS.values():
            for write in writer(_client(_user(username, NODE_B)), NODE_A):
                assert policy.admit(write) is None, username


def _write(resource: str, operation: str, new: Any, old: Any, name: str, *, user: str = PLUGIN, node: str = NODE_A, sub: str = "") -> dict[str, Any]:  # fmt: skip
    group, version, _, kind = RESOURCES[resource]
    request = {
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": resource},
        "name": name, "operation": operation, "userInfo": _user(user, node),
    }  # fmt: skip
    if sub:
        request["subResource"] = sub
    return {"request": request, "object": new, "oldObject": old}


def test_an_object_cannot_be_moved_to_or_from_another_node(policy: Policy) -> None:
    """Node A may not take over node B's objects by rewriting them (the old object is checked on
    update, as on delete), nor disguise its own: a ResourceSlice moved from node B, or with no
    nodeName (allNodes), a NodeFeature named for A but labelled for B, an Event about A naming node
    B as its related object, one about a Pod."""
    client = _client(_user(LABELLER, NODE_A))
    node_feature_writes(client, NODE_A)
    ((_, feature),) = [(p, o) for p, o in client.objects.items() if "nodefeatures" in p]
    relabelled = copy.deepcopy(feature)
    relabelled["metadata"]["labels"]["nfd.node.kubernetes.io/node-name"] = NODE_B
    (own_slice,) = build_slices(nodes.pcie_l4(), [], node_name=NODE_A)
    own_slice["metadata"]["name"] = "s1"
    from_b = copy.deepcopy(own_slice)
    from_b["spec"]["nodeName"] = NODE_B
    everywhere = copy.deepcopy(own_slice)
    del everywhere["spec"]["nodeName"]
    everywhere["spec"]["allNodes"] = True
    event = health_writes(_client(_user(PLUGIN, NODE_A)), NODE_A)[1]["object"]
    related = {**copy.deepcopy(event), "related": {"kind": "Node", "name": NODE_B}}
    about_pod = {
        **copy.deepcopy(event),
        "involvedObject": {"kind": "Pod", "namespace": "ml", "name": "trainer"},
    }
    refused = [
        _write("resourceslices", "UPDATE", own_slice, from_b, "s1"),
        _write("resourceslices", "UPDATE", from_b, own_slice, "s1"),
        _write("resourceslices", "CREATE", everywhere, None, "s1"),
        _write("resourceslices", "DELETE", None, from_b, "s1"),
        _write("nodefeatures", "CREATE", relabelled, None, feature["metadata"]["name"], user=LABELLER),
        _write("nodefeatures", "UPDATE", feature, relabelled, feature["metadata"]["name"], user=LABELLER),
        _write("events", "CREATE", related, None, event["metadata"]["name"]),
        _write("events", "CREATE", about_pod, None, event["metadata"]["name"]),
        _write("nodes", "UPDATE", {"metadata": {"name": NODE_B}}, {"metadata": {"name": NODE_B}}, NODE_B, sub="status"),
    ]  # fmt: skip
    for write in refused:
        assert policy.matches(write["request"]), write["request"]
        assert policy.admit(write) is not None, write


def test_reads_are_not_matched(policy: Policy) -> None:
    """Only CREATE, UPDATE and DELETE are matched: gets, lists and watches go by RBAC alone, and
    CONNECT (no such verb here) is left out."""
    for rule in policy.spec["matchConstraints"]["resourceRules"]:
        assert sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"], rule


def test_events_k8s_io_is_matched_as_core_events(policy: Policy) -> None:
    """events.k8s.io/v1 Events share core Events' storage (pkg/kubeapiserver
    default_storage_factory_builder.go: AddCohabitatingResources(api events, events.k8s.io
    events)), so matchPolicy Equivalent sends them here converted to core/v1: the policy names core
    events only, with Equivalent."""
    assert policy.spec["matchConstraints"]["matchPolicy"] == "Equivalent"
    groups = {g for r in policy.spec["matchConstraints"]["resourceRules"] if "events" in r["resources"] for g in r["apiGroups"]}  # fmt: skip
    assert groups == {""}


# --- when the chart renders it --------------------------------------------------------------------

VAP_KIND = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"


@pytest.mark.parametrize(
    ("capabilities", "rendered"),
    [
        ({}, True),  # helm template: Helm's default Kubernetes version (>= 1.30), no discovery
        ({"kube_version": "1.29.0"}, False),  # helm template --kube-version 1.29: no v1 policy
        ({"kube_version": "1.29.0", "api_versions": [VAP_KIND]}, True),  # --api-versions says so
        ({"api_versions": ["apps/v1/DaemonSet", VAP_KIND]}, True),  # a cluster that serves it
        ({"api_versions": ["apps/v1/DaemonSet"]}, False),  # a cluster that lists kinds, not this one
    ],
)
def test_the_policy_is_on_where_the_api_server_serves_it(
    capabilities: dict[str, Any], rendered: bool
) -> None:
    """enabled null: with a cluster's discovery (kinds listed as group/version/Kind) the policy is
    rendered where ValidatingAdmissionPolicy v1 is served; offline, by the Kubernetes version (v1
    from 1.30). The binding comes and goes with it."""
    docs = _render(VALUES, **capabilities)
    kinds = sorted(d["kind"] for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy"))
    assert kinds == (["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] if rendered else [])


def test_values_turn_it_off_force_it_or_only_warn() -> None:
    """enabled false: none (even where served); true: rendered even for 1.29 (the install then
    fails there, as asked); validationActions reach the binding; an unknown action is refused."""
    assert (
        _policy(_render({**VALUES, "gpuvisor": {"mode": "dra", "nodeRestriction": {"enabled": False}}}))
        is None
    )
    assert _policy(_render({**VALUES, "gpuvisor": {"mode": "dra", "nodeRestriction": {"enabled": True}}}, kube_version="1.29.0"))  # fmt: skip
    docs = _render(
        {**VALUES, "gpuvisor": {"mode": "dra", "nodeRestriction": {"validationActions": ["Warn", "Audit"]}}}
    )
    binding = manifests.find(docs, "ValidatingAdmissionPolicyBinding", "gpuvisor-node-restriction")
    assert binding["spec"] == {
        "policyName": "gpuvisor-node-restriction",
        "validationActions": ["Warn", "Audit"],
    }
    with pytest.raises(helm_python.HelmError) as caught:
        _render({"gpuvisor": {"nodeRestriction": {"validationActions": ["Refuse"]}}})
    assert "validationActions" in str(caught.value)


def test_it_names_only_the_service_accounts_that_write() -> None:
    """The plugin's account when it has a token; the labeller's when it writes a NodeFeature or
    watches its Node; neither: no policy (a plugin that never calls the API server needs none)."""

    def users(values: dict[str, Any]) -> str | None:
        found = _policy(_render(values))
        return None if found is None else str(found["spec"]["matchConditions"][0]["expression"])

    assert users({}) == f'request.userInfo.username in ["{PLUGIN}"]'
    assert users(VALUES) == f'request.userInfo.username in ["{PLUGIN}","{LABELLER}"]'
    labeller_file = {"devicePlugin": {"enabled": False}, "gfd": {"enabled": True, "useNodeFeatureAPI": False}}
    assert users(labeller_file) is None
    assert users({"gpuvisor": {"nodeHealth": False}}) is None


def test_kustomize_base_ships_the_charts_policy() -> None:
    """deploy/kubernetes/base/node-restriction.yaml is the chart's policy and binding, its
    matchCondition naming the base's service account (gpuvisor in namespace gpuvisor)."""
    kustomize = [d for d in yaml.safe_load_all(KUSTOMIZE_POLICY.read_text()) if d]
    chart = _render({})
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        ours = manifests.find(kustomize, kind, "gpuvisor-node-restriction")["spec"]
        theirs = json.loads(json.dumps(manifests.find(chart, kind, "gpuvisor-node-restriction")["spec"]).replace(
            f"system:serviceaccount:{NAMESPACE}:gpuvisor", "system:serviceaccount:gpuvisor:gpuvisor"))  # fmt: skip
        assert ours == theirs, kind
