"""The DRA worker's view of its devices' health, as the kubelet's health stream shows it.

The worker holds the supervisor's health of its devices (the clone pattern, worker.healthcopy);
this board turns it into `NodeWatchResourcesResponse`s: every device of the pool, each time, with
HEALTHY or UNHEALTHY, the reason as the message (1.36 shows it in the pod's status) and the time
of the answer as `last_updated_time`. The kubelet marks a device UNKNOWN once its last report is
older than `health_check_timeout_seconds` (30 s by default), so streams also resend the whole
list every `RESEND_S` when nothing changed. A change bumps the version and wakes every stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from common.draapi import healthpb
from common.model import ResourcePlan
from worker.server import Health  # the device-plugin worker's: one health record for both

RESEND_S = 10.0  # a third of the kubelet's default timeout: a lost answer or two cost nothing
TIMEOUT_S = 30  # what each device's report tells the kubelet to wait for the next (its default)
MAX_MESSAGE = 1024  # the kubelet cuts longer messages (dra-health v1alpha1 `message`)


def _shown(book: dict[str, Health], ids: list[str]) -> list[tuple[bool, str] | None]:
    """What a stream shows of these devices (the time of a flip is no change to show)."""
    return [(h.healthy, h.reason) if (h := book.get(i)) is not None else None for i in ids]


class HealthBoard:
    """The plan's devices and their health; thread-safe, a version bump wakes every stream."""

    def __init__(self, plan: ResourcePlan) -> None:
        self._cond = threading.Condition()
        self._plan = plan
        self._health: dict[str, Health] = {}
        self._version = 0
        self._closed = False

    def set_plan(self, plan: ResourcePlan, health: Iterable[tuple[str, Health]]) -> None:
        """A new device list, with the health that covers it, as one change."""
        with self._cond:
            self._plan = plan
            self._health = dict(health)
            self._bump()

    def set_health(self, changes: Iterable[tuple[str, Health]], *, replace: bool = False) -> bool:
        """Apply health records (`replace`: they are the whole truth); True when a device's
        healthy flag or reason changed."""
        with self._cond:
            new = {} if replace else dict(self._health)
            new.update(changes)
            ids = [d.id for d in self._plan.devices]
            changed = _shown(self._health, ids) != _shown(new, ids)
            self._health = new
            if changed:
                self._bump()
            return changed

    def health_of(self, device: str) -> Health | None:
        """The device's health, or None when the supervisor has not told it (yet)."""
        with self._cond:
            return self._health.get(device)

    def unhealthy(self) -> list[str]:
        with self._cond:
            return [d.id for d in self._plan.devices if (h := self._health.get(d.id)) and not h.healthy]

    def version(self) -> int:
        with self._cond:
            return self._version

    def response(self, now: float) -> healthpb.NodeWatchResourcesResponse:
        """Every device of the pool with its health, as of `now` (wall seconds)."""
        with self._cond:
            plan, health = self._plan, dict(self._health)
        pool = plan.dra.pool if plan.dra is not None else ""
        devices = []
        for device in plan.devices:
            h = health.get(device.id)
            status = healthpb.UNKNOWN if h is None else healthpb.HEALTHY if h.healthy else healthpb.UNHEALTHY
            message = "" if h is None else h.reason
            if len(message) > MAX_MESSAGE:
                message = message[: MAX_MESSAGE - 3] + "..."
            devices.append(
                healthpb.DeviceHealth(
                    device=healthpb.DeviceIdentifier(pool_name=pool, device_name=device.id),
                    health=status,
                    last_updated_time=int(now),
                    health_check_timeout_seconds=TIMEOUT_S,
                    message=message,
                )
            )
        return healthpb.NodeWatchResourcesResponse(devices=devices)

    def wait_change(self, seen: int, timeout: float, done: Callable[[], bool]) -> int | None:
        """Wait for a version after `seen`; the version, or None on timeout, at close or once `done()`.

        `done` is evaluated under the board's lock, so a `wake()` after setting what it reads is
        never lost between the test and the wait.
        """
        with self._cond:
            if self._version == seen and not self._closed and not done():
                self._cond.wait(timeout)
            if self._closed or done() or self._version == seen:
                return None
            return self._version

    def wake(self, before: Callable[[], None] | None = None) -> None:
        with self._cond:
            if before is not None:
                before()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _bump(self) -> None:
        self._version += 1
        self._cond.notify_all()
