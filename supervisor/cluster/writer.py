"""The thread that keeps GPU health on the Node: the GPUUnhealthy condition and the Events.

The main loop only hands it what it wants (`want` the latest condition, `event` one Event) and
never waits on the API server: with the server slow or gone, the kubelet path runs on and the
node's GPUs stay advertised as the health book says. This thread:

- writes the newest wanted condition, not each one in between (a storm of changes is one PATCH
  per pass, at most one pass per `MIN_INTERVAL_S`), against the Node's current condition, so
  that `lastTransitionTime` moves only with the status and a restart of gpuvisor changes nothing
  that is right already. It reads the Node for that at its first pass, after a failure and every
  `RESYNC_S` (repairing a condition someone else changed); otherwise the answer to its own last
  PATCH says what the Node holds, and a change is one call, not a GET and a PATCH;
- sends the Events in order through the recorder (client-go's counting, combining and spam
  filter), keeping at most `MAX_QUEUED` while the server is away (the oldest dropped and counted);
- on a failure keeps everything wanted and tries again after the capped backoff; each distinct
  failure is logged once, every one counted; when the server answers again the Node catches up.

`stop()` aborts the client: a call in flight ends at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from common.backoff import Backoff
from common.messages import Json
from supervisor.cluster.health import CONDITION_TYPE, NodeCondition, NodeEvent, condition_patch
from supervisor.kube.client import STRATEGIC_MERGE, KubeClient
from supervisor.kube.errors import ApiError, Stopped
from supervisor.kube.failing import Failing
from supervisor.kube.recorder import EventRecorder, rfc3339

log = logging.getLogger("gpuvisor.cluster")

MIN_INTERVAL_S = 5.0  # a storm on a fleet: at most 12 condition patches a minute per node
RESYNC_S = 300.0
MAX_QUEUED = 100


class NodeHealthWriter:
    def __init__(
        self,
        client: KubeClient,
        *,
        node: str,
        on_count: Callable[[str, str], None] = lambda what, result: None,
        retry: Backoff | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.node = node
        self.on_count = on_count  # (condition|event, written|unchanged|counted|throttled|dropped|failed)
        self.failing = Failing(retry or Backoff(1.0, 30.0, jitter=0.3))  # capped as the watch is
        self.clock = clock
        self.recorder = EventRecorder(client, node=node, clock=clock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._wanted: NodeCondition | None = None
        self._written: NodeCondition | None = None  # what the Node holds, as last read or written
        self._seen: dict[str, Any] | None = None  # the Node's condition object, as last read or written
        self._seen_known = False  # False: read the Node before the next write
        self._events: deque[NodeEvent] = deque()
        self._next_resync = 0.0
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.condition_writes = 0

    # ------------------------------------------------------------------ from the main loop
    def want(self, condition: NodeCondition) -> None:
        with self._lock:
            self._wanted = condition
        self._wake.set()

    def event(self, event: NodeEvent) -> None:
        with self._lock:
            if len(self._events) >= MAX_QUEUED:
                self._events.popleft()
                self.dropped += 1
                self.on_count("event", "dropped")
            self._events.append(event)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="node health", daemon=True)
        self._thread.start()

    def stop(self, join: float = 1.0) -> None:
        self.client.abort()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(join)

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        while not self.client.stopped:
            self._wake.wait(max(0.0, self._next_resync - time.monotonic()))
            self._wake.clear()  # before the pass: work that arrives during it wakes the next one
            if self.client.stopped:
                break
            try:
                wrote = self.sync()
            except Stopped:
                break
            except ApiError as exc:
                self._failed(exc)
                pause = self.failing.pause()
            except Exception as exc:  # a bug must not end the thread: count it, back off, go on
                log.exception("writing GPU health on Node %s failed unexpectedly", self.node)
                self._failed(ApiError(f"Node {self.node}", 0, type(exc).__name__, str(exc)))
                pause = self.failing.pause()
            else:
                self._works()
                # After a pass that called the server, new work waits this long: a storm is one
                # pass every 5 s (the newest condition wins). A pass that had nothing to do leaves
                # the next one free, so the first change after a quiet spell is written at once.
                pause = MIN_INTERVAL_S if wrote else 0.0
            if self.client.stop_event.wait(pause):
                break
            if self._pending():
                self._wake.set()

    def sync(self) -> bool:
        """One pass: the condition if it differs (or a resync is due), then the queued Events.
        Whether it called the API server."""
        with self._lock:
            wanted = self._wanted
        called = False
        resync = time.monotonic() >= self._next_resync
        if wanted is not None and (wanted != self._written or resync):
            self._write_condition(wanted, read=resync)
            called = True
        if resync:
            self._next_resync = time.monotonic() + RESYNC_S
        while True:
            with self._lock:
                if not self._events:
                    return called
                event = self._events[0]
            called = True
            result = self.recorder.emit(event.type, event.reason, event.message)
            self.on_count("event", result)
            with self._lock:
                if self._events and self._events[0] is event:
                    self._events.popleft()

    def _write_condition(self, wanted: NodeCondition, *, read: bool) -> None:
        if read or not self._seen_known:
            node = self.client.get(f"/api/v1/nodes/{self.node}", what=f"get Node {self.node}")
            self._seen, self._seen_known = _condition(node), True
        patch = condition_patch(self._seen, wanted, rfc3339(self.clock()))
        if patch is None:
            self._written = wanted
            self.on_count("condition", "unchanged")
            return
        self._seen_known = False  # until the answer says what the Node holds now
        answer = self.client.request(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            what=f"patch the {CONDITION_TYPE} condition of Node {self.node}",
            body=patch,
            content_type=STRATEGIC_MERGE,
        )
        self._seen = _condition(answer)
        self._seen_known = self._seen is not None
        self._written = wanted
        self.condition_writes += 1
        self.on_count("condition", "written")
        log.info("Node %s: condition %s=%s (%s)", self.node, CONDITION_TYPE, wanted.status, wanted.reason)

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._events) or (self._wanted is not None and self._wanted != self._written)

    def _failed(self, exc: ApiError) -> None:
        self.on_count("sync", "failed")
        self._seen_known = False  # the Node may have changed meanwhile (or been made anew): read it first
        text = exc.describe()
        if self.failing.failed(text):
            log.warning(
                "GPU health could not be written on Node %s (retrying with backoff; the kubelet is unaffected): %s",
                self.node,
                text,
            )

    def _works(self) -> None:
        lasted = self.failing.works()
        if lasted is not None:
            log.info("GPU health on Node %s is written again after %.0fs", self.node, lasted)

    def status(self) -> dict[str, Json]:
        with self._lock:
            wanted, queued = self._wanted, len(self._events)
        return {
            "condition": None if wanted is None else {"status": wanted.status, "reason": wanted.reason},
            "written": self._written == wanted and wanted is not None,
            "condition_writes": self.condition_writes,
            "events": dict(self.recorder.counts),
            "events_queued": queued,
            "events_dropped": self.dropped,
            **self.failing.status(),
        }


def _condition(node: Any) -> dict[str, Any] | None:
    status = node.get("status") if isinstance(node, dict) else None
    conditions = status.get("conditions") if isinstance(status, dict) else None
    for condition in conditions if isinstance(conditions, list) else []:
        if isinstance(condition, dict) and condition.get("type") == CONDITION_TYPE:
            return condition
    return None
