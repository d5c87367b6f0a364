"""The one backoff every retry in gpuvisor uses: exponential, capped, jittered, resettable.

Worker restarts, registration, NVML re-init, the NVML event wait, MPS daemon restarts, CDI spec
writes and pending reloads all retry something that failed; each holds its own `Backoff`. The
n-th delay (n counted from 1 since the last `reset()`) is

    0                                           for n <= free
    min(start * factor ** (n - free - 1), cap)   after that, times a jitter factor

(a start of 0 retries at once every time; a cap below the start makes every delay the cap).

The jitter factor is drawn uniformly from [1 - jitter, 1], so a delay never exceeds the cap
and a fleet of retriers that failed together spreads out instead of retrying in lockstep.
`free` is for retries whose first attempts should cost nothing (a worker's first crash is
restarted at once). The random source is a parameter, so tests get exact delays.
"""

from __future__ import annotations

import math
import random


class Backoff:
    def __init__(
        self,
        start: float,
        cap: float,
        *,
        factor: float = 2.0,
        jitter: float = 0.0,
        free: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        for name, value in (("start", start), ("cap", cap)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"backoff {name} must be a number of seconds >= 0, got {value!r}")
        if not math.isfinite(factor) or factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {factor!r}")
        if not 0 <= jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {jitter!r}")
        if free < 0:
            raise ValueError(f"backoff free attempts must be >= 0, got {free!r}")
        self.start = start
        self.cap = cap
        self.factor = factor
        self.jitter = jitter
        self.free = free
        self._random = rng  # made on first use: seeding reads the OS's entropy, a system call
        self.attempts = 0  # delays handed out since the last reset

    def step(self, n: int) -> float:
        """The un-jittered delay of attempt `n` (1-based)."""
        if n <= self.free or self.start == 0 or self.cap == 0:
            return 0.0
        exponent = n - self.free - 1
        # Past this exponent the step is at the cap anyway; stop before floats overflow.
        if (
            exponent > 1
            and self.factor > 1
            and exponent >= math.log(max(self.cap / self.start, 1.0), self.factor) + 1
        ):
            return self.cap
        return float(min(self.start * self.factor**exponent, self.cap))

    def next(self) -> float:
        """The delay before the next attempt; counts the attempt."""
        self.attempts += 1
        delay = self.step(self.attempts)
        if delay and self.jitter:
            if self._random is None:
                self._random = random.Random()
            delay *= 1.0 - self.jitter * self._random.random()
        return delay

    def reset(self) -> None:
        """Success: the next failure starts from the beginning again."""
        self.attempts = 0
