"""The health board: a worker's devices, each one's last health record, and a version that every
change bumps, waking the streams that show it. Both kinds of worker keep one.

A device-plugin worker shows it as ListAndWatch's device list (worker.devicebook), a DRA worker
as the kubelet's health stream (worker.dra.health), and a change is whatever alters what the
worker shows: `shown(record)` is that part of a device's record (None: none told yet), and new
records that leave each device's shown part alike bump nothing. A stream waits on the board's
condition with its own "done" test, evaluated under the board's lock (`wait_change`), so whoever
sets what that test reads and then calls `wake()` never loses the wake-up between test and wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from common.model import ResourcePlan


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str = ""
    since: float = 0.0


def shown_whole(health: Health | None) -> Hashable:
    """All a record says but its time (the time of a flip is no change to show); None unknown."""
    return None if health is None else (health.healthy, health.reason)


class HealthBoard:
    """The plan's devices and their health; thread-safe, a version bump wakes every stream."""

    def __init__(self, plan: ResourcePlan, shown: Callable[[Health | None], Hashable] = shown_whole) -> None:
        self._cond = threading.Condition()
        self._plan = plan
        self._health: dict[str, Health] = {}
        self._version = 0
        self._closed = False
        self._shown = shown

    @property
    def plan(self) -> ResourcePlan:
        return self._plan

    def set_plan(self, plan: ResourcePlan, health: Iterable[tuple[str, Health]] | None = None) -> None:
        """Swap the device list in place (a reload that kept the resource name).

        `health`, when given, replaces every record in the same change (a snapshot that covers
        the new devices), so no stream ever sees the new list without its health.
        """
        with self._cond:
            self._plan = plan
            if health is not None:
                self._health = dict(health)
            self._bump()

    def set_health(self, changes: Iterable[tuple[str, Health]], *, replace: bool = False) -> bool:
        """Apply health records (`replace`: they are the whole truth, a snapshot); True when what
        the board shows of a device changed."""
        with self._cond:
            new = {} if replace else dict(self._health)
            new.update(changes)
            shown, old = self._shown, self._health
            changed = any(shown(old.get(d.id)) != shown(new.get(d.id)) for d in self._plan.devices)
            self._health = new
            if changed:
                self._bump()
            return changed

    def health_of(self, device_id: str) -> Health | None:
        """The device's last record, or None when the supervisor has not told it (yet)."""
        with self._cond:
            return self._health.get(device_id)

    def unhealthy(self) -> list[str]:
        """The plan's devices whose last record says unhealthy, in the plan's order."""
        with self._cond:
            return [d.id for d in self._plan.devices if (h := self._health.get(d.id)) and not h.healthy]

    def records(self) -> tuple[ResourcePlan, dict[str, Health]]:
        """The plan and a copy of its records, as of one moment."""
        with self._cond:
            return self._plan, dict(self._health)

    def version(self) -> int:
        with self._cond:
            return self._version

    def wait_change(self, seen: int, timeout: float, done: Callable[[], bool] = lambda: False) -> int | None:
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
        """Wake every stream; `before` runs under the board's lock first (see `wait_change`)."""
        with self._cond:
            if before is not None:
                before()
            self._cond.notify_all()

    def close(self) -> None:
        """End every stream's wait for good (the worker is going away)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _bump(self) -> None:
        self._version += 1
        self._cond.notify_all()
