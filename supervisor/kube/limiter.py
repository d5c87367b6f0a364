"""client-go's client-side rate limiter: a token bucket, `qps` tokens a second, `burst` saved up.

Every request of a client takes a token first, so a storm on the node (an XID burst, a flapping
label) reaches the API server at `qps` at most. The rules are client-go's flowcontrol ones: 0
means its defaults (5 and 10), a negative QPS means no limit. A wait for a token ends at once when
the client is stopped (`stop` set): it raises `Stopped`.
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
        self._stop = stop or threading.Event()
        self._wait = wait or self._stop.wait  # True when stopped meanwhile (tests pass a fake)
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it (0 when one was there)."""
        if self.qps < 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1.0
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def try_accept(self) -> bool:
        """Take a token if one is there now (client-go's TryAccept); False takes nothing."""
        if self.qps < 0:
            return True
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def acquire(self) -> float:
        """Take a token, waiting for it; returns the seconds waited. Raises Stopped."""
        if self._stop.is_set():
            raise Stopped("the API client is stopped")
        wait = self.reserve()
        if wait > 0 and self._wait(wait):
            raise Stopped("the API client is stopped")
        return wait
