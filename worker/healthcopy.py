"""The worker's copy of its resource's health: the worker side of the clone pattern.

The supervisor publishes health deltas numbered by one node-wide sequence (common.messages
explains the wire side). A worker asks for a snapshot of its resource at sequence S, then applies
only deltas after S, in order; anything that skips ahead is a gap that asks for a new snapshot.
This module is that bookkeeping, as plain data in and out, so it is tested without a socket.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from common.messages import DeviceHealth, HealthBeacon, HealthDelta, HealthSnapshot


class ApplyOutcome(Enum):
    APPLIED = "applied"  # in order; state updated
    STALE = "stale"  # at or before what we have: nothing to do
    GAP = "gap"  # something was missed: request a new snapshot
    BUFFERED = "buffered"  # no snapshot yet: kept for replay


@dataclass(frozen=True)
class ApplyResult:
    outcome: ApplyOutcome
    changed: tuple[DeviceHealth, ...] = ()  # devices whose state (healthy, reason) changed


class HealthApplier:
    """The worker's copy of its resource's health: a snapshot at S, then only deltas after S.

    Deltas that arrive before the first snapshot (or while a new one is awaited after a gap) are
    buffered and replayed once it comes. A delta or beacon whose seq skips ahead, or whose epoch
    differs from the snapshot's, is a gap: `needs_snapshot` turns true and the worker should send
    a SnapshotRequest. Until then the last known state stays in force (better than none).
    """

    def __init__(self, device_ids: Iterable[str] | None = None, *, max_buffer: int = 10_000) -> None:
        self._wanted: frozenset[str] | None = None if device_ids is None else frozenset(device_ids)
        self._state: dict[str, DeviceHealth] = {}
        self._seq: int | None = None
        self._epoch: str | None = None
        self._needs_snapshot = True
        self._buffer: list[HealthDelta] = []
        self._max_buffer = max_buffer

    @property
    def seq(self) -> int | None:
        """The last health sequence applied, or None before the first snapshot."""
        return self._seq

    @property
    def needs_snapshot(self) -> bool:
        return self._needs_snapshot

    @property
    def state(self) -> dict[str, DeviceHealth]:
        return dict(self._state)

    def health_of(self, device_id: str) -> DeviceHealth | None:
        return self._state.get(device_id)

    def set_device_ids(self, device_ids: Iterable[str] | None) -> None:
        """A new plan: track these IDs from now on; a new snapshot is needed to fill them in."""
        self._wanted = None if device_ids is None else frozenset(device_ids)
        self._state = {k: v for k, v in self._state.items() if self._wants(k)}
        self._needs_snapshot = True

    def _wants(self, device_id: str) -> bool:
        return self._wanted is None or device_id in self._wanted

    def _put(self, records: Iterable[DeviceHealth]) -> tuple[DeviceHealth, ...]:
        changed: list[DeviceHealth] = []
        for rec in records:
            if not self._wants(rec.device_id):
                continue
            old = self._state.get(rec.device_id)
            self._state[rec.device_id] = rec
            if old is None or (old.healthy, old.reason) != (rec.healthy, rec.reason):
                changed.append(rec)
        return tuple(changed)

    def apply_snapshot(self, snapshot: HealthSnapshot) -> ApplyResult:
        """Take the snapshot as the truth at its seq, then replay buffered newer deltas."""
        if (
            self._seq is not None
            and snapshot.epoch == self._epoch
            and snapshot.seq < self._seq
            and not self._needs_snapshot
        ):
            return ApplyResult(ApplyOutcome.STALE)
        previous = self._state
        self._state = {}
        self._put(snapshot.devices)
        changed = {
            rec.device_id: rec
            for rec in self._state.values()
            if (old := previous.get(rec.device_id)) is None
            or (old.healthy, old.reason) != (rec.healthy, rec.reason)
        }
        self._seq = snapshot.seq
        self._epoch = snapshot.epoch
        self._needs_snapshot = False
        pending, self._buffer = self._buffer, []
        # Deltas of another supervisor life are meaningless against this snapshot: drop them.
        for delta in sorted((d for d in pending if d.epoch == snapshot.epoch), key=lambda d: d.seq):
            result = self.apply_delta(delta)
            for rec in result.changed:
                changed[rec.device_id] = rec
        return ApplyResult(ApplyOutcome.APPLIED, tuple(changed.values()))

    def apply_delta(self, delta: HealthDelta) -> ApplyResult:
        if self._seq is None or self._needs_snapshot:
            self._keep(delta)
            return ApplyResult(ApplyOutcome.BUFFERED)
        if delta.epoch != self._epoch:
            return self._gap(delta)
        if delta.seq <= self._seq:
            return ApplyResult(ApplyOutcome.STALE)
        if delta.seq != self._seq + 1:
            return self._gap(delta)
        self._seq = delta.seq
        return ApplyResult(ApplyOutcome.APPLIED, self._put(delta.changes))

    def apply_beacon(self, beacon: HealthBeacon) -> ApplyResult:
        if self._seq is None or self._needs_snapshot:
            return ApplyResult(ApplyOutcome.BUFFERED)
        if beacon.epoch != self._epoch or beacon.seq > self._seq:
            self._needs_snapshot = True
            return ApplyResult(ApplyOutcome.GAP)
        return ApplyResult(ApplyOutcome.STALE)

    def _gap(self, delta: HealthDelta) -> ApplyResult:
        self._needs_snapshot = True
        self._keep(delta)
        return ApplyResult(ApplyOutcome.GAP)

    def _keep(self, delta: HealthDelta) -> None:
        # Bounded: if a snapshot never comes, the oldest deltas go first (the snapshot covers them).
        self._buffer.append(delta)
        if len(self._buffer) > self._max_buffer:
            del self._buffer[0]
