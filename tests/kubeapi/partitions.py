"""Partitionable devices (KEP-4815, the DRAPartitionableDevices gate) as the real API server
checks and gates them, by the version it serves, for the fake.

The rules of pkg/apis/resource/validation/validation.go by release, on a slice's
`spec.sharedCounters` and its devices' `consumesCounters`:

- 1.33 and 1.34 (validateResourceSliceSpec, validateCounterSet, validateDevice,
  validateDeviceCounterConsumption; the cases of validation_resourceslice_test.go of that
  release, "bad-name-shared-counters" to "too-many-device-counters-in-slice", and
  kubernetes/api v0.34.0 resource/v1/types.go:169-204, 282-296, 397-415, 527-544): a counter set
  has a name (a DNS label, unique in the slice: "Duplicate value" at `.name`) and counters
  (required, each name a DNS label); the counters of all sets together at most 32
  (ResourceSliceMaxSharedCounters: "the total number of shared counters must not exceed 32");
  a device's consumption names its set (required, a DNS label, once per device) and counters
  (required, DNS labels), at most 32 counters in a device (ResourceSliceMaxCountersPerDevice:
  "the total number of counters must not exceed 32") and 1024 in all the slice's devices
  (ResourceSliceMaxDeviceCountersPerSlice); and the set and each counter must be defined in
  this slice's sharedCounters ("must reference a counterSet defined in the ResourceSlice
  sharedCounters", "must reference a counter defined in the ResourceSlice sharedCounters"),
  so a slice carries the counter sets its devices consume.
- 1.35 on (validation.go of 1.35: validateResourceSliceSpec, validateCounterSet, validateDevice,
  validateDeviceCounterConsumption, validateSet and validateMap, which stop at a list or map
  over its size; kubernetes/api v0.35.0 resource/v1/types.go:174-192, 262-292, 310-328,
  437-452): a slice has `sharedCounters` or `devices`, not both ("only one of `sharedCounters`
  or `devices` is allowed"); at most 8 counter sets (ResourceSliceMaxCounterSets), unique by
  name ("Duplicate value" at the item), each with 1 to 32 counters
  (ResourceSliceMaxCountersPerCounterSet); a device has at most 2 consumptions
  (ResourceSliceMaxDeviceCounterConsumptionsPerDevice), unique by counter set, each with 1 to
  32 counters (ResourceSliceMaxCountersPerDeviceCounterConsumption); a slice whose devices
  consume counters (or carry taints) has at most 64 devices
  (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters; validation.py applies it). The server
  no longer checks what a consumption names: the scheduler does, per pool
  (tests/drascheduler.py).

And pkg/registry/resource/resourceslice/strategy.go dropDisabledDRAPartitionableDevicesFields
with draPartitionableDevicesFeatureInUse: without the gate (alpha, off, in 1.33 to 1.35) a
write loses `sharedCounters`, `perDeviceNodeSelection` and each device's `consumesCounters`,
`nodeName`, `nodeSelector` and `allNodes`, unless the stored slice (an update's old object)
already uses any of them (`drop_partitionable`).

Messages are worded as field.ErrorList prints them (`path: Invalid value: "x": reason`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tests.kubeapi.capacity import quantity

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
# 1.33/1.34 (kubernetes/api v0.34.0 resource/v1/types.go)
MAX_SHARED_COUNTERS = 32  # ResourceSliceMaxSharedCounters: summed over all sets of a slice
MAX_COUNTERS_PER_DEVICE = 32  # ResourceSliceMaxCountersPerDevice
MAX_DEVICE_COUNTERS_PER_SLICE = 1024  # ResourceSliceMaxDeviceCountersPerSlice
# 1.35 on (kubernetes/api v0.35.0 resource/v1/types.go)
MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets
MAX_COUNTERS_PER_SET = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_CONSUMPTIONS_PER_DEVICE = 2  # ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS_PER_CONSUMPTION = 32  # ResourceSliceMaxCountersPerDeviceCounterConsumption
DEVICE_NODE_FIELDS = ("nodeName", "nodeSelector", "allNodes")


def minor(version: str) -> int:
    """The minor release of a Kubernetes version ("1.35.0", "v1.35.2-gke.1" -> 35)."""
    m = re.match(r"^v?1\.(\d+)", version)
    if m is None:
        raise ValueError(f"kube_version {version!r} is not a Kubernetes 1.x version")
    return int(m.group(1))


def split_layout(version: str) -> bool:
    """Whether the server of `version` wants counter sets and devices in separate slices (1.35 on)."""
    return minor(version) >= 35


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def _invalid(at: str, value: Any, why: str) -> str:
    return f"{at}: Invalid value: {_value(value)}: {why}"


def _too_many(at: str, count: int, limit: int) -> str:
    return f"{at}: Too many: {count}: must have at most {limit} items"


def _name_problems(name: Any, at: str) -> list[str]:
    """validateCounterName (corevalidation.ValidateDNS1123Label) after the required check."""
    if not name:
        return [f"{at}: Required value"]
    if not isinstance(name, str) or not DNS_LABEL.match(name):
        return [_invalid(at, name, DNS_LABEL_MESSAGE)]
    if len(name) > 63:
        return [_invalid(at, name, "must be no more than 63 characters")]
    return []


def _counters_problems(counters: Any, at: str, limit: int | None) -> list[str]:
    """A counters map: required, at most `limit` (1.35's validateMap stops there), names DNS
    labels, values quantities (apimachinery's Quantity decoding)."""
    if not counters or not isinstance(counters, dict):
        return [f"{at}: Required value"]
    if limit is not None and len(counters) > limit:
        return [_too_many(at, len(counters), limit)]
    problems = []
    for name, counter in counters.items():
        key = f"{at}[{name}]"
        if not DNS_LABEL.match(name) or len(name) > 63:
            problems.append(_invalid(key, name, DNS_LABEL_MESSAGE))
        value = counter.get("value") if isinstance(counter, dict) else None
        if quantity(value) is None:
            problems.append(_invalid(f"{key}.value", value, "must be a quantity"))
    return problems


def counter_sets(spec: dict[str, Any]) -> dict[str, set[str]]:
    """The slice's counter sets: name -> its counter names."""
    return {
        str(s.get("name")): set(s.get("counters") or {})
        for s in spec.get("sharedCounters") or []
        if isinstance(s, dict)
    }


def counter_problems(spec: dict[str, Any], version: str) -> list[str]:
    """What the API server of `version` refuses in a slice's sharedCounters and consumesCounters."""
    if minor(version) >= 35:
        return _problems_135(spec)
    return _problems_134(spec)


def _problems_134(spec: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    sets = spec.get("sharedCounters") or []
    defined = counter_sets(spec)
    in_devices = 0
    for i, device in enumerate(spec.get("devices") or []):
        at = f"spec.devices[{i}]"
        consumes = device.get("consumesCounters") or []
        total = sum(len(c.get("counters") or {}) for c in consumes if isinstance(c, dict))
        in_devices += total
        if total > MAX_COUNTERS_PER_DEVICE:
            problems.append(
                _invalid(at, total, f"the total number of counters must not exceed {MAX_COUNTERS_PER_DEVICE}")
            )
        seen: set[str] = set()
        for j, consumption in enumerate(consumes):
            here = f"{at}.consumesCounters[{j}]"
            name = consumption.get("counterSet", "")
            problems += _name_problems(name, f"{here}.counterSet")
            problems += _counters_problems(consumption.get("counters"), f"{here}.counters", None)
            if name in seen:
                problems.append(f"{here}.counterSet: Duplicate value: {_value(name)}")
            seen.add(name)
            if name not in defined:
                problems.append(
                    _invalid(
                        f"{here}.counterSet",
                        name,
                        "must reference a counterSet defined in the ResourceSlice sharedCounters",
                    )
                )
                continue
            for counter in consumption.get("counters") or {}:
                if counter not in defined[name]:
                    problems.append(
                        _invalid(
                            f"{here}.counters",
                            counter,
                            "must reference a counter defined in the ResourceSlice sharedCounters",
                        )
                    )
    if in_devices > MAX_DEVICE_COUNTERS_PER_SLICE:
        problems.append(
            _invalid(
                "spec.devices",
                in_devices,
                f"the total number of counters in devices must not exceed {MAX_DEVICE_COUNTERS_PER_SLICE}",
            )
        )
    shared = sum(len(s.get("counters") or {}) for s in sets if isinstance(s, dict))
    if shared > MAX_SHARED_COUNTERS:
        problems.append(
            _invalid(
                "spec.sharedCounters",
                shared,
                f"the total number of shared counters must not exceed {MAX_SHARED_COUNTERS}",
            )
        )
    return problems + _set_problems(sets, None, ".name")


def _set_problems(sets: list[Any], limit: int | None, duplicate_at: str) -> list[str]:
    """Each counter set's name and counters, and names given twice (1.34 says the duplicate at
    `.name`, 1.35 at the set)."""
    problems: list[str] = []
    names: set[str] = set()
    for i, counter_set in enumerate(sets):
        at = f"spec.sharedCounters[{i}]"
        name = counter_set.get("name", "")
        problems += _name_problems(name, f"{at}.name")
        problems += _counters_problems(counter_set.get("counters"), f"{at}.counters", limit)
        if name in names:
            problems.append(f"{at}{duplicate_at}: Duplicate value: {_value(name)}")
        names.add(name)
    return problems


def _problems_135(spec: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if isinstance(spec.get("sharedCounters"), list) and isinstance(spec.get("devices"), list):
        problems.append(_invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    for i, device in enumerate(spec.get("devices") or []):
        at = f"spec.devices[{i}].consumesCounters"
        consumes = device.get("consumesCounters") or []
        if len(consumes) > MAX_CONSUMPTIONS_PER_DEVICE:
            problems.append(_too_many(at, len(consumes), MAX_CONSUMPTIONS_PER_DEVICE))
            continue
        seen: set[str] = set()
        for j, consumption in enumerate(consumes):
            name = consumption.get("counterSet", "")
            problems += _name_problems(name, f"{at}[{j}].counterSet")
            problems += _counters_problems(
                consumption.get("counters"), f"{at}[{j}].counters", MAX_COUNTERS_PER_CONSUMPTION
            )
            if name in seen:
                problems.append(f"{at}[{j}]: Duplicate value: {_value(name)}")
            seen.add(name)
    sets = spec.get("sharedCounters") or []
    if len(sets) > MAX_COUNTER_SETS:
        return [*problems, _too_many("spec.sharedCounters", len(sets), MAX_COUNTER_SETS)]
    return problems + _set_problems(sets, MAX_COUNTERS_PER_SET, "")


def consumes_counters(spec: dict[str, Any]) -> bool:
    """haveConsumesCounters: a device of the slice consumes counters."""
    return any(d.get("consumesCounters") for d in spec.get("devices") or [])


def uses_partitionable(spec: dict[str, Any]) -> bool:
    """draPartitionableDevicesFeatureInUse: the stored slice already uses one of the gate's fields."""
    if spec.get("sharedCounters") or spec.get("perDeviceNodeSelection") is not None:
        return True
    return any(
        d.get("consumesCounters") or any(d.get(k) is not None for k in DEVICE_NODE_FIELDS)
        for d in spec.get("devices") or []
    )


def drop_partitionable(spec: dict[str, Any]) -> None:
    """dropDisabledDRAPartitionableDevicesFields without the gate: the fields go from what is stored."""
    spec.pop("sharedCounters", None)
    spec.pop("perDeviceNodeSelection", None)
    for device in spec.get("devices") or []:
        for key in ("consumesCounters", *DEVICE_NODE_FIELDS):
            device.pop(key, None)
