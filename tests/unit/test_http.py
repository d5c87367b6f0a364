"""supervisor/observe/http.py: /metrics, /healthz and /readyz on a real socket, and the probe helpers."""

from __future__ import annotations

import http.client
import logging
import socket
from collections.abc import Iterator

import pytest

from supervisor.observe.http import (
    AddressError,
    ProbeServer,
    loop_liveness,
    parse_address,
)
from supervisor.observe.metrics import Metrics
from supervisor.observe.status import Readiness, ReadinessCell, worker_readiness
from supervisor.workers.lifecycle import WorkerHandle, WState


def get(host: str, port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


class Probes:
    def __init__(self) -> None:
        self.alive: tuple[bool, str] = (True, "ok")
        self.ready: tuple[bool, str] = (False, "not ready: nvidia.com/gpu: worker STARTING")
        self.fail_render = False
        self.metrics = Metrics()

    def render(self) -> bytes:
        if self.fail_render:
            raise RuntimeError("boom")
        return self.metrics.render()


@pytest.fixture
def served() -> Iterator[tuple[ProbeServer, Probes]]:
    probes = Probes()
    server = ProbeServer(
        address="127.0.0.1:0",
        render=probes.render,
        liveness=lambda: probes.alive,
        readiness=lambda: probes.ready,
    )
    server.start()
    try:
        yield server, probes
    finally:
        server.stop()


def test_metrics_page_serves_the_exposition(served: tuple[ProbeServer, Probes]) -> None:
    """GET /metrics on an ephemeral port answers 200 with the Prometheus text format."""
    server, _ = served
    assert server.port > 0
    status, ctype, body = get("127.0.0.1", server.port, "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain") and "version=" in ctype
    assert "gpuvisor_up 1.0" in body


def test_probes_answer_200_or_503_with_the_reason(served: tuple[ProbeServer, Probes]) -> None:
    """/healthz and /readyz give 200 when the callable says so, else 503 with its text."""
    server, probes = served
    assert get("127.0.0.1", server.port, "/healthz")[::2] == (200, "ok\n")
    status, _, body = get("127.0.0.1", server.port, "/readyz")
    assert (status, body) == (503, "not ready: nvidia.com/gpu: worker STARTING\n")
    probes.ready = (True, "ready: 1 resource(s) registered and streaming")
    probes.alive = (False, "the supervisor's main loop has not ticked for 12.0s (limit 10s)")
    assert get("127.0.0.1", server.port, "/readyz")[0] == 200
    status, _, body = get("127.0.0.1", server.port, "/healthz")
    assert status == 503 and "not ticked" in body


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("GET", "/", 200), ("HEAD", "/metrics", 200), ("GET", "/metrics?x=1", 200)],
)
def test_other_paths_and_methods(
    served: tuple[ProbeServer, Probes], method: str, path: str, status: int
) -> None:
    """Unknown paths are 404, HEAD works, a query string does not change the page."""
    server, _ = served
    assert get("127.0.0.1", server.port, path, method)[0] == status


def test_a_failing_page_is_a_500_and_the_server_lives_on(served: tuple[ProbeServer, Probes]) -> None:
    """An exception while rendering gives a 500; the next request is served normally."""
    server, probes = served
    probes.fail_render = True
    assert get("127.0.0.1", server.port, "/metrics")[0] == 500
    probes.fail_render = False
    assert get("127.0.0.1", server.port, "/metrics")[0] == 200


def test_requests_are_not_logged(
    served: tuple[ProbeServer, Probes], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe or scrape writes no access-log line (nothing per poll), to logging or stderr."""
    server, _ = served
    caplog.set_level(logging.DEBUG)
    for path in ("/metrics", "/healthz", "/readyz", "/nope"):
        get("127.0.0.1", server.port, path)
    assert caplog.records == []
    assert capsys.readouterr().err == ""


def test_stop_closes_the_port() -> None:
    """After stop() nothing listens on the port any more."""
    server = ProbeServer(
        address="127.0.0.1:0",
        render=lambda: b"",
        liveness=lambda: (True, ""),
        readiness=lambda: (True, ""),
    )
    server.start()
    port = server.port
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


def test_all_interfaces_form_accepts_ipv4() -> None:
    """':0' listens on every interface, IPv4 included (dual-stack when IPv6 exists)."""
    server = ProbeServer(
        address=":0",
        render=lambda: b"x",
        liveness=lambda: (True, "ok"),
        readiness=lambda: (True, "ok"),
    )
    server.start()
    try:
        assert get("127.0.0.1", server.port, "/healthz")[0] == 200
    finally:
        server.stop()


def test_ipv6_loopback() -> None:
    """A bracketed IPv6 host binds that address."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    server = ProbeServer(
        address="[::1]:0",
        render=lambda: b"x",
        liveness=lambda: (True, "ok"),
        readiness=lambda: (True, "ok"),
    )
    server.start()
    try:
        assert server.url.startswith("http://[::1]:")
        assert get("::1", server.port, "/healthz")[0] == 200
    finally:
        server.stop()


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("address", "shown"),
    [("0.0.0.0:0", "127.0.0.1"), (":0", "127.0.0.1"), ("[::]:0", "[::1]"), ("127.0.0.1:0", "127.0.0.1")],
)
def test_url_of_a_wildcard_bind_is_one_to_open(address: str, shown: str) -> None:
    """A server on all interfaces (0.0.0.0, an empty host, [::]) shows the loopback URL that reaches
    it from the node, not the wildcard; a specific host is shown as it is. The URL answers."""
    if "::" in address and not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    server = ProbeServer(
        address=address, render=lambda: b"", liveness=lambda: (True, "ok"), readiness=lambda: (True, "")
    )
    server.start()
    try:
        assert server.url == f"http://{shown}:{server.port}"
        assert get(shown.strip("[]"), server.port, "/healthz")[0] == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:9475", ("0.0.0.0", 9475)),
        (":9475", ("", 9475)),
        ("[::]:9475", ("::", 9475)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:8080", ("localhost", 8080)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    """host:port, :port and [ipv6]:port parse to (host, port); empty host means all interfaces."""
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("9475", "host:port"),
        ("host:", "host:port"),
        ("host:99999", "host:port"),
        ("::1:9475", "brackets"),
        ("[::1:9475", "brackets"),
    ],
)
def test_bad_addresses_are_refused_clearly(text: str, words: str) -> None:
    """A malformed address raises AddressError naming the address and the expected form."""
    with pytest.raises(AddressError, match=words) as info:
        parse_address(text)
    assert repr(text) in str(info.value)


def test_port_in_use_is_a_clear_error() -> None:
    """Binding a taken port raises AddressError naming the address and the setting."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = ProbeServer(
            address=f"127.0.0.1:{port}",
            render=lambda: b"",
            liveness=lambda: (True, ""),
            readiness=lambda: (True, ""),
        )
        with pytest.raises(AddressError, match=r"cannot listen on metrics address .*--metrics-address"):
            server.start()


def test_unknown_host_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name that does not resolve raises AddressError (resolver stubbed: no DNS in tests)."""

    def no_such_host(*args: object, **kwargs: object) -> list[object]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    server = ProbeServer(
        address="no-such-host.invalid:9475",
        render=lambda: b"",
        liveness=lambda: (True, ""),
        readiness=lambda: (True, ""),
    )
    with pytest.raises(
        AddressError, match=r"cannot resolve .*no-such-host\.invalid.*Name or service not known"
    ):
        server.start()


def test_loop_liveness() -> None:
    """Alive while the last tick is within the limit; otherwise the answer says how stale."""
    now = [100.0]
    probe = loop_liveness(lambda: 95.0, limit=10.0, clock=lambda: now[0])
    assert probe() == (True, "ok")
    now[0] = 106.5
    ok, text = probe()
    assert not ok and "11.5s" in text


def _handle(resource: str, state: WState, registered: bool = True, streams: float = 1.0) -> WorkerHandle:
    h = WorkerHandle(resource, "/plan.json")
    h.state = state
    h.registered = registered
    h.stats = {"gauge:streams": streams}
    return h


@pytest.mark.parametrize(
    ("handles", "ready", "words"),
    [
        ([_handle("a", WState.RUNNING), _handle("b", WState.RUNNING)], True, "2 resource(s)"),
        ([_handle("a", WState.RUNNING), _handle("b", WState.BACKOFF)], False, "b: worker BACKOFF"),
        ([_handle("a", WState.RUNNING, registered=False)], False, "a: not registered"),
        ([_handle("a", WState.RUNNING, streams=0)], False, "no ListAndWatch stream"),
        ([_handle("a", WState.RUNNING)], False, "b: no worker"),
    ],
)
def test_worker_readiness(handles: list[WorkerHandle], ready: bool, words: str) -> None:
    """Ready only when every planned resource's worker runs, is registered and streams."""
    planned = ["a"] if ready and len(handles) == 1 else ["a", "b"]
    ok, text = worker_readiness(planned, {h.resource: h for h in handles})
    assert ok is ready
    assert words in text


def test_no_plans_is_not_ready_and_the_cell_starts_not_ready() -> None:
    """Nothing planned is not ready; a fresh ReadinessCell answers not ready until set."""
    assert worker_readiness([], {})[0] is False
    cell = ReadinessCell()
    assert cell()[0] is False
    cell.set((True, "ready"))
    assert cell() == (True, "ready")


def test_publishing_readiness_tells_the_listeners_each_turn_and_logs_a_flip_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each published answer is the cell's and goes to every listener; the log says "ready" or
    "not ready" only when the answer flips, not on every turn."""
    told: list[tuple[bool, str]] = []
    cell = ReadinessCell(lambda ready, detail: told.append((ready, detail)))
    with caplog.at_level(logging.INFO, logger="gpuvisor.supervisor"):
        for ready in (False, True, True, False):
            cell.publish(Readiness(ready, f"ready={ready}"))
    assert cell() == (False, "ready=False") and [r for r, _ in told] == [False, True, True, False]
    assert [r.getMessage() for r in caplog.records] == ["ready", "not ready"]


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"501"),
        (b"nonsense\r\n\r\n", b"400"),
        (b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", b"431"),
        (b"GET /healthz HTTP/1.0\n\n", b"200"),
    ],
)
def test_what_is_not_a_get_or_head_gets_a_clear_status(
    served: tuple[ProbeServer, Probes], request_bytes: bytes, status: bytes
) -> None:
    """Another method is 501, a malformed request line 400, an oversized head 431; bare-LF line
    ends are read too. Every answer says how long it is and closes the connection."""
    server, _ = served
    answer = raw(server.port, request_bytes)
    head = answer.split(b"\r\n\r\n", 1)[0]
    assert head.split(b" ")[1] == status
    assert b"\r\nConnection: close" in head and b"\r\nContent-Length: " in head


def test_head_sends_the_length_without_the_body(served: tuple[ProbeServer, Probes]) -> None:
    """HEAD answers GET's headers (its Content-Length included) and no body."""
    server, _ = served
    answer = raw(server.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Length: 3" in head and body == b""


def test_stop_returns_at_once_without_polling() -> None:
    """The serving thread sleeps until a client or stop(): stop() wakes it through a pipe, so an
    idle endpoint costs no wake-ups and stopping it takes no poll interval."""
    server = ProbeServer(
        address="127.0.0.1:0", render=lambda: b"", liveness=lambda: (True, ""), readiness=lambda: (True, "")
    )
    server.start()
    thread = server._thread
    assert thread is not None and thread.is_alive()
    server.stop()
    assert not thread.is_alive() and not server.serving
