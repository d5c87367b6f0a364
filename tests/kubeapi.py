"""A fake Kubernetes API server for tests: the real one's contract where gpuvisor depends on it.

No API server can be installed where the suite runs (docs/testing.md), so this serves the REST paths gpuvisor uses, over
TLS with a certificate from its own test CA and a bearer token (so the client's kubeconfig path,
CA data and token, is exercised), with the real server's rules for them:

- Status objects for refusals (401, 403, 404, 405, 409, 410, 415, 422), and, as the real server's
  mux does, a plain-text `404 page not found` for a path it does not serve at all: an unknown
  path, or a CRD's path while the CRD is not installed (`crds`);
- `resourceVersion`: one counter for every write; optimistic concurrency (a stale version sent
  back is 409 Conflict); list answers carry the collection's version;
- watch (`?watch=true`) of nodes: chunked JSON lines from a resourceVersion (or the current state
  as ADDED events without one), `fieldSelector=metadata.name=...`, BOOKMARK events when asked
  (`allowWatchBookmarks`, every `bookmark_s`), `timeoutSeconds`, and `410 Gone` for a version
  older than the last compaction (`compact()`): as an HTTP 410 when the watch starts, as an ERROR
  event in a stream that `expire_watches()` ends;
- the `status` subresource of nodes, PATCHed with a strategic-merge patch that merges
  `status.conditions` by `type` (other conditions untouched) or with a JSON merge patch;
- core/v1 Events: created (validated: namespace rules for a cluster-scoped object, type, name,
  timestamps), PATCHed (count, lastTimestamp), listed;
- resource.k8s.io/v1 ResourceSlices (cluster-scoped: get, list and watch by `fieldSelector`
  `spec.nodeName` / `spec.driver` / `metadata.name` as the real server indexes them, any other
  field a 400; create with `generateName`, update with optimistic concurrency and the immutable
  driver, pool name and node name, delete with `preconditions`, deletecollection as the kubelet
  wipes a node's slices, `dryRun=All`) and ResourceClaims (get, list, watch, create, delete),
  each checked against the `resource.k8s.io/v1` schema (kubernetes-validate's, strict) and the
  server's own rules (one controller owner, one of nodeName/nodeSelector/allNodes, device names,
  counts, semver, taints); `device_taints=False` is a server without the DRADeviceTaints gate,
  which drops `devices[].taints` on write; `dra=False` one that does not serve the API at all;
- RBAC: with `allow` set, a request whose (verb, resource) is not in it gets the real 403 text;
- NFD's NodeFeature (checked against NFD v0.19.0's CRD schema, `tests/data/`, as the structural
  schema it is, so unknown fields fail too) and pods (read only);
- every request is recorded with its user agent and field manager (the `fieldManager` parameter,
  else the user agent up to its first "/", as the real server derives it).

And the failures a real server shows: a frozen server (`freeze()`: requests hang until `thaw()`),
dropped watch connections (`drop_connections()`), an outage (`stop()` then `start()` on the same
port), and one injected failure per method (`fail_next`). Refusals of what gpuvisor sent are
recorded in `errors`, which a test expects empty.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import importlib
import ipaddress
import json
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SCHEMA_FILE = Path(__file__).parent / "data" / "nfd-nodefeature-v1alpha1-schema.yaml"
NFD_GROUP = "nfd.k8s-sigs.io"
NF_PATH = re.compile(r"^/apis/nfd\.k8s-sigs\.io/v1alpha1/namespaces/([^/]+)/nodefeatures(?:/([^/]+))?$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
NODE_PATH = re.compile(r"^/api/v1/nodes(?:/([^/]+)(?:/(status))?)?$")
EVENT_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
TOKEN = "gpuvisor-test-token"
USER = "system:serviceaccount:gpuvisor:gpuvisor"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}
HISTORY = 1000  # watch events kept; older versions are compacted away


def structural(schema: Any) -> Any:
    """The CRD's openAPIV3Schema as a JSON schema that also refuses fields the server would prune."""
    if isinstance(schema, dict):
        out = {k: structural(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [structural(v) for v in schema]
    return schema


NODE_FEATURE_SCHEMA = structural(yaml.safe_load(SCHEMA_FILE.read_text()))


def node_feature_problems(obj: Any, namespace: str, name: str | None) -> list[str]:
    """What the API server would refuse in a NodeFeature sent to `namespace` (and `name` for a PUT)."""
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '(object)'}: {e.message}"
        for e in jsonschema.Draft7Validator(NODE_FEATURE_SCHEMA).iter_errors(obj)
    ]
    if not isinstance(obj, dict):
        return problems or ["not an object"]
    if (obj.get("apiVersion"), obj.get("kind")) != ("nfd.k8s-sigs.io/v1alpha1", "NodeFeature"):
        problems.append(
            f"apiVersion/kind {obj.get('apiVersion')}/{obj.get('kind')} is not nfd.k8s-sigs.io/v1alpha1/NodeFeature"
        )
    meta = obj.get("metadata") or {}
    problems += _name_problems(meta, name)
    if meta.get("namespace", namespace) != namespace:
        problems.append(
            f"metadata.namespace {meta.get('namespace')!r} does not match the URL's {namespace!r}"
        )
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if not (LABEL_NAME.match(label) and 0 < len(label) <= 63) or (
            prefix and not DNS_SUBDOMAIN.match(prefix)
        ):
            problems.append(f"metadata.labels key {key!r} is not a valid label name")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_NAME.match(value):
            problems.append(f"metadata.labels[{key!r}] value {value!r} is not a valid label value")
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        missing = [k for k in ("apiVersion", "kind", "name", "uid") if not ref.get(k)]
        if missing:
            problems.append(f"metadata.ownerReferences[{i}]: missing {missing}")
    if sum(1 for ref in meta.get("ownerReferences") or [] if ref.get("controller")) > 1:
        problems.append("metadata.ownerReferences: only one reference can have controller set to true")
    return problems


def _name_problems(meta: dict[str, Any], url_name: str | None) -> list[str]:
    name = meta.get("name", "")
    problems = []
    if not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        problems.append(f"metadata.name {name!r} is not a DNS-1123 subdomain")
    if url_name is not None and name != url_name:
        problems.append(f"metadata.name {name!r} does not match the URL's {url_name!r}")
    return problems


def event_problems(event: Any, namespace: str) -> list[str]:
    """What the API server's core/v1 Event validation (ValidateEventCreate) would refuse."""
    if not isinstance(event, dict):
        return ["not an object"]
    meta = event.get("metadata") or {}
    problems = _name_problems(meta, None)
    involved = event.get("involvedObject") or {}
    if not involved.get("kind") or not involved.get("name"):
        problems.append("involvedObject.kind and involvedObject.name are required")
    if not involved.get("namespace") and namespace not in ("", "default"):
        problems.append(
            f"metadata.namespace {namespace!r}: does not match event.involvedObject.namespace "
            "(a cluster-scoped object's events go to 'default')"
        )
    if involved.get("namespace") and involved["namespace"] != namespace:
        problems.append("metadata.namespace does not match involvedObject.namespace")
    if event.get("type") not in ("Normal", "Warning"):
        problems.append(f"type {event.get('type')!r}: must be Normal or Warning")
    for key in ("firstTimestamp", "lastTimestamp"):
        if key in event and not (isinstance(event[key], str) and TIME.match(event[key])):
            problems.append(f"{key} {event[key]!r} is not an RFC 3339 time")
    if not isinstance(event.get("count", 1), int) or event.get("count", 1) < 1:
        problems.append("count must be a positive integer")
    if len(str(event.get("reason", ""))) > 128:
        problems.append("reason is over 128 characters")
    return problems


def condition_problems(node: dict[str, Any]) -> list[str]:
    """A Node's conditions as the API server decodes them: a type, a known status, RFC 3339 times."""
    problems = []
    for cond in (node.get("status") or {}).get("conditions") or []:
        if not isinstance(cond, dict) or not cond.get("type"):
            problems.append(f"condition {cond!r}: type is required")
            continue
        if cond.get("status") not in ("True", "False", "Unknown"):
            problems.append(
                f"condition {cond['type']}: status {cond.get('status')!r} is not True/False/Unknown"
            )
        for key in ("lastHeartbeatTime", "lastTransitionTime"):
            value = cond.get(key)
            if value is not None and not (isinstance(value, str) and TIME.match(value)):
                problems.append(f"condition {cond['type']}: {key} {value!r} is not an RFC 3339 time")
    return problems


# ---------------------------------------------------------------------------------- resource.k8s.io/v1

RESOURCE_GROUP = "resource.k8s.io"
GROUPS = {"nodefeatures": NFD_GROUP, "resourceslices": RESOURCE_GROUP, "resourceclaims": RESOURCE_GROUP}
KINDS = {
    "nodes": ("v1", "Node"),
    "resourceslices": ("resource.k8s.io/v1", "ResourceSlice"),
    "resourceclaims": ("resource.k8s.io/v1", "ResourceClaim"),
}
# The fields each resource can be selected by (the real server's field label conversions): a list
# or watch with any other field is a 400.
FIELD_LABELS = {
    "nodes": ("metadata.name",),
    "resourceslices": ("metadata.name", "spec.nodeName", "spec.driver"),
    "resourceclaims": ("metadata.name", "metadata.namespace"),
}
SLICE_PATH = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices(?:/([^/]+))?$")
CLAIM_PATH = re.compile(
    r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims(?:/([^/]+)(?:/(status))?)?$"
)
SCHEMA_VERSION = "1.34.0"  # the resource.k8s.io/v1 schema the objects are checked against
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$"
)
SLICE_MAX_DEVICES = 128  # ResourceSliceMaxDevices (1.34)
DEVICE_MAX_TAINTS = 4  # DeviceTaintsMaxLength (1.34)
DEVICE_MAX_ATTRIBUTES = 32  # attributes and capacities together
GENERATED_SUFFIX = 5  # the API server's names.SimpleNameGenerator


def field_value(obj: dict[str, Any], key: str) -> str:
    """The value a field selector compares (absent is "", as the server's field sets give it)."""
    value: Any = obj
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def schema_problems(obj: Any) -> list[str]:
    """What the resource.k8s.io/v1 OpenAPI schema (strict: an unknown field fails) refuses."""
    try:  # the test extra's validator, with the bundled schemas
        kubernetes_validate: Any = importlib.import_module("kubernetes_validate")
    except ImportError:  # pragma: no cover - without it only the server's own rules below apply
        return []
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path) or "(object)"
        return [f"{where}: {exc.message}"]
    except Exception as exc:  # an unknown kind, a schema the validator lacks
        return [f"schema: {exc}"]
    return []


def _owner_problems(meta: dict[str, Any]) -> list[str]:
    problems = []
    refs = meta.get("ownerReferences") or []
    for i, ref in enumerate(refs):
        missing = [k for k in ("apiVersion", "kind", "name", "uid") if not ref.get(k)]
        if missing:
            problems.append(f"metadata.ownerReferences[{i}]: missing {missing}")
    if sum(1 for ref in refs if ref.get("controller")) > 1:
        problems.append("metadata.ownerReferences: Only one reference can have Controller set to true")
    return problems


def _taint_problems(taints: Any, where: str) -> list[str]:
    problems = []
    if len(taints) > DEVICE_MAX_TAINTS:
        problems.append(
            f"{where}.taints: Too many: {len(taints)}: must have at most {DEVICE_MAX_TAINTS} items"
        )
    for j, taint in enumerate(taints):
        at = f"{where}.taints[{j}]"
        key = str(taint.get("key", ""))
        prefix, _, name = key.rpartition("/")
        if (
            not name
            or len(name) > 63
            or not LABEL_NAME.match(name)
            or (prefix and not DNS_SUBDOMAIN.match(prefix))
        ):
            problems.append(f"{at}.key: Invalid value: {key!r}: a qualified name")
        value = str(taint.get("value", ""))
        if len(value) > 63 or not LABEL_NAME.match(value):
            problems.append(f"{at}.value: Invalid value: {value!r}: a label value")
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            problems.append(
                f'{at}.effect: Unsupported value: {taint.get("effect")!r}: "NoExecute", "NoSchedule"'
            )
        if "timeAdded" in taint and not (
            isinstance(taint["timeAdded"], str) and TIME.match(taint["timeAdded"])
        ):
            problems.append(f"{at}.timeAdded: not an RFC 3339 time")
    return problems


def resource_slice_problems(obj: Any) -> list[str]:
    """What the API server refuses in a ResourceSlice: its schema, then the rules of
    validation.ValidateResourceSlice (1.34) that gpuvisor's slices touch."""
    if not isinstance(obj, dict):
        return ["not an object"]
    problems = schema_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) != ("resource.k8s.io/v1", "ResourceSlice"):
        problems.append(
            f"apiVersion/kind {obj.get('apiVersion')}/{obj.get('kind')} is not resource.k8s.io/v1 ResourceSlice"
        )
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not (DNS_SUBDOMAIN.match(name) and len(name) <= 253):
        problems.append(f"metadata.name: Invalid value: {name!r}: a DNS-1123 subdomain")
    problems += _owner_problems(meta)
    spec = obj.get("spec") or {}
    driver = str(spec.get("driver", ""))
    if not driver or len(driver) > 63 or not DNS_SUBDOMAIN.match(driver):
        problems.append(
            f"spec.driver: Invalid value: {driver!r}: a DNS-1123 subdomain of at most 63 characters"
        )
    pool = spec.get("pool") or {}
    if not pool.get("name") or len(str(pool.get("name"))) > 253:
        problems.append("spec.pool.name: Required value")
    if int(pool.get("generation", 0)) < 0:
        problems.append("spec.pool.generation: must be greater than or equal to 0")
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        problems.append("spec.pool.resourceSliceCount: must be greater than zero")
    where = [k for k in ("nodeName", "nodeSelector") if spec.get(k)] + [
        k for k in ("allNodes", "perDeviceNodeSelection") if spec.get(k) is True
    ]
    if len(where) != 1:
        problems.append(
            "spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
            f"`perDeviceNodeSelection` is required, got {where}"
        )
    devices = spec.get("devices") or []
    if len(devices) > SLICE_MAX_DEVICES:
        problems.append(
            f"spec.devices: Too many: {len(devices)}: must have at most {SLICE_MAX_DEVICES} items"
        )
    names: set[str] = set()
    for i, device in enumerate(devices):
        at = f"spec.devices[{i}]"
        dname = str(device.get("name", ""))
        if not DNS_LABEL.match(dname) or len(dname) > 63:
            problems.append(f"{at}.name: Invalid value: {dname!r}: a DNS-1123 label")
        if dname in names:
            problems.append(f"{at}.name: Duplicate value: {dname!r}")
        names.add(dname)
        attrs, capacity = device.get("attributes") or {}, device.get("capacity") or {}
        if len(attrs) + len(capacity) > DEVICE_MAX_ATTRIBUTES:
            problems.append(
                f"{at}: Too many: attributes and capacities must have at most {DEVICE_MAX_ATTRIBUTES} items"
            )
        for key in [*attrs, *capacity]:
            domain, sep, ident = key.rpartition("/")
            if (sep and not (DNS_SUBDOMAIN.match(domain) and len(domain) <= 63)) or not (
                C_IDENTIFIER.match(ident) and len(ident) <= 32
            ):
                problems.append(f"{at}: Invalid value: {key!r}: a qualified name")
        for key, attr in attrs.items():
            kinds = [k for k in ("int", "bool", "string", "version") if k in attr]
            if len(kinds) != 1:
                problems.append(f"{at}.attributes[{key}]: exactly one value must be specified")
                continue
            value = attr[kinds[0]]
            if kinds[0] in ("string", "version") and len(value) > 64:
                problems.append(f"{at}.attributes[{key}]: Too long: may not be more than 64 bytes")
            if kinds[0] == "version" and not SEMVER.match(value):
                problems.append(
                    f"{at}.attributes[{key}].version: Invalid value: {value!r}: must be semantic version 2.0.0"
                )
        problems += _taint_problems(device.get("taints") or [], at)
    return problems


def resource_claim_problems(obj: Any, namespace: str) -> list[str]:
    """What the API server refuses in a ResourceClaim sent to `namespace`."""
    if not isinstance(obj, dict):
        return ["not an object"]
    problems = schema_problems(obj)
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not (DNS_SUBDOMAIN.match(name) and len(name) <= 253):
        problems.append(f"metadata.name: Invalid value: {name!r}: a DNS-1123 subdomain")
    if meta.get("namespace", namespace) != namespace:
        problems.append("metadata.namespace: does not match the namespace of the request")
    results = (
        (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
    ) or []
    if len(results) > 32:
        problems.append(
            f"status.allocation.devices.results: Too many: {len(results)}: must have at most 32 items"
        )
    return problems


CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
DEVICE_STATUS_MAX_CONDITIONS = 8  # resource/v1 AllocatedDeviceStatusMaxConditions
DEVICE_STATUS_MAX_DATA = 10 * 1024  # AllocatedDeviceStatusDataMaxLength


def condition_list_problems(conditions: Any, where: str) -> list[str]:
    """apimachinery's metav1validation.ValidateConditions: type a qualified name and unique,
    status True/False/Unknown, reason required in CamelCase form (at most 1024), message at most
    32768, lastTransitionTime required, observedGeneration not negative."""
    if not isinstance(conditions, list):
        return [f"{where}: Invalid value: must be a list"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, cond in enumerate(conditions):
        here = f"{where}[{i}]"
        if not isinstance(cond, dict):
            problems.append(f"{here}: Invalid value: must be an object")
            continue
        kind = cond.get("type")
        if not isinstance(kind, str) or not QUALIFIED_NAME.match(kind) or len(kind) > 316:
            problems.append(f"{here}.type: Invalid value: {kind!r}: a qualified name")
        elif kind in seen:
            problems.append(f"{here}.type: Duplicate value: {kind!r}")
        else:
            seen.add(kind)
        if cond.get("status") not in ("True", "False", "Unknown"):
            problems.append(f"{here}.status: Unsupported value: {cond.get('status')!r}")
        reason = cond.get("reason")
        if not isinstance(reason, str) or not reason:
            problems.append(f"{here}.reason: Required value")
        elif len(reason) > 1024 or not CONDITION_REASON.match(reason):
            problems.append(f"{here}.reason: Invalid value: {reason!r}")
        if len(str(cond.get("message", ""))) > 32768:
            problems.append(f"{here}.message: Too long: may not be more than 32768 bytes")
        when = cond.get("lastTransitionTime")
        if not isinstance(when, str) or not TIME.match(when):
            problems.append(f"{here}.lastTransitionTime: Required value: must be set")
        generation = cond.get("observedGeneration", 0)
        if not isinstance(generation, int) or generation < 0:
            problems.append(
                f"{here}.observedGeneration: Invalid value: must be greater than or equal to zero"
            )
    return problems


def claim_status_problems(claim: dict[str, Any]) -> list[str]:
    """pkg/apis/resource/validation/validation.go validateResourceClaimStatusUpdate for
    status.devices: each entry of an allocated device ("must be an allocated device in the
    claim"), unique by driver, pool, device and shareID, at most 8 conditions, valid conditions,
    data a JSON object of at most 10 KiB."""
    status = claim.get("status") or {}
    devices = status.get("devices")
    if devices is None:
        return []
    if not isinstance(devices, list):
        return ["status.devices: Invalid value: must be a list"]
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    allocated = {
        (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID"))
        for r in results
        if isinstance(r, dict)
    }
    problems: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for i, entry in enumerate(devices):
        here = f"status.devices[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{here}: Invalid value: must be an object")
            continue
        key = (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))
        for part in ("driver", "pool", "device"):
            if not entry.get(part):
                problems.append(f"{here}.{part}: Required value")
        if key in seen:
            problems.append(f"{here}: Duplicate value: {'/'.join(str(k) for k in key[:3])}")
        seen.add(key)
        if key not in allocated:
            problems.append(
                f"{here}: Invalid value: {'/'.join(str(k) for k in key[:3])}: must be an allocated device in the claim"
            )
        conditions = entry.get("conditions") or []
        if isinstance(conditions, list) and len(conditions) > DEVICE_STATUS_MAX_CONDITIONS:
            problems.append(f"{here}.conditions: Too many: {len(conditions)}: must have at most 8 items")
        problems += condition_list_problems(conditions, f"{here}.conditions")
        if "data" in entry:
            data = entry["data"]
            if not isinstance(data, dict):
                problems.append(f"{here}.data: Invalid value: must be a valid JSON object")
            elif len(json.dumps(data)) > DEVICE_STATUS_MAX_DATA:
                problems.append(f"{here}.data: Too long: may not be more than 10240 bytes")
    return problems


def _drop_taints(spec: dict[str, Any]) -> None:
    """dropDisabledDRADeviceTaintsFields: without the DRADeviceTaints gate the field is dropped."""
    for device in spec.get("devices") or []:
        device.pop("taints", None)


def strategic_merge(target: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    """A strategic-merge patch for the fields gpuvisor sends: maps merge, null deletes, lists with a
    merge key (a Node's conditions by `type`) merge element by element, other lists are replaced."""
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value, here)
        elif isinstance(value, list) and here in MERGE_KEYS and isinstance(target.get(key), list):
            merge_key = MERGE_KEYS[here]
            merged = target[key]
            for item in value:
                existing = next(
                    (e for e in merged if isinstance(e, dict) and e.get(merge_key) == item.get(merge_key)),
                    None,
                )
                if existing is None:
                    merged.append(copy.deepcopy(item))
                else:
                    strategic_merge(existing, item, here)
        else:
            target[key] = copy.deepcopy(value)


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch: maps merge, null deletes, everything else (lists too) replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class JsonPatchError(ValueError):
    """An RFC 6902 patch that does not apply; the text as github.com/evanphx/json-patch words it."""


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"invalid path {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _container(doc: Any, parts: list[str], path: str, op: str) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise JsonPatchError(f"{op} operation does not apply: doc is missing path: {path!r}")
    return node, parts[-1]


def json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 on a copy of `doc`: add, remove, replace, move, copy, test; the first op that does
    not apply fails the whole patch (the API server answers 422: apiserver's patch.go
    `applyJSPatch`, `errors.NewGenericServerResponse(http.StatusUnprocessableEntity, ...)`)."""
    if not isinstance(ops, list):
        raise JsonPatchError("the patch is not a JSON array of operations")
    out = copy.deepcopy(doc)
    for op in ops:
        if (
            not isinstance(op, dict)
            or not isinstance(op.get("op"), str)
            or not isinstance(op.get("path"), str)
        ):
            raise JsonPatchError(f"invalid operation {op!r}")
        kind, path = op["op"], op["path"]
        parts = _pointer(path)
        if not parts:
            raise JsonPatchError(f"{kind} on the whole document is not supported here")
        if kind == "test":
            node, last = _container(out, parts, path, kind)
            current = node.get(last) if isinstance(node, dict) else None
            if not isinstance(node, dict) or last not in node or current != op.get("value"):
                raise JsonPatchError(f"testing value {path} failed: test failed")
            continue
        if kind in ("move", "copy"):
            source = _pointer(str(op.get("from", "")))
            holder, key = _container(out, source, str(op.get("from")), kind)
            if not isinstance(holder, dict) or key not in holder:
                raise JsonPatchError(
                    f"{kind} operation does not apply: doc is missing from path: {op.get('from')!r}"
                )
            value = holder.pop(key) if kind == "move" else copy.deepcopy(holder[key])
            node, last = _container(out, parts, path, kind)
            node[last] = value
            continue
        node, last = _container(out, parts, path, kind)
        if not isinstance(node, dict):
            raise JsonPatchError(f"{kind} into a list is not supported here: {path!r}")
        if kind == "add":
            node[last] = copy.deepcopy(op.get("value"))
        elif kind == "remove":
            if last not in node:
                raise JsonPatchError(f"remove operation does not apply: doc is missing path: {path!r}")
            del node[last]
        elif kind == "replace":
            if last not in node:
                raise JsonPatchError(f"replace operation does not apply: doc is missing key: {path!r}")
            node[last] = copy.deepcopy(op.get("value"))
        else:
            raise JsonPatchError(f"unexpected kind {kind!r}")
    return out


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Request:
    method: str
    path: str
    body: Any
    content_type: str | None = None
    query: dict[str, str] = field(default_factory=dict)
    user_agent: str = ""
    manager: str = ""  # the field manager the server would record for a write
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
    crds: set[str] = field(default_factory=lambda: {NFD_GROUP})  # API groups of installed CRDs
    allow: set[tuple[str, str]] | None = None  # (verb, resource[/subresource]); None allows all
    bookmark_s: float = 1.0
    resource_slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    device_taints: bool = True  # the DRADeviceTaints gate: off, devices[].taints are dropped on write
    dra: bool = True  # resource.k8s.io/v1 is served (off: a plain 404, as a server without it)
    claim_device_status: bool = True  # the DRAResourceClaimDeviceStatus gate (beta, on since 1.33)
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
        """Store a slice as another writer would (an earlier life, another tool): checked, then
        kept with the metadata the server adds, and a watch event."""
        problems = resource_slice_problems(obj)
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


def status(
    code: int, reason: str, message: str, name: str = "", kind: str = "nodefeatures", group: str | None = None
) -> dict[str, Any]:
    """A metav1.Status as the API server sends it with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "group": GROUPS.get(kind, "") if group is None else group, "kind": kind},
        "code": code,
    }  # fmt: skip


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-kube-apiserver"
    protocol_version = "HTTP/1.1"
    state: FakeApiServer  # set on the subclass made per server
    live: set[socket.socket]  # the connections being served, for drop_connections()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # As the real (Go) server: no Nagle delay. Without it an answer's body, written after its
        # headers, waits for the client's delayed ACK (~200 ms a call on loopback).
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.live.add(self.connection)

    def finish(self) -> None:
        self.live.discard(self.connection)
        with contextlib.suppress(OSError):  # a connection dropped by a test
            super().finish()

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _plain_404(self) -> None:
        """The real server's mux for a path nothing serves (an uninstalled CRD's included)."""
        data = b"404 page not found\n"
        self.send_response(404)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        state = self.state
        self.close_connection = True
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        split = urllib.parse.urlsplit(self.path)
        path = split.path
        query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
        ua = self.headers.get("User-Agent", "")
        manager = query.get("fieldManager") or ua.split("/", 1)[0]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        with state.lock:
            state.requests.append(
                Request(method, path, body, self.headers.get("Content-Type"), query, ua, manager)
            )
        while state.frozen.is_set():  # a hung server: the request waits, unanswered
            state.thawed.wait(0.2)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, status(401, "Unauthorized", "Unauthorized"))
            return
        with state.lock:
            if method in state.fail_next:
                code, reason = state.fail_next.pop(method)
                self._send(code, status(code, reason, f"injected {reason}"))
                return
        if (
            method in ("POST", "PUT")
            and (self.headers.get("Content-Type") or "application/json").split(";")[0] != "application/json"
        ):
            self._send(415, status(415, "UnsupportedMediaType", "expected application/json"))
            return
        json_patch_body = method == "PATCH" and (self.headers.get("Content-Type") or "").startswith(
            JSON_PATCH
        )
        if not isinstance(body, dict | None) and not (json_patch_body and isinstance(body, list)):
            self._send(400, status(400, "BadRequest", "the body is not a JSON object"))
            return
        if (m := POD_PATH.match(path)) and method == "GET":
            if self._allowed("get", "pods", m[1], m[2]):
                found = state.pods.get((m[1], m[2]))
                if found is None:
                    self._send(404, status(404, "NotFound", f'pods "{m[2]}" not found', m[2], "pods"))
                else:
                    self._send(200, found)
            return
        if (m := NODE_PATH.match(path)) is not None:
            self._node(method, m[1], m[2], query, body)
            return
        if (m := EVENT_PATH.match(path)) is not None:
            self._event(method, m[1], m[2], body)
            return
        if (m := SLICE_PATH.match(path)) is not None and state.dra:
            self._slice(method, m[1], query, body)
            return
        if (m := CLAIM_PATH.match(path)) is not None and state.dra:
            if m[3]:
                self._claim_status(method, m[1], m[2], body)
            else:
                self._claim(method, m[1], m[2], query, body)
            return
        nf = NF_PATH.match(path)
        if nf is None or NFD_GROUP not in state.crds:
            self._plain_404()
            return
        self._node_feature(method, nf[1], nf[2], body)

    # ------------------------------------------------------------------ RBAC
    def _allowed(self, verb: str, resource: str, namespace: str = "", name: str = "") -> bool:
        allow = self.state.allow
        if allow is None or (verb, resource) in allow:
            return True
        who = f'{resource.split("/")[0]} "{name}"' if name else resource.split("/")[0]
        group = GROUPS.get(resource.split("/")[0], "")
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        message = f'{who} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API group "{group}" {scope}'
        self._send(403, status(403, "Forbidden", message, name, resource.split("/")[0], group))
        return False

    # ------------------------------------------------------------------ nodes
    def _node(self, method: str, name: str | None, sub: str | None, query: dict[str, str], body: Any) -> None:
        state = self.state
        if name is None:
            if method != "GET":
                self._send(
                    405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="nodes")
                )
                return
            watching = query.get("watch") in ("true", "1")
            if self._allowed("watch" if watching else "list", "nodes"):
                (self._watch_nodes if watching else self._list_nodes)(query)
            return
        resource = "nodes/status" if sub else "nodes"
        if method == "GET":
            if not self._allowed("get", resource, name=name):
                return
            with state.lock:
                node = copy.deepcopy(state.nodes.get(name))
            if node is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
            else:
                self._send(200, node)
            return
        if method != "PATCH":
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="nodes"))
            return
        if not self._allowed("patch", resource, name=name):
            return
        kind = (self.headers.get("Content-Type") or "").split(";")[0]
        if kind == JSON_PATCH:
            self._json_patch_node(name, sub, body)
            return
        if kind not in (STRATEGIC, MERGE) or not isinstance(body, dict):
            self._send(
                415,
                status(
                    415, "UnsupportedMediaType", f"the patch type {kind!r} is not supported", kind="nodes"
                ),
            )
            return
        with state.lock:
            current = state.nodes.get(name)
            if current is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
                return
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent is not None and sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "nodes"))  # fmt: skip
                return
            updated = copy.deepcopy(current)
            # The status subresource takes only status (metadata.resourceVersion as a precondition);
            # the main resource ignores status.
            part = (
                {"status": body.get("status") or {}}
                if sub
                else {k: v for k, v in body.items() if k != "status"}
            )
            (strategic_merge if kind == STRATEGIC else merge_patch)(updated, part)
            problems = condition_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._send(422, status(422, "Invalid", "; ".join(problems), name, "nodes"))
                return
            stored = state._store_node(name, updated, "MODIFIED")
            self._send(200, copy.deepcopy(stored))

    def _json_patch_node(self, name: str, sub: str | None, body: Any) -> None:
        """A JSON patch of a Node (or its status): applied to the whole object, then the status
        subresource keeps only the status and the main resource everything but it, as the Node's
        strategies reset the rest (pkg/registry/core/node/strategy.go PrepareForUpdate)."""
        state = self.state
        with state.lock:
            current = state.nodes.get(name)
            if current is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
                return
            try:
                patched = json_patch(current, body)
            except JsonPatchError as exc:
                self._send(422, status(422, "Invalid", str(exc), name, "nodes"))
                return
            updated = copy.deepcopy(current)
            if sub:
                updated["status"] = patched.get("status") or {}
            else:
                updated.update({k: v for k, v in patched.items() if k != "status"})
            problems = condition_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._send(422, status(422, "Invalid", "; ".join(problems), name, "nodes"))
                return
            stored = state._store_node(name, updated, "MODIFIED")
            self._send(200, copy.deepcopy(stored))

    def _selector(self, resource: str, query: dict[str, str]) -> list[tuple[str, str, bool]] | None:
        """The query's fieldSelector as (field, value, equal) terms; None after answering 400 for a
        field the resource does not index (the real server's words)."""
        terms = []
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            if "!=" in term:
                key, _, value = term.partition("!=")
                equal = False
            else:
                key, _, value = term.partition("=")
                value, equal = value.removeprefix("="), True
            if key not in FIELD_LABELS[resource]:
                self._send(
                    400,
                    status(400, "BadRequest", f"field label not supported: {key}", kind=resource),
                )
                return None
            terms.append((key, value, equal))
        return terms

    def _selected(self, obj: dict[str, Any], terms: list[tuple[str, str, bool]]) -> bool:
        return all((field_value(obj, key) == value) == equal for key, value, equal in terms)

    def _list(self, resource: str, objects: list[dict[str, Any]], query: dict[str, str]) -> None:
        terms = self._selector(resource, query)
        if terms is None:
            return
        with self.state.lock:
            items = [copy.deepcopy(o) for o in objects if self._selected(o, terms)]
            version = str(self.state.version)
        api_version, kind = KINDS[resource]
        self._send(
            200,
            {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": version},
                "items": items,
            },
        )

    def _list_nodes(self, query: dict[str, str]) -> None:
        with self.state.lock:
            nodes = list(self.state.nodes.values())
        self._list("nodes", nodes, query)

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch_nodes(self, query: dict[str, str]) -> None:
        self._watch("nodes", lambda: list(self.state.nodes.values()), query)

    def _watch(
        self, resource: str, current: Callable[[], list[dict[str, Any]]], query: dict[str, str]
    ) -> None:
        """A watch of `resource` (`current()` gives its objects now, under the lock)."""
        state = self.state
        terms = self._selector(resource, query)
        if terms is None:
            return
        start = query.get("resourceVersion", "")
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        api_version, kind_name = KINDS[resource]
        with state.lock:
            if start not in ("", "0") and (not start.isdigit() or int(start) < state.compacted):
                self._send(
                    410,
                    status(
                        410,
                        "Expired",
                        f"too old resource version: {start} ({state.compacted})",
                        kind=resource,
                    ),
                )
                return
            epoch = state.watch_epoch
            if start in ("", "0"):  # no version: the current state first, as ADDED events
                pending = [("ADDED", copy.deepcopy(o)) for o in current() if self._selected(o, terms)]
                seen = state.version
            else:
                pending, seen = [], int(start)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + state.bookmark_s
        try:
            for kind, obj in pending:
                self._chunk({"type": kind, "object": obj})
            while time.monotonic() < deadline:
                with state.lock:
                    if state.watch_epoch != epoch:
                        self._chunk(
                            {
                                "type": "ERROR",
                                "object": status(
                                    410,
                                    "Expired",
                                    "The resourceVersion for the provided watch is too old.",
                                    kind=resource,
                                ),
                            }
                        )
                        break
                    events = [(v, k, o) for v, r, k, o in state.history if v > seen and r == resource]
                    if not events:
                        state.changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                        events = [(v, k, o) for v, r, k, o in state.history if v > seen and r == resource]
                    current_version = state.version
                for version, kind, obj in events:
                    seen = version
                    if self._selected(obj, terms):
                        self._chunk({"type": kind, "object": copy.deepcopy(obj)})
                if bookmarks and time.monotonic() >= next_bookmark:
                    seen = max(seen, current_version)
                    self._chunk({"type": "BOOKMARK", "object": {"kind": kind_name, "apiVersion": api_version,
                                                                "metadata": {"resourceVersion": str(seen)}}})  # fmt: skip
                    next_bookmark = time.monotonic() + state.bookmark_s
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client went, or a test dropped the connection

    # ------------------------------------------------------------------ events
    def _event(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        verb = {"POST": "create", "PATCH": "patch", "GET": "get" if name else "list"}.get(method)
        if verb is None or (method == "POST") == bool(name):
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="events"))
            return
        if not self._allowed(verb, "events", namespace, name or ""):
            return
        with state.lock:
            if method == "GET":
                if name:
                    found = state.events.get((namespace, name))
                    self._send(200, found) if found else self._send(
                        404, status(404, "NotFound", f'events "{name}" not found', name, "events")
                    )
                else:
                    items = [e for (ns, _), e in state.events.items() if ns == namespace]
                    self._send(
                        200,
                        {
                            "kind": "EventList",
                            "metadata": {"resourceVersion": str(state.version)},
                            "items": items,
                        },
                    )
                return
            if method == "POST":
                problems = event_problems(body, namespace)
                key = (namespace, (body or {}).get("metadata", {}).get("name", ""))
                if not problems and key in state.events:
                    self._send(
                        409,
                        status(409, "AlreadyExists", f'events "{key[1]}" already exists', key[1], "events"),
                    )
                    return
                stored = copy.deepcopy(body)
            else:
                key = (namespace, name or "")
                current = state.events.get(key)
                if current is None:
                    self._send(
                        404, status(404, "NotFound", f'events "{name}" not found', name or "", "events")
                    )
                    return
                kind = (self.headers.get("Content-Type") or "").split(";")[0]
                if kind not in (STRATEGIC, MERGE):
                    self._send(
                        415,
                        status(
                            415,
                            "UnsupportedMediaType",
                            f"the patch type {kind!r} is not supported",
                            kind="events",
                        ),
                    )
                    return
                stored = copy.deepcopy(current)
                (strategic_merge if kind == STRATEGIC else merge_patch)(stored, body or {})
                problems = event_problems(stored, namespace)
            if problems:
                state.errors.extend(problems)
                self._send(422, status(422, "Invalid", "; ".join(problems), key[1], "events"))
                return
            state.version += 1
            stored.setdefault("metadata", {})["namespace"] = namespace
            stored["metadata"]["resourceVersion"] = str(state.version)
            stored["metadata"].setdefault("uid", str(uuid.uuid4()))
            state.events[key] = stored
            self._send(201 if method == "POST" else 200, stored)

    # ------------------------------------------------------------------ ResourceSlices
    def _slice(self, method: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceSlices (cluster-scoped): get, list, watch, create (with
        generateName), update, delete (with preconditions), deletecollection, and `dryRun=All`."""
        state = self.state
        dry = query.get("dryRun") == "All"
        if method == "GET":
            if name is None:
                watching = query.get("watch") in ("true", "1")
                if self._allowed("watch" if watching else "list", "resourceslices"):

                    def current() -> list[dict[str, Any]]:
                        return list(state.resource_slices.values())

                    if watching:
                        self._watch("resourceslices", current, query)
                    else:
                        with state.lock:
                            objects = current()
                        self._list("resourceslices", objects, query)
                return
            if self._allowed("get", "resourceslices", name=name):
                with state.lock:
                    found = copy.deepcopy(state.resource_slices.get(name))
                self._send(200, found) if found else self._not_found("resourceslices", name)
            return
        if method == "DELETE":
            self._delete_slices(name, query, body, dry)
            return
        if method == "POST" and name is None:
            if self._allowed("create", "resourceslices"):
                self._create_slice(body, dry)
            return
        if method == "PUT" and name is not None:
            if self._allowed("update", "resourceslices", name=name):
                self._update_slice(name, body, dry)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceslices")
        )

    def _not_found(self, resource: str, name: str) -> None:
        group = GROUPS.get(resource, "")
        qualified = f"{resource}.{group}" if group else resource
        self._send(404, status(404, "NotFound", f'{qualified} "{name}" not found', name, resource))

    def _invalid(self, resource: str, name: str, problems: list[str]) -> None:
        self.state.errors.extend(problems)
        kind = KINDS[resource][1]
        self._send(
            422,
            status(
                422,
                "Invalid",
                f'{kind}.{RESOURCE_GROUP} "{name}" is invalid: ' + "; ".join(problems),
                name,
                resource,
            ),
        )

    def _create_slice(self, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict):
            self._send(
                400, status(400, "BadRequest", "the body is not a ResourceSlice", kind="resourceslices")
            )
            return
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(GENERATED_SUFFIX)
            )
        if not state.device_taints:
            _drop_taints(obj.get("spec") or {})
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            meta.pop(key, None)
        problems = resource_slice_problems(obj)
        if problems:
            self._invalid("resourceslices", str(meta.get("name", "")), problems)
            return
        with state.lock:
            if meta["name"] in state.resource_slices:
                self._send(409, status(409, "AlreadyExists", f'resourceslices.{RESOURCE_GROUP} "{meta["name"]}" already exists',
                                       meta["name"], "resourceslices"))  # fmt: skip
                return
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[meta["name"]] = obj
                state._record("resourceslices", "ADDED", obj)
            self._send(201, copy.deepcopy(obj))

    def _update_slice(self, name: str, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != name:
            self._send(400, status(400, "BadRequest", f"the name of the object does not match the name on the URL ({name})",
                                   name, "resourceslices"))  # fmt: skip
            return
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            sent = body["metadata"].get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceslices"))  # fmt: skip
                return
            obj = copy.deepcopy(body)
            spec, old = obj.get("spec") or {}, current["spec"]
            if not state.device_taints and not any(d.get("taints") for d in old.get("devices") or []):
                _drop_taints(spec)
            problems = resource_slice_problems(obj)
            for key in ("driver", "nodeName"):
                if spec.get(key) != old.get(key):
                    problems.append(f"spec.{key}: Invalid value: {spec.get(key)!r}: field is immutable")
            if (spec.get("pool") or {}).get("name") != old["pool"]["name"]:
                problems.append("spec.pool.name: Invalid value: field is immutable")
            if problems:
                self._invalid("resourceslices", name, problems)
                return
            meta = obj["metadata"]
            for key in ("uid", "creationTimestamp"):
                meta[key] = current["metadata"][key]
            meta["generation"] = current["metadata"]["generation"] + (spec != old)
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[name] = obj
                state._record("resourceslices", "MODIFIED", obj)
            else:
                meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            self._send(200, copy.deepcopy(obj))

    def _delete_slices(self, name: str | None, query: dict[str, str], body: Any, dry: bool) -> None:
        state = self.state
        if name is None:  # deletecollection, as the kubelet wipes a node's slices
            if not self._allowed("deletecollection", "resourceslices"):
                return
            terms = self._selector("resourceslices", query)
            if terms is None:
                return
            with state.lock:
                gone = [
                    o if dry else state._delete_slice(n)
                    for n, o in list(state.resource_slices.items())
                    if self._selected(o, terms)
                ]
                version = str(state.version)
            self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": {"resourceVersion": version}, "items": gone})  # fmt: skip
            return
        if not self._allowed("delete", "resourceslices", name=name):
            return
        pre = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            for key in ("uid", "resourceVersion"):
                if pre.get(key) and pre[key] != current["metadata"][key]:
                    self._send(409, status(409, "Conflict", f"Precondition failed: {key} in precondition: {pre[key]}, "
                                           f"{key} in object meta: {current['metadata'][key]}", name, "resourceslices"))  # fmt: skip
                    return
            deleted = copy.deepcopy(current) if dry else state._delete_slice(name)
        self._send(200, copy.deepcopy(deleted))

    # ------------------------------------------------------------------ ResourceClaims
    def _claim(self, method: str, namespace: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceClaims of a namespace: get, list, watch, create, delete."""
        state = self.state
        if method == "GET" and name is None:
            watching = query.get("watch") in ("true", "1")
            if self._allowed("watch" if watching else "list", "resourceclaims", namespace):

                def current() -> list[dict[str, Any]]:
                    return [o for (ns, _), o in state.resource_claims.items() if ns == namespace]

                if watching:
                    self._watch("resourceclaims", current, query)
                else:
                    with state.lock:
                        objects = current()
                    self._list("resourceclaims", objects, query)
            return
        if method == "GET":
            assert name is not None
            if self._allowed("get", "resourceclaims", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method == "POST" and name is None:
            if not self._allowed("create", "resourceclaims", namespace):
                return
            problems = resource_claim_problems(body, namespace)
            claim_name = str(((body or {}).get("metadata") or {}).get("name", ""))
            if problems:
                self._invalid("resourceclaims", claim_name, problems)
                return
            with state.lock:
                if (namespace, claim_name) in state.resource_claims:
                    self._send(409, status(409, "AlreadyExists", f'resourceclaims.{RESOURCE_GROUP} "{claim_name}" already exists',
                                           claim_name, "resourceclaims"))  # fmt: skip
                    return
                body["metadata"]["namespace"] = namespace
                body["metadata"].pop("uid", None)
                state.put_claim(body, validate=False)
                self._send(201, copy.deepcopy(state.resource_claims[(namespace, claim_name)]))
            return
        if method == "DELETE" and name is not None:
            if not self._allowed("delete", "resourceclaims", namespace, name):
                return
            with state.lock:
                if (namespace, name) not in state.resource_claims:
                    self._not_found("resourceclaims", name)
                    return
                gone = copy.deepcopy(state.resource_claims[(namespace, name)])
                state.delete_claim(namespace, name)
            self._send(200, gone)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
        )

    def _claim_status(self, method: str, namespace: str, name: str, body: Any) -> None:
        """PUT of a ResourceClaim's status subresource: the resourceVersion must be the stored one
        (409 otherwise); only the status is taken (the status strategy resets spec and metadata);
        status.devices is checked as validateResourceClaimStatusUpdate checks it; without the
        DRAResourceClaimDeviceStatus gate it is dropped (dropDisabledDRAResourceClaimDeviceStatusFields)."""
        state = self.state
        if method == "GET":
            if self._allowed("get", "resourceclaims/status", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method != "PUT":
            self._send(
                405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
            )
            return
        if not self._allowed("update", "resourceclaims/status", namespace, name):
            return
        with state.lock:
            current = state.resource_claims.get((namespace, name))
            if current is None:
                self._not_found("resourceclaims", name)
                return
            sent = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceclaims.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceclaims"))  # fmt: skip
                return
            updated = copy.deepcopy(current)
            new_status = copy.deepcopy((body or {}).get("status") or {})
            if not state.claim_device_status:
                new_status.pop("devices", None)
            updated["status"] = new_status
            problems = schema_problems(updated) + claim_status_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._invalid("resourceclaims", name, problems)
                return
            state.version += 1
            updated["metadata"]["resourceVersion"] = str(state.version)
            state.resource_claims[(namespace, name)] = updated
            state._record("resourceclaims", "MODIFIED", updated)
            self._send(200, copy.deepcopy(updated))

    # ------------------------------------------------------------------ NodeFeature
    def _node_feature(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        key = (namespace, name or "")
        if method == "GET" and name:
            if not self._allowed("get", "nodefeatures", namespace, name):
                return
            found = state.node_features.get(key)
            if found is None:
                self._send(
                    404, status(404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{name}" not found', name)
                )
            else:
                self._send(200, found)
            return
        if method not in ("POST", "PUT") or (method == "POST") == bool(name):
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here"))
            return
        if not self._allowed(
            "create" if method == "POST" else "update", "nodefeatures", namespace, name or ""
        ):
            return
        problems = node_feature_problems(body, namespace, name)
        if problems:
            state.errors.extend(problems)
            self._send(422, status(422, "Invalid", "; ".join(problems)))
            return
        obj_name = body["metadata"]["name"]
        with state.lock:
            current = state.node_features.get((namespace, obj_name))
            if method == "POST" and current is not None:
                self._send(
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" already exists',
                        obj_name,
                    ),
                )
                return
            if method == "PUT":
                if current is None:
                    self._send(
                        404,
                        status(
                            404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" not found', obj_name
                        ),
                    )
                    return
                sent = body["metadata"].get("resourceVersion")
                if sent != current["metadata"]["resourceVersion"]:
                    self._send(
                        409,
                        status(
                            409,
                            "Conflict",
                            f"Operation cannot be fulfilled: the object has been modified (resourceVersion {sent!r})",
                            obj_name,
                        ),
                    )
                    return
            state.version += 1
            stored = json.loads(json.dumps(body))
            meta = stored["metadata"]
            meta["namespace"] = namespace
            meta["resourceVersion"] = str(state.version)
            meta.setdefault("uid", current["metadata"]["uid"] if current else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta["generation"] = (current["metadata"].get("generation", 1) + 1) if current else 1
            state.node_features[(namespace, obj_name)] = stored
        self._send(201 if method == "POST" else 200, stored)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


def _certificates(directory: Path) -> tuple[bytes, Path, Path]:
    """A test CA (PEM bytes) and a server certificate and key for 127.0.0.1 signed by it (files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuvisor test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca.public_bytes(serialization.Encoding.PEM), cert_file, key_file


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a stop, a test cutting connections) is no error."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class RunningApiServer:
    """The fake on 127.0.0.1 (a free port, kept across stop()/start()) in a thread, and a kubeconfig
    that trusts it."""

    def __init__(self, directory: Path, state: FakeApiServer | None = None) -> None:
        self.state = state or FakeApiServer()
        ca_pem, self._cert_file, self._key_file = _certificates(directory)
        self.live: set[socket.socket] = set()
        self.port = 0
        self.httpd: _Server | None = None
        self.thread: threading.Thread | None = None
        self.start()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_data = base64.b64encode(ca_pem).decode()
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(self.kubeconfig_text(self.ca_data))

    def start(self) -> None:
        """Serve (again, on the same port after stop())."""
        handler = type("Handler", (_Handler,), {"state": self.state, "live": self.live})
        httpd = _Server(("127.0.0.1", self.port), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._cert_file, self._key_file)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        self.port = httpd.server_address[1]
        self.httpd = httpd
        self.thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """An outage: no more connections are accepted and the open ones (watches) are cut."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        if self.thread is not None:
            self.thread.join(timeout=10)
            self.thread = None
        self.drop_connections()

    def drop_connections(self) -> None:
        """Cut every connection being served (a watch stream ends mid-way, as when a server restarts)."""
        for conn in list(self.live):
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def kubeconfig_text(self, ca_data: str, token: str = TOKEN) -> str:
        return yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority-data": ca_data}}],
            "users": [{"name": "labeller", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "labeller"}}],
            "current-context": "test",
        })  # fmt: skip

    def close(self) -> None:
        self.state.thaw()
        self.stop()
