"""List and watch, as the API server's registry and watch cache answer them.

A `fieldSelector` is terms (`=`, `==`, `!=`) over the fields a resource indexes (FIELD_LABELS; any
other field is the real server's 400); a list carries the collection's resourceVersion. A watch
(`?watch=true`) streams chunked JSON lines: from a resourceVersion, or the current state as ADDED
events without one; BOOKMARK events when asked (`allowWatchBookmarks`, every `bookmark_s`);
`timeoutSeconds`; and `410 Gone` for a version older than the last compaction, as an HTTP 410 when
the watch starts or as an ERROR event in a stream that `expire_watches()` ends.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

from tests.kubeapi.base import HandlerBase
from tests.kubeapi.resources import FIELD_LABELS, KINDS, status


def field_value(obj: dict[str, Any], key: str) -> str:
    """The value a field selector compares (absent is "", as the server's field sets give it)."""
    value: Any = obj
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


class ListWatch(HandlerBase):
    """Field selectors, lists and watches, for the resources that are listed and watched."""

    def _selector(self, resource: str, query: dict[str, str]) -> list[tuple[str, str, bool]] | None:
        """The query's fieldSelector as (field, value, equal) terms; None after answering 400 for a
        field the resource does not index (the real server's words)."""
        terms = []
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            if "!=" in term:
                key, _, value = term.partition("!=")
                equal = False
            else:
                key, _, value = term.partition("=")
                value, equal = value.removeprefix("="), True
            if key not in FIELD_LABELS[resource]:
                self._send(
                    400,
                    status(400, "BadRequest", f"field label not supported: {key}", kind=resource),
                )
                return None
            terms.append((key, value, equal))
        return terms

    def _selected(self, obj: dict[str, Any], terms: list[tuple[str, str, bool]]) -> bool:
        return all((field_value(obj, key) == value) == equal for key, value, equal in terms)

    def _list(self, resource: str, objects: list[dict[str, Any]], query: dict[str, str]) -> None:
        terms = self._selector(resource, query)
        if terms is None:
            return
        with self.state.lock:
            items = [copy.deepcopy(o) for o in objects if self._selected(o, terms)]
            version = str(self.state.version)
        api_version, kind = KINDS[resource]
        self._send(
            200,
            {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": version},
                "items": items,
            },
        )

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(
        self, resource: str, current: Callable[[], list[dict[str, Any]]], query: dict[str, str]
    ) -> None:
        """A watch of `resource` (`current()` gives its objects now, under the lock)."""
        state = self.state
        terms = self._selector(resource, query)
        if terms is None:
            return
        start = query.get("resourceVersion", "")
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        pending: list[tuple[str, dict[str, Any]]]
        with state.lock:
            if start not in ("", "0") and (not start.isdigit() or int(start) < state.compacted):
                self._send(
                    410,
                    status(
                        410,
                        "Expired",
                        f"too old resource version: {start} ({state.compacted})",
                        kind=resource,
                    ),
                )
                return
            epoch = state.watch_epoch
            if start in ("", "0"):  # no version: the current state first, as ADDED events
                pending = [("ADDED", copy.deepcopy(o)) for o in current() if self._selected(o, terms)]
                seen = state.version
            else:
                pending, seen = [], int(start)
        state.tally.opened(resource, self.user)
        try:
            self._stream(resource, terms, pending, seen, epoch, timeout, bookmarks)
        finally:
            state.tally.closed(resource, self.user)

    def _stream(
        self,
        resource: str,
        terms: list[tuple[str, str, bool]],
        pending: list[tuple[str, dict[str, Any]]],
        seen: int,
        epoch: int,
        timeout: float,
        bookmarks: bool,
    ) -> None:
        """The watch's stream: `pending` first, then the history after `seen`, until `timeout`."""
        state = self.state
        api_version, kind_name = KINDS[resource]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + state.bookmark_s
        try:
            for kind, obj in pending:
                self._chunk({"type": kind, "object": obj})
            while time.monotonic() < deadline:
                with state.lock:
                    if state.watch_epoch != epoch:
                        self._chunk(
                            {
                                "type": "ERROR",
                                "object": status(
                                    410,
                                    "Expired",
                                    "The resourceVersion for the provided watch is too old.",
                                    kind=resource,
                                ),
                            }
                        )
                        break
                    events = [(v, k, o) for v, r, k, o in state.history if v > seen and r == resource]
                    if not events:
                        state.changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                        events = [(v, k, o) for v, r, k, o in state.history if v > seen and r == resource]
                    current_version = state.version
                for version, kind, obj in events:
                    seen = version
                    if self._selected(obj, terms):
                        self._chunk({"type": kind, "object": copy.deepcopy(obj)})
                if bookmarks and time.monotonic() >= next_bookmark:
                    seen = max(seen, current_version)
                    self._chunk({"type": "BOOKMARK", "object": {"kind": kind_name, "apiVersion": api_version,
                                                                "metadata": {"resourceVersion": str(seen)}}})  # fmt: skip
                    next_bookmark = time.monotonic() + state.bookmark_s
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client went, or a test dropped the connection
