"""Kubernetes Events about one object, correlated as client-go's recorder correlates them.

client-go's EventCorrelator (tools/record/events_cache.go), with its defaults:

- the same event again (same type, reason and message) within ten minutes of its last occurrence
  raises the `count` of the Event already written (a strategic-merge PATCH of count,
  lastTimestamp and message), no new object; a PATCH that finds the Event expired (404) writes
  a new one;
- more than 10 distinct messages with one type and reason within ten minutes are combined: the
  Event written is "(combined from similar events): <message>", counted like any repeat;
- a spam filter per source and object: 25 Events at once, then one every 5 minutes (a token
  bucket); an Event past it is dropped and counted, never queued.

The Event itself is a core/v1 Event as the kubelet writes one about its Node: in the `default`
namespace, `involvedObject` the Node with its name as UID (kubectl describe node looks events up
so), `source.component` and `reportingComponent` the component ("gpuvisor"), the node as host
and reporting instance. Names are client-go's `<object>.<unix nanoseconds in hex>`.

`correlate` is the pure decision (tested on a fake clock); `EventRecorder.emit` carries it out
with the client, on the caller's thread.
"""

from __future__ import annotations

import datetime
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.kube.client import STRATEGIC_MERGE, KubeClient
from supervisor.kube.errors import ApiError
from supervisor.kube.limiter import TokenBucket

AGGREGATE_MAX_EVENTS = 10
AGGREGATE_INTERVAL_S = 600.0
SPAM_BURST = 25
SPAM_QPS = 1.0 / 300.0
CACHE_ENTRIES = 4096  # client-go's LRU size: bounds what is remembered
MAX_MESSAGE = 1024  # events.k8s.io's note limit; core/v1 takes more, nobody reads it
EVENTS_NAMESPACE = "default"  # where Events about a cluster-scoped object go


def rfc3339(when: float) -> str:
    return datetime.datetime.fromtimestamp(int(when), datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Seen:
    name: str
    count: int
    first: float
    last: float


@dataclass
class _Similar:
    messages: set[str] = field(default_factory=set)
    last: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What to write: `create` a new Event, `patch` the one named, or nothing (`throttled`)."""

    action: str  # "create", "patch" or "throttled"
    name: str
    count: int
    first: float
    message: str


class Correlator:
    def __init__(self, object_name: str, clock: Callable[[], float] = time.time) -> None:
        self.object_name = object_name
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str, str], _Seen] = OrderedDict()
        self._similar: OrderedDict[tuple[str, str], _Similar] = OrderedDict()
        self._spam = TokenBucket(SPAM_QPS, SPAM_BURST, clock=clock)

    def correlate(self, event_type: str, reason: str, message: str) -> Decision:
        now = self.clock()
        message = _shorten(message)
        similar = self._remember(self._similar, (event_type, reason), _Similar())
        if now - similar.last > AGGREGATE_INTERVAL_S:
            similar.messages = set()
        similar.messages.add(message)
        similar.last = now
        if len(similar.messages) >= AGGREGATE_MAX_EVENTS:
            similar.messages.pop()  # the set stays bounded, as client-go's
            message = _shorten("(combined from similar events): " + message)
        key = (event_type, reason, message)
        seen = self._seen.get(key)
        if seen is not None and now - seen.last <= AGGREGATE_INTERVAL_S:
            seen.count += 1
            seen.last = now
            self._seen.move_to_end(key)
            decision = Decision("patch", seen.name, seen.count, seen.first, message)
        else:
            name = f"{self.object_name}.{int(now * 1e9):x}"
            self._remember(self._seen, key, _Seen(name, 1, now, now), replace=True)
            decision = Decision("create", name, 1, now, message)
        if not self._spam.try_accept():  # no token now: dropped, as client-go's spam filter drops it
            return Decision("throttled", decision.name, decision.count, decision.first, message)
        return decision

    def forget(self, event_type: str, reason: str, message: str) -> None:
        """The Event is gone on the server (its PATCH found nothing): the next one is new."""
        self._seen.pop((event_type, reason, message), None)

    @staticmethod
    def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, *, replace: bool = False) -> Any:
        if replace or key not in cache:
            cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHE_ENTRIES:
            cache.popitem(last=False)
        return cache[key]


def _shorten(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


class EventRecorder:
    """Writes correlated Events about one Node through `client` (on the caller's thread)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node: str,
        component: str = "gpuvisor",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.node = node
        self.component = component
        self.correlator = Correlator(node, clock)
        self.clock = clock
        self.counts = {"created": 0, "counted": 0, "throttled": 0}

    def emit(self, event_type: str, reason: str, message: str) -> str:
        """Write (or count) one Event: "created", "counted" or "throttled". Raises ApiError or Stopped."""
        decision = self.correlator.correlate(event_type, reason, message)
        if decision.action == "throttled":
            self.counts["throttled"] += 1
            return "throttled"
        path = f"/api/v1/namespaces/{EVENTS_NAMESPACE}/events"
        now = rfc3339(self.clock())
        if decision.action == "patch":
            patch = {"count": decision.count, "lastTimestamp": now, "message": decision.message}
            try:
                self.client.request(
                    "PATCH",
                    f"{path}/{decision.name}",
                    what=f"count Event {decision.name}",
                    body=patch,
                    content_type=STRATEGIC_MERGE,
                )
                self.counts["counted"] += 1
                return "counted"
            except ApiError as exc:
                if not exc.not_found:
                    raise
                self.correlator.forget(event_type, reason, decision.message)  # expired: a new one
                decision = self.correlator.correlate(event_type, reason, message)
                if decision.action == "throttled":
                    self.counts["throttled"] += 1
                    return "throttled"
        body = self.event(decision, event_type, reason, now)
        self.client.request("POST", path, what=f"create Event {decision.name}", body=body)
        self.counts["created"] += 1
        return "created"

    def event(self, decision: Decision, event_type: str, reason: str, now: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": decision.name, "namespace": EVENTS_NAMESPACE},
            "involvedObject": {"kind": "Node", "name": self.node, "uid": self.node, "apiVersion": "v1"},
            "reason": reason,
            "message": decision.message,
            "type": event_type,
            "count": decision.count,
            "firstTimestamp": rfc3339(decision.first),
            "lastTimestamp": now,
            "source": {"component": self.component, "host": self.node},
            "reportingComponent": self.component,
            "reportingInstance": self.node,
        }
