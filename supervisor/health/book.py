"""The HealthBook: the supervisor's single truth of device health. Pure data, no I/O, and the
clock is a parameter (`now`, wall seconds) so tests drive time by hand.

What is tracked is a set of *conditions*, each on a physical GPU (`gpu_uuid`) or on a part of
it (`gpu_uuid`, GPU instance, compute instance). A condition says why, since when, and how it
ends (`Recovery`). Device health is derived, never stored by hand: an allocatable device (a full
GPU, a MIG device, or a replica of either) is healthy exactly when no condition overlaps the
hardware that backs it. So:

- an event on a physical GPU reaches every device it backs: all replicas, and all MIG devices
  when the event names no instance (NVIDIA #1929 flags one replica only; we do not);
- an event naming a GI (and CI) reaches only that MIG device and its replicas, and any device
  that is the whole GPU;
- several conditions can hold at once (say a transient XID and a lost GPU); each ends by its own
  rule, and the device is healthy only when none is left.

Every call that can change something returns a `ChangeBatch`: the changed devices, one record
fit for one log line, and the health sequence number, which grows by one for each non-empty
batch. Workers get `snapshot(resource)` (sequence + full state) and then the batches as deltas.

Recovery (the point of the exercise: NVIDIA never recovers a device):
- TRANSIENT: no new event for `policy.quiet_seconds` AND a probe that passed after the last
  event; checked on `tick` and whenever a probe passes.
- UNTIL_RESET: `mark_reset`, or `mark_found` after the GPU was lost.
- UNTIL_FOUND (a lost GPU): `mark_found`.
- UNTIL_PROBE_PASSES (a failed probe): the next passing probe.
- The event-wait failure of `mark_all_unhealthy` is TRANSIENT: while waits keep failing the
  supervisor keeps calling it and the quiet period never starts.
- EXTERNAL: a condition some other part of the supervisor owns (e.g. `mps:<resource>` while that
  resource's MPS control daemon is down). Only `clear_external(name)` ends it: resets, probes,
  found GPUs and ticks know nothing of why it was raised, so they never touch it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common.messages import DeviceHealth, HealthDelta
from common.model import AllocatableDevice, ResourcePlan
from supervisor.health.policy import EccKind, HealthAction, HealthPolicy

# NVML reports "no GPU/compute instance" as 0xFFFFFFFF; accept it and mean None.
NVML_NO_INSTANCE = 0xFFFFFFFF


class Recovery(StrEnum):
    TRANSIENT = "transient"
    UNTIL_RESET = "until-reset"
    UNTIL_FOUND = "until-found"
    UNTIL_PROBE_PASSES = "until-probe-passes"
    EXTERNAL = "external"  # set and cleared by its owner (an MPS daemon's supervision), by name


# Which condition explains a device best when several hold: the hardest to get rid of first.
SEVERITY = {
    Recovery.UNTIL_FOUND: 0,
    Recovery.UNTIL_RESET: 1,
    Recovery.EXTERNAL: 2,
    Recovery.UNTIL_PROBE_PASSES: 3,
    Recovery.TRANSIENT: 4,
}

_LOST = "lost"
_PROBE = "probe"
_EVENT_WAIT = "event-wait"


@dataclass
class _Condition:
    gi: int | None
    ci: int | None
    name: str  # one per (place, name): "xid:79", "ecc:double-bit", "lost", "probe", "event-wait"
    recovery: Recovery
    reason: str
    since: float
    last_event: float
    last_event_op: int  # orders events against probes without trusting equal timestamps


@dataclass(frozen=True)
class ConditionView:
    """A read-only view of one condition, for `gpuvisor status` and logs."""

    gpu_uuid: str
    gi: int | None
    ci: int | None
    name: str
    recovery: Recovery
    reason: str
    since: float
    last_event: float


@dataclass(frozen=True)
class DeviceChange:
    """One allocatable device's new health. `since` is when its healthy flag last flipped."""

    device_id: str
    resource: str
    healthy: bool
    reason: str
    since: float

    def to_health(self) -> DeviceHealth:
        return DeviceHealth(
            device_id=self.device_id, healthy=self.healthy, reason=self.reason, since=self.since
        )


@dataclass(frozen=True)
class ChangeBatch:
    """What one call changed; empty when nothing did (then `seq` is the unchanged sequence)."""

    seq: int
    now: float
    cause: str
    changes: tuple[DeviceChange, ...] = ()
    gpu_uuid: str | None = None
    xid: int | None = None
    action: HealthAction | None = None
    raised: str = ""  # the condition this call raised ("xid:79", "lost", "mps:<resource>", ...), if any

    def __len__(self) -> int:
        return len(self.changes)

    def __iter__(self) -> Iterator[DeviceChange]:
        return iter(self.changes)

    def __bool__(self) -> bool:
        return bool(self.changes)

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(sorted({c.resource for c in self.changes}))

    def log_record(self) -> dict[str, Any]:
        """The batch as one structured log record."""
        record: dict[str, Any] = {"seq": self.seq, "cause": self.cause}
        if self.gpu_uuid is not None:
            record["gpu"] = self.gpu_uuid
        if self.xid is not None:
            record["xid"] = self.xid
        if self.action is not None:
            record["action"] = self.action.value
        record["resources"] = list(self.resources)
        record["devices"] = [
            {"id": c.device_id, "resource": c.resource, "healthy": c.healthy, "reason": c.reason}
            for c in self.changes
        ]
        return record

    def to_delta(self, epoch: str = "") -> HealthDelta:
        return HealthDelta(seq=self.seq, changes=tuple(c.to_health() for c in self.changes), epoch=epoch)


@dataclass(frozen=True)
class _Device:
    resource: str
    device: AllocatableDevice

    @property
    def key(self) -> tuple[str, str]:
        return (self.resource, self.device.id)


NO_PLACEMENT_GI = -1  # `overlaps`' instance of a device that has none yet


def overlaps(cond_gi: int | None, cond_ci: int | None, dev_gi: int | None, dev_ci: int | None) -> bool:
    """Does a condition on (gi, ci) touch a device backed by (gi, ci)? None means "all of it"."""
    if cond_gi is None or dev_gi is None:
        return True
    if cond_gi != dev_gi:
        return False
    return cond_ci is None or dev_ci is None or cond_ci == dev_ci


def _instance(value: int | None, what: str) -> int | None:
    if value is None or value == NVML_NO_INSTANCE:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer or None, got {value!r}")
    return value


class HealthBook:
    """Device health for every resource plan, from conditions on GPUs and MIG devices."""

    def __init__(self, plans: Mapping[str, ResourcePlan], policy: HealthPolicy, now: float) -> None:
        self._policy = policy
        self._seq = 0
        self._op = 0
        self._now = now
        self._conditions: dict[str, dict[tuple[int | None, int | None, str], _Condition]] = {}
        self._probe_ok_op: dict[str, int] = {}
        self._devices: dict[str, list[_Device]] = {}
        self._by_gpu: dict[str, list[_Device]] = {}
        self._state: dict[tuple[str, str], tuple[bool, str, float]] = {}
        self._index(plans)
        for dev in self._all_devices():
            self._state[dev.key] = (True, "", now)

    # -- reading -------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def policy(self) -> HealthPolicy:
        return self._policy

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(self._devices)

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(self._by_gpu)

    def snapshot(self, resource: str) -> tuple[int, list[DeviceHealth]]:
        """(health sequence, every device of `resource`) — consistent with each other."""
        if resource not in self._devices:
            raise KeyError(
                f"no resource {resource!r} in the health book (known: {', '.join(self._devices) or 'none'})"
            )
        records = []
        for dev in self._devices[resource]:
            healthy, reason, since = self._state[dev.key]
            records.append(DeviceHealth(device_id=dev.device.id, healthy=healthy, reason=reason, since=since))
        return self._seq, records

    def health_for(self, resource: str) -> dict[str, tuple[bool, str, float]]:
        _, records = self.snapshot(resource)
        return {r.device_id: (r.healthy, r.reason, r.since) for r in records}

    def conditions(self) -> list[ConditionView]:
        return [
            ConditionView(gpu, c.gi, c.ci, c.name, c.recovery, c.reason, c.since, c.last_event)
            for gpu, conds in sorted(self._conditions.items())
            for c in conds.values()
        ]

    # -- events --------------------------------------------------------------------------------

    def apply_xid(
        self, gpu_uuid: str, xid: int, gi: int | None = None, ci: int | None = None, *, now: float
    ) -> ChangeBatch:
        """An XID on a GPU (gi None) or on one MIG instance; the policy decides what it does."""
        self._begin(now)
        action = self._policy.classify_xid(xid)
        where = self._where(gpu_uuid, gi, ci)
        if action is HealthAction.IGNORE:
            return self._finish([], now, f"XID {xid} on {where} ignored by policy", gpu_uuid, xid, action)
        if gpu_uuid not in self._by_gpu:
            return self._finish([], now, f"XID {xid} on {where}: GPU backs no device", gpu_uuid, xid, action)
        recovery = Recovery.TRANSIENT if action is HealthAction.TRANSIENT else Recovery.UNTIL_RESET
        reason = f"{self._policy.reason_for_xid(xid)} [{action.value}]"
        self._raise(gpu_uuid, gi, ci, f"xid:{xid}", recovery, reason, now)
        changes = self._recompute({gpu_uuid}, now)
        return self._finish(
            changes, now, f"XID {xid} on {where}: {action.value}", gpu_uuid, xid, action, f"xid:{xid}"
        )

    def apply_ecc(
        self, gpu_uuid: str, kind: EccKind | str, gi: int | None = None, ci: int | None = None, *, now: float
    ) -> ChangeBatch:
        """An ECC event (single- or double-bit) on a GPU or MIG instance."""
        self._begin(now)
        action = self._policy.classify_ecc(kind)
        ecc = EccKind(kind)
        where = self._where(gpu_uuid, gi, ci)
        if action is HealthAction.IGNORE or gpu_uuid not in self._by_gpu:
            why = "ignored by policy" if action is HealthAction.IGNORE else "GPU backs no device"
            return self._finish([], now, f"{ecc.value} ECC error on {where} {why}", gpu_uuid, None, action)
        recovery = Recovery.TRANSIENT if action is HealthAction.TRANSIENT else Recovery.UNTIL_RESET
        reason = f"{ecc.value} ECC error [{action.value}]"
        self._raise(gpu_uuid, gi, ci, f"ecc:{ecc.value}", recovery, reason, now)
        changes = self._recompute({gpu_uuid}, now)
        return self._finish(
            changes,
            now,
            f"{ecc.value} ECC error on {where}: {action.value}",
            gpu_uuid,
            None,
            action,
            f"ecc:{ecc.value}",
        )

    def mark_lost(self, gpu_uuid: str, now: float, reason: str = "") -> ChangeBatch:
        """NVML lost the GPU (fell off the bus, handle gone): unhealthy until it is found again."""
        self._begin(now)
        if gpu_uuid not in self._by_gpu:
            return self._finish([], now, f"GPU {gpu_uuid} lost: backs no device", gpu_uuid)
        text = f"GPU lost: {reason}" if reason else "GPU lost"
        self._raise(gpu_uuid, None, None, _LOST, Recovery.UNTIL_FOUND, text, now)
        return self._finish(
            self._recompute({gpu_uuid}, now), now, f"GPU {gpu_uuid} lost", gpu_uuid, raised=_LOST
        )

    def mark_found(self, gpu_uuid: str, now: float) -> ChangeBatch:
        """The GPU answers again. If it was lost, that and its until-reset faults are over."""
        self._begin(now)
        conds = self._conditions.get(gpu_uuid, {})
        if not any(c.name == _LOST for c in conds.values()):
            return self._finish([], now, f"GPU {gpu_uuid} found (was not lost)", gpu_uuid)
        self._clear(gpu_uuid, lambda c: c.recovery in (Recovery.UNTIL_FOUND, Recovery.UNTIL_RESET))
        return self._finish(self._recompute({gpu_uuid}, now), now, f"GPU {gpu_uuid} found again", gpu_uuid)

    def mark_reset(self, gpu_uuid: str, now: float) -> ChangeBatch:
        """The GPU was reset: its until-reset faults (on it and on its MIG devices) are over."""
        self._begin(now)
        self._clear(gpu_uuid, lambda c: c.recovery is Recovery.UNTIL_RESET)
        return self._finish(self._recompute({gpu_uuid}, now), now, f"GPU {gpu_uuid} reset", gpu_uuid)

    def probe_result(self, gpu_uuid: str, ok: bool, reason: str, now: float) -> ChangeBatch:
        """A health probe of the GPU ran. A failure marks it unhealthy until a probe passes; a
        pass also lets quiet transient faults recover."""
        self._begin(now)
        if gpu_uuid not in self._by_gpu:
            return self._finish([], now, f"probe of {gpu_uuid}: GPU backs no device", gpu_uuid)
        if not ok:
            text = f"health probe failed: {reason}" if reason else "health probe failed"
            self._raise(gpu_uuid, None, None, _PROBE, Recovery.UNTIL_PROBE_PASSES, text, now)
            return self._finish(
                self._recompute({gpu_uuid}, now), now, f"probe of {gpu_uuid} failed", gpu_uuid, raised=_PROBE
            )
        self._probe_ok_op[gpu_uuid] = self._op
        self._clear(gpu_uuid, lambda c: c.recovery is Recovery.UNTIL_PROBE_PASSES)
        recovered = self._clear_quiet_transients(gpu_uuid, now)
        cause = f"probe of {gpu_uuid} passed"
        if recovered:
            cause += "; recovered: " + ", ".join(recovered)
        return self._finish(self._recompute({gpu_uuid}, now), now, cause, gpu_uuid)

    def clear(self) -> bool:
        """No condition is held on any GPU."""
        return not self._conditions

    def tick(self, now: float) -> ChangeBatch:
        """Recover transient faults that have been quiet long enough and saw a passing probe."""
        self._begin(now)
        recovered: list[str] = []
        touched: set[str] = set()
        for gpu in list(self._conditions):
            names = self._clear_quiet_transients(gpu, now)
            if names:
                touched.add(gpu)
                recovered.extend(f"{name} on {gpu}" for name in names)
        cause = "recovered: " + ", ".join(recovered) if recovered else "tick"
        return self._finish(self._recompute(touched, now), now, cause)

    def mark_all_unhealthy(self, reason: str, now: float) -> ChangeBatch:
        """Health can no longer be watched (NVML event wait failed): every GPU is suspect."""
        self._begin(now)
        text = f"health events unavailable: {reason}" if reason else "health events unavailable"
        for gpu in self._by_gpu:
            self._raise(gpu, None, None, _EVENT_WAIT, Recovery.TRANSIENT, text, now)
        return self._finish(self._recompute(set(self._by_gpu), now), now, text, raised=_EVENT_WAIT)

    def mark_external(self, gpu_uuids: Iterable[str], name: str, reason: str, now: float) -> ChangeBatch:
        """Raise (or refresh) the external condition `name` on these GPUs; GPUs that back no
        device are skipped. Ends only with `clear_external(name)`."""
        self._begin(now)
        gpus = {g for g in gpu_uuids if g in self._by_gpu}
        for gpu in sorted(gpus):
            self._raise(gpu, None, None, name, Recovery.EXTERNAL, reason, now)
        return self._finish(self._recompute(gpus, now), now, f"{name}: {reason}", raised=name)

    def clear_external(self, name: str, now: float, gpu_uuids: Iterable[str] | None = None) -> ChangeBatch:
        """End the external condition `name` wherever it holds (or only on `gpu_uuids`)."""
        self._begin(now)
        only = None if gpu_uuids is None else set(gpu_uuids)
        touched = {
            gpu
            for gpu in list(self._conditions)
            if (only is None or gpu in only)
            and self._clear(gpu, lambda c: c.name == name and c.recovery is Recovery.EXTERNAL)
        }
        return self._finish(self._recompute(touched, now), now, f"{name} cleared")

    # -- configuration -------------------------------------------------------------------------

    def set_policy(self, policy: HealthPolicy) -> None:
        """A reloaded policy applies to new events and to the next recovery check."""
        self._policy = policy

    def set_plans(self, plans: Mapping[str, ResourcePlan], now: float | None = None) -> ChangeBatch:
        """New plans (reload). Conditions on hardware that still backs a device are kept; the
        batch lists new devices and devices whose health changed."""
        when = self._now if now is None else now
        self._begin(when)
        self._index(plans)
        for gpu in list(self._conditions):
            devices = self._by_gpu.get(gpu, [])
            kept = {
                key: c
                for key, c in self._conditions[gpu].items()
                if any(overlaps(c.gi, c.ci, d.device.mig_gi, d.device.mig_ci) for d in devices)
            }
            if kept:
                self._conditions[gpu] = kept
            else:
                del self._conditions[gpu]
        self._probe_ok_op = {g: op for g, op in self._probe_ok_op.items() if g in self._by_gpu}
        live = {dev.key for dev in self._all_devices()}
        self._state = {key: value for key, value in self._state.items() if key in live}
        changes = self._recompute(set(self._by_gpu), when)
        return self._finish(changes, when, "plans reloaded")

    # -- internals -----------------------------------------------------------------------------

    def _index(self, plans: Mapping[str, ResourcePlan]) -> None:
        self._devices = {}
        self._by_gpu = {}
        for name, plan in plans.items():
            devs = [_Device(name, d) for d in plan.devices]
            self._devices[name] = devs
            for dev in devs:
                self._by_gpu.setdefault(dev.device.gpu_uuid, []).append(dev)

    def _all_devices(self) -> Iterable[_Device]:
        for devs in self._devices.values():
            yield from devs

    def _begin(self, now: float) -> None:
        self._op += 1
        self._now = now

    @staticmethod
    def _where(gpu_uuid: str, gi: int | None, ci: int | None) -> str:
        gi_n = _instance(gi, "GPU instance id")
        ci_n = _instance(ci, "compute instance id")
        if gi_n is None:
            return gpu_uuid
        return f"{gpu_uuid} GI {gi_n}" + (f" CI {ci_n}" if ci_n is not None else "")

    def _raise(
        self, gpu: str, gi: int | None, ci: int | None, name: str, recovery: Recovery, reason: str, now: float
    ) -> None:
        gi_n = _instance(gi, "GPU instance id")
        # A compute instance id means nothing without its GPU instance: then it is the whole GPU.
        ci_n = _instance(ci, "compute instance id") if gi_n is not None else None
        conds = self._conditions.setdefault(gpu, {})
        existing = conds.get((gi_n, ci_n, name))
        if existing is None:
            conds[(gi_n, ci_n, name)] = _Condition(gi_n, ci_n, name, recovery, reason, now, now, self._op)
            return
        # The same fault again: the quiet period starts over; the condition keeps its start.
        existing.recovery = recovery
        existing.reason = reason
        existing.last_event = now
        existing.last_event_op = self._op

    def _clear(self, gpu: str, predicate: Callable[[_Condition], bool]) -> list[str]:
        conds = self._conditions.get(gpu)
        if not conds:
            return []
        gone = [key for key, c in conds.items() if predicate(c)]
        for key in gone:
            del conds[key]
        if not conds:
            del self._conditions[gpu]
        return [name for (_, _, name) in gone]

    def _clear_quiet_transients(self, gpu: str, now: float) -> list[str]:
        quiet = self._policy.quiet_seconds
        probe_op = self._probe_ok_op.get(gpu, -1)
        return self._clear(
            gpu,
            lambda c: (
                c.recovery is Recovery.TRANSIENT
                and now - c.last_event >= quiet
                and probe_op > c.last_event_op
            ),
        )

    def _explain(self, dev: _Device) -> str | None:
        """Why the device is unhealthy (None: it is healthy)."""
        conds = self._conditions.get(dev.device.gpu_uuid)
        if not conds:
            return None
        # A MIG placement not made yet (MIG on demand) has no instance a condition can be on: only
        # the GPU's own conditions touch it (NO_PLACEMENT_GI matches no instance's).
        gi = NO_PLACEMENT_GI if dev.device.on_demand and not dev.device.uuid else dev.device.mig_gi
        hits = [c for c in conds.values() if overlaps(c.gi, c.ci, gi, dev.device.mig_ci)]
        if not hits:
            return None
        hits.sort(key=lambda c: (SEVERITY[c.recovery], c.since, c.name))
        more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
        return hits[0].reason + more

    def _recompute(self, gpus: set[str], now: float) -> list[DeviceChange]:
        changes: list[DeviceChange] = []
        for dev in self._all_devices():
            if dev.device.gpu_uuid not in gpus and dev.key in self._state:
                continue
            why = self._explain(dev)
            healthy, reason = why is None, why or ""
            old = self._state.get(dev.key)
            if old is not None and (old[0], old[1]) == (healthy, reason):
                continue
            since = now if old is None or old[0] != healthy else old[2]
            self._state[dev.key] = (healthy, reason, since)
            changes.append(DeviceChange(dev.device.id, dev.resource, healthy, reason, since))
        return changes

    def _finish(
        self,
        changes: list[DeviceChange],
        now: float,
        cause: str,
        gpu_uuid: str | None = None,
        xid: int | None = None,
        action: HealthAction | None = None,
        raised: str = "",
    ) -> ChangeBatch:
        if changes:
            self._seq += 1
        return ChangeBatch(self._seq, now, cause, tuple(changes), gpu_uuid, xid, action, raised)
