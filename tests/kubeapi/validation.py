"""What the fake API server refuses in an object, as the real one's validation words it.

One function per kind of object, each returning the problems (empty: accepted), so a test can call
them on its own objects too:

- a Node's conditions as the API server decodes them (`condition_problems`);
- core/v1 Events: ValidateEventCreate's rules (`event_problems`);
- NFD's NodeFeature: NFD v0.19.0's CRD schema (tests/data/) as the structural schema it is, so an
  unknown field fails as the server would prune it, and the metadata rules (`node_feature_problems`);
- resource.k8s.io/v1 ResourceSlices and ResourceClaims: kubernetes-validate's OpenAPI schema (strict)
  and then the rules of pkg/apis/resource/validation/validation.go (1.34; 1.35's where they
  differ, by the served `version`) that gpuvisor's objects touch: validation.ValidateResourceSlice
  (`resource_slice_problems`; its counter rules in tests/kubeapi/partitions.py), a claim's name, namespace and
  results (`resource_claim_problems`), validateResourceClaimStatusUpdate for status.devices
  (`claim_status_problems`) with apimachinery's metav1validation.ValidateConditions
  (`condition_list_problems`);
- and dropDisabledDRADeviceTaintsFields, what a server without the DRADeviceTaints gate drops on
  write (`drop_taints`).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.kubeapi.capacity import result_problems, slice_capacity_problems
from tests.kubeapi.partitions import consumes_counters, counter_problems, minor

SCHEMA_FILE = Path(__file__).parent.parent / "data" / "nfd-nodefeature-v1alpha1-schema.yaml"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


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

SCHEMA_VERSION = "1.34.0"  # the resource.k8s.io/v1 schema the objects are checked against
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$"
)
SLICE_MAX_DEVICES = 128  # ResourceSliceMaxDevices
# ResourceSliceMaxDevicesWithTaintsOrConsumesCounters (1.35; ResourceSliceMaxDevicesWithAdvancedFeatures
# in 1.36): the devices of a slice one of whose devices has taints or consumes counters
SLICE_MAX_DEVICES_WITH_COUNTERS = 64
DEVICE_MAX_TAINTS = 4  # DeviceTaintsMaxLength (1.34; 16 from 1.35)
DEVICE_MAX_TAINTS_135 = 16
DEVICE_MAX_ATTRIBUTES = 32  # attributes and capacities together


def schema_problems(obj: Any, version: str = SCHEMA_VERSION) -> list[str]:
    """What the resource.k8s.io/v1 OpenAPI schema of Kubernetes `version` (strict: an unknown
    field fails) refuses."""
    try:  # the test extra's validator, with the bundled schemas
        kubernetes_validate: Any = importlib.import_module("kubernetes_validate")
    except ImportError:  # pragma: no cover - without it only the server's own rules below apply
        return []
    try:
        kubernetes_validate.validate(obj, version, strict=True)
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


def _taint_problems(taints: Any, where: str, limit: int = DEVICE_MAX_TAINTS) -> list[str]:
    problems = []
    if len(taints) > limit:
        problems.append(f"{where}.taints: Too many: {len(taints)}: must have at most {limit} items")
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


def resource_slice_problems(obj: Any, version: str = SCHEMA_VERSION) -> list[str]:
    """What the API server of Kubernetes `version` refuses in a ResourceSlice: its schema, then
    the rules of validation.ValidateResourceSlice (1.34's, and 1.35's where they differ) that
    gpuvisor's slices touch, consumable capacity's (tests/kubeapi/capacity.py) and partitionable
    devices' (tests/kubeapi/partitions.py) included."""
    if not isinstance(obj, dict):
        return ["not an object"]
    problems = schema_problems(obj, version)
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
    later = minor(version) >= 35
    most = SLICE_MAX_DEVICES
    if later and (consumes_counters(spec) or any(d.get("taints") for d in devices)):
        most = SLICE_MAX_DEVICES_WITH_COUNTERS
    if len(devices) > most:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {most} items")
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
        taints = device.get("taints") or []
        problems += _taint_problems(taints, at, DEVICE_MAX_TAINTS_135 if later else DEVICE_MAX_TAINTS)
        problems += slice_capacity_problems(device, at)
    return problems + counter_problems(spec, version)


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
    for i, result in enumerate(results if isinstance(results, list) else []):
        if isinstance(result, dict):
            problems += result_problems(result, f"status.allocation.devices.results[{i}]")
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


def drop_taints(spec: dict[str, Any]) -> None:
    """dropDisabledDRADeviceTaintsFields: without the DRADeviceTaints gate the field is dropped."""
    for device in spec.get("devices") or []:
        device.pop("taints", None)
