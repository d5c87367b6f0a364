"""A small Kubernetes API client over the standard library: kept-alive connections, bounded calls.

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

Connections are kept alive and reused (HTTP/1.1, as Go's transport under client-go keeps them):
a new TLS connection costs a claim GET more than twice a kept one's time (docs/performance.md).
Each client keeps at most `MAX_IDLE` idle connections, each for `IDLE_S` at most (the idle
timeout of Go's default transport, which client-go keeps; kube-apiserver closes one idle that long
too), newest first; one that the server closed meanwhile (readable while idle: its FIN or a TLS
close) is closed, not used. A GET whose reused connection the server closed before a byte of the
answer came (the server's idle close racing the request) is sent once more, on a new connection,
as Go's transport retries a replayable request (net/http transport.go, `shouldRetryRequest`);
nothing else is ever sent twice, and each such retry is counted (`retries`). A watch has a
connection of its own, closed when the watch ends. TCP keepalive finds a watch whose peer vanished
without a FIN within about a minute.

A 429 or 5xx answer with `Retry-After` (client-go's `checkWait`, rest/with_retry.go) holds the
client's limiter for that long (at most `MAX_RETRY_AFTER_S`): no request of the process leaves
before, and the call's ApiError carries the wait (`retry_after`) for its caller's backoff.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import os
import platform
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from typing import Any

from supervisor.kube.credentials import Credentials
from supervisor.kube.errors import NO_ANSWER, ApiError, Stopped
from supervisor.kube.limiter import DEFAULT_BURST, DEFAULT_QPS, TokenBucket

log = logging.getLogger("gpuvisor.kube")

JSON = "application/json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "gpuvisor"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_LINE_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0
WRITES = ("POST", "PUT", "PATCH")
MAX_IDLE = 4  # idle connections kept per client (client-go keeps 25 per host; gpuvisor calls a few at a time)
IDLE_S = 90.0  # Go's http.DefaultTransport IdleConnTimeout, kept by client-go (apimachinery util/net)
MAX_RETRY_AFTER_S = 60.0  # the longest Retry-After honoured: a broken header cannot stall the node
# A reused connection that fails this way before a byte of the answer came was closed by the server.
_CLOSED = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)


def user_agent(component: str, version: str) -> str:
    """client-go's form, `<name>/<version> (<os>/<arch>) <component>`: the server takes the part
    before the first "/" as the field manager when a request names none."""
    return f"gpuvisor/{version} (linux/{platform.machine() or 'unknown'}) {component}"


class KubeClient:
    """`component` and `version` (gpuvisor's: `supervisor.config.version`, which this layer may
    not import, and not `importlib.metadata`'s ~1 MB of imports) make the user agent. `limiter`
    is the process's one (several clients of one process share it); without one, the client makes
    its own from `qps` and `burst`. Safe to call from several threads at once."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        component: str,
        version: str,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        limiter: TokenBucket | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        on_request: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.credentials = credentials
        self.user_agent = user_agent(component, version)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.on_request = on_request or (lambda verb, code: None)
        self.stop_event = threading.Event()
        self.limiter = limiter if limiter is not None else TokenBucket(qps, burst)
        self.clock = clock
        self._open: set[int] = set()  # descriptors of every connection, busy or idle: abort() shuts them
        self._idle: list[_Call] = []  # kept-alive connections, the newest last
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()  # readable once aborted: wakes waiting connects
        os.set_blocking(self._wake_w, False)
        self.requests = 0
        self.connections = 0  # connections opened (TLS handshakes, under TLS)
        self.retries = 0  # GETs sent again because the server had closed their kept connection

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
        self._acquire()
        wait = timeout or self.timeout
        try:
            call = self._send(method, path, what, query, body, content_type, wait, self._take())
        except _ServerClosed as closed:
            # The server closed the kept connection before answering: it did not act on the call.
            # A GET is sent once more, on a new connection (Go's transport: a replayable request).
            if method != "GET":
                raise self._no_answer(method, what, closed.error) from None
            self.retries += 1
            log.debug("%s: the kept connection was closed by the server (%s): once more", what, closed.error)
            self._drop_idle()  # its siblings were likely closed with it (a server restart)
            try:
                call = self._send(method, path, what, query, body, content_type, wait, None)
            except _ServerClosed as again:  # a new connection: cannot happen, said plainly if it does
                raise self._no_answer(method, what, again.error) from None
        resp, retry_after = call.answer, call.retry_after
        keep = False
        try:
            data = self._read(resp, MAX_BODY_BYTES, what)
            keep = not resp.will_close and resp.isclosed()
        finally:
            self._done(call, keep)
        if 200 <= resp.status < 300:
            return self._decode(data, what) if data else None
        raise self._error(resp, data, what, retry_after)

    def get(self, path: str, *, what: str, query: Mapping[str, str] | None = None) -> Any:
        return self.request("GET", path, what=what, query=query)

    def stream(self, path: str, *, what: str, query: Mapping[str, str], timeout: float) -> WatchStream:
        """A watch, on a connection of its own: each JSON line of the answer as it arrives, until
        the server ends the stream. `timeout` bounds the wait for one line.

        The request is sent, and the answer's status read, before this returns (a refusal raises
        here, not at the first line): once it returns, the server is watching. The lines are read
        as it is iterated; closing it, read or not, closes the connection. Raises ApiError (a bad
        answer, an event over MAX_LINE_BYTES, a broken stream) or Stopped."""
        self._acquire()
        try:
            call = self._send("GET", path, what, query, None, JSON, timeout, None)
        except _ServerClosed as closed:  # on a new connection: no retry, a failed watch
            raise self._no_answer("GET", what, closed.error) from None
        resp = call.answer
        if resp.status != 200:
            try:
                raise self._error(resp, self._read(resp, MAX_BODY_BYTES, what), what, call.retry_after)
            finally:
                self._done(call, keep=False)
        return WatchStream(self._lines(call, what), lambda: self._done(call, keep=False))

    def _lines(self, call: _Call, what: str) -> Generator[dict[str, Any], None, None]:
        """A watch's answer, a JSON object a line; the connection is closed when it ends."""
        resp = call.answer
        try:
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
            self._done(call, keep=False)

    def abort(self) -> None:
        """Stop: every call in flight ends now, every later call raises Stopped. Safe from any
        thread and from a signal handler."""
        self.stop_event.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        # Under the lock, so that no descriptor is closed (and its number reused) meanwhile; the
        # lock is re-entrant because a signal handler may run this while its own thread holds it.
        # A dup's shutdown acts on the connection itself (also under TLS, which it leaves to the
        # reader to notice), waking whatever waits on it; idle connections are shut down too.
        with self._lock:
            for fd in self._open:
                with (
                    contextlib.suppress(OSError),
                    socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup,
                ):
                    dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self._drop_idle()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        # A client dropped without close(): its idle connections are closed, not left to the GC.
        with contextlib.suppress(Exception):
            self._drop_idle()

    # ------------------------------------------------------------------ internals
    def _acquire(self) -> None:
        if self.stopped:
            raise Stopped("the API client is stopped")
        self.limiter.acquire(self.stop_event)

    def _take(self) -> _Call | None:
        """The newest idle connection still open at the server's end, or None (a new one then).
        Idle ones past IDLE_S, or that the server closed meanwhile, are closed here."""
        now = self.clock()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                call = self._idle.pop()
            if now - call.idle_since < IDLE_S and _quiet(call):
                return call
            self._done(call, keep=False)

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for call in idle:
            self._done(call, keep=False)

    def _send(
        self,
        method: str,
        path: str,
        what: str,
        query: Mapping[str, str] | None,
        body: object,
        content_type: str,
        timeout: float,
        kept: _Call | None,
    ) -> _Call:
        """The request sent and its answer's head read, on `kept` or a new connection. Raises
        _ServerClosed when `kept` turns out closed by the server before any answer."""
        creds = self.credentials
        params = dict(query or {})
        if method in WRITES:
            params.setdefault("fieldManager", FIELD_MANAGER)
        url = creds.base_path + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"User-Agent": self.user_agent, "Accept": JSON}
        try:
            auth = creds.authorization()
        except Exception as exc:  # an exec plugin or token file failing: the text names it
            if kept is not None:
                self._done(kept, keep=True)
            self.on_request(method, NO_ANSWER)
            raise ApiError(what, NO_ANSWER, "NoCredentials", str(exc)) from None
        if auth:
            headers["Authorization"] = auth
        if payload is not None:
            headers["Content-Type"] = content_type
        call = kept or _Call(http.client.HTTPConnection(creds.host, creds.port, timeout=timeout))
        try:
            if kept is None:
                call.conn.sock = self._connect(timeout)
                call.fd = call.conn.sock.fileno()
                self.connections += 1
            else:
                call.conn.sock.settimeout(timeout)
            call.conn.request(method, url, body=payload, headers=headers)
            call.resp = call.conn.getresponse()
        except Stopped:
            self._done(call, keep=False)
            raise
        except _CLOSED as exc:
            self._done(call, keep=False)
            if kept is not None and not self.stopped:
                raise _ServerClosed(exc) from None
            raise self._no_answer(method, what, exc) from None
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            self._done(call, keep=False)
            raise self._no_answer(method, what, exc) from None
        resp = call.answer
        self.requests += 1
        self.on_request(method, resp.status)
        if resp.status == 401 and creds.tokens is not None:
            creds.tokens.invalidate()  # a rotated or expired token: read or fetch it again
        if resp.status == 429 or resp.status >= 500:
            call.retry_after = self._retry_after(resp)
        return call

    def _retry_after(self, resp: http.client.HTTPResponse) -> float | None:
        """client-go's `retryAfterSeconds`: a whole number of seconds (strconv.Atoi), else none.
        Honoured by holding the limiter: no request of this process leaves before it passes."""
        text = (resp.getheader("Retry-After") or "").strip()
        try:
            seconds = int(text, 10)
        except ValueError:
            return None
        wait = float(min(max(seconds, 0), MAX_RETRY_AFTER_S))
        self.limiter.hold(wait)
        return wait

    def _no_answer(self, method: str, what: str, exc: BaseException) -> Exception:
        self.on_request(method, NO_ANSWER)
        return self._failed(what, exc)

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

    def _done(self, call: _Call, keep: bool) -> None:
        """A call's end: its connection kept for the next (an answer read to its end, the server
        keeping it, room in the pool, the client not stopped), else closed. Closed: the descriptor
        is forgotten first, so that abort() never touches a number reused since."""
        if keep and call.conn.sock is not None:
            with self._lock:
                if not self.stopped and len(self._idle) < MAX_IDLE:
                    call.resp = None
                    call.retry_after = None
                    call.idle_since = self.clock()
                    self._idle.append(call)
                    return
        if call.fd >= 0:
            self._untrack(call.fd)
            call.fd = -1
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
    def _error(
        resp: http.client.HTTPResponse, data: bytes, what: str, retry_after: float | None = None
    ) -> ApiError:
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
                retry_after=retry_after,
            )
        text = data.decode("utf-8", errors="replace").strip()[:200]
        return ApiError(what, resp.status, resp.reason, text, plain=True, retry_after=retry_after)


class WatchStream:
    """A watch's answer (KubeClient.stream): iterating it gives its events; close() ends the
    connection, also before the first is read (a generator not yet started would keep it)."""

    def __init__(self, lines: Generator[dict[str, Any], None, None], close: Callable[[], None]) -> None:
        self._lines = lines
        self._close = close

    def __iter__(self) -> WatchStream:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._lines)

    def close(self) -> None:
        self._lines.close()
        self._close()


class _Call:
    """One connection, its descriptor (kept: the socket may be closed under us), the answer of the
    call it carries and, idle, since when."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.fd = -1
        self.resp: http.client.HTTPResponse | None = None
        self.retry_after: float | None = None
        self.idle_since = 0.0

    @property
    def answer(self) -> http.client.HTTPResponse:
        assert self.resp is not None, "read only after _send returned"
        return self.resp


class _ServerClosed(Exception):
    """A kept connection the server had closed: nothing of an answer came."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _quiet(call: _Call) -> bool:
    """An idle connection with nothing to read: the server has not closed it (a FIN, a TLS
    close_notify or a reset makes it readable). Nothing was sent on it yet."""
    sock = call.conn.sock
    if sock is None or call.fd < 0:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    waiting = select.poll()
    waiting.register(call.fd, select.POLLIN | select.POLLPRI)
    return not waiting.poll(0)


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 30 s, every 10 s, 3 times: a vanished peer shows in ~60 s."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
