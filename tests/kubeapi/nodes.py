"""core/v1 Nodes and their status subresource: get, list, watch and PATCH.

A PATCH is a strategic-merge patch (`status.conditions` merged by `type`) or a JSON merge patch,
either a 409 when it carries a stale `metadata.resourceVersion`, or a JSON patch. The status
subresource takes only the status and the main resource everything but it, as the Node's strategies
reset the rest (pkg/registry/core/node/strategy.go PrepareForUpdate); the conditions are checked as
the server decodes them.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.kubeapi.listwatch import ListWatch
from tests.kubeapi.patch import (
    JSON_PATCH,
    MERGE,
    STRATEGIC,
    JsonPatchError,
    json_patch,
    merge_patch,
    strategic_merge,
)
from tests.kubeapi.resources import status
from tests.kubeapi.validation import condition_problems


class NodeHandler(ListWatch):
    """core/v1 Nodes and nodes/status."""

    def _node(self, method: str, name: str | None, sub: str | None, query: dict[str, str], body: Any) -> None:
        state = self.state
        if name is None:
            if method != "GET":
                self._send(
                    405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="nodes")
                )
                return
            watching = query.get("watch") in ("true", "1")
            if self._allowed("watch" if watching else "list", "nodes"):
                (self._watch_nodes if watching else self._list_nodes)(query)
            return
        resource = "nodes/status" if sub else "nodes"
        if method == "GET":
            if not self._allowed("get", resource, name=name):
                return
            with state.lock:
                node = copy.deepcopy(state.nodes.get(name))
            if node is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
            else:
                self._send(200, node)
            return
        if method != "PATCH":
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="nodes"))
            return
        if not self._allowed("patch", resource, name=name):
            return
        kind = (self.headers.get("Content-Type") or "").split(";")[0]
        if kind == JSON_PATCH:
            self._json_patch_node(name, sub, body)
            return
        if kind not in (STRATEGIC, MERGE) or not isinstance(body, dict):
            self._send(
                415,
                status(
                    415, "UnsupportedMediaType", f"the patch type {kind!r} is not supported", kind="nodes"
                ),
            )
            return
        with state.lock:
            current = state.nodes.get(name)
            if current is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
                return
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent is not None and sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "nodes"))  # fmt: skip
                return
            updated = copy.deepcopy(current)
            # The status subresource takes only status (metadata.resourceVersion as a precondition);
            # the main resource ignores status.
            part = (
                {"status": body.get("status") or {}}
                if sub
                else {k: v for k, v in body.items() if k != "status"}
            )
            (strategic_merge if kind == STRATEGIC else merge_patch)(updated, part)
            self._store_checked(name, updated)

    def _store_checked(self, name: str, updated: dict[str, Any]) -> None:
        """A patched Node checked as the server checks its conditions, then stored (under the lock)."""
        state = self.state
        problems = condition_problems(updated)
        if problems:
            state.errors.extend(problems)
            self._send(422, status(422, "Invalid", "; ".join(problems), name, "nodes"))
            return
        stored = state._store_node(name, updated, "MODIFIED")
        self._send(200, copy.deepcopy(stored))

    def _json_patch_node(self, name: str, sub: str | None, body: Any) -> None:
        """A JSON patch of a Node (or its status): applied to the whole object, then the status
        subresource keeps only the status and the main resource everything but it, as the Node's
        strategies reset the rest (pkg/registry/core/node/strategy.go PrepareForUpdate)."""
        state = self.state
        with state.lock:
            current = state.nodes.get(name)
            if current is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found', name, "nodes"))
                return
            try:
                patched = json_patch(current, body)
            except JsonPatchError as exc:
                self._send(422, status(422, "Invalid", str(exc), name, "nodes"))
                return
            updated = copy.deepcopy(current)
            if sub:
                updated["status"] = patched.get("status") or {}
            else:
                updated.update({k: v for k, v in patched.items() if k != "status"})
            self._store_checked(name, updated)

    def _list_nodes(self, query: dict[str, str]) -> None:
        with self.state.lock:
            nodes = list(self.state.nodes.values())
        self._list("nodes", nodes, query)

    def _watch_nodes(self, query: dict[str, str]) -> None:
        self._watch("nodes", lambda: list(self.state.nodes.values()), query)
