"""The cluster's part between a demo's objects and the kubelet's NodePrepareResources, for one node
whose ResourceSlices the fake API server holds: what a ResourceClaim looks like once Kubernetes
allocated it, and which claims the kubelet sends for which pod.

- `instantiate`: the resourceclaim controller (kubernetes pkg/controller/resourceclaim/controller.go
  `handleClaim`): a pod's claim from a template is a ResourceClaim in the pod's namespace with
  generateName `<pod>-<pod claim>-`, the template's `spec.spec`, the annotation
  `resource.kubernetes.io/pod-claim-name` and the pod as its controlling owner.
- `to_v1`: the API server serves a v1beta1 object at v1 (pkg/apis/resource/v1beta1 conversion: a
  request's device fields move under `exactly`).
- `Allocator`: the scheduler's structured allocator (k8s.io/dynamic-resource-allocation/structured,
  allocator.go) for what the demos use: per request, the devices in the pool's order that match
  the class's and the request's CEL selectors (evaluated with cel-expr-python plus the strings
  extension; a runtime error, e.g. an attribute the device does not have, fails the claim as
  the scheduler fails it), `count` of them (1 by default), none allocated to another claim,
  `matchAttribute` constraints across the listed requests (all when empty), searched with
  backtracking; with the DRAPartitionableDevices gate (`counters`, tests/dracounters.py) a device
  that consumes counters only where its counter sets, less what the devices allocated before
  (this allocator's and, with `state`, every allocated claim's in the fake API server) consume,
  still hold what this claim's devices consume; without it no such device at all
  (`Allocator.from_state` reads the pool, the gate and the version from the fake API server). The result names request, driver, pool and device; `config` holds, per request,
  its class's `spec.config` with source `FromClass`, then the claim's with `FromClaim`
  (allocator.go `allocateOne` / `Allocate`: class config first). `reservedFor` names the pod.
- `KubeletClaims`: the kubelet's DRA manager (pkg/kubelet/cm/dra/manager.go `prepareResources`:
  one NodePrepareResources per pod for its claims not yet prepared: "If this claim is already
  prepared, continue"; `unprepareResources`: a claim is unprepared once no pod references it).
"""

from __future__ import annotations

import copy
import itertools
import secrets
import string
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_strings

from supervisor.sim.drakubelet import DraKubeletStandin
from tests.dracounters import Consumption, PoolCounters, consumption, gather
from tests.kubeapi.partitions import split_layout
from tests.kubeapi.state import FakeApiServer

DRIVER = "gpu.nvidia.com"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


class Unschedulable(Exception):
    """The claim cannot be allocated on this node; the message says why, as the scheduler would."""


def to_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """A ResourceClaim or ResourceClaimTemplate as the API server serves it at resource.k8s.io/v1."""
    out = copy.deepcopy(obj)
    if out["apiVersion"] == "resource.k8s.io/v1beta1":
        out["apiVersion"] = "resource.k8s.io/v1"
        spec = out["spec"]["spec"] if out["kind"] == "ResourceClaimTemplate" else out["spec"]
        for request in spec["devices"]["requests"]:
            fields = {k: request.pop(k) for k in list(request) if k != "name"}
            request["exactly"] = fields
    return out


def instantiate(template: dict[str, Any], pod_name: str, pod_uid: str, pod_claim: str) -> dict[str, Any]:
    """The claim the resourceclaim controller makes for a pod's claim from `template` (v1)."""
    suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
    meta = template["metadata"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"{pod_name}-{pod_claim}-{suffix}",
            "namespace": meta["namespace"],
            "uid": str(uuidlib.uuid4()),
            "annotations": {POD_CLAIM_ANNOTATION: pod_claim},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid,
                 "controller": True, "blockOwnerDeletion": True}
            ],
        },
        "spec": copy.deepcopy(template["spec"]["spec"]),
    }  # fmt: skip


def _value(attribute: dict[str, Any]) -> Any:
    for kind in ("string", "int", "bool", "version"):
        if kind in attribute:
            return attribute[kind]
    raise ValueError(f"attribute {attribute} has no value")


@dataclass(frozen=True)
class Device:
    name: str
    attributes: dict[str, Any]  # qualified name ("gpu.nvidia.com/type") -> value
    consumes: Consumption = field(default_factory=dict)  # consumesCounters: set -> counter -> amount
    slice: str = ""  # the ResourceSlice it is published in

    def cel(self) -> dict[str, Any]:
        """The `device` CEL variable: driver, attributes by domain then name."""
        by_domain: dict[str, dict[str, Any]] = {}
        for qualified, value in self.attributes.items():
            domain, _, name = qualified.rpartition("/")
            by_domain.setdefault(domain, {})[name] = value
        return {"driver": DRIVER, "attributes": by_domain}


def pool_devices(slices: Sequence[dict[str, Any]], counter_slices_hold_none: bool = False) -> list[Device]:
    """The devices of a pool's newest generation, in slice and device order; an attribute without
    a domain is the driver's (resource.k8s.io/v1 DeviceAttribute names). A slice of counter sets
    only has none; with `counter_slices_hold_none` (1.35's buildPool) neither has a slice with
    sharedCounters and devices."""
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    out = []
    for s in sorted(slices, key=lambda s: s["metadata"]["name"]):
        if s["spec"]["pool"]["generation"] != newest:
            continue
        if counter_slices_hold_none and s["spec"].get("sharedCounters"):
            continue
        for d in s["spec"].get("devices") or []:
            attrs = {
                (k if "/" in k else f"{DRIVER}/{k}"): _value(v) for k, v in d.get("attributes", {}).items()
            }
            out.append(Device(d["name"], attrs, consumption(d), s["metadata"]["name"]))
    return out


class Allocator:
    """Allocates claims on one pool: devices are handed out once until `release` (and, with
    `state`, while a claim in the fake API server has them in its allocation); with `counters`
    (the DRAPartitionableDevices gate on) within their counter sets."""

    def __init__(
        self,
        pool: str,
        devices: Sequence[Device],
        classes: dict[str, dict[str, Any]],
        counters: PoolCounters | None = None,
        state: FakeApiServer | None = None,
    ) -> None:
        self.pool = pool
        self.devices = list(devices)
        self.by_name = {d.name: d for d in self.devices}
        self.classes = classes
        self.counters = counters
        self.state = state
        self.in_use: dict[str, str] = {}  # device -> claim uid
        self._env = cel.NewEnv(variables={"device": cel.Type.DYN}, extensions=[ext_strings.ExtStrings()])
        self._compiled: dict[str, Any] = {}

    @classmethod
    def from_state(cls, state: FakeApiServer, pool: str, classes: dict[str, dict[str, Any]]) -> Allocator:
        """The scheduler of the fake API server's cluster for one pool: its slices, its gate
        (`partitionable_devices`) and version (`kube_version`: 1.34's counters per slice, 1.35's
        per pool), its allocated claims."""
        slices = [s for s in state.slices(driver=DRIVER) if s["spec"]["pool"]["name"] == pool]
        split = split_layout(state.kube_version)
        on = state.partitionable_devices
        devices = pool_devices(slices, counter_slices_hold_none=on and split) if slices else []
        counters = gather(slices, state.kube_version) if on else None
        return cls(pool, devices, classes, counters, state)

    def allocated(self) -> set[str]:
        """The pool's devices allocated before: this allocator's, and every allocated claim's in
        the fake API server (allocatedState.AllocatedDevices)."""
        names = set(self.in_use)
        if self.state is not None:
            with self.state.lock:
                claims = list(self.state.resource_claims.values())
            for claim in claims:
                allocation = (claim.get("status") or {}).get("allocation") or {}
                for r in (allocation.get("devices") or {}).get("results") or []:
                    if r.get("driver") == DRIVER and r.get("pool") == self.pool:
                        names.add(str(r.get("device")))
        return names

    def _counters_fit(self, chosen: Sequence[Device], allocated: set[str]) -> bool:
        if self.counters is None:
            return True
        before = [self.by_name[n] for n in allocated if n in self.by_name]
        return self.counters.fits(
            ((d.slice, d.consumes) for d in chosen), ((d.slice, d.consumes) for d in before)
        )

    def _matches(self, expression: str, device: Device, where: str) -> bool:
        if expression not in self._compiled:
            self._compiled[expression] = self._env.compile(expression)
        value = self._compiled[expression].eval(data={"device": device.cel()})
        if value.type() == cel.Type.ERROR:
            raise Unschedulable(f"{where}: CEL runtime error: {value.value()}")
        return value.plain_value() is True

    def _candidates(
        self, claim: str, request: dict[str, Any], taken: set[str], allocated: set[str]
    ) -> list[Device]:
        exactly = request["exactly"]
        device_class = self.classes.get(exactly["deviceClassName"])
        if device_class is None:
            raise Unschedulable(
                f"claim {claim}: request {request['name']}: no DeviceClass {exactly['deviceClassName']}"
            )
        selectors = [
            (f"claim {claim}: class {exactly['deviceClassName']}: selector #{i}", s["cel"]["expression"])
            for i, s in enumerate(device_class["spec"].get("selectors", []))
        ] + [
            (f"claim {claim}: request {request['name']}: selector #{i}", s["cel"]["expression"])
            for i, s in enumerate(exactly.get("selectors", []))
        ]
        out = []
        for device in self.devices:
            if device.name in allocated or device.name in taken:
                continue
            if device.consumes and self.counters is None:  # isSelectable without the gate
                continue
            if not self._counters_fit([device], allocated):  # alone it does not fit: skip early
                continue
            if all(self._matches(expression, device, where) for where, expression in selectors):
                out.append(device)
        return out

    def allocate(self, claim: dict[str, Any], pod: tuple[str, str]) -> dict[str, Any]:
        """`claim` (v1) with `status` as the scheduler writes it, reserved for pod (name, uid);
        raises Unschedulable."""
        meta = claim["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        devices = claim["spec"]["devices"]
        requests = devices["requests"]
        constraints = devices.get("constraints", [])
        chosen: dict[str, list[Device]] = {}
        before = self.allocated()
        if self.counters is not None and self.counters.invalid:
            raise Unschedulable(
                f"claim {key}: invalid resource pools were encountered: pool {self.pool}: {self.counters.invalid}"
            )

        def consistent() -> bool:
            if not self._counters_fit([d for ds in chosen.values() for d in ds], before):
                return False
            for c in constraints:
                names = c.get("requests") or [r["name"] for r in requests]
                picked = [d for n in names for d in chosen.get(n, [])]
                values = {d.attributes.get(c["matchAttribute"], KeyError) for d in picked}
                if KeyError in values or len(values) > 1:
                    return False
            return True

        def search(i: int) -> bool:
            if i == len(requests):
                return True
            request = requests[i]
            taken = {d.name for ds in chosen.values() for d in ds}
            count = int(request["exactly"].get("count", 1))
            for combo in itertools.combinations(self._candidates(key, request, taken, before), count):
                chosen[request["name"]] = list(combo)
                if consistent() and search(i + 1):
                    return True
                del chosen[request["name"]]
            return False

        if not search(0):
            raise Unschedulable(f"claim {key}: cannot allocate all claims on node {self.pool}")
        results = [
            {"request": r["name"], "driver": DRIVER, "pool": self.pool, "device": d.name}
            for r in requests
            for d in chosen[r["name"]]
        ]
        config = [
            {"source": "FromClass", "requests": [r["name"]], **entry}
            for r in requests
            for entry in self.classes[r["exactly"]["deviceClassName"]]["spec"].get("config", [])
        ] + [{"source": "FromClaim", **entry} for entry in devices.get("config", [])]
        allocated = copy.deepcopy(claim)
        allocation: dict[str, Any] = {"devices": {"results": results}}
        if config:
            allocation["devices"]["config"] = config
        allocation["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [self.pool]}]}
            ]
        }
        allocated["status"] = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": pod[0], "uid": pod[1]}],
        }
        for r in results:
            self.in_use[r["device"]] = meta["uid"]
        return allocated

    def release(self, claim_uid: str) -> None:
        self.in_use = {d: u for d, u in self.in_use.items() if u != claim_uid}


@dataclass
class KubeletClaims:
    """The kubelet's DRA manager over the DRA kubelet stand-in: which claims each pod's start and
    stop send, one call per pod."""

    dra: DraKubeletStandin
    timeout: float = 45.0
    prepared: dict[str, set[str]] = field(default_factory=dict)  # claim uid -> pod uids
    calls: list[tuple[str, list[str]]] = field(default_factory=list)  # (operation, claim uids)

    def start_pod(self, pod_uid: str, claims: Sequence[tuple[str, str, str]]) -> dict[str, Any]:
        """NodePrepareResources for the pod's claims not yet prepared: uid -> answer ({} if none)."""
        todo = [c for c in claims if c[2] not in self.prepared]
        for c in claims:
            if c[2] in self.prepared:
                self.prepared[c[2]].add(pod_uid)
        if not todo:
            return {}
        self.calls.append(("prepare", [c[2] for c in todo]))
        answers = dict(self.dra.prepare(DRIVER, todo, timeout=self.timeout).claims)
        for c in todo:
            if not answers[c[2]].error:
                self.prepared[c[2]] = {pod_uid}
        return answers

    def stop_pod(self, pod_uid: str, claims: Sequence[tuple[str, str, str]]) -> dict[str, Any]:
        """NodeUnprepareResources for the pod's claims no other pod references: uid -> answer."""
        todo = []
        for c in claims:
            pods = self.prepared.get(c[2])
            if pods is None:
                continue
            pods.discard(pod_uid)
            if not pods:
                todo.append(c)
        if not todo:
            return {}
        self.calls.append(("unprepare", [c[2] for c in todo]))
        answers = dict(self.dra.unprepare(DRIVER, todo, timeout=self.timeout).claims)
        for c in todo:
            if not answers[c[2]].error:
                del self.prepared[c[2]]
        return answers
