"""Asking the supervisor and waiting for its answer, from a gRPC thread: `Asking`.

The DRA worker's gRPC threads ask the supervisor for what only it does (a ResourceClaim from the
API server, worker/dra/claims.py; an MPS claim's daemon, worker/dra/mps.py; a MIG device made on
demand, worker/dra/migdemand.py). A request goes to
`send` (posted to the main thread, which owns the DEALER) with a request ID of its own; the reply
comes back through `answer` (main thread) and wakes the one thread waiting for that ID. A reply
nobody waits for any more (it came after the wait's end) is dropped. Waits are bounded: the
kubelet's prepare has 45 s in all.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from worker.dra.edits import SharingError


class _Reply(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def error(self) -> str: ...


R = TypeVar("R", bound=_Reply)


class _Waiter(Generic[R]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: R | None = None


class Asking(Generic[R]):
    def __init__(
        self, send: Callable[[Any], None], timeout: float, error: type[Exception] = SharingError
    ) -> None:
        self.send = send
        self.timeout = timeout
        self.error = error  # what a wait without an answer raises
        # This process's own IDs: a reply meant for a worker killed meanwhile never wakes its successor.
        self._prefix = f"{os.getpid()}.{os.urandom(3).hex()}"
        self._ids = itertools.count(1)
        self._waiting: dict[str, _Waiter[R]] = {}
        self._lock = threading.Lock()

    def ask(self, request: Any, what: str, *, raise_error: bool = True) -> R:
        """Send `request` (a dataclass with a `request_id` field) and wait for its reply; raises
        `error` with `what` when none comes in time, and SharingError with the reply's error
        (unless `raise_error` is False: the caller reads it)."""
        waiter: _Waiter[R] = _Waiter()
        with self._lock:
            request_id = f"{self._prefix}-{next(self._ids)}"
            self._waiting[request_id] = waiter
        try:
            self.send(dataclasses.replace(request, request_id=request_id))
            if not waiter.done.wait(self.timeout):
                raise self.error(f"{what} within {self.timeout:g}s")
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        reply = waiter.reply
        assert reply is not None
        if reply.error and raise_error:
            raise SharingError(reply.error)
        return reply

    def answer(self, reply: R) -> None:
        """The supervisor's reply (main thread); one nobody waits for any more is dropped."""
        with self._lock:
            waiter = self._waiting.get(reply.request_id)
        if waiter is not None:
            waiter.reply = reply
            waiter.done.set()

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)
