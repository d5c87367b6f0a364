"""One thread that keeps something at the API server in step, pass by pass: `PassThread`.

The DRA side's tidying of the Node's status (`released`) and its claims' device health
(`claimstatus`) work alike: the main loop says what it wants and wakes the thread; the thread
runs one pass (`step`), which answers when to look again (None: when woken); an API failure is
counted, said once per distinct error, and retried with capped backoff, and the first success
after it says how long it lasted. A stopped client ends the thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from common.backoff import Backoff
from supervisor.kube.client import KubeClient
from supervisor.kube.errors import ApiError, Stopped
from supervisor.kube.failing import Failing

log = logging.getLogger("gpuvisor.dra")


class PassThread:
    """Subclasses give `step()`, and the words of the failure and recovery lines."""

    NAME = "dra-pass"
    WHAT = "pass"  # the `what` of gpuvisor_dra_api_total for a failure
    FAILED = "cannot keep the API server in step (retrying with backoff): %s"
    AGAIN = "the API server is in step again (after %.0f s)"

    def __init__(
        self,
        client: KubeClient,
        *,
        on_count: Callable[[str, str], None] = lambda what, result: None,
        retry: Backoff | None = None,
    ) -> None:
        self.client = client
        self.on_count = on_count
        self.failing = Failing(retry or Backoff(1.0, 60.0, jitter=0.3))
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> float | None:
        """One pass: the seconds until the next (None: until woken). Raises ApiError or Stopped."""
        raise NotImplementedError

    def failed(self, exc: ApiError) -> None:
        """A pass failed (the thread, after counting it): what the subclass shows of it."""

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)
        self._thread.start()

    def stop(self, join: float = 0.5) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(join)

    def _run(self) -> None:
        while not self.client.stopped:
            self._wake.clear()
            try:
                pause = self.step()
            except Stopped:
                return
            except ApiError as exc:
                if self.failing.failed(exc.describe()):
                    log.error(self.FAILED, exc.describe())
                self.on_count(self.WHAT, exc.kind)
                self.failed(exc)
                pause = self.failing.pause()
            except Exception as exc:  # a bug: said, counted and retried; never the thread's end
                if self.failing.failed(f"{type(exc).__name__}: {exc}"):
                    log.exception("%s: a pass failed (retrying with backoff)", self.NAME)
                self.on_count(self.WHAT, "error")
                pause = self.failing.pause()
            else:
                lasted = self.failing.works()
                if lasted is not None:
                    log.info(self.AGAIN, lasted)
            self._wake.wait(pause)
