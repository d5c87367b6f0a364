"""The main loops' mailbox (the supervisor's and each worker's): `Mailbox`."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
from collections.abc import Callable


class Mailbox:
    """Work for a main loop from other threads and signal handlers: a queue plus a wake pipe.

    The loop polls `fileno()` (also the `signal.set_wakeup_fd` target, so a signal wakes it too)
    and calls `drain()`, which empties the pipe and runs every posted callable in order. A
    callable that raises is logged and dropped: one bad finding never ends the loop.
    """

    def __init__(self, log: logging.Logger, on_error: Callable[[], None] | None = None) -> None:
        self._log = log
        self._on_error = on_error  # told of each callable that raised (a metric), after the log line
        self._queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    @property
    def wakeup_fd(self) -> int:
        return self._w

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop (callable from any thread); what it returns is dropped."""
        self._queue.put(fn)
        with contextlib.suppress(BlockingIOError):  # a full pipe already means "wake up"
            os.write(self._w, b"x")

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass
        while True:
            try:
                fn = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                self._log.exception("a queued main-loop call failed")
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error()
