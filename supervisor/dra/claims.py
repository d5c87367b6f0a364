"""ResourceClaims for the DRA worker, fetched from the API server by the supervisor: `ClaimFetcher`.

The DRA worker names a claim (`ClaimRequest` over the control channel) when the kubelet asks it
to prepare one it has not prepared before; the supervisor GETs
`/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>` with the node's one API client
(its credentials, its QPS limiter, its counters) and answers with the claim's JSON or why not
(`ClaimReply`). Why the worker has no client of its own: measured in docs/dra.md.

The main loop only queues a request (`request`, which hands the GIL to the fetch thread at once);
`THREADS` threads of this part do the calls, on the client's kept-alive connections, so a slow
API server delays prepares, never the loop. A request that arrives before the API-server
side has started waits for it, at most `START_WAIT_S`; the queue holds at most `MAX_QUEUED`
(a kubelet prepares a pod's claims a few at a time): beyond, or past its wait, a request is
answered at once with the reason, and the kubelet tries the claim again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.messages import ClaimReply, ClaimRequest, Json

if TYPE_CHECKING:
    from supervisor.kube.client import KubeClient

log = logging.getLogger("gpuvisor.dra")

THREADS = 2
MAX_QUEUED = 256
START_WAIT_S = 15.0  # under the worker's own 20 s wait for an answer
MAX_CLAIM_BYTES = 1 << 20  # the worker takes no bigger claim; the message stays far below its limit


class ClaimFetcher:
    def __init__(
        self,
        *,
        reply: Callable[[str, ClaimReply], None],
        on_count: Callable[[str], None] = lambda result: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reply = reply  # (resource, reply) to the worker; called from this part's threads
        self.on_count = on_count  # ok, not-found, failed, busy, late
        self.clock = clock
        self._queue: queue.Queue[tuple[float, ClaimRequest] | None] = queue.Queue(MAX_QUEUED)
        self._client: KubeClient | None = None
        self._ready = threading.Event()
        self._threads: list[threading.Thread] = []
        self.fetched = 0
        self.failed = 0
        self.last_error = ""

    # ------------------------------------------------------------------ the main loop
    def request(self, request: ClaimRequest) -> None:
        """Queue a worker's request (never blocks): answered from a fetch thread."""
        self._ensure_threads()
        try:
            self._queue.put_nowait((self.clock() + START_WAIT_S, request))
        except queue.Full:
            self._answer(
                request, ClaimReply(request.request_id, error="too many claim requests queued"), "busy"
            )
            return
        # The GIL to the fetch thread now: it sends the GET and blocks on the socket, and the loop
        # goes on. Without it the thread waits out the rest of the loop's turn (its housekeeping),
        # ~0.4 ms of every new claim's prepare (docs/performance.md).
        time.sleep(0)

    def _ensure_threads(self) -> None:
        """The threads start with the first request (a device-plugin node never has any)."""
        while len(self._threads) < THREADS:
            thread = threading.Thread(target=self._run, name=f"dra claims {len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # ------------------------------------------------------------------ the cluster side
    def start(self, client: KubeClient) -> None:
        """The API client is up: fetch what waits and what comes."""
        self._client = client
        self._ready.set()

    def stop(self) -> None:
        """The client is aborted by its owner; requests still queued are answered as failed."""
        self._ready.clear()
        self._client = None

    def close(self) -> None:
        """End the threads (the supervisor stops)."""
        self.stop()
        for _ in self._threads:
            with contextlib.suppress(queue.Full):  # a full queue: its threads answer it, then idle
                self._queue.put_nowait(None)
        self._threads = []

    # ------------------------------------------------------------------ the threads
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            deadline, request = item
            try:
                self._serve(deadline, request)
            except Exception as exc:  # a bug must not end the thread: answer, log, go on
                log.exception("fetching claim %s/%s failed unexpectedly", request.namespace, request.name)
                self._answer(
                    request, ClaimReply(request.request_id, error=f"internal error: {exc}"), "failed"
                )

    def _serve(self, deadline: float, request: ClaimRequest) -> None:
        # The API-server layer is loaded by the cluster side's start; a request that comes first
        # waits for it below, so these imports cost nothing then.
        from supervisor.kube.errors import ApiError, Stopped
        from supervisor.kube.watch import quote

        what = f"get ResourceClaim {request.namespace}/{request.name}"
        if not self._ready.wait(max(0.0, deadline - self.clock())):
            error = "the supervisor's link to the API server is not up (yet): see gpuvisor status, cluster"
            self._answer(request, ClaimReply(request.request_id, error=error), "late")
            return
        client = self._client
        if client is None:
            self._answer(request, ClaimReply(request.request_id, error="the API client is stopped"), "failed")
            return
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(request.namespace)}/resourceclaims/{quote(request.name)}"
        try:
            claim = client.get(path, what=what)
        except Stopped:
            self._answer(request, ClaimReply(request.request_id, error="the API client is stopped"), "failed")
            return
        except ApiError as exc:
            reply = ClaimReply(request.request_id, error=exc.describe(), not_found=exc.not_found)
            self._answer(request, reply, "not-found" if exc.not_found else "failed")
            return
        text = json.dumps(claim, separators=(",", ":"))
        if not isinstance(claim, dict) or len(text) > MAX_CLAIM_BYTES:
            error = f"{what}: the answer is not a claim of at most {MAX_CLAIM_BYTES} bytes"
            self._answer(request, ClaimReply(request.request_id, error=error), "failed")
            return
        self._answer(request, ClaimReply(request.request_id, claim_json=text), "ok")

    def _answer(self, request: ClaimRequest, reply: ClaimReply, result: str) -> None:
        if result == "ok":
            self.fetched += 1
        elif result != "not-found":
            self.failed += 1
            if reply.error != self.last_error:
                log.warning("claim %s/%s not fetched: %s", request.namespace, request.name, reply.error)
            self.last_error = reply.error
        self.on_count(result)
        self.reply(request.resource, reply)

    def status(self) -> dict[str, Json]:
        return {
            "fetched": self.fetched,
            "failed": self.failed,
            "queued": self._queue.qsize(),
            "error": self.last_error or None,
        }
