"""The fake API server's state and the calls tests make on it.

`FakeApiServer` holds the objects (Nodes, Events, pods, NodeFeatures, ResourceSlices and
ResourceClaims), one `resourceVersion` counter for every write and one watch history for every
resource (compacted as etcd compacts, `HISTORY` events kept), every request with its user agent
and field manager, the refusals of what gpuvisor sent (`errors`), and the trouble a test injects
(`fail_next`, `freeze()`, `compact()`, `expire_watches()`, the feature gates), and the version
it serves (`kube_version`, `version_info()`). Its helpers write as
the other writers of a cluster do: the kubelet (`add_node`, `kubelet_status`, as
pkg/kubelet/kubelet_node_status.go tryUpdateNodeStatus writes, `touch_node`, `delete_slices`), an
operator (`set_node_label`), the scheduler (`add_claim`). The HTTP side is tests/kubeapi/handler.py.
"""

from __future__ import annotations

import copy
import datetime
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.kubeapi.resources import NFD_GROUP, TOKEN, USER
from tests.kubeapi.tally import Tally
from tests.kubeapi.validation import resource_claim_problems, resource_slice_problems

HISTORY = 1000  # watch events kept; older versions are compacted away


def now_rfc3339() -> str:
    """Now as the API server writes a time: RFC 3339 in UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Request:
    """A request as the server received it, for a test to look at (`FakeApiServer.calls`)."""

    method: str
    path: str
    body: Any
    content_type: str | None = None
    query: dict[str, str] = field(default_factory=dict)
    user_agent: str = ""
    manager: str = ""  # the field manager the server would record for a write
    user: str = ""  # the user its bearer token names ("" for a token the server does not know)
    at: float = field(default_factory=time.monotonic)  # when it came in (this process's clock)


@dataclass
class FakeApiServer:
    """The server's state: objects, the watch history, every request and refusal, injected trouble."""

    node_features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fail_next: dict[str, tuple[int, str]] = field(default_factory=dict)  # method -> (code, reason)
    # method ("*": any) -> (answers left, Retry-After): APF's 429 (throttle())
    throttled: dict[str, tuple[int, str]] = field(default_factory=dict)
    idle_timeout_s: float = 90.0  # kube-apiserver's IdleTimeout: an idle kept-alive connection is closed
    crds: set[str] = field(default_factory=lambda: {NFD_GROUP})  # API groups of installed CRDs
    allow: set[tuple[str, str]] | None = None  # (verb, resource[/subresource]); None allows all
    bookmark_s: float = 1.0
    resource_slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    device_taints: bool = True  # the DRADeviceTaints gate: off, devices[].taints are dropped on write
    dra: bool = True  # resource.k8s.io/v1 is served (off: a plain 404, as a server without it)
    claim_device_status: bool = True  # the DRAResourceClaimDeviceStatus gate (beta, on since 1.33)
    # The DRAConsumableCapacity gate (alpha, off, in 1.34 and 1.35; beta, on, in 1.36): off, a
    # slice's allowMultipleAllocations and requestPolicy are dropped on write.
    consumable_capacity: bool = False
    # The DRAPartitionableDevices gate (alpha, off, in 1.33 to 1.35; beta, on, in 1.36): off, a
    # slice's sharedCounters and its devices' consumesCounters (and per-device node selection) are
    # dropped on write; on, they are kept and checked by kube_version's rules (partitions.py).
    partitionable_devices: bool = False
    # The served version: the schema and the validation rules objects are checked against, and
    # what GET /version answers (version_info()).
    kube_version: str = "1.34.0"
    version_overrides: dict[str, str] = field(default_factory=dict)  # /version fields to replace
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = field(init=False)
    version: int = 0
    compacted: int = 0  # watches from a version at or below this get 410 Gone
    # (version, resource, event type, object): one history for every watched resource
    history: deque[tuple[int, str, str, dict[str, Any]]] = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )
    watch_epoch: int = 0  # expire_watches() moves it: streams of an older epoch end with 410
    frozen: threading.Event = field(default_factory=threading.Event)
    thawed: threading.Event = field(default_factory=threading.Event)
    # bearer token -> user: TOKEN is USER; a fleet adds one token per node (add_user) so that the
    # tally tells the nodes apart
    users: dict[str, str] = field(default_factory=lambda: {TOKEN: USER})
    tally: Tally = field(default_factory=Tally)  # every request by verb, resource, user; open watches

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self.thawed.set()

    # ------------------------------------------------------------------ objects
    def add_daemonset_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gpuvisor-labels", "uid": str(uuid.uuid4()),
                     "controller": True, "blockOwnerDeletion": True},
                ],
            },
            "spec": {"containers": [{"name": "labels", "image": "gpuvisor"}]},
        }  # fmt: skip
        self.pods[(namespace, name)] = pod
        return pod

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A Node as the kubelet registers it, with the conditions it keeps (gpuvisor must leave them)."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels or {})},
            "spec": {},
            "status": {
                "conditions": [
                    {"type": t, "status": s, "reason": r, "message": m,
                     "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": "2026-01-01T00:00:00Z"}
                    for t, s, r, m in (
                        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                        ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
                    )
                ],
                "capacity": {"cpu": "64"},
            },
        }  # fmt: skip
        with self.lock:
            self._store_node(name, node, "ADDED")
        return node

    def set_node_label(self, name: str, key: str, value: str | None) -> None:
        """An operator's `kubectl label node`: a new version and a MODIFIED watch event."""
        with self.lock:
            node = copy.deepcopy(self.nodes[name])
            labels = node["metadata"].setdefault("labels", {})
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
            self._store_node(name, node, "MODIFIED")

    def kubelet_status(self, name: str, setter: Callable[[dict[str, Any]], None]) -> bool:
        """The kubelet's node status update: its setters run on the Node as the API server has it
        and a change is written (a new version, a MODIFIED event); no change, no write
        (pkg/kubelet/kubelet_node_status.go tryUpdateNodeStatus: PatchNodeStatus with the two-way
        merge patch of the original and the set node). True when it wrote."""
        with self.lock:
            current = self.nodes.get(name)
            if current is None:
                return False
            node = copy.deepcopy(current)
            setter(node.setdefault("status", {}))
            if node == current:
                return False
            self._store_node(name, node, "MODIFIED")
            return True

    def touch_node(self, name: str) -> None:
        """The kubelet's heartbeat: the Node changes (a new version) but not its labels."""
        with self.lock:
            node = copy.deepcopy(self.nodes[name])
            node["status"]["conditions"][-1]["lastHeartbeatTime"] = now_rfc3339()
            self._store_node(name, node, "MODIFIED")

    def delete_node(self, name: str) -> None:
        with self.lock:
            node = self.nodes.pop(name)
            self.version += 1
            node = copy.deepcopy(node)
            node["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, "nodes", "DELETED", node))
            self.changed.notify_all()

    def condition(self, node: str, kind: str) -> dict[str, Any] | None:
        with self.lock:
            conds = self.nodes[node]["status"].get("conditions") or []
            return copy.deepcopy(next((c for c in conds if c.get("type") == kind), None))

    def node_events(self, node: str) -> list[dict[str, Any]]:
        with self.lock:
            return [
                copy.deepcopy(e)
                for e in self.events.values()
                if e.get("involvedObject", {}).get("kind") == "Node"
                and e["involvedObject"].get("name") == node
            ]

    def version_info(self) -> dict[str, str]:
        """GET /version as kube-apiserver answers it: k8s.io/apimachinery pkg/version/types.go
        Info (major, minor, the emulation and minimum-compatibility versions since 1.33,
        gitVersion, ...) for `kube_version`, with `version_overrides` on top (a provider's
        "minor": "34+" or gitVersion "v1.34.2-eks-4f9c3a1")."""
        major, minor, *_ = self.kube_version.split(".")
        info = {
            "major": major,
            "minor": minor,
            "emulationMajor": major,
            "emulationMinor": minor,
            "minCompatibilityMajor": major,
            "minCompatibilityMinor": str(int(minor) - 1),
            "gitVersion": f"v{self.kube_version}",
            "gitCommit": "0" * 40,
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24.6",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
        return {**info, **self.version_overrides}

    # ------------------------------------------------------------------ resource.k8s.io/v1
    def slices(self, node: str | None = None, driver: str | None = None) -> list[dict[str, Any]]:
        """The stored ResourceSlices (of a node, of a driver), by name."""
        with self.lock:
            return [
                copy.deepcopy(o)
                for _, o in sorted(self.resource_slices.items())
                if (node is None or o["spec"].get("nodeName") == node)
                and (driver is None or o["spec"].get("driver") == driver)
            ]

    def put_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a slice as another writer would (an earlier life, another tool): checked by the
        served version's rules, then kept as given (no gate drops a field: a slice written while
        the gates were on) with the metadata the server adds, and a watch event."""
        problems = resource_slice_problems(obj, self.kube_version)
        if problems:
            raise ValueError("; ".join(problems))
        with self.lock:
            stored = copy.deepcopy(obj)
            meta = stored["metadata"]
            old = self.resource_slices.get(meta["name"])
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta["generation"] = old["metadata"]["generation"] + 1 if old else 1
            self.version += 1
            meta["resourceVersion"] = str(self.version)
            self.resource_slices[meta["name"]] = stored
            self._record("resourceslices", "MODIFIED" if old else "ADDED", stored)
            return copy.deepcopy(stored)

    def delete_slices(self, node: str, driver: str | None = None) -> int:
        """What the kubelet does at its start (DeleteCollection by spec.nodeName): how many went."""
        with self.lock:
            names = [s["metadata"]["name"] for s in self.slices(node, driver)]
            for name in names:
                self._delete_slice(name)
            return len(names)

    def _delete_slice(self, name: str) -> dict[str, Any]:
        obj = self.resource_slices.pop(name)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self._record("resourceslices", "DELETED", obj)
        return obj

    def add_claim(
        self,
        namespace: str,
        name: str,
        pool: str,
        devices: list[str],
        *,
        driver: str = "gpu.nvidia.com",
        device_class: str = "gpu.nvidia.com",
        request: str = "gpu",
        uid: str | None = None,
    ) -> tuple[str, str, str]:
        """A claim as the scheduler leaves it once allocated to `devices` of `pool`: (namespace,
        name, uid). Checked as the API server checks it."""
        claim_uid = uid or str(uuid.uuid4())
        obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": claim_uid},
            "spec": {"devices": {"requests": [
                {"name": request, "exactly": {"deviceClassName": device_class, "count": len(devices)}}]}},
            "status": {"allocation": {
                "devices": {"results": [{"request": request, "driver": driver, "pool": pool, "device": d}
                                        for d in devices]},
                "nodeSelector": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}]},
            }},
        }  # fmt: skip
        self.put_claim(obj)
        return namespace, name, claim_uid

    def put_claim(self, obj: dict[str, Any], *, validate: bool = True) -> None:
        """Store a claim (`validate=False`: one the API server would refuse, to test a reader)."""
        meta = obj["metadata"]
        if validate:
            problems = resource_claim_problems(obj, meta["namespace"])
            if problems:
                raise ValueError("; ".join(problems))
        with self.lock:
            self.version += 1
            stored = copy.deepcopy(obj)
            stored["metadata"]["resourceVersion"] = str(self.version)
            stored["metadata"].setdefault("uid", str(uuid.uuid4()))
            stored["metadata"].setdefault("creationTimestamp", now_rfc3339())
            key = (meta["namespace"], meta["name"])
            kind = "MODIFIED" if key in self.resource_claims else "ADDED"
            self.resource_claims[key] = stored
            self._record("resourceclaims", kind, stored)

    def delete_claim(self, namespace: str, name: str) -> None:
        with self.lock:
            obj = self.resource_claims.pop((namespace, name))
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            self._record("resourceclaims", "DELETED", obj)

    def add_user(self, user: str) -> str:
        """A bearer token the server accepts as `user` (a node's own service account in a fleet)."""
        token = f"token-{uuid.uuid4().hex}"
        with self.lock:
            self.users[token] = user
        return token

    def calls(self, method: str | None = None, path: str | None = None) -> list[Request]:
        with self.lock:
            return [
                r
                for r in self.requests
                if (method is None or r.method == method) and (path is None or r.path.startswith(path))
            ]

    # ------------------------------------------------------------------ trouble
    def compact(self) -> None:
        """etcd compaction: every version up to now is gone for a new watch (410 Gone)."""
        with self.lock:
            self.compacted = self.version

    def expire_watches(self) -> None:
        """The watch cache drops its watchers: each open stream ends with an ERROR 410 event."""
        with self.lock:
            self.compact()
            self.watch_epoch += 1
            self.changed.notify_all()

    def throttle(self, count: int = 1, retry_after: str = "1", method: str = "*") -> None:
        """The next `count` requests (of `method`, "*" for any) are refused as the API server's
        priority and fairness filter refuses one it has no seat for: 429, `Retry-After` and its
        plain-text words (k8s.io/apiserver pkg/server/filters/priority-and-fairness.go,
        `tooManyRequests`, through Go's http.Error)."""
        with self.lock:
            self.throttled[method] = (count, retry_after)

    def freeze(self) -> None:
        """Requests hang (accepted, never answered) until thaw()."""
        self.thawed.clear()
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()
        self.thawed.set()

    # ------------------------------------------------------------------ internals
    def _store_node(self, name: str, node: dict[str, Any], kind: str) -> dict[str, Any]:
        self.version += 1
        node["metadata"]["resourceVersion"] = str(self.version)
        node["metadata"].setdefault("creationTimestamp", now_rfc3339())
        self.nodes[name] = node
        self._record("nodes", kind, node)
        return node

    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        """A watch event at the current version (the caller bumped it and holds the lock)."""
        self.history.append((self.version, resource, kind, copy.deepcopy(obj)))
        if len(self.history) == HISTORY:
            self.compacted = max(self.compacted, self.history[0][0] - 1)
        self.changed.notify_all()
