"""One log line for every NVML health event the supervisor receives, and bursts summarised.

An operator reading the log after an incident must be able to tell whether an event arrived and
what was decided, also for an event the policy ignores (NVIDIA's plugin logs `Skipping event`
for those). So each XID or ECC event is one line: the GPU (and MIG instance), the XID or ECC
kind, the policy's decision in words (`ignored as an application error`, `Unhealthy until the
GPU is reset`, `Unhealthy, transient: recovering after 60s ...`), and the devices it changed.

A burst must not flood the log (NVIDIA #1553): a repeat of the same event on the same GPU and
instance that changes no device's health, within `window` seconds of that event's last line,
is only counted; when the window has passed, the count is one summary line (`... 512 more in
the last 10s`). A line that changes health is never held back. Distinct events are bounded too:
past `max_keys` in one window, further kinds are counted together in one summary. Every
XID is still counted in `gpuvisor_xid_events_total` by the hub, line or not.

This runs on the supervisor's main loop: the monitor thread only posts its findings, so a slow
log never stalls the thread that waits on NVML. `now` is a monotonic clock reading passed in, so
a wall-clock step cannot stretch or cut a window and tests drive the windows by hand. Windows
open in time order, so a flush looks only at the expired ones at the front: a burst of many
kinds costs no more per event than one kind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gpuvisor.health")

WINDOW_S = 10.0
MAX_KEYS = 1024

# GPU UUID, GPU instance, compute instance, event, decision (a reloaded policy opens a new window)
Key = tuple[str, int | None, int | None, str, str]


@dataclass(frozen=True)
class HealthEvent:
    """One NVML event, as its log line names it."""

    gpu_uuid: str  # "" when NVML named no GPU we can tell
    gi: int | None
    ci: int | None
    what: str  # "XID 31", "double-bit ECC error"
    decision: str  # the policy's decision in words
    unhealthy: bool  # the decision takes devices out
    fields: tuple[tuple[str, Any], ...] = ()  # structured fields for the line (xid, action)
    odd: bool = False  # worth a warning though it takes nothing out (no GPU named, or advice to act)

    @property
    def level(self) -> int:
        return logging.WARNING if self.unhealthy or self.odd else logging.INFO

    @property
    def key(self) -> Key:
        return (self.gpu_uuid, self.gi, self.ci, self.what, self.decision)

    @property
    def where(self) -> str:
        text = self.gpu_uuid or "an unknown GPU"
        if self.gi is not None:
            text += f" GI {self.gi}"
        if self.ci is not None:
            text += f" CI {self.ci}"
        return text


def event_line(event: HealthEvent, changed: int, resources: tuple[str, ...]) -> str:
    """The words of an event's line (also the message of the Node Event that tells of it)."""
    if changed:
        outcome = f" -> {changed} device(s) Unhealthy in {', '.join(resources)}"
    elif event.unhealthy:
        outcome = " (no device changed: already Unhealthy, or the GPU backs none)"
    else:
        outcome = ""
    return f"health event: {event.what} on {event.where}: {event.decision}{outcome}"


@dataclass
class _Window:
    event: HealthEvent
    opened: float
    held: int = 0  # events counted, not logged, since `opened`


class EventLog:
    def __init__(
        self, *, window: float = WINDOW_S, max_keys: int = MAX_KEYS, logger: logging.Logger = log
    ) -> None:
        self.window = window
        self.max_keys = max_keys
        self.log = logger
        self._windows: dict[Key, _Window] = {}
        self._overflow = 0  # events of kinds past max_keys, since `_overflow_since`
        self._overflow_since = 0.0
        self.lines = 0  # log lines written
        self.held = 0  # events counted instead of logged, over the whole life

    def record(self, event: HealthEvent, changed: int, resources: tuple[str, ...], now: float) -> None:
        """One event arrived; `changed` devices (of `resources`) changed health because of it."""
        self.flush(now)
        window = self._windows.get(event.key)
        if changed == 0 and window is not None:
            window.held += 1
            self.held += 1
            return
        if changed == 0 and len(self._windows) >= self.max_keys:
            if self._overflow == 0:
                self._overflow_since = now
            self._overflow += 1
            self.held += 1
            return
        self._line(event, event_line(event, changed, resources))
        if window is None:
            self._windows[event.key] = _Window(event, now)

    def status(self) -> dict[str, int]:
        """For `gpuvisor status`: lines written, events held (counted, summarised later)."""
        return {"lines": self.lines, "held": self.held}

    def empty(self) -> bool:
        """No window is open and no overflow is counted: `flush` has nothing to do."""
        return not self._windows and not self._overflow

    def flush(self, now: float, *, everything: bool = False) -> None:
        """Summarise and forget the windows that have passed (call it every loop turn);
        `everything`: every window, passed or not (at shutdown, so no count is lost)."""
        windows = self._windows
        while windows:
            key = next(iter(windows))  # the oldest: windows are kept in the order they opened
            window = windows[key]
            if not everything and now - window.opened < self.window:
                break
            del windows[key]
            if window.held:
                event = window.event
                self._line(
                    event,
                    f"health event: {event.what} on {event.where}: {window.held} more in the last "
                    f"{now - window.opened:.0f}s, {event.decision}",
                    count=window.held,
                )
        if self._overflow and (everything or now - self._overflow_since >= self.window):
            self.lines += 1
            self.log.warning(
                "health events: %d more of other kinds in the last %.0fs, not logged one by one "
                "(over %d kinds at once); every XID is counted in gpuvisor_xid_events_total",
                self._overflow,
                now - self._overflow_since,
                self.max_keys,
            )
            self._overflow = 0

    def _line(self, event: HealthEvent, text: str, count: int | None = None) -> None:
        self.lines += 1
        extra: dict[str, Any] = dict(event.fields)
        if event.gpu_uuid:  # an event that named no GPU has no device field
            extra["device"] = event.gpu_uuid
        if count is not None:
            extra["count"] = count
        self.log.log(event.level, "%s", text, extra=extra)
