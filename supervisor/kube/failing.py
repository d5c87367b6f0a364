"""What a thread that calls the API server in the background keeps of its failures.

The watches, the ResourceSlice publisher and the Node health writer all retry forever and must
say so without flooding the log: every failure is counted, each distinct one is said once (the
caller words it), the time of the first of a run is kept for status, and the first success after
a run says how long it lasted and resets the backoff. `Failing` holds that, once; each owner keeps
its own log lines and metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.backoff import Backoff
from common.messages import Json


class Failing:
    def __init__(self, retry: Backoff, clock: Callable[[], float] = time.time) -> None:
        self.retry = retry
        self.clock = clock
        self.count = 0  # every failure since the start
        self.error = ""  # the last one's text while failing, "" once it works
        self.since: float | None = None  # wall time of the first failure of this run

    def failed(self, text: str) -> bool:
        """One failure, described by `text`: counted. Whether to say it (it differs from the last)."""
        self.count += 1
        if self.since is None:
            self.since = self.clock()
        new = text != self.error
        self.error = text
        return new

    def works(self) -> float | None:
        """A success: the backoff starts again. How long the run of failures lasted (to say it
        works again), or None when none was running."""
        lasted = None if self.since is None else self.clock() - self.since
        self.since = None
        self.error = ""
        self.retry.reset()
        return lasted

    def pause(self) -> float:
        """The wait before the next try."""
        return self.retry.next()

    def status(self) -> dict[str, Json]:
        return {"failures": self.count, "error": self.error or None, "failing_since": self.since}
