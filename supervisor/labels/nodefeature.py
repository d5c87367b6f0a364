"""GFD's other output: the labels as an NFD `NodeFeature` object, through the API server.

The object is what GFD v0.20.0 writes (internal/lm/output.go): `nfd.k8s-sigs.io/v1alpha1`
`NodeFeature` named `nvidia-features-for-<node>` in the pod's namespace, labelled
`nfd.node.kubernetes.io/node-name: <node>`, owned by the pod's DaemonSet (as controller) and the
pod itself, with `spec.labels` the label set and `spec.features` empty. Each output reads the
object and creates it when missing, replaces it only when its labels, owner references or spec
differ, and otherwise sends nothing more.

The calls go through gpuvisor's API-server layer (supervisor/kube), built on first use from
`--kubeconfig` or the pod's service account and rate-limited by `--kube-api-qps` /
`--kube-api-burst` with client-go's rules. What that layer fixes here, found against a real
kube-apiserver v1.34: a frozen server no longer holds a pass (and a SIGTERM) for a minute
(`abort()` ends the call in flight; there are no hidden retries); a missing NFD CRD is named as
such (the server's plain-text `404 page not found`), with no create attempted; requests name
gpuvisor as user agent and field manager. A failure says whether the labels are still published
(`PublishError.published`), so the labeller never claims "the last labels stay in place" for an
object that is gone.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from supervisor.config.version import VERSION as GPUVISOR_VERSION
from supervisor.kube.limiter import DEFAULT_BURST, DEFAULT_QPS, TokenBucket

if TYPE_CHECKING:
    from supervisor.kube.client import KubeClient
    from supervisor.kube.errors import ApiError

log = logging.getLogger("gpuvisor.labels")

GROUP = "nfd.k8s-sigs.io"
VERSION = "v1alpha1"
PLURAL = "nodefeatures"
KIND = "NodeFeature"
NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"  # NFD's NodeFeatureObjNodeNameLabel
NAME_PREFIX = "nvidia-features-for"


class PublishConfigError(ValueError):
    """The NodeFeature output cannot work with these settings (no node name, no namespace)."""


class PublishError(Exception):
    """One publication failed. `published` is what the API server holds now, as far as known:
    True the last labels, False none (the object or its CRD is gone), None unknown."""

    def __init__(self, text: str, published: bool | None) -> None:
        super().__init__(text)
        self.published = published


def node_feature_name(node_name: str) -> str:
    return f"{NAME_PREFIX}-{node_name}"


def node_feature_object(
    node_name: str, namespace: str, labels: Mapping[str, str], owners: list[dict[str, Any]]
) -> dict[str, Any]:
    """The NodeFeature GFD creates (metadata without owner references when there are none)."""
    metadata: dict[str, Any] = {
        "name": node_feature_name(node_name),
        "namespace": namespace,
        "labels": {NODE_NAME_LABEL: node_name},
    }
    if owners:
        metadata["ownerReferences"] = owners
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": {"features": {"flags": {}, "attributes": {}, "instances": {}}, "labels": dict(labels)},
    }


def _spec_view(spec: object) -> dict[str, Any]:
    """A spec as GFD's typed comparison sees it: absent, null and empty maps are all equal."""
    raw = spec if isinstance(spec, dict) else {}
    features = raw.get("features") if isinstance(raw.get("features"), dict) else {}
    assert isinstance(features, dict)
    return {
        "features": {k: features.get(k) or {} for k in ("flags", "attributes", "instances")},
        "labels": raw.get("labels") or {},
    }


def _owners_view(owners: object) -> list[dict[str, Any]]:
    keys = ("apiVersion", "kind", "name", "uid", "controller", "blockOwnerDeletion")
    return (
        [{k: o.get(k) for k in keys} for o in owners if isinstance(o, dict)]
        if isinstance(owners, list)
        else []
    )


class NodeFeaturePublisher:
    """Creates or updates this node's NodeFeature object. One per loaded config, as GFD's outputer."""

    def __init__(
        self,
        *,
        node_name: str,
        namespace: str,
        pod_name: str = "",
        kubeconfig: str = "",
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        limiter: Callable[[], TokenBucket] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if not node_name:
            raise PublishConfigError(
                "the NodeFeature API needs the node name: set NODE_NAME (or --node-name)"
            )
        if not namespace:
            raise PublishConfigError("the NodeFeature API needs a namespace: set NAMESPACE (or --namespace)")
        self.node_name = node_name
        self.namespace = namespace
        self.pod_name = pod_name
        self.kubeconfig = kubeconfig
        self.qps = qps
        self.burst = burst
        self.limiter = limiter  # the process's one bucket (the daemon's), else one of the client's own
        self.environ = dict(os.environ) if environ is None else environ
        self.client: KubeClient | None = None  # built on first use
        self.owners: list[dict[str, Any]] | None = None  # resolved on first use, then kept
        self.published: bool | None = None  # after the last call: are our labels on the server?

    @property
    def name(self) -> str:
        return node_feature_name(self.node_name)

    @property
    def path(self) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}"

    def abort(self) -> None:
        """End the call in flight now (a stop): it raises PublishError. Safe from a signal handler."""
        if self.client is not None:
            self.client.abort()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def publish(self, labels: Mapping[str, str]) -> str:
        """Make the object carry `labels`: "created", "updated" or "unchanged". Raises PublishError."""
        from supervisor.kube.errors import ApiError, KubeError

        try:
            return self._publish(labels)
        except ApiError as exc:
            raise PublishError(self._explain(exc), self.published) from None
        except KubeError as exc:  # the credentials, or a stop
            raise PublishError(
                f"NodeFeature object {self.namespace}/{self.name}: {exc}", self.published
            ) from None

    def _publish(self, labels: Mapping[str, str]) -> str:
        from supervisor.kube.errors import ApiError

        client = self._client()
        if self.owners is None:
            self.owners = self._owner_references()
        wanted = node_feature_object(self.node_name, self.namespace, labels, self.owners)
        where = f"NodeFeature object {self.namespace}/{self.name}"
        try:
            current = client.get(f"{self.path}/{self.name}", what=f"failed to get {where}")
        except ApiError as exc:
            if exc.no_such_api:
                self.published = False  # no CRD, no object: nothing of ours is published
            if not exc.not_found:
                raise
            current = None
        if current is None:
            self.published = False  # the object is gone (deleted, or never made): make it
            client.request("POST", self.path, what=f"failed to create {where}", body=wanted)
            self.published = True
            log.info("created %s with %d labels", where, len(labels))
            return "created"
        if not isinstance(current, dict):
            raise ApiError(f"failed to get {where}", 200, "BadObject", "the answer is not an object")
        self.published = True  # the object is there; whether its labels are ours is checked next
        updated = copy.deepcopy(current)
        metadata = updated.setdefault("metadata", {})
        metadata["labels"] = {NODE_NAME_LABEL: self.node_name}
        if self.owners:
            metadata["ownerReferences"] = self.owners
        else:
            metadata.pop("ownerReferences", None)
        updated["spec"] = wanted["spec"]
        before = current.get("metadata", {})
        if (
            before.get("labels") == metadata["labels"]
            and _owners_view(before.get("ownerReferences")) == _owners_view(metadata.get("ownerReferences"))
            and _spec_view(current.get("spec")) == _spec_view(updated["spec"])
        ):
            log.debug("no changes in %s", where)
            return "unchanged"
        client.request("PUT", f"{self.path}/{self.name}", what=f"failed to update {where}", body=updated)
        log.info("updated %s: %d labels", where, len(labels))
        return "updated"

    def _explain(self, exc: ApiError) -> str:
        if exc.no_such_api:
            return (
                f"{exc.what}: the API server does not serve {GROUP}/{VERSION} {PLURAL} "
                f"({exc.status} {exc.message or exc.reason}): is node-feature-discovery's NodeFeature CRD installed?"
            )
        return exc.describe()

    def _owner_references(self) -> list[dict[str, Any]]:
        """The pod's DaemonSet (as controller) and the pod (getOwnerReferences); none when the pod
        name is unknown, the pod has no DaemonSet owner or the lookup fails (logged, as GFD does)."""
        from supervisor.kube.errors import ApiError

        if not self.pod_name:
            log.info("pod name not given (POD_NAME): the NodeFeature object gets no owner references")
            return []
        try:
            pod = self._client().get(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}",
                what=f"failed to get pod {self.namespace}/{self.pod_name}",
            )
        except ApiError as exc:
            log.warning("failed to resolve owner references: %s", exc.describe())
            return []
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        refs = meta.get("ownerReferences") if isinstance(meta, dict) else None
        owner = next(
            (o for o in refs or [] if isinstance(o, dict) and o.get("kind") == "DaemonSet"),
            None,
        )
        if owner is None or not isinstance(meta, dict):
            log.info(
                "pod %s is not owned by a DaemonSet: the NodeFeature object gets no owner references",
                self.pod_name,
            )
            return []
        return [
            {
                "apiVersion": owner.get("apiVersion"),
                "kind": owner.get("kind"),
                "name": owner.get("name"),
                "uid": owner.get("uid"),
                "controller": True,
            },
            {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"), "uid": meta.get("uid")},
        ]

    def _client(self) -> KubeClient:
        if self.client is None:
            from supervisor.kube.client import KubeClient
            from supervisor.kube.credentials import load_credentials

            self.client = KubeClient(
                load_credentials(self.kubeconfig, self.environ),
                component="labels",
                version=GPUVISOR_VERSION,
                qps=self.qps,
                burst=self.burst,
                limiter=self.limiter() if self.limiter is not None else None,
            )
        return self.client
