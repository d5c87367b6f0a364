"""Consumable capacity (KEP-5075) as the real API server checks and gates it, for the fake.

Written from kubernetes/kubernetes pkg/apis/resource/validation/validation.go (read at commit
797475e, by function: validateDevice, validateMultiAllocatableDeviceCapacity,
validateSingleAllocatableDeviceCapacity, validateRequestPolicy, validateValidRequestValues,
validateRequestPolicyValidValues, validateRequestPolicyRange, validateRequestPolicyRangeStep,
validateUID) and pkg/registry/resource/resourceslice/strategy.go (dropDisabledFields), with the
field names and limits of kubernetes/api resource/v1/types.go at v0.34.0 (:387-394
allowMultipleAllocations, :428-440 requestPolicy, :451-530 the policy and its range, :1560-1580
shareID and consumedCapacity):

- `slice_capacity_problems(device, where)`: validateDevice takes its capacities through
  validateMultiAllocatableDeviceCapacity when `allowMultipleAllocations` is true, else through
  validateSingleAllocatableDeviceCapacity, which forbids any `requestPolicy` ("allowMultipleAllocations
  must be true"). A policy: validateRequestPolicy forbids `validValues` beside `validRange`;
  validateValidRequestValues requires `default` with either; validateRequestPolicyValidValues
  wants the values sorted ascending, at most 10 (types.go CapacityRequestPolicyDiscreteMaxOptions),
  none above the capacity, the default among them; validateRequestPolicyRange requires `min`,
  min within the capacity, default at least min, max (when set) at least min, within the
  capacity and at least the default, and with a step: min + step within the capacity and the
  default and max whole steps above min (validateRequestPolicyRangeStep).
- `result_problems(result, where)`: an allocation result's `shareID` is an RFC 4122 UID in
  normalized form (validateUID) and `consumedCapacity` a map of quantities.
- `drop_consumable_capacity(spec)`: without the DRAConsumableCapacity gate (alpha, off, in 1.34
  and 1.35; beta, on, in 1.36), a slice's `allowMultipleAllocations` and each capacity's
  `requestPolicy` are dropped on write, unless the stored object already uses them.

Quantities are read with apimachinery's grammar for the forms a slice carries (a number with a
binary or decimal suffix); `quantity` is the fake's own reader, apart from gpuvisor's.
"""

from __future__ import annotations

import re
from typing import Any

MAX_VALID_VALUES = 10  # CapacityRequestPolicyDiscreteMaxOptions
UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_QUANTITY = re.compile(r"^([0-9]+)(?:\.([0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_FACTOR = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "m": 10**-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}  # fmt: skip


def quantity(value: Any) -> float | None:
    """A quantity's value, None where it is none."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        return None
    m = _QUANTITY.match(value.strip())
    if m is None:
        return None
    number = float(f"{m.group(1)}.{m.group(2) or 0}")
    return number * _FACTOR.get(m.group(3) or "", 1)


def slice_capacity_problems(device: dict[str, Any], where: str) -> list[str]:
    problems: list[str] = []
    multiple = device.get("allowMultipleAllocations") is True
    for key, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy") if isinstance(capacity, dict) else None
        if policy is None:
            continue
        at = f"{where}.capacity[{key}].requestPolicy"
        if not multiple:
            problems.append(f"{at}: Forbidden: allowMultipleAllocations must be true")
            continue
        value = quantity(capacity.get("value"))
        if value is None:
            problems.append(f"{where}.capacity[{key}].value: Required value")
            continue
        values, rng = policy.get("validValues") or [], policy.get("validRange")
        if values and rng is not None:
            problems.append(
                f'{at}: Forbidden: exactly one policy can be specified, cannot specify "validValues" '
                'and "validRange" at the same time'
            )
            continue
        default = quantity(policy.get("default")) if policy.get("default") is not None else None
        if (values or rng is not None) and default is None:
            which = "validValues" if values else "validRange"
            problems.append(f"{at}.default: Required value: required when {which} is defined")
            continue
        if values:
            problems += _values_problems([quantity(v) for v in values], value, default, f"{at}.validValues")
        elif rng is not None:
            problems += _range_problems(rng, value, default, f"{at}.validRange")
    return problems


def _values_problems(values: list[float | None], value: float, default: float | None, at: str) -> list[str]:
    if len(values) > MAX_VALID_VALUES:
        return [f"{at}: Too many: {len(values)}: must have at most {MAX_VALID_VALUES} items"]
    problems = []
    for i in range(len(values) - 1):
        a, b = values[i], values[i + 1]
        if a is not None and b is not None and a > b:
            problems.append(f"{at}[{i + 1}]: Invalid value: values must be sorted in ascending order")
    for i, v in enumerate(values):
        if v is None or v > value:
            problems.append(f"{at}[{i}]: Invalid value: option is larger than capacity value")
    if default not in values:
        problems.append(f"{at}: Invalid value: default value is not valid according to the requestPolicy")
    return problems


def _range_problems(rng: dict[str, Any], value: float, default: float | None, at: str) -> list[str]:
    lo = quantity(rng.get("min")) if rng.get("min") is not None else None
    if lo is None or default is None:
        return [f"{at}.min: Required value: required when validRange is defined"]
    problems = []
    if lo > value:
        problems.append(f"{at}.min: Invalid value: min is larger than capacity value")
    if default < lo:
        problems.append(f"{at}.min: Invalid value: default is less than min")
    hi = quantity(rng.get("max")) if rng.get("max") is not None else None
    if hi is not None:
        if lo > hi:
            problems.append(f"{at}.max: Invalid value: min is larger than max")
        if hi > value:
            problems.append(f"{at}.max: Invalid value: max is larger than capacity value")
        if default > hi:
            problems.append(f"{at}.max: Invalid value: default is more than max")
    step = quantity(rng.get("step")) if rng.get("step") is not None else None
    if step is not None:
        if lo + step > value:
            problems.append(f"{at}.step: Invalid value: one step is larger than capacity value")
        for what in [default] + ([hi] if hi is not None else []):
            if step <= 0 or (what - lo) % step:
                problems.append(f"{at}.step: Invalid value: value is not a multiple of a given step from min")
    return problems


def result_problems(result: dict[str, Any], where: str) -> list[str]:
    problems = []
    share = result.get("shareID")
    if share is not None and not (isinstance(share, str) and UID.match(share)):
        problems.append(f"{where}.shareID: Invalid value: {share!r}: uid must be in RFC 4122 normalized form")
    for key, amount in (result.get("consumedCapacity") or {}).items():
        if quantity(amount) is None:
            problems.append(f"{where}.consumedCapacity[{key}]: Invalid value: {amount!r}: not a quantity")
    return problems


def uses_consumable_capacity(spec: dict[str, Any]) -> bool:
    return any(
        d.get("allowMultipleAllocations") is not None
        or any(isinstance(c, dict) and "requestPolicy" in c for c in (d.get("capacity") or {}).values())
        for d in spec.get("devices") or []
    )


def drop_consumable_capacity(spec: dict[str, Any]) -> None:
    """dropDisabledFields without DRAConsumableCapacity: the fields go from what is stored."""
    for device in spec.get("devices") or []:
        device.pop("allowMultipleAllocations", None)
        for capacity in (device.get("capacity") or {}).values():
            if isinstance(capacity, dict):
                capacity.pop("requestPolicy", None)
