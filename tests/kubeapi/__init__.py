"""A fake Kubernetes API server for tests: the real one's contract where gpuvisor depends on it.

No API server can run here (MACHINE-NOTES.md), so this serves the REST paths gpuvisor uses, over
TLS with a certificate from its own test CA and a bearer token (so the client's kubeconfig path,
CA data and token, is exercised), with the real server's rules for them:

- Status objects for refusals (401, 403, 404, 405, 409, 410, 415, 422), and, as the real server's
  mux does, a plain-text `404 page not found` for a path it does not serve at all: an unknown
  path, or a CRD's path while the CRD is not installed (`crds`);
- `resourceVersion`: one counter for every write; optimistic concurrency (a stale version sent
  back is 409 Conflict); list answers carry the collection's version;
- watch (`?watch=true`) of nodes: chunked JSON lines from a resourceVersion (or the current state
  as ADDED events without one), `fieldSelector=metadata.name=...`, BOOKMARK events when asked
  (`allowWatchBookmarks`, every `bookmark_s`), `timeoutSeconds`, and `410 Gone` for a version
  older than the last compaction (`compact()`): as an HTTP 410 when the watch starts, as an ERROR
  event in a stream that `expire_watches()` ends;
- the `status` subresource of nodes, PATCHed with a strategic-merge patch that merges
  `status.conditions` by `type` (other conditions untouched) or with a JSON merge patch;
- core/v1 Events: created (validated: namespace rules for a cluster-scoped object, type, name,
  timestamps), PATCHed (count, lastTimestamp), listed;
- resource.k8s.io/v1 ResourceSlices (cluster-scoped: get, list and watch by `fieldSelector`
  `spec.nodeName` / `spec.driver` / `metadata.name` as the real server indexes them, any other
  field a 400; create with `generateName`, update with optimistic concurrency and the immutable
  driver, pool name and node name, delete with `preconditions`, deletecollection as the kubelet
  wipes a node's slices, `dryRun=All`) and ResourceClaims (get, list, watch, create, delete),
  each checked against the `resource.k8s.io/v1` schema (kubernetes-validate's, strict) and the
  server's own rules (one controller owner, one of nodeName/nodeSelector/allNodes, device names,
  counts, semver, taints); `device_taints=False` is a server without the DRADeviceTaints gate,
  which drops `devices[].taints` on write; `dra=False` one that does not serve the API at all;
- RBAC: with `allow` set, a request whose (verb, resource) is not in it gets the real 403 text;
- NFD's NodeFeature (checked against NFD v0.19.0's CRD schema, `tests/data/`, as the structural
  schema it is, so unknown fields fail too) and pods (read only);
- every request is recorded with its user agent and field manager (the `fieldManager` parameter,
  else the user agent up to its first "/", as the real server derives it).

And the failures a real server shows: a frozen server (`freeze()`: requests hang until `thaw()`),
dropped watch connections (`drop_connections()`), an outage (`stop()` then `start()` on the same
port), and one injected failure per method (`fail_next`). Refusals of what gpuvisor sent are
recorded in `errors`, which a test expects empty.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import ipaddress
import json
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.kubeapi.patch import (
    JSON_PATCH,
    MERGE,
    STRATEGIC,
    JsonPatchError,
    json_patch,
    merge_patch,
    strategic_merge,
)
from tests.kubeapi.resources import (
    FIELD_LABELS,
    GROUPS,
    KINDS,
    NFD_GROUP,
    RESOURCE_GROUP,
    TOKEN,
    USER,
    status,
)
from tests.kubeapi.state import FakeApiServer, Request, now_rfc3339
from tests.kubeapi.validation import (
    claim_status_problems,
    condition_list_problems,
    condition_problems,
    drop_taints,
    event_problems,
    node_feature_problems,
    resource_claim_problems,
    resource_slice_problems,
    schema_problems,
)

__all__ = [  # what tests import from here
    "TOKEN",
    "FakeApiServer",
    "RunningApiServer",
    "condition_list_problems",
    "node_feature_problems",
]

NF_PATH = re.compile(r"^/apis/nfd\.k8s-sigs\.io/v1alpha1/namespaces/([^/]+)/nodefeatures(?:/([^/]+))?$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
NODE_PATH = re.compile(r"^/api/v1/nodes(?:/([^/]+)(?:/(status))?)?$")
EVENT_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?$")
SLICE_PATH = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices(?:/([^/]+))?$")
CLAIM_PATH = re.compile(
    r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims(?:/([^/]+)(?:/(status))?)?$"
)
GENERATED_SUFFIX = 5  # the API server's names.SimpleNameGenerator


def field_value(obj: dict[str, Any], key: str) -> str:
    """The value a field selector compares (absent is "", as the server's field sets give it)."""
    value: Any = obj
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-kube-apiserver"
    protocol_version = "HTTP/1.1"
    state: FakeApiServer  # set on the subclass made per server
    live: set[socket.socket]  # the connections being served, for drop_connections()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # As the real (Go) server: no Nagle delay. Without it an answer's body, written after its
        # headers, waits for the client's delayed ACK (~200 ms a call on loopback).
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.live.add(self.connection)

    def finish(self) -> None:
        self.live.discard(self.connection)
        with contextlib.suppress(OSError):  # a connection dropped by a test
            super().finish()

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _plain_404(self) -> None:
        """The real server's mux for a path nothing serves (an uninstalled CRD's included)."""
        data = b"404 page not found\n"
        self.send_response(404)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        state = self.state
        self.close_connection = True
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        split = urllib.parse.urlsplit(self.path)
        path = split.path
        query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
        ua = self.headers.get("User-Agent", "")
        manager = query.get("fieldManager") or ua.split("/", 1)[0]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        with state.lock:
            state.requests.append(
                Request(method, path, body, self.headers.get("Content-Type"), query, ua, manager)
            )
        while state.frozen.is_set():  # a hung server: the request waits, unanswered
            state.thawed.wait(0.2)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, status(401, "Unauthorized", "Unauthorized"))
            return
        with state.lock:
            if method in state.fail_next:
                code, reason = state.fail_next.pop(method)
                self._send(code, status(code, reason, f"injected {reason}"))
                return
        if (
            method in ("POST", "PUT")
            and (self.headers.get("Content-Type") or "application/json").split(";")[0] != "application/json"
        ):
            self._send(415, status(415, "UnsupportedMediaType", "expected application/json"))
            return
        json_patch_body = method == "PATCH" and (self.headers.get("Content-Type") or "").startswith(
            JSON_PATCH
        )
        if not isinstance(body, dict | None) and not (json_patch_body and isinstance(body, list)):
            self._send(400, status(400, "BadRequest", "the body is not a JSON object"))
            return
        if (m := POD_PATH.match(path)) and method == "GET":
            if self._allowed("get", "pods", m[1], m[2]):
                found = state.pods.get((m[1], m[2]))
                if found is None:
                    self._send(404, status(404, "NotFound", f'pods "{m[2]}" not found', m[2], "pods"))
                else:
                    self._send(200, found)
            return
        if (m := NODE_PATH.match(path)) is not None:
            self._node(method, m[1], m[2], query, body)
            return
        if (m := EVENT_PATH.match(path)) is not None:
            self._event(method, m[1], m[2], body)
            return
        if (m := SLICE_PATH.match(path)) is not None and state.dra:
            self._slice(method, m[1], query, body)
            return
        if (m := CLAIM_PATH.match(path)) is not None and state.dra:
            if m[3]:
                self._claim_status(method, m[1], m[2], body)
            else:
                self._claim(method, m[1], m[2], query, body)
            return
        nf = NF_PATH.match(path)
        if nf is None or NFD_GROUP not in state.crds:
            self._plain_404()
            return
        self._node_feature(method, nf[1], nf[2], body)

    # ------------------------------------------------------------------ RBAC
    def _allowed(self, verb: str, resource: str, namespace: str = "", name: str = "") -> bool:
        allow = self.state.allow
        if allow is None or (verb, resource) in allow:
            return True
        who = f'{resource.split("/")[0]} "{name}"' if name else resource.split("/")[0]
        group = GROUPS.get(resource.split("/")[0], "")
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        message = f'{who} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API group "{group}" {scope}'
        self._send(403, status(403, "Forbidden", message, name, resource.split("/")[0], group))
        return False

    # ------------------------------------------------------------------ nodes
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
            problems = condition_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._send(422, status(422, "Invalid", "; ".join(problems), name, "nodes"))
                return
            stored = state._store_node(name, updated, "MODIFIED")
            self._send(200, copy.deepcopy(stored))

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

    def _list_nodes(self, query: dict[str, str]) -> None:
        with self.state.lock:
            nodes = list(self.state.nodes.values())
        self._list("nodes", nodes, query)

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch_nodes(self, query: dict[str, str]) -> None:
        self._watch("nodes", lambda: list(self.state.nodes.values()), query)

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
        api_version, kind_name = KINDS[resource]
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

    # ------------------------------------------------------------------ events
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

    # ------------------------------------------------------------------ ResourceSlices
    def _slice(self, method: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceSlices (cluster-scoped): get, list, watch, create (with
        generateName), update, delete (with preconditions), deletecollection, and `dryRun=All`."""
        state = self.state
        dry = query.get("dryRun") == "All"
        if method == "GET":
            if name is None:
                watching = query.get("watch") in ("true", "1")
                if self._allowed("watch" if watching else "list", "resourceslices"):

                    def current() -> list[dict[str, Any]]:
                        return list(state.resource_slices.values())

                    if watching:
                        self._watch("resourceslices", current, query)
                    else:
                        with state.lock:
                            objects = current()
                        self._list("resourceslices", objects, query)
                return
            if self._allowed("get", "resourceslices", name=name):
                with state.lock:
                    found = copy.deepcopy(state.resource_slices.get(name))
                self._send(200, found) if found else self._not_found("resourceslices", name)
            return
        if method == "DELETE":
            self._delete_slices(name, query, body, dry)
            return
        if method == "POST" and name is None:
            if self._allowed("create", "resourceslices"):
                self._create_slice(body, dry)
            return
        if method == "PUT" and name is not None:
            if self._allowed("update", "resourceslices", name=name):
                self._update_slice(name, body, dry)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceslices")
        )

    def _not_found(self, resource: str, name: str) -> None:
        group = GROUPS.get(resource, "")
        qualified = f"{resource}.{group}" if group else resource
        self._send(404, status(404, "NotFound", f'{qualified} "{name}" not found', name, resource))

    def _invalid(self, resource: str, name: str, problems: list[str]) -> None:
        self.state.errors.extend(problems)
        kind = KINDS[resource][1]
        self._send(
            422,
            status(
                422,
                "Invalid",
                f'{kind}.{RESOURCE_GROUP} "{name}" is invalid: ' + "; ".join(problems),
                name,
                resource,
            ),
        )

    def _create_slice(self, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict):
            self._send(
                400, status(400, "BadRequest", "the body is not a ResourceSlice", kind="resourceslices")
            )
            return
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(GENERATED_SUFFIX)
            )
        if not state.device_taints:
            drop_taints(obj.get("spec") or {})
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            meta.pop(key, None)
        problems = resource_slice_problems(obj)
        if problems:
            self._invalid("resourceslices", str(meta.get("name", "")), problems)
            return
        with state.lock:
            if meta["name"] in state.resource_slices:
                self._send(409, status(409, "AlreadyExists", f'resourceslices.{RESOURCE_GROUP} "{meta["name"]}" already exists',
                                       meta["name"], "resourceslices"))  # fmt: skip
                return
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[meta["name"]] = obj
                state._record("resourceslices", "ADDED", obj)
            self._send(201, copy.deepcopy(obj))

    def _update_slice(self, name: str, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != name:
            self._send(400, status(400, "BadRequest", f"the name of the object does not match the name on the URL ({name})",
                                   name, "resourceslices"))  # fmt: skip
            return
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            sent = body["metadata"].get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceslices"))  # fmt: skip
                return
            obj = copy.deepcopy(body)
            spec, old = obj.get("spec") or {}, current["spec"]
            if not state.device_taints and not any(d.get("taints") for d in old.get("devices") or []):
                drop_taints(spec)
            problems = resource_slice_problems(obj)
            for key in ("driver", "nodeName"):
                if spec.get(key) != old.get(key):
                    problems.append(f"spec.{key}: Invalid value: {spec.get(key)!r}: field is immutable")
            if (spec.get("pool") or {}).get("name") != old["pool"]["name"]:
                problems.append("spec.pool.name: Invalid value: field is immutable")
            if problems:
                self._invalid("resourceslices", name, problems)
                return
            meta = obj["metadata"]
            for key in ("uid", "creationTimestamp"):
                meta[key] = current["metadata"][key]
            meta["generation"] = current["metadata"]["generation"] + (spec != old)
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[name] = obj
                state._record("resourceslices", "MODIFIED", obj)
            else:
                meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            self._send(200, copy.deepcopy(obj))

    def _delete_slices(self, name: str | None, query: dict[str, str], body: Any, dry: bool) -> None:
        state = self.state
        if name is None:  # deletecollection, as the kubelet wipes a node's slices
            if not self._allowed("deletecollection", "resourceslices"):
                return
            terms = self._selector("resourceslices", query)
            if terms is None:
                return
            with state.lock:
                gone = [
                    o if dry else state._delete_slice(n)
                    for n, o in list(state.resource_slices.items())
                    if self._selected(o, terms)
                ]
                version = str(state.version)
            self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": {"resourceVersion": version}, "items": gone})  # fmt: skip
            return
        if not self._allowed("delete", "resourceslices", name=name):
            return
        pre = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            for key in ("uid", "resourceVersion"):
                if pre.get(key) and pre[key] != current["metadata"][key]:
                    self._send(409, status(409, "Conflict", f"Precondition failed: {key} in precondition: {pre[key]}, "
                                           f"{key} in object meta: {current['metadata'][key]}", name, "resourceslices"))  # fmt: skip
                    return
            deleted = copy.deepcopy(current) if dry else state._delete_slice(name)
        self._send(200, copy.deepcopy(deleted))

    # ------------------------------------------------------------------ ResourceClaims
    def _claim(self, method: str, namespace: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceClaims of a namespace: get, list, watch, create, delete."""
        state = self.state
        if method == "GET" and name is None:
            watching = query.get("watch") in ("true", "1")
            if self._allowed("watch" if watching else "list", "resourceclaims", namespace):

                def current() -> list[dict[str, Any]]:
                    return [o for (ns, _), o in state.resource_claims.items() if ns == namespace]

                if watching:
                    self._watch("resourceclaims", current, query)
                else:
                    with state.lock:
                        objects = current()
                    self._list("resourceclaims", objects, query)
            return
        if method == "GET":
            assert name is not None
            if self._allowed("get", "resourceclaims", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method == "POST" and name is None:
            if not self._allowed("create", "resourceclaims", namespace):
                return
            problems = resource_claim_problems(body, namespace)
            claim_name = str(((body or {}).get("metadata") or {}).get("name", ""))
            if problems:
                self._invalid("resourceclaims", claim_name, problems)
                return
            with state.lock:
                if (namespace, claim_name) in state.resource_claims:
                    self._send(409, status(409, "AlreadyExists", f'resourceclaims.{RESOURCE_GROUP} "{claim_name}" already exists',
                                           claim_name, "resourceclaims"))  # fmt: skip
                    return
                body["metadata"]["namespace"] = namespace
                body["metadata"].pop("uid", None)
                state.put_claim(body, validate=False)
                self._send(201, copy.deepcopy(state.resource_claims[(namespace, claim_name)]))
            return
        if method == "DELETE" and name is not None:
            if not self._allowed("delete", "resourceclaims", namespace, name):
                return
            with state.lock:
                if (namespace, name) not in state.resource_claims:
                    self._not_found("resourceclaims", name)
                    return
                gone = copy.deepcopy(state.resource_claims[(namespace, name)])
                state.delete_claim(namespace, name)
            self._send(200, gone)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
        )

    def _claim_status(self, method: str, namespace: str, name: str, body: Any) -> None:
        """PUT of a ResourceClaim's status subresource: the resourceVersion must be the stored one
        (409 otherwise); only the status is taken (the status strategy resets spec and metadata);
        status.devices is checked as validateResourceClaimStatusUpdate checks it; without the
        DRAResourceClaimDeviceStatus gate it is dropped (dropDisabledDRAResourceClaimDeviceStatusFields)."""
        state = self.state
        if method == "GET":
            if self._allowed("get", "resourceclaims/status", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method != "PUT":
            self._send(
                405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
            )
            return
        if not self._allowed("update", "resourceclaims/status", namespace, name):
            return
        with state.lock:
            current = state.resource_claims.get((namespace, name))
            if current is None:
                self._not_found("resourceclaims", name)
                return
            sent = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceclaims.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceclaims"))  # fmt: skip
                return
            updated = copy.deepcopy(current)
            new_status = copy.deepcopy((body or {}).get("status") or {})
            if not state.claim_device_status:
                new_status.pop("devices", None)
            updated["status"] = new_status
            problems = schema_problems(updated) + claim_status_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._invalid("resourceclaims", name, problems)
                return
            state.version += 1
            updated["metadata"]["resourceVersion"] = str(state.version)
            state.resource_claims[(namespace, name)] = updated
            state._record("resourceclaims", "MODIFIED", updated)
            self._send(200, copy.deepcopy(updated))

    # ------------------------------------------------------------------ NodeFeature
    def _node_feature(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        key = (namespace, name or "")
        if method == "GET" and name:
            if not self._allowed("get", "nodefeatures", namespace, name):
                return
            found = state.node_features.get(key)
            if found is None:
                self._send(
                    404, status(404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{name}" not found', name)
                )
            else:
                self._send(200, found)
            return
        if method not in ("POST", "PUT") or (method == "POST") == bool(name):
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here"))
            return
        if not self._allowed(
            "create" if method == "POST" else "update", "nodefeatures", namespace, name or ""
        ):
            return
        problems = node_feature_problems(body, namespace, name)
        if problems:
            state.errors.extend(problems)
            self._send(422, status(422, "Invalid", "; ".join(problems)))
            return
        obj_name = body["metadata"]["name"]
        with state.lock:
            current = state.node_features.get((namespace, obj_name))
            if method == "POST" and current is not None:
                self._send(
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" already exists',
                        obj_name,
                    ),
                )
                return
            if method == "PUT":
                if current is None:
                    self._send(
                        404,
                        status(
                            404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" not found', obj_name
                        ),
                    )
                    return
                sent = body["metadata"].get("resourceVersion")
                if sent != current["metadata"]["resourceVersion"]:
                    self._send(
                        409,
                        status(
                            409,
                            "Conflict",
                            f"Operation cannot be fulfilled: the object has been modified (resourceVersion {sent!r})",
                            obj_name,
                        ),
                    )
                    return
            state.version += 1
            stored = json.loads(json.dumps(body))
            meta = stored["metadata"]
            meta["namespace"] = namespace
            meta["resourceVersion"] = str(state.version)
            meta.setdefault("uid", current["metadata"]["uid"] if current else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta["generation"] = (current["metadata"].get("generation", 1) + 1) if current else 1
            state.node_features[(namespace, obj_name)] = stored
        self._send(201 if method == "POST" else 200, stored)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


def _certificates(directory: Path) -> tuple[bytes, Path, Path]:
    """A test CA (PEM bytes) and a server certificate and key for 127.0.0.1 signed by it (files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuvisor test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca.public_bytes(serialization.Encoding.PEM), cert_file, key_file


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a stop, a test cutting connections) is no error."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class RunningApiServer:
    """The fake on 127.0.0.1 (a free port, kept across stop()/start()) in a thread, and a kubeconfig
    that trusts it."""

    def __init__(self, directory: Path, state: FakeApiServer | None = None) -> None:
        self.state = state or FakeApiServer()
        ca_pem, self._cert_file, self._key_file = _certificates(directory)
        self.live: set[socket.socket] = set()
        self.port = 0
        self.httpd: _Server | None = None
        self.thread: threading.Thread | None = None
        self.start()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_data = base64.b64encode(ca_pem).decode()
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(self.kubeconfig_text(self.ca_data))

    def start(self) -> None:
        """Serve (again, on the same port after stop())."""
        handler = type("Handler", (_Handler,), {"state": self.state, "live": self.live})
        httpd = _Server(("127.0.0.1", self.port), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._cert_file, self._key_file)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        self.port = httpd.server_address[1]
        self.httpd = httpd
        self.thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """An outage: no more connections are accepted and the open ones (watches) are cut."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        if self.thread is not None:
            self.thread.join(timeout=10)
            self.thread = None
        self.drop_connections()

    def drop_connections(self) -> None:
        """Cut every connection being served (a watch stream ends mid-way, as when a server restarts)."""
        for conn in list(self.live):
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def kubeconfig_text(self, ca_data: str, token: str = TOKEN) -> str:
        return yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority-data": ca_data}}],
            "users": [{"name": "labeller", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "labeller"}}],
            "current-context": "test",
        })  # fmt: skip

    def close(self) -> None:
        self.state.thaw()
        self.stop()
