"""client-go's client-side rate limiter: a token bucket, `qps` tokens a second, `burst` saved up.

Every request of a process takes a token first (its clients share one bucket: `gpuvisor run`'s
and `gpuvisor labels`' `--kube-api-qps`, `--kube-api-burst`), so a storm on the node (an XID
burst, a flapping label) reaches the API server at `qps` at most. The rules are client-go's
flowcontrol ones: 0 means its defaults (5 and 10), a negative QPS means no limit. A server that
answered 429 (or 5xx) with `Retry-After` holds the bucket (`hold`): no request leaves before that
time, whatever tokens are saved. A wait ends at once when the caller's client is stopped (the
`stop` event given to `acquire`): it raises `Stopped`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from supervisor.kube.errors import Stopped

DEFAULT_QPS = 5.0  # client-go rest.DefaultQPS / DefaultBurst
DEFAULT_BURST = 10


class TokenBucket:
    def __init__(
        self,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        clock: Callable[[], float] = time.monotonic,
        stop: threading.Event | None = None,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        self.qps = DEFAULT_QPS if qps == 0 else qps
        self.burst = max(1, DEFAULT_BURST if burst == 0 else burst)
        self._clock = clock
        self._stop = stop or threading.Event()  # the default for acquire() without one
        self._fake_wait = wait  # tests: waits that move a fake clock; True means stopped meanwhile
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._not_before = 0.0  # a server's Retry-After, as this clock's time
        self._lock = threading.Lock()
        self.held = 0  # holds by a Retry-After, counted
        self.waited_s = 0.0  # the seconds requests waited here, summed

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it (0 when one was there and no hold)."""
        with self._lock:
            now = self._clock()
            hold = max(0.0, self._not_before - now)
            if self.qps < 0:
                return hold
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1.0
            return max(hold, 0.0 if self._tokens >= 0 else -self._tokens / self.qps)

    def try_accept(self) -> bool:
        """Take a token if one is there now (client-go's TryAccept); False takes nothing."""
        with self._lock:
            now = self._clock()
            if now < self._not_before:
                return False
            if self.qps < 0:
                return True
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def hold(self, seconds: float) -> None:
        """The server asked for `seconds` of quiet (Retry-After): nothing leaves before."""
        if seconds <= 0:
            return
        with self._lock:
            self._not_before = max(self._not_before, self._clock() + seconds)
            self.held += 1

    def acquire(self, stop: threading.Event | None = None) -> float:
        """Take a token, waiting for it (and for a hold set meanwhile); the seconds waited.
        Raises Stopped when `stop` is set before or during the wait."""
        stop = stop or self._stop
        if stop.is_set():
            raise Stopped("the API client is stopped")
        waited = 0.0
        wait = self.reserve()
        while wait > 0:
            if self._sleep(wait, stop):
                raise Stopped("the API client is stopped")
            waited += wait
            with self._lock:  # a Retry-After that came while this one waited holds it too
                wait = max(0.0, self._not_before - self._clock())
        if waited:
            with self._lock:
                self.waited_s += waited
        return waited

    def _sleep(self, seconds: float, stop: threading.Event) -> bool:
        if self._fake_wait is not None:
            return self._fake_wait(seconds)
        return stop.wait(seconds)
