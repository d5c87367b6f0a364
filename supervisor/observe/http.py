"""The node's HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).

A listening socket served on a daemon thread, each connection on a daemon thread of its own:
three tiny read-only pages do not justify a web framework, and a scrape never waits for the
supervisor's main loop. The handlers only call the three callables they are given; those must be
safe to call from another thread (they read figures the main loop keeps up to date, never the
loop's live dicts).

The HTTP itself is the few lines these pages need (a request line and headers in, a response with
its length out, one request per connection), not the standard library's `http.server`: that
module brings `http.client`, `email`, `html` and `ssl` into the supervisor (docs/performance.md
says what they cost), and its `serve_forever` wakes every half second to look for a stop. Here the serving
thread sleeps in `select` until a client or `stop()` (a pipe) wakes it.

- /healthz answers 200 "ok" while the main loop ticked recently (`loop_liveness`), else 503 with
  the reason: a wedged loop is what a liveness probe should restart.
- /readyz answers 200 when every planned resource is registered and streaming, else 503 with
  what is missing (the main loop's answer, `supervisor.observe.status.readiness`, handed over
  through a `ReadinessCell`).
- GET and HEAD only (others: 501), a request head of at most `MAX_HEAD_BYTES` (else 431), sent
  within `REQUEST_TIMEOUT_S`; every response closes its connection (`Connection: close`).
- No access log: a probe every few seconds is not an event (one log line per event, nothing per
  poll). Server-side failures are logged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from supervisor.observe.exposition import CONTENT_TYPE

log = logging.getLogger("gpuvisor.http")

Probe = Callable[[], tuple[bool, str]]

# The main loop turns at least every 10 s (supervisor.main's IDLE_TICK_S; every 2 s while health
# conditions are held, and at every heartbeat): three missed idle turns is a wedged loop.
LIVENESS_LIMIT_S = 30.0
REQUEST_TIMEOUT_S = 10.0  # seconds a client may take to send its request head
MAX_HEAD_BYTES = 16384  # a request line and headers; a probe or a scrape sends a few hundred
BACKLOG = 16
TEXT = "text/plain; charset=utf-8"
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


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


def _probe_page(probe: Probe) -> tuple[int, str, bytes]:
    ok, text = probe()
    body = (text or ("ok" if ok else "not ok")).rstrip("\n") + "\n"
    return (200 if ok else 503), TEXT, body.encode()


def _read_head(conn: socket.socket) -> bytes | None:
    """The request line and headers (up to the blank line), all within REQUEST_TIMEOUT_S (else
    TimeoutError); None when they grow past MAX_HEAD_BYTES."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request head took too long")
        conn.settimeout(left)
        chunk = conn.recv(4096)
        if not chunk:
            break  # the client ended its side: answer what it sent
        data += chunk
    ends = [i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0]
    return data if min(ends, default=len(data)) <= MAX_HEAD_BYTES else None


def _response(status: int, ctype: str, body: bytes, send_body: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\n"
        "Server: gpuvisor\r\n"
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}\r\n"
        f"Content-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + (body if send_body else b"")


class ProbeServer:
    """Serves /metrics, /healthz and /readyz on `address` until `stop()`."""

    def __init__(
        self,
        *,
        address: str,
        render: Callable[[], bytes],
        liveness: Probe,
        readiness: Probe,
    ) -> None:
        self.address = address
        self.render = render
        self.liveness = liveness
        self.readiness = readiness
        self._sock: socket.socket | None = None
        self._wake: tuple[int, int] | None = None  # stop() writes to [1]; the serving thread selects on [0]
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when the address asked for port 0)."""
        if self._sock is None:
            raise RuntimeError("the HTTP server is not started")
        return int(self._sock.getsockname()[1])

    @property
    def host(self) -> str:
        if self._sock is None:
            raise RuntimeError("the HTTP server is not started")
        return str(self._sock.getsockname()[0])

    def start(self) -> None:
        """Bind and serve in a daemon thread; AddressError says what is wrong with the address."""
        host, port = parse_address(self.address)
        self._sock = self._bind(host, port)
        self._wake = os.pipe()
        self._thread = threading.Thread(
            target=self._serve, args=(self._sock, self._wake[0]), name="http", daemon=True
        )
        self._thread.start()
        everywhere = " (all interfaces)" if self.host in ("0.0.0.0", "::") else ""
        log.info("serving /metrics, /healthz and /readyz on %s%s", self.url, everywhere)

    @property
    def serving(self) -> bool:
        return self._sock is not None

    @property
    def url(self) -> str:
        """The endpoint as one opens it on this node: a wildcard bind (0.0.0.0, ::) is not an
        address to connect to, so it is shown as the loopback that reaches it."""
        host = self.host
        if host == "0.0.0.0":
            host = "127.0.0.1"
        elif host == "::":
            host = "127.0.0.1" if self._takes_ipv4() else "::1"
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}"

    def _takes_ipv4(self) -> bool:
        """An IPv6 wildcard socket bound for "all interfaces" (an empty host) that accepts IPv4
        too; one asked for as [::] is shown as IPv6, as asked."""
        assert self._sock is not None
        asked = parse_address(self.address)[0]
        return asked == "" and self._sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0

    def _bind(self, host: str, port: int) -> socket.socket:
        where = (
            f"metrics address {self.address!r} (--metrics-address / GPUVISOR_METRICS_ADDRESS; empty disables)"
        )
        if host == "":
            # All interfaces: one IPv6 wildcard socket that takes IPv4 too, or plain IPv4 on a
            # node without IPv6.
            try:
                return self._listen(socket.AF_INET6, ("::", port), dual_stack=True)
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
            return self._listen(family, sockaddr, dual_stack=False)
        except OSError as exc:
            raise AddressError(f"cannot listen on {where}: {exc.strerror or exc}") from None

    @staticmethod
    def _listen(family: int, sockaddr: tuple[str, int], dual_stack: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted supervisor binds its port again at once, not after TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if dual_stack:
                with contextlib.suppress(OSError):  # accept IPv4 too on an IPv6 wildcard socket
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(BACKLOG)
            sock.setblocking(False)  # a client gone between select and accept must not block us
        except OSError:
            sock.close()
            raise
        return sock

    def _serve(self, sock: socket.socket, wake: int) -> None:
        """The serving thread: asleep until a client connects or stop() writes to the pipe."""
        listening = sock.fileno()
        while True:
            try:
                ready, _, _ = select.select([listening, wake], [], [])
            except (OSError, ValueError):  # closed under us: stopping
                return
            if wake in ready:
                return
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:  # out of fds, say: logged, and the next client tried
                log.warning("HTTP accept failed: %s", exc)
                time.sleep(0.1)
                continue
            threading.Thread(target=self._handle, args=(conn,), name="http-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                answer = self._answer(_read_head(conn))
                conn.settimeout(REQUEST_TIMEOUT_S)
                conn.sendall(answer)
            except OSError as exc:  # the client went away or was too slow: nothing to answer
                log.debug("HTTP client error: %s", exc)

    def _answer(self, head: bytes | None) -> bytes:
        if head is None:
            return _response(431, TEXT, b"request head too large\n", True)
        words = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].decode("latin-1").split()
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            return _response(400, TEXT, b"bad request line\n", True)
        method, target = words[0], words[1]
        if method not in ("GET", "HEAD"):
            return _response(501, TEXT, f"method {method} not supported: use GET\n".encode(), True)
        path = urlsplit(target).path
        try:
            if path == "/metrics":
                status, ctype, body = 200, CONTENT_TYPE, self.render()
            elif path in ("/healthz", "/livez"):
                status, ctype, body = _probe_page(self.liveness)
            elif path == "/readyz":
                status, ctype, body = _probe_page(self.readiness)
            elif path == "/":
                status, ctype, body = 200, TEXT, b"gpuvisor: /metrics /healthz /readyz\n"
            else:
                status, ctype, body = 404, TEXT, b"not found: try /metrics, /healthz or /readyz\n"
        except Exception as exc:  # a bug behind one page must not take the endpoint down
            log.warning("HTTP %s failed: %s: %s", path, type(exc).__name__, exc)
            status, ctype, body = 500, TEXT, f"internal error: {type(exc).__name__}\n".encode()
        return _response(status, ctype, body, send_body=method == "GET")

    def stop(self) -> None:
        """Stop serving and close the listening socket (a connection being answered finishes)."""
        sock, self._sock = self._sock, None
        wake, self._wake = self._wake, None
        if sock is None:
            return
        if wake is not None:
            os.write(wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        sock.close()
        if wake is not None:
            for fd in wake:
                os.close(fd)


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
