"""core/v1 Events of a namespace: create, patch, get and list.

A create is checked as ValidateEventCreate checks it (a cluster-scoped object's events go to
`default`); a patch (count, lastTimestamp) is a strategic-merge or JSON merge patch, checked again.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from tests.kubeapi.base import HandlerBase
from tests.kubeapi.patch import MERGE, STRATEGIC, merge_patch, strategic_merge
from tests.kubeapi.resources import status
from tests.kubeapi.validation import event_problems


class EventHandler(HandlerBase):
    """core/v1 Events."""

    def _event(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        verb = {"POST": "create", "PATCH": "patch", "GET": "get" if name else "list"}.get(method)
        if verb is None or (method == "POST") == bool(name):
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="events"))
            return
        if not self._allowed(verb, "events", namespace, name or ""):
            return
        with state.lock:
            if method == "GET":
                if name:
                    found = state.events.get((namespace, name))
                    self._send(200, found) if found else self._send(
                        404, status(404, "NotFound", f'events "{name}" not found', name, "events")
                    )
                else:
                    items = [e for (ns, _), e in state.events.items() if ns == namespace]
                    self._send(
                        200,
                        {
                            "kind": "EventList",
                            "metadata": {"resourceVersion": str(state.version)},
                            "items": items,
                        },
                    )
                return
            if method == "POST":
                problems = event_problems(body, namespace)
                key = (namespace, (body or {}).get("metadata", {}).get("name", ""))
                if not problems and key in state.events:
                    self._send(
                        409,
                        status(409, "AlreadyExists", f'events "{key[1]}" already exists', key[1], "events"),
                    )
                    return
                stored = copy.deepcopy(body)
            else:
                key = (namespace, name or "")
                current = state.events.get(key)
                if current is None:
                    self._send(
                        404, status(404, "NotFound", f'events "{name}" not found', name or "", "events")
                    )
                    return
                kind = (self.headers.get("Content-Type") or "").split(";")[0]
                if kind not in (STRATEGIC, MERGE):
                    self._send(
                        415,
                        status(
                            415,
                            "UnsupportedMediaType",
                            f"the patch type {kind!r} is not supported",
                            kind="events",
                        ),
                    )
                    return
                stored = copy.deepcopy(current)
                (strategic_merge if kind == STRATEGIC else merge_patch)(stored, body or {})
                problems = event_problems(stored, namespace)
            if problems:
                state.errors.extend(problems)
                self._send(422, status(422, "Invalid", "; ".join(problems), key[1], "events"))
                return
            state.version += 1
            stored.setdefault("metadata", {})["namespace"] = namespace
            stored["metadata"]["resourceVersion"] = str(state.version)
            stored["metadata"].setdefault("uid", str(uuid.uuid4()))
            state.events[key] = stored
            self._send(201 if method == "POST" else 200, stored)
