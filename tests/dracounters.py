"""The counters of partitionable devices (KEP-4815) as the scheduler's structured allocator
accounts them, for tests/drascheduler.py's Allocator.

From kubernetes/dynamic-resource-allocation (the staging repository of
k8s.io/dynamic-resource-allocation), structured/internal/experimental, the allocator used when
the DRAPartitionableDevices gate is on:

- v0.34.0 (Kubernetes 1.34): allocator_experimental.go `checkAvailableCounters` takes a device's
  counter sets from the device's own slice (`slice.Spec.SharedCounters`); the available amount
  of each counter is the set's minus what the slice's devices already allocated (in any claim:
  `allocatedState.AllocatedDevices`) consume, and the devices being allocated now (this claim's,
  `consumedCounters`) must not consume more than that of any counter of the slice's sets
  ("Insufficient counters"). A set the slice does not define adds no limit (the API server has
  refused such a slice already). pools_experimental.go has no counter checks.
- v0.35.0 (Kubernetes 1.35): the same accounting per pool (`checkAvailableCounters` over
  `pool.CounterSets`, the devices of all the pool's device slices), the counter sets gathered
  from the pool's slices of its newest generation that have `sharedCounters`
  (pools_experimental.go `buildPool`, `getAndValidateCounterSets`); a pool with a counter set
  defined twice ("duplicate counter set name"), or a device consuming a set or counter the pool
  lacks ("counter set %s not found", "counter %s not found in counter set %s",
  `validateDeviceCounterConsumption`) is invalid, and nothing is allocated from it
  (allocator_experimental.go `allocateOne`: "We don't allocate devices from invalid or
  incomplete pools"). The devices of a slice with `sharedCounters` are not allocatable at all
  (`buildPool` files that slice as a counter-set slice only; the 1.35 API server refuses such a
  slice anyway).
- Both: without the gate a device that consumes counters is never allocated
  (`isSelectable`: "Device consumes counters, but the partitionable devices feature is not
  enabled"); the fake API server has dropped the field by then anyway.

Counter values are quantities (tests/kubeapi/capacity.py reads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.kubeapi.capacity import quantity
from tests.kubeapi.partitions import split_layout

Consumption = dict[str, dict[str, float]]  # counter set -> counter -> amount


def consumption(device: dict[str, Any]) -> Consumption:
    """A slice device's consumesCounters: counter set -> counter -> amount."""
    return {
        str(c.get("counterSet")): {
            name: quantity((counter or {}).get("value")) or 0.0 for name, counter in (c.get("counters") or {}).items()
        }
        for c in device.get("consumesCounters") or []
    }  # fmt: skip


@dataclass(frozen=True)
class PoolCounters:
    """A pool's counter sets as the allocator of one release sees them."""

    # (scope, counter set) -> counter -> amount; the scope is the slice's name where counters
    # are per slice (1.34), "" where per pool (1.35)
    sets: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    per_slice: bool = False
    invalid: str = ""  # why the pool is invalid (1.35's buildPool), "" when it is not

    def scope(self, slice_name: str) -> str:
        return slice_name if self.per_slice else ""

    def fits(
        self, chosen: Iterable[tuple[str, Consumption]], allocated: Iterable[tuple[str, Consumption]]
    ) -> bool:
        """Whether devices being allocated now (`chosen`: (slice, consumption) each) fit beside the
        devices allocated before (`allocated`): checkAvailableCounters' test, for every counter of
        every set in the scopes the chosen devices consume from."""
        chosen = [c for c in chosen if c[1]]
        if not chosen:
            return True
        available: dict[tuple[str, str], dict[str, float]] = {}
        scopes = {self.scope(s) for s, _ in chosen}
        for key, counters in self.sets.items():
            if key[0] in scopes:
                available[key] = dict(counters)
        for slice_name, used in allocated:
            self._add(available, slice_name, used, -1.0)
        consumed: dict[tuple[str, str], dict[str, float]] = {
            k: dict.fromkeys(v, 0.0) for k, v in available.items()
        }
        for slice_name, used in chosen:
            self._add(consumed, slice_name, used, 1.0)
        return all(
            amount >= consumed[key].get(name, 0.0)
            for key, counters in available.items()
            for name, amount in counters.items()
        )

    def _add(
        self, into: dict[tuple[str, str], dict[str, float]], slice_name: str, used: Consumption, sign: float
    ) -> None:
        for set_name, counters in used.items():
            target = into.get((self.scope(slice_name), set_name))
            if target is None:  # a set outside these scopes (or undefined): no limit here
                continue
            for name, amount in counters.items():
                if name in target:
                    target[name] += sign * amount  # fmt: skip


def gather(slices: Sequence[dict[str, Any]], version: str) -> PoolCounters:
    """The counter sets of one pool's newest generation as the allocator of Kubernetes `version`
    gathers them (1.34: per slice; 1.35 on: per pool, checked)."""
    if not slices:
        return PoolCounters()
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
    per_slice = not split_layout(version)
    sets: dict[tuple[str, str], dict[str, float]] = {}
    for s in current:
        scope = s["metadata"]["name"] if per_slice else ""
        for counter_set in s["spec"].get("sharedCounters") or []:
            key = (scope, str(counter_set.get("name")))
            if key in sets and not per_slice:
                return PoolCounters(per_slice=False, invalid=f"duplicate counter set name {key[1]}")
            sets[key] = {
                name: quantity((c or {}).get("value")) or 0.0
                for name, c in (counter_set.get("counters") or {}).items()
            }
    if per_slice:
        return PoolCounters(sets, per_slice=True)
    for s in current:
        for device in s["spec"].get("devices") or []:
            for set_name, counters in consumption(device).items():
                if ("", set_name) not in sets:
                    return PoolCounters(sets, invalid=f"counter set {set_name} not found")
                for name in counters:
                    if name not in sets[("", set_name)]:
                        return PoolCounters(
                            sets, invalid=f"counter {name} not found in counter set {set_name}"
                        )
    return PoolCounters(sets)
