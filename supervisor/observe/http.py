"""The node's HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).

A stdlib `ThreadingHTTPServer` in a daemon thread: three tiny read-only pages do not justify a
web framework, and a scrape never waits for the supervisor's main loop. The handlers only call
the three callables they are given; those must be safe to call from another thread (they read
figures the main loop keeps up to date, never the loop's live dicts).

- /healthz answers 200 "ok" while the main loop ticked recently (`loop_liveness`), else 503 with
  the reason: a wedged loop is what a liveness probe should restart.
- /readyz answers 200 when every planned resource is registered and streaming, else 503 with
  what is missing (the main loop's answer, `supervisor.observe.status.readiness`, handed over
  through a `ReadinessCell`).
- No access log: a probe every few seconds is not an event (one log line per event, nothing per
  poll). Server-side failures are logged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("gpuvisor.http")

Probe = Callable[[], tuple[bool, str]]

LIVENESS_LIMIT_S = 10.0  # the main loop turns at least every second: 10 missed turns is a wedged loop


class AddressError(Exception):
    """The metrics address cannot be parsed, resolved or bound; the text says which and why."""


def parse_address(text: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces) -> (host, port); host "" = all."""
    value = text.strip()
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise AddressError(f"invalid metrics address {text!r}: use host:port, [ipv6]:port or :port")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise AddressError(f"invalid metrics address {text!r}: unbalanced brackets around the IPv6 host")
        host = host[1:-1]
    elif ":" in host:
        raise AddressError(
            f"invalid metrics address {text!r}: write an IPv6 host in brackets, e.g. [::1]:{port_text}"
        )
    return host, int(port_text)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds up the process's exit
    dual_stack = False
    owner: ProbeServer

    def server_bind(self) -> None:
        if self.dual_stack:
            with contextlib.suppress(OSError):  # accept IPv4 too on an IPv6 wildcard socket
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind would call socket.getfqdn(host): a reverse DNS lookup that can
        # hang for seconds on a node without DNS. The name is only used in CGI environments.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Server6Dual(_Server6):
    dual_stack = True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "gpuvisor"
    sys_version = ""
    timeout = 10  # seconds a client may take to send its request

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        owner = self.server.owner
        path = urlsplit(self.path).path
        try:
            if path == "/metrics":
                status, ctype, body = 200, CONTENT_TYPE_LATEST, owner.render()
            elif path in ("/healthz", "/livez"):
                status, ctype, body = _probe_page(owner.liveness)
            elif path == "/readyz":
                status, ctype, body = _probe_page(owner.readiness)
            elif path == "/":
                status, ctype, body = (
                    200,
                    "text/plain; charset=utf-8",
                    b"gpuvisor: /metrics /healthz /readyz\n",
                )
            else:
                status, ctype, body = (
                    404,
                    "text/plain; charset=utf-8",
                    b"not found: try /metrics, /healthz or /readyz\n",
                )
        except Exception as exc:  # a bug behind one page must not take the endpoint down
            log.warning("HTTP %s failed: %s: %s", path, type(exc).__name__, exc)
            status, ctype, body = (
                500,
                "text/plain; charset=utf-8",
                f"internal error: {type(exc).__name__}\n".encode(),
            )
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log (see the module docstring); errors are logged in _answer

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("HTTP client error: " + format, *args)


def _probe_page(probe: Probe) -> tuple[int, str, bytes]:
    ok, text = probe()
    body = (text or ("ok" if ok else "not ok")).rstrip("\n") + "\n"
    return (200 if ok else 503), "text/plain; charset=utf-8", body.encode()


class ProbeServer:
    """Serves /metrics, /healthz and /readyz on `address` until `stop()`."""

    def __init__(
        self,
        *,
        address: str,
        render: Callable[[], bytes],
        liveness: Probe,
        readiness: Probe,
        poll_interval: float = 0.5,
    ) -> None:
        self.address = address
        self.poll_interval = poll_interval  # how often serve_forever checks for stop(): its latency
        self.render = render
        self.liveness = liveness
        self.readiness = readiness
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when the address asked for port 0)."""
        if self._server is None:
            raise RuntimeError("the HTTP server is not started")
        return int(self._server.server_address[1])

    @property
    def host(self) -> str:
        if self._server is None:
            raise RuntimeError("the HTTP server is not started")
        return str(self._server.server_address[0])

    def start(self) -> None:
        """Bind and serve in a daemon thread; AddressError says what is wrong with the address."""
        host, port = parse_address(self.address)
        server = self._bind(host, port)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": self.poll_interval},
            name="http",
            daemon=True,
        )
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s", self.url)

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        host = self.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}"

    def _bind(self, host: str, port: int) -> _Server:
        where = (
            f"metrics address {self.address!r} (--metrics-address / GPUVISOR_METRICS_ADDRESS; empty disables)"
        )
        if host == "":
            # All interfaces: one IPv6 wildcard socket that takes IPv4 too, or plain IPv4 on a
            # node without IPv6.
            try:
                return self._make(socket.AF_INET6, ("::", port), dual_stack=True)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise AddressError(f"cannot listen on {where}: {exc.strerror}") from None
            family, sockaddr = socket.AF_INET, ("0.0.0.0", port)
        else:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror as exc:
                raise AddressError(f"cannot resolve the host of {where}: {exc.strerror}") from None
            family, sockaddr = infos[0][0], (str(infos[0][4][0]), port)
        try:
            return self._make(family, sockaddr, dual_stack=False)
        except OSError as exc:
            raise AddressError(f"cannot listen on {where}: {exc.strerror or exc}") from None

    @staticmethod
    def _make(family: int, sockaddr: tuple[str, int], dual_stack: bool) -> _Server:
        cls = _Server if family != socket.AF_INET6 else (_Server6Dual if dual_stack else _Server6)
        return cls(sockaddr, _Handler)

    def stop(self) -> None:
        """Stop serving and close the listening socket (waits up to `poll_interval`)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# ---------------------------------------------------------------------- probe helpers


def loop_liveness(
    last_tick: Callable[[], float],
    limit: float = LIVENESS_LIMIT_S,
    clock: Callable[[], float] = time.monotonic,
) -> Probe:
    """A liveness probe: alive while `last_tick()` (a `clock` reading) is at most `limit` old."""

    def probe() -> tuple[bool, str]:
        age = clock() - last_tick()
        if age <= limit:
            return True, "ok"
        return False, f"the supervisor's main loop has not ticked for {age:.1f}s (limit {limit:g}s)"

    return probe
