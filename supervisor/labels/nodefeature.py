"""GFD's other output: the labels as an NFD `NodeFeature` object, through the Kubernetes API.

The object is what GFD v0.20.0 writes (internal/lm/output.go): `nfd.k8s-sigs.io/v1alpha1`
`NodeFeature` named `nvidia-features-for-<node>` in the pod's namespace, labelled
`nfd.node.kubernetes.io/node-name: <node>`, owned by the pod's DaemonSet (as controller) and the
pod itself, with `spec.labels` the label set and `spec.features` empty. Each output reads the
object and creates it when missing, replaces it only when its labels, owner references or spec
differ, and otherwise sends nothing more.

The client is the Kubernetes project's Python client (`kubernetes` on PyPI), imported only when
this output is used, so `gpuvisor run` does not pay for it. Its configuration comes from
`--kubeconfig` or, when that is empty, the pod's service account, as client-go's does; the
client has no rate limiter of its own, so `--kube-api-qps` / `--kube-api-burst` drive a token
bucket here with client-go's rules (0 means the defaults 5 and 10; a negative QPS, no limit).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("gpuvisor.labels")

GROUP = "nfd.k8s-sigs.io"
VERSION = "v1alpha1"
PLURAL = "nodefeatures"
KIND = "NodeFeature"
NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"  # NFD's NodeFeatureObjNodeNameLabel
NAME_PREFIX = "nvidia-features-for"
DEFAULT_QPS = 5.0  # client-go rest.DefaultQPS / DefaultBurst
DEFAULT_BURST = 10
REQUEST_TIMEOUT = (10.0, 30.0)  # connect, read: seconds


class ApiError(Exception):
    """A call to the API server failed, or the client could not be configured."""


class TokenBucket:
    """client-go's flowcontrol token bucket: `qps` tokens a second, at most `burst` saved up."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.qps = DEFAULT_QPS if qps == 0 else qps
        self.burst = max(1, DEFAULT_BURST if burst == 0 else burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take a token, sleeping until one is there; returns the seconds waited."""
        if self.qps < 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1.0
            wait = 0.0 if self._tokens >= 0 else -self._tokens / self.qps
        if wait > 0:
            self._sleep(wait)
        return wait


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
        api_client: Any = None,
    ) -> None:
        if not node_name:
            raise ApiError("the NodeFeature API needs the node name: set NODE_NAME (or --node-name)")
        if not namespace:
            raise ApiError("the NodeFeature API needs a namespace: set NAMESPACE (or --namespace)")
        self.node_name = node_name
        self.namespace = namespace
        self.pod_name = pod_name
        self.kubeconfig = kubeconfig
        self.limiter = TokenBucket(qps, burst)
        self._client = api_client  # a kubernetes.client.ApiClient; built on first use when None
        self.owners: list[dict[str, Any]] | None = None  # resolved on first use, then kept

    @property
    def name(self) -> str:
        return node_feature_name(self.node_name)

    def publish(self, labels: Mapping[str, str]) -> str:
        """Make the object carry `labels`: "created", "updated" or "unchanged". Raises ApiError."""
        from kubernetes.client.exceptions import ApiException

        api = self._custom_objects()
        if self.owners is None:
            self.owners = self._owner_references()
        wanted = node_feature_object(self.node_name, self.namespace, labels, self.owners)
        try:
            self.limiter.acquire()
            current = api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != 404:
                raise ApiError(
                    f"failed to get NodeFeature object {self.namespace}/{self.name}: {_describe(exc)}"
                ) from None
            current = None
        except Exception as exc:  # urllib3 connection and TLS errors
            raise ApiError(f"failed to get NodeFeature object {self.namespace}/{self.name}: {exc}") from None
        if current is None:
            self._send(
                api.create_namespaced_custom_object, "create", GROUP, VERSION, self.namespace, PLURAL, wanted
            )
            log.info(
                "created NodeFeature object %s/%s with %d labels", self.namespace, self.name, len(labels)
            )
            return "created"
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
            log.debug("no changes in NodeFeature object %s/%s", self.namespace, self.name)
            return "unchanged"
        self._send(
            api.replace_namespaced_custom_object,
            "update",
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            self.name,
            updated,
        )
        log.info("updated NodeFeature object %s/%s: %d labels", self.namespace, self.name, len(labels))
        return "updated"

    def _send(self, call: Callable[..., Any], what: str, *args: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        self.limiter.acquire()
        try:
            call(*args, _request_timeout=REQUEST_TIMEOUT, _content_type="application/json")
        except ApiException as exc:
            raise ApiError(
                f"failed to {what} NodeFeature object {self.namespace}/{self.name}: {_describe(exc)}"
            ) from None
        except Exception as exc:
            raise ApiError(
                f"failed to {what} NodeFeature object {self.namespace}/{self.name}: {exc}"
            ) from None

    def _owner_references(self) -> list[dict[str, Any]]:
        """The pod's DaemonSet (as controller) and the pod (getOwnerReferences); none when the pod
        name is unknown, the pod has no DaemonSet owner or the lookup fails (logged, as GFD does)."""
        if not self.pod_name:
            log.info("pod name not given (POD_NAME): the NodeFeature object gets no owner references")
            return []
        from kubernetes import client

        self.limiter.acquire()
        try:
            pod = client.CoreV1Api(self._api_client()).read_namespaced_pod(
                self.pod_name, self.namespace, _request_timeout=REQUEST_TIMEOUT
            )
        except Exception as exc:
            detail = _describe(exc) if hasattr(exc, "status") else str(exc)
            log.warning(
                "failed to resolve owner references: failed to get pod %s/%s: %s",
                self.namespace,
                self.pod_name,
                detail,
            )
            return []
        meta = pod.metadata
        owner = next(
            (o for o in (meta.owner_references if meta is not None else None) or [] if o.kind == "DaemonSet"),
            None,
        )
        if owner is None or meta is None:
            log.info(
                "pod %s is not owned by a DaemonSet: the NodeFeature object gets no owner references",
                self.pod_name,
            )
            return []
        return [
            {
                "apiVersion": owner.api_version,
                "kind": owner.kind,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
            },
            {"apiVersion": "v1", "kind": "Pod", "name": meta.name, "uid": meta.uid},
        ]

    def _custom_objects(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api_client())

    def _api_client(self) -> Any:
        if self._client is None:
            self._client = api_client_for(self.kubeconfig)
        return self._client


def api_client_for(kubeconfig: str) -> Any:
    """A `kubernetes.client.ApiClient` from a kubeconfig file, or in-cluster when `kubeconfig` is empty."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, ValueError, TypeError) as exc:
        where = (
            f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account (no --kubeconfig)"
        )
        raise ApiError(f"cannot configure the Kubernetes client from {where}: {exc}") from None
    return client.ApiClient(configuration)


def _describe(exc: Any) -> str:
    """An ApiException as one line: the status code, and the API server's own message if it sent one."""
    message = ""
    try:
        body = json.loads(exc.body) if exc.body else {}
        message = str(body.get("message", "")) if isinstance(body, dict) else ""
    except (TypeError, ValueError):
        pass
    return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
