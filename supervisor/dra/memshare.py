"""Full GPUs shared by memory in the ResourceSlices (KEP-5075 consumable capacity): pure functions.

With `gpuvisor.dra.memorySharing` (supervisor/config/memory.py) each full GPU is published with
`allowMultipleAllocations: true` and a request policy on its `memory` capacity, so the scheduler
hands it to several claims by the memory each asks for (`spec.devices.requests[].exactly.capacity
.requests.memory`, rounded up by the policy) and keeps their sum within the GPU's memory; each
result then carries a `shareID` and `consumedCapacity.memory`, which the DRA worker enforces
(worker/dra/memshare.py). The fields are resource.k8s.io/v1's (and v1beta1's, v1beta2's) since
Kubernetes 1.34 (kubernetes/api v0.34.0 resource/v1/types.go:387-394 `AllowMultipleAllocations`,
:428-440 `DeviceCapacity.RequestPolicy`, :451-530 `CapacityRequestPolicy` and
`CapacityRequestPolicyRange`), behind the DRAConsumableCapacity gate (alpha, off, in 1.34 and
1.35; beta, on, in 1.36); a server without it drops them (`supervisor.dra.probe`), and the GPUs are
then published whole, as without the setting.

The policy is a range, `validRange {min, max, step}` with `default`: the configured minimum and
step, and `max` the largest `minimum + k * step` within the GPU's memory, as the API server's
validateRequestPolicyRange wants it (kubernetes pkg/apis/resource/validation/validation.go: min and
max within the capacity, min + step within it, default and max whole steps above min). The
capacity's value stays the GPU's memory (the attribute NVIDIA publishes). A GPU too small for the
policy (`minimum + step`, or the default, above its memory) is published whole. MIG devices are
never shared this way: their memory is their GPU instance's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.dracheckpoint import MEMORY_SHARE, DeviceSharing

MemoryPolicy = tuple[int, int, int]  # (step, default, minimum) in bytes, as the DRA plan carries it
MIB = 1 << 20


def binary(value: int) -> str:
    """A byte count as Kubernetes writes a BinarySI quantity: the largest suffix that divides it."""
    for suffix, shift in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def request_policy(memory: int, policy: MemoryPolicy) -> dict[str, Any] | None:
    """The `memory` capacity's request policy of a GPU with `memory` bytes; None where it does not fit."""
    step, default, minimum = policy
    if step <= 0 or minimum + step > memory:
        return None
    maximum = minimum + (memory - minimum) // step * step
    if default > maximum:
        return None
    return {
        "default": binary(default),
        "validRange": {"min": binary(minimum), "max": binary(maximum), "step": binary(step)},
    }


def share(device: dict[str, Any], memory: int, policy: MemoryPolicy) -> bool:
    """Make a full GPU's device (supervisor.dra.slices.gpu_device) shared by memory; did it fit?"""
    rule = request_policy(memory, policy)
    if rule is None:
        return False
    device["allowMultipleAllocations"] = True
    device["capacity"]["memory"]["requestPolicy"] = rule
    return True


def shared(devices: Sequence[Any]) -> bool:
    """Do any of these devices allow multiple allocations? (what a server without the gate drops)"""
    return any(isinstance(d, Mapping) and d.get("allowMultipleAllocations") is True for d in devices)


# ---------------------------------------------------------------------------------- the API server's rules


def _bytes(text: Any) -> int | None:
    """A quantity this module writes (whole binary units or bytes); None for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        return None
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10), ("", 0)):
        number = text[: len(text) - len(suffix)] if suffix else text
        if text.endswith(suffix) and number.isdigit():
            return int(number) << shift
    return None


def capacity_problems(device: Mapping[str, Any], where: str) -> list[str]:
    """validateDevice's capacity rules (validation.go): a request policy only where multiple
    allocations are allowed, then validateRequestPolicy and validateRequestPolicyRange."""
    problems: list[str] = []
    multiple = device.get("allowMultipleAllocations") is True
    for key, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy") if isinstance(capacity, Mapping) else None
        if policy is None:
            continue
        at = f"{where}.capacity[{key!r}].requestPolicy"
        if not multiple:
            problems.append(f"{at}: allowMultipleAllocations must be true")
            continue
        value, default = _bytes(capacity.get("value")), _bytes(policy.get("default"))
        rng = policy.get("validRange")
        if policy.get("validValues") and rng is not None:
            problems.append(f'{at}: cannot specify "validValues" and "validRange" at the same time')
            continue
        if rng is None:
            continue
        lo, hi, step = (_bytes(rng.get(k)) if k in rng else None for k in ("min", "max", "step"))
        if value is None or default is None or lo is None:
            problems.append(f"{at}: value, default and validRange.min are required quantities")
            continue
        if lo > value:
            problems.append(f"{at}.validRange.min: min is larger than capacity value")
        if default < lo:
            problems.append(f"{at}.validRange.min: default is less than min")
        if hi is not None and (lo > hi or hi > value or default > hi):
            problems.append(
                f"{at}.validRange.max: max must lie within min, the capacity value and above default"
            )
        if step is not None:
            if step <= 0 or lo + step > value:
                problems.append(f"{at}.validRange.step: one step is larger than capacity value")
            elif (default - lo) % step or (hi is not None and (hi - lo) % step):
                problems.append(f"{at}.validRange.step: value is not a multiple of a given step from min")
    return problems


# ---------------------------------------------------------------------------------- a claim's status


def status_data(sharing: DeviceSharing | None) -> dict[str, Any] | None:
    """What a prepared memory share shows in its claim's `status.devices[].data`; None for others."""
    if sharing is None or sharing.strategy != MEMORY_SHARE or sharing.pinned_memory_limit is None:
        return None
    mib = sharing.pinned_memory_limit // MIB
    return {
        "memoryShare": binary(mib * MIB),
        "mpsPinnedDeviceMemoryLimit": f"{mib}M",
        "gpu": sharing.gpu_uuid,
    }
