"""The handler's common part: how the fake API server answers, whatever the resource.

A JSON body, or the plain-text `404 page not found` the real server's mux gives a path nothing
serves; RBAC refusals (`allow`) with the authorizer's 403 text; NotFound and Invalid as a
resource's registry words them (every refusal of what gpuvisor sent is kept in `errors`); and the
connection as the real (Go) server sets it up: no Nagle delay, and kept alive as Go's HTTP/1.1
server keeps one (every answer has a Content-Length or is chunked; a client's `Connection: close`
ends it after the answer; one idle for `idle_timeout_s` is closed: kube-apiserver's `IdleTimeout`,
90 s, k8s.io/apiserver pkg/server/secure_serving.go).
"""

from __future__ import annotations

import contextlib
import json
import socket
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.kubeapi.resources import GROUPS, KINDS, RESOURCE_GROUP, USER, status
from tests.kubeapi.state import FakeApiServer


class HandlerBase(BaseHTTPRequestHandler):
    """What every resource's part uses: the answers, RBAC, and the connection's setup."""

    server_version = "fake-kube-apiserver"
    protocol_version = "HTTP/1.1"
    state: FakeApiServer  # set on the subclass made per server
    live: set[socket.socket]  # the connections being served, for drop_connections()
    user = ""  # the user the request's bearer token names (set by the handler)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # As the real (Go) server: no Nagle delay. Without it an answer's body, written after its
        # headers, waits for the client's delayed ACK (~200 ms a call on loopback).
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The wait for a request on a kept connection (and for its parts): an idle connection is
        # closed after it, as Go's server does after its IdleTimeout.
        self.connection.settimeout(self.state.idle_timeout_s)
        self.live.add(self.connection)

    def finish(self) -> None:
        # Still in `live` here: the server forgets it once closed (_Server.shutdown_request), so
        # a test that waits for it to leave waits for the close a client can see.
        with contextlib.suppress(OSError):  # a connection dropped by a test
            super().finish()

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _too_many(self, retry_after: str) -> None:
        """Priority and fairness's refusal: 429, `Retry-After`, Go's http.Error text."""
        data = b"Too many requests, please try again later.\n"
        self.send_response(429)
        self.send_header("Retry-After", retry_after)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
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

    # ------------------------------------------------------------------ refusals
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
