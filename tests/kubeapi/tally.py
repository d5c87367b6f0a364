"""What the fake API server counts for a fleet: every request by verb, resource and user, and the
watches open now.

A request's verb is the API server's own name for it (its RequestInfo resolver,
k8s.io/apiserver/pkg/endpoints/request/requestinfo.go `NewRequestInfo`): GET of one object is
`get`, of a collection `list`, with `watch=true` `watch`; POST `create`, PUT `update`, PATCH
`patch`, DELETE of one object `delete`, of a collection `deletecollection`. Its resource is the
plural, with the subresource after a "/" (`nodes/status`). Its user is the one its bearer token
names (`FakeApiServer.users`, one token per node in a fleet), so each node's share is counted
apart, as the real server's audit log would tell them apart.

The handler calls `count` for each request as it comes in (before any answer, so a request the
server refuses is counted too) and `opened`/`closed` around each watch stream it serves; `at`
keeps each request's arrival (monotonic clock) with its key, for spreads over time.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


def resource_of(path: str) -> tuple[str, bool]:
    """(resource[/subresource], names one object) of an API path; ("", False) for another path.
    After the group and version: [namespaces/<ns>/]<resource>[/<name>[/<subresource>]]."""
    if path.startswith("/api/v1/"):
        parts = path.removeprefix("/api/v1/").split("/")
    elif path.startswith("/apis/"):
        parts = path.removeprefix("/apis/").split("/")[2:]  # drop group and version
    else:
        return "", False
    if len(parts) >= 2 and parts[0] == "namespaces" and len(parts) != 2:
        parts = parts[2:]  # namespaces/<ns>/<resource>...; "namespaces/<name>" is the namespace itself
    parts = [p for p in parts if p]
    if not parts:
        return "", False
    resource = parts[0] if len(parts) < 3 else f"{parts[0]}/{parts[2]}"
    return resource, len(parts) >= 2


def verb_of(method: str, path: str, query: dict[str, str]) -> str:
    """The API server's verb for a request (requestinfo.go's mapping)."""
    _, one = resource_of(path)
    if method == "GET":
        if query.get("watch") in ("true", "1"):
            return "watch"
        return "get" if one else "list"
    if method == "DELETE":
        return "delete" if one else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


@dataclass
class Tally:
    """Counts by (verb, resource, user); open watches by (resource, user); arrivals in order."""

    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    open_watches: Counter[tuple[str, str]] = field(default_factory=Counter)
    at: list[tuple[float, str, str, str]] = field(default_factory=list)  # (when, verb, resource, user)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method: str, path: str, query: dict[str, str], user: str) -> None:
        resource, _ = resource_of(path)
        verb = verb_of(method, path, query)
        with self.lock:
            self.counts[(verb, resource, user)] += 1
            self.at.append((time.monotonic(), verb, resource, user))

    def opened(self, resource: str, user: str) -> None:
        with self.lock:
            self.open_watches[(resource, user)] += 1

    def closed(self, resource: str, user: str) -> None:
        with self.lock:
            self.open_watches[(resource, user)] -= 1

    def snapshot(self) -> tuple[Counter[tuple[str, str, str]], Counter[tuple[str, str]]]:
        """Copies of the counts and of the open watches (none at zero)."""
        with self.lock:
            return Counter(self.counts), Counter({k: v for k, v in self.open_watches.items() if v > 0})

    def since(self, start: float, end: float = float("inf")) -> list[tuple[float, str, str, str]]:
        """The arrivals in [start, end)."""
        with self.lock:
            return [a for a in self.at if start <= a[0] < end]
