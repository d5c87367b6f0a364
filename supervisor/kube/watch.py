"""A collection (or one named object) kept in view: a list, then a watch from its resourceVersion.

client-go's reflector, for the objects a field selector picks (`ListWatch`: the node's
ResourceSlices) or one object by `metadata.name` (`ObjectWatch`: the supervisor's own Node):

- a list gives the objects (or the one's absence) and the resourceVersion to watch from;
- the watch asks for bookmarks, so the kept resourceVersion moves even when the object does not;
- a stream the server ends (its `timeoutSeconds`, 5 to 10 minutes) is watched again at once from
  the kept resourceVersion; `410 Gone` (a version the server no longer keeps) means a new list;
- any other failure (no answer, 5xx, 403, a 429) is retried after the capped, jittered backoff
  (client-go's numbers: `ReflectorBackoff`; at least a 429's `Retry-After`), the watch from the
  kept version first, as client-go does; each distinct failure is logged once and every one
  counted, and the first success after failures logs that it works again;
- once a working watch broke (a failure, or a 410 Gone that ends it), each retry until it works
  again waits a random time up to `RECONNECT_SPREAD_S` (the first instead of the backoff, the
  later ones on top of it): an API server that restarts sees its nodes come back spread over that
  window after it is back, however long it was away, not in the same second (client-go's first
  retry is 0.8-1.6 s, which a fleet of 5,000 turns into thousands of lists a second);
- every call has a timeout: the list the client's, a watch its `timeoutSeconds` at the server
  and a read timeout a minute past it here (a stream that goes quiet without ending).

It runs on its own thread and calls its callbacks only from there: the owner posts what it needs
to its own loop. `stop()` ends it at once: it aborts the client, which cuts the stream's read short.
"""

from __future__ import annotations

import logging
import random
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from common.backoff import Backoff
from common.messages import Json
from supervisor.kube.client import KubeClient
from supervisor.kube.errors import NO_ANSWER, ApiError, Stopped
from supervisor.kube.failing import Failing

log = logging.getLogger("gpuvisor.kube")

# client-go's reflector (k8s.io/client-go tools/cache/reflector.go): each watch asks for a
# timeoutSeconds drawn from [defaultMinWatchTimeout, 2 * defaultMinWatchTimeout] (5 to 10 min), and
# a failure waits wait.Backoff{Duration: 800ms, Cap: 30s, Factor: 2.0, Jitter: 1.0}.
MIN_WATCH_S = 300
BACKOFF_START_S = 0.8
BACKOFF_CAP_S = 30.0
BACKOFF_FACTOR = 2.0
BACKOFF_JITTER = 1.0


def watch_seconds() -> int:
    """A watch's timeoutSeconds: random in [MIN_WATCH_S, 2 * MIN_WATCH_S], so that a node's
    watches (and a fleet's) do not all end and start again at the same moment."""
    return random.randint(MIN_WATCH_S, 2 * MIN_WATCH_S)


class ReflectorBackoff(Backoff):
    """client-go's reflector backoff. apimachinery's wait.Backoff with Jitter 1.0 adds up to the
    whole step on top (`wait.Jitter(d, 1.0)` is d + rand * d): the n-th delay is drawn from
    [d, 2d) with d = min(0.8 s * 2**(n-1), 30 s), so [0.8, 1.6) s first and [30, 60) s at the
    cap; a success starts it again. (common.backoff's jitter only shortens a delay.)"""

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(BACKOFF_START_S, BACKOFF_CAP_S, factor=BACKOFF_FACTOR, rng=rng)
        self.spread = BACKOFF_JITTER

    def next(self) -> float:
        self.attempts += 1
        delay = self.step(self.attempts)
        if self._random is None:
            self._random = random.Random()
        return delay * (1.0 + self.spread * self._random.random())


RECONNECT_SPREAD_S = 15.0  # the first retry after a working watch broke: uniform in [0, this]


def spread() -> float:
    """The wait before a broken watch's retry: uniform in [0, RECONNECT_SPREAD_S]."""
    return random.uniform(0.0, RECONNECT_SPREAD_S)


def backoff() -> Backoff:
    """client-go's reflector backoff: 800 ms doubling to 30 s, each delay jittered up to twice."""
    return ReflectorBackoff()


class ListWatch:
    """A collection kept in view: `on_list` gets every listed object (the truth at that version),
    `on_event` each watch event after it ("ADDED", "MODIFIED", "DELETED"). `selector` is the
    query's `fieldSelector` (e.g. "spec.nodeName=n1,spec.driver=gpu.nvidia.com"). Both callbacks
    run on the watch's thread."""

    def __init__(
        self,
        client: KubeClient,
        *,
        path: str,
        selector: str,
        what: str,
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        on_count: Callable[[str], None] = lambda event: None,
        retry: Backoff | None = None,
        watch_seconds: Callable[[], int] = watch_seconds,
        reconnect: Callable[[], float] = spread,
    ) -> None:
        self.client = client
        self.path = path  # the collection, e.g. /api/v1/nodes
        self.selector = selector
        self.what = what  # e.g. "Node gpu-1", for logs
        self.on_list = on_list
        self.on_event = on_event
        self.on_count = on_count  # "list", "watch", "gone", "failure": what the metrics count
        self.failing = Failing(retry or backoff())
        self.watch_seconds = watch_seconds
        self.reconnect = reconnect  # the wait before the first retry after a working watch broke
        self._working = False  # listed or watching since the last failure
        self._broken = False  # a working watch broke, and it has not worked since
        self.resource_version = ""
        self.state = "starting"  # listing, watching, failing, stopped
        self.relists = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"watch {self.what}", daemon=True)
        self._thread.start()

    def stop(self, join: float = 1.0) -> None:
        self.client.abort()
        if self._thread is not None:
            self._thread.join(join)

    def run(self) -> None:
        selector = {"fieldSelector": self.selector} if self.selector else {}
        while not self.client.stopped:
            try:
                if not self.resource_version:
                    self.state = "listing"
                    self._list(selector)
                self._watch(selector)
            except Stopped:
                break
            except ApiError as exc:
                was_working, self._working = self._working, False
                self._broken = self._broken or was_working
                if was_working and self.client.stop_event.wait(self.reconnect()):
                    break
                if exc.gone:
                    self.on_count("gone")
                    self.relists += 1
                    log.info(
                        "%s: resourceVersion %s is gone (410): listing again",
                        self.what,
                        self.resource_version,
                    )
                    self.resource_version = ""
                    continue
                self._failed(exc)
                pause = (
                    0.0 if was_working else self.failing.pause() + (self.reconnect() if self._broken else 0.0)
                )
                # A 429's Retry-After holds the client's limiter already; the wait is at least it.
                if self.client.stop_event.wait(max(pause, exc.retry_after or 0.0)):
                    break
            except Exception as exc:  # a bug here must not end the watch: count it, back off, go on
                log.exception("%s: the watch failed unexpectedly", self.what)
                self._failed(ApiError(self.what, NO_ANSWER, type(exc).__name__, str(exc)))
                if self.client.stop_event.wait(self.failing.pause()):
                    break
        self.state = "stopped"

    def _list(self, selector: dict[str, str]) -> None:
        self.on_count("list")
        answer = self.client.get(self.path, what=f"list {self.what}", query=selector)
        items = answer.get("items") if isinstance(answer, dict) else None
        meta = answer.get("metadata") if isinstance(answer, dict) else None
        if not isinstance(items, list) or not isinstance(meta, dict):
            raise ApiError(f"list {self.what}", 200, "BadList", "the answer is not a list")
        self.resource_version = str(meta.get("resourceVersion") or "")
        self._works()
        self.on_list([o for o in items if isinstance(o, dict)])

    def _watch(self, selector: dict[str, str]) -> None:
        seconds = self.watch_seconds()
        query = {
            **selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": str(seconds),
        }
        self.on_count("watch")
        stream = self.client.stream(self.path, what=f"watch {self.what}", query=query, timeout=seconds + 60.0)
        self.state = "watching"
        try:
            self._events(stream)
        finally:
            # Closed here, not when the generator is collected: an ERROR event or a callback's
            # exception leaves it suspended, and with it the stream's socket open until a GC.
            stream.close()
        # The server ended the stream (its timeout): watch again from where it left off.

    def _events(self, stream: Iterable[dict[str, Any]]) -> None:
        first = True
        for event in stream:
            if first:
                self._works()
                first = False
            kind, obj = event.get("type"), event.get("object")
            if kind == "ERROR":
                status = obj if isinstance(obj, dict) else {}
                raise ApiError(
                    f"watch {self.what}",
                    int(status.get("code") or 500),
                    str(status.get("reason") or "Error"),
                    str(status.get("message") or "")[:500],
                )
            if not isinstance(obj, dict):
                continue
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = str(version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.on_event(str(kind), obj)

    def _failed(self, exc: ApiError) -> None:
        self.on_count("failure")
        self.state = "failing"
        text = exc.describe()
        if self.failing.failed(text):
            log.warning(
                "%s failed (retrying with backoff; the last state seen stays in force): %s", self.what, text
            )

    def _works(self) -> None:
        self._working, self._broken = True, False
        lasted = self.failing.works()
        if lasted is not None:
            log.info("%s works again after %.0fs", self.what, lasted)

    def status(self) -> dict[str, Json]:
        return {
            "state": self.state,
            "resource_version": self.resource_version,
            "relists": self.relists,
            **self.failing.status(),
        }


class ObjectWatch(ListWatch):
    """One object of a collection, by `metadata.name`: `on_object` gets it as listed or changed,
    or None when it is deleted or absent."""

    def __init__(
        self,
        client: KubeClient,
        *,
        path: str,
        name: str,
        what: str,
        on_object: Callable[[dict[str, Any] | None], None],
        on_count: Callable[[str], None] = lambda event: None,
        retry: Backoff | None = None,
        watch_seconds: Callable[[], int] = watch_seconds,
        reconnect: Callable[[], float] = spread,
    ) -> None:
        super().__init__(
            client,
            path=path,
            selector=f"metadata.name={name}",
            what=what,
            on_list=self._listed,
            on_event=self._changed,
            on_count=on_count,
            retry=retry,
            watch_seconds=watch_seconds,
            reconnect=reconnect,
        )
        self.name = name
        self.on_object = on_object

    def _listed(self, items: list[dict[str, Any]]) -> None:
        self.on_object(next((o for o in items if _name(o) == self.name), None))

    def _changed(self, kind: str, obj: dict[str, Any]) -> None:
        if _name(obj) != self.name:
            return
        self.on_object(None if kind == "DELETED" else obj)


def _name(obj: object) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return str(meta.get("name", "")) if isinstance(meta, dict) else ""


def quote(name: str) -> str:
    """A name as one path segment."""
    return urllib.parse.quote(name, safe="")
