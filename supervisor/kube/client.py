"""A small Kubernetes API client over the standard library: one request, one connection.

Why not the Kubernetes project's Python client or lightkube: their imports cost several times
this layer's, in time and memory (`python -m tests.benchmarks --only bench_kube`; the figures are
in docs/performance.md), for a supervisor that needs four verbs on three kinds. This client is `http.client`, `ssl` and `json`,
and it does what those clients would not do for gpuvisor:

- a stop ends every call at once: `abort()` shuts the socket of each call in flight down (a
  read, a TLS handshake or a watch stream returns at once), wakes a connect that is waiting
  (connects select on a wake pipe), and cuts a wait for a rate-limiter token short; the call
  raises `Stopped`. No retry loop hides inside a call (urllib3's retries can make one call
  last a minute against a frozen server): callers retry with their own backoff;
- every answer is bounded (`MAX_BODY_BYTES`, and `MAX_LINE_BYTES` per watch event);
- a failure is an `ApiError` whose text says what was being done and what the server said,
  including when the server's answer is not a JSON `Status` (a plain-text 404 means the path,
  e.g. a CRD's, is not served at all);
- requests carry gpuvisor's own user agent and `fieldManager=gpuvisor` on writes, so the
  server's managed fields name gpuvisor;
- client-go's token bucket (`--kube-api-qps`/`--kube-api-burst`) guards every request, and each
  answer is counted by verb and code (`on_request`).

Each call opens its own connection (`Connection: close`): gpuvisor calls the API server a few
times a minute, and a connection per call leaves no pool to repair after a server restart.
TCP keepalive finds a watch whose peer vanished without a FIN within about a minute.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import platform
import select
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from typing import Any

from supervisor.kube.credentials import Credentials
from supervisor.kube.errors import NO_ANSWER, ApiError, Stopped
from supervisor.kube.limiter import DEFAULT_BURST, DEFAULT_QPS, TokenBucket

JSON = "application/json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "gpuvisor"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_LINE_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0
WRITES = ("POST", "PUT", "PATCH")


def user_agent(component: str, version: str) -> str:
    """client-go's form, `<name>/<version> (<os>/<arch>) <component>`: the server takes the part
    before the first "/" as the field manager when a request names none."""
    return f"gpuvisor/{version} (linux/{platform.machine() or 'unknown'}) {component}"


class KubeClient:
    """`component` and `version` (gpuvisor's: `supervisor.config.version`, which this layer may
    not import, and not `importlib.metadata`'s ~1 MB of imports) make the user agent."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        component: str,
        version: str,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        timeout: float = REQUEST_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        on_request: Callable[[str, int], None] | None = None,
    ) -> None:
        self.credentials = credentials
        self.user_agent = user_agent(component, version)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.on_request = on_request or (lambda verb, code: None)
        self.stop_event = threading.Event()
        self.limiter = TokenBucket(qps, burst, stop=self.stop_event)
        self._open: set[int] = set()  # descriptors of calls in flight, shut down by abort()
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()  # readable once aborted: wakes waiting connects
        os.set_blocking(self._wake_w, False)
        self.requests = 0

    @property
    def stopped(self) -> bool:
        return self.stop_event.is_set()

    # ------------------------------------------------------------------ calls
    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        query: Mapping[str, str] | None = None,
        body: object = None,
        content_type: str = JSON,
        timeout: float | None = None,
    ) -> Any:
        """One call; the decoded JSON answer (None for an empty one). Raises ApiError or Stopped."""
        self.limiter.acquire()
        call = self._send(method, path, what, query, body, content_type, timeout or self.timeout)
        resp = call.answer
        try:
            data = self._read(resp, MAX_BODY_BYTES, what)
        finally:
            self._close(call)
        if 200 <= resp.status < 300:
            return self._decode(data, what) if data else None
        raise self._error(resp, data, what)

    def get(self, path: str, *, what: str, query: Mapping[str, str] | None = None) -> Any:
        return self.request("GET", path, what=what, query=query)

    def stream(
        self, path: str, *, what: str, query: Mapping[str, str], timeout: float
    ) -> Generator[dict[str, Any], None, None]:
        """A watch: each JSON line of the answer as it arrives, until the server ends the stream.
        `timeout` bounds the wait for one line. Raises ApiError (a bad answer, an event over
        MAX_LINE_BYTES, a broken stream) or Stopped."""
        self.limiter.acquire()
        call = self._send("GET", path, what, query, None, JSON, timeout)
        resp = call.answer
        try:
            if resp.status != 200:
                raise self._error(resp, self._read(resp, MAX_BODY_BYTES, what), what)
            while True:
                try:
                    line = resp.readline(MAX_LINE_BYTES + 1)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    raise self._failed(what, exc) from None
                if not line:
                    if self.stopped:
                        raise Stopped(f"{what}: stopped")
                    return
                if len(line) > MAX_LINE_BYTES:
                    raise ApiError(what, NO_ANSWER, "TooLarge", f"a watch event over {MAX_LINE_BYTES} bytes")
                if line.strip():
                    event = self._decode(line, what)
                    if not isinstance(event, dict):
                        raise ApiError(what, NO_ANSWER, "BadEvent", "a watch event that is not an object")
                    yield event
        finally:
            self._close(call)

    def abort(self) -> None:
        """Stop: every call in flight ends now, every later call raises Stopped. Safe from any
        thread and from a signal handler."""
        self.stop_event.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        # Under the lock, so that no descriptor is closed (and its number reused) meanwhile; the
        # lock is re-entrant because a signal handler may run this while its own thread holds it.
        # A dup's shutdown acts on the connection itself (also under TLS, which it leaves to the
        # reader to notice), waking whatever waits on it.
        with self._lock:
            for fd in self._open:
                with (
                    contextlib.suppress(OSError),
                    socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup,
                ):
                    dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------ internals
    def _send(
        self,
        method: str,
        path: str,
        what: str,
        query: Mapping[str, str] | None,
        body: object,
        content_type: str,
        timeout: float,
    ) -> _Call:
        creds = self.credentials
        params = dict(query or {})
        if method in WRITES:
            params.setdefault("fieldManager", FIELD_MANAGER)
        url = creds.base_path + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"User-Agent": self.user_agent, "Accept": JSON, "Connection": "close"}
        try:
            auth = creds.authorization()
        except Exception as exc:  # an exec plugin or token file failing: the text names it
            self.on_request(method, NO_ANSWER)
            raise ApiError(what, NO_ANSWER, "NoCredentials", str(exc)) from None
        if auth:
            headers["Authorization"] = auth
        if payload is not None:
            headers["Content-Type"] = content_type
        call = _Call(http.client.HTTPConnection(creds.host, creds.port, timeout=timeout))
        try:
            call.conn.sock = self._connect(timeout)
            call.fd = call.conn.sock.fileno()
            call.conn.request(method, url, body=payload, headers=headers)
            call.resp = call.conn.getresponse()
        except Stopped:
            self._close(call)
            raise
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            self._close(call)
            self.on_request(method, NO_ANSWER)
            raise self._failed(what, exc) from None
        resp = call.answer
        self.requests += 1
        self.on_request(method, resp.status)
        if resp.status == 401 and creds.tokens is not None:
            creds.tokens.invalidate()  # a rotated or expired token: read or fetch it again
        return call

    def _connect(self, timeout: float) -> socket.socket:
        """A connected (and TLS-wrapped) socket; the connect waits on the wake pipe too.

        Under TLS the socket is wrapped before it connects and the handshake is done here. Wrapped
        once connected, a connection the server reset meanwhile (an API server closing its listener
        with connections in its backlog) makes `ssl.SSLSocket._create` raise without closing the
        SSLSocket it made: no one could close it, and it was collected unclosed later."""
        creds = self.credentials
        last: Exception = OSError(f"cannot resolve {creds.host}")
        for family, kind, proto, _name, addr in socket.getaddrinfo(
            creds.host, creds.port, type=socket.SOCK_STREAM
        ):
            sock = socket.socket(family, kind, proto)
            fd = sock.fileno()  # the same descriptor once TLS wraps it: abort() shuts it down by fd
            try:
                self._track(fd)
                if creds.ssl_context is not None:
                    sock = creds.ssl_context.wrap_socket(
                        sock,
                        server_hostname=creds.server_hostname or creds.host,
                        do_handshake_on_connect=False,
                    )
                sock.setblocking(False)
                err = sock.connect_ex(addr)
                if err == errno.EINPROGRESS:
                    # poll, not select: a descriptor over 1023 (a busy process) is no error here.
                    waiting = select.poll()
                    waiting.register(self._wake_r, select.POLLIN)
                    waiting.register(fd, select.POLLOUT)
                    ready = waiting.poll(1000 * min(timeout, self.connect_timeout))
                    if self.stopped:
                        raise Stopped("the API client is stopped")
                    if not any(ready_fd == fd for ready_fd, _ in ready):
                        raise TimeoutError(f"connect to {creds.host}:{creds.port} timed out")
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, f"connect to {creds.host}:{creds.port}: {os.strerror(err)}")
                sock.setblocking(True)
                sock.settimeout(timeout)
                _keepalive(sock)
                # As Go's net package and http.client do: a request's last small write never waits
                # for the server's delayed ACK.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if isinstance(sock, ssl.SSLSocket):
                    sock.do_handshake()
                return sock
            except BaseException as exc:  # whatever it is, this socket is closed and forgotten
                self._untrack(fd)
                sock.close()
                if isinstance(exc, Stopped) or not isinstance(exc, OSError):  # (ssl.SSLError is one)
                    raise
                if self.stopped:
                    raise Stopped("the API client is stopped") from None
                last = exc
        raise last

    def _track(self, fd: int) -> None:
        with self._lock:
            if self.stopped:  # abort() has run: it would not see this one
                raise Stopped("the API client is stopped")
            self._open.add(fd)

    def _untrack(self, fd: int) -> None:
        with self._lock:
            self._open.discard(fd)

    def _close(self, call: _Call) -> None:
        """Forget the descriptor first, then close: abort() never touches a number reused since."""
        if call.fd >= 0:
            self._untrack(call.fd)
        if call.resp is not None:
            call.resp.close()
        call.conn.close()

    def _read(self, resp: http.client.HTTPResponse, limit: int, what: str) -> bytes:
        try:
            data = resp.read(limit + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(what, exc) from None
        if len(data) > limit:
            raise ApiError(what, resp.status, "TooLarge", f"an answer over {limit} bytes")
        return data

    def _failed(self, what: str, exc: BaseException) -> Exception:
        if self.stopped:
            return Stopped(f"{what}: stopped")
        text = str(exc) or type(exc).__name__
        return ApiError(what, NO_ANSWER, type(exc).__name__, text)

    @staticmethod
    def _decode(data: bytes, what: str) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise ApiError(what, NO_ANSWER, "BadJSON", "the answer is not JSON") from None

    @staticmethod
    def _error(resp: http.client.HTTPResponse, data: bytes, what: str) -> ApiError:
        """The API server's Status, or what it sent instead (the server's own words, shortened)."""
        status: Any = None
        if (resp.getheader("Content-Type") or "").split(";")[0].strip() == JSON:
            with contextlib.suppress(ValueError):
                status = json.loads(data)
        if isinstance(status, dict) and status.get("kind") == "Status":
            return ApiError(
                what,
                resp.status,
                str(status.get("reason") or resp.reason),
                str(status.get("message") or "")[:1000],
            )
        text = data.decode("utf-8", errors="replace").strip()[:200]
        return ApiError(what, resp.status, resp.reason, text, plain=True)


class _Call:
    """One call's connection, its descriptor (kept: the socket may be closed under us) and answer."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.fd = -1
        self.resp: http.client.HTTPResponse | None = None

    @property
    def answer(self) -> http.client.HTTPResponse:
        assert self.resp is not None, "read only after _send returned"
        return self.resp


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 30 s, every 10 s, 3 times: a vanished peer shows in ~60 s."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
