"""The supervisor's clock and its one scheduler for every timer.

Every timed thing the supervisor does (a worker's backoff ending, a beacon, the next
rediscovery, an NVML re-init, a pending reload's retry, a CDI retry, the debounce of a config
file change) is a named timer here, so the loop has one place to ask "when must I wake up?" and
one place that runs what is due. A timer has a key; setting a key again replaces its deadline
(re-arming is the common case), and `cancel` forgets it.

The clock is injected: the supervisor runs on `SystemClock`, unit tests on a fake whose time
moves only when the test says so, and drive the scheduler with `run_due()` by hand.

A callback that raises is logged with its cause and reported to `on_error` (a metric); it never
ends the loop, and it does not re-arm by itself: a part that must retry uses `Retrying`, which
schedules the retry itself. Between timers the loop sleeps on a `Poller` of its sockets and fds.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from common.backoff import Backoff

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("gpuvisor.supervisor")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: deadlines and durations."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch: timestamps shown to people."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class Scheduler:
    """Named one-shot timers on an injected clock. Single-threaded: call from the main loop."""

    def __init__(self, clock: Clock, on_error: Callable[[str], None] | None = None) -> None:
        self.clock = clock
        # key -> (deadline, arming number, callback); the heap may hold stale entries of a key
        # that was re-armed or cancelled: only the entry with the key's latest number counts.
        self._timers: dict[str, tuple[float, int, Callable[[], object]]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._order = 0
        self._on_error = on_error

    def call_at(self, key: str, when: float, fn: Callable[[], object]) -> None:
        """Run `fn` once the clock reaches `when`; replaces any timer with this key."""
        self._order += 1
        self._timers[key] = (when, self._order, fn)
        heapq.heappush(self._heap, (when, self._order, key))

    def call_later(self, key: str, delay: float, fn: Callable[[], object]) -> None:
        self.call_at(key, self.clock.monotonic() + max(0.0, delay), fn)

    def cancel(self, key: str) -> None:
        self._timers.pop(key, None)

    def when(self, key: str) -> float | None:
        """The deadline of the timer `key`, or None when none is set."""
        timer = self._timers.get(key)
        return timer[0] if timer is not None else None

    def next_deadline(self) -> float | None:
        self._prune()
        return self._heap[0][0] if self._heap else None

    def wait_seconds(self, most: float) -> float:
        """How long the loop may sleep: until the next deadline, at most `most`."""
        deadline = self.next_deadline()
        if deadline is None:
            return most
        return max(0.0, min(most, deadline - self.clock.monotonic()))

    def run_due(self) -> int:
        """Run every timer whose deadline has come, earliest first; returns how many ran.

        A timer armed by a callback during this run waits for the next run, even if it is due:
        a callback that re-arms itself at "now" cannot spin here.
        """
        ran = 0
        now = self.clock.monotonic()
        armed_before = self._order
        while True:
            self._prune()
            if not self._heap or self._heap[0][0] > now or self._heap[0][1] > armed_before:
                return ran
            _when, _order, key = heapq.heappop(self._heap)
            fn = self._timers.pop(key)[2]
            ran += 1
            try:
                fn()
            except Exception:  # a timer's failure must never end the loop (and every resource)
                log.exception("timer %s failed", key)
                if self._on_error is not None:
                    self._on_error(key)

    def _prune(self) -> None:
        """Drop heap entries that a later call_at or a cancel made stale."""
        heap = self._heap
        while heap:
            _when, order, key = heap[0]
            timer = self._timers.get(key)
            if timer is not None and timer[1] == order:
                return
            heapq.heappop(heap)


class Retrying:
    """One step of a part (write the CDI spec, write the node labels) that is retried on failure.

    `attempt` runs the step now (a retry it had scheduled is cancelled first). On one of the
    `catch` exceptions the step is retried under timer `key` after the backoff's next delay, and
    the failure is logged once per distinct error (`failed` is the log line, with `%s` for the
    error); `error` holds it for status until the step succeeds, which logs `again` once.
    """

    def __init__(
        self,
        timers: Scheduler,
        key: str,
        backoff: Backoff,
        failed: str,
        again: str,
        catch: tuple[type[Exception], ...] = (Exception,),
        describe: Callable[[Exception], str] = str,
    ) -> None:
        self.timers = timers
        self.key = key
        self.backoff = backoff
        self.failed = failed
        self.again = again
        self.catch = catch
        self.describe = describe
        self.error = ""

    def attempt(self, step: Callable[[], object], retry: Callable[[], object]) -> bool:
        """Run `step`; True if it succeeded, else `retry` is scheduled."""
        self.timers.cancel(self.key)
        try:
            step()
        except self.catch as exc:
            text = self.describe(exc)
            if text != self.error:
                log.error(self.failed, text)
            self.error = text
            self.timers.call_later(self.key, self.backoff.next(), retry)
            return False
        if self.error:
            log.info("%s", self.again)
        self.error = ""
        self.backoff.reset()
        return True


class Poller:
    """What the loop sleeps on until its next timer: one zmq.Poller over sockets and fds that can
    change between turns (a socket opened, the zygote replaced), made again only when they do.
    `watched` names them, in order; None and negative fds are left out."""

    def __init__(self, watched: Callable[[], tuple[object, ...]]) -> None:
        self.watched = watched
        self._poller: zmq.Poller | None = None
        self._sources: tuple[object, ...] = ()

    def poll(self, seconds: float) -> list[object]:
        """The sockets and fds ready within `seconds`; none when the poll was interrupted."""
        import zmq  # loaded by the supervisor's start anyway; not by the CLI's other commands

        sources = self.watched()
        if self._poller is None or sources != self._sources:
            self._poller, self._sources = zmq.Poller(), sources
            for source in sources:
                if source is not None and not (isinstance(source, int) and source < 0):
                    self._poller.register(source, zmq.POLLIN)
        try:
            return [sock for sock, _event in self._poller.poll(int(seconds * 1000) + 1)]
        except zmq.ZMQError as exc:  # EINTR and the like: the loop just goes round again
            log.debug("poll interrupted: %s", exc)
            return []
