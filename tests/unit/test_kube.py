"""The API-server layer (supervisor/kube) against the fake API server, and the fake's own contract.

The fake (`tests/kubeapi/`) keeps the real server's rules where gpuvisor depends on them; the
last tests here check that it does (a fake that accepted anything would prove nothing).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import itertools
import json
import logging
import platform
import re
import select
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.backoff import Backoff
from supervisor.kube import client as client_module
from supervisor.kube.client import MERGE_PATCH, STRATEGIC_MERGE, KubeClient
from supervisor.kube.credentials import Credentials, FileToken, load_credentials
from supervisor.kube.errors import NO_ANSWER, ApiError, CredentialsError, Stopped
from supervisor.kube.failing import Failing
from supervisor.kube.limiter import TokenBucket
from supervisor.kube.recorder import Correlator, EventRecorder
from supervisor.kube.watch import ObjectWatch
from tests.helpers import wait_until
from tests.kubeapi import TOKEN, RunningApiServer

NODE = "gpu-node-1"


def kube(api: RunningApiServer, **kw: Any) -> KubeClient:
    return KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test", **kw)


@pytest.fixture
def node_api(api: RunningApiServer) -> RunningApiServer:
    api.state.add_node(NODE, {"kubernetes.io/hostname": NODE})
    return api


# --- the rate limiter --------------------------------------------------------------------------


def test_token_bucket_follows_client_gos_rules() -> None:
    """Burst requests go at once, then one per 1/qps; qps 0 is client-go's 5/10; negative is unlimited."""
    now = [0.0]
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        now[0] += seconds
        return False

    bucket = TokenBucket(2.0, 3, clock=lambda: now[0], wait=wait)
    assert [bucket.acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.acquire() == pytest.approx(0.5)
    assert bucket.acquire() == pytest.approx(0.5)
    defaults = TokenBucket(0, 0)
    assert (defaults.qps, defaults.burst) == (5.0, 10)
    unlimited = TokenBucket(-1, 1, wait=wait)
    assert [unlimited.acquire() for _ in range(50)] == [0.0] * 50


def test_token_bucket_try_accept_takes_nothing_when_empty() -> None:
    """try_accept (the spam filter's) takes a token when one is there and never waits or goes into debt."""
    now = [0.0]
    bucket = TokenBucket(1.0, 2, clock=lambda: now[0])
    assert [bucket.try_accept() for _ in range(4)] == [True, True, False, False]
    now[0] += 1.0
    assert [bucket.try_accept() for _ in range(2)] == [True, False]


def test_a_wait_for_a_token_ends_when_the_client_stops() -> None:
    """A stop during the wait for a token raises Stopped at once, not after the wait."""
    stop = threading.Event()
    bucket = TokenBucket(0.01, 1, stop=stop)
    bucket.acquire()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        bucket.acquire()  # the next token is 100 s away
    assert time.monotonic() - started < 2.0


# --- credentials -------------------------------------------------------------------------------


def test_in_cluster_credentials_read_the_service_account(tmp_path: Path, api: RunningApiServer) -> None:
    """In a pod: KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA; calls work."""
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa" / "token").write_text(TOKEN + "\n")
    (tmp_path / "sa" / "ca.crt").write_bytes(base64.b64decode(api.ca_data))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    creds = load_credentials("", env, service_account_dir=str(tmp_path / "sa"))
    assert creds.source == "the pod's service account"
    api.state.add_node(NODE)
    answer = KubeClient(creds, component="test", version="test").get(f"/api/v1/nodes/{NODE}", what="get node")
    assert answer["metadata"]["name"] == NODE


def test_a_rotated_token_file_is_read_again(tmp_path: Path) -> None:
    """A projected token is re-read once a minute, and at once after a 401 (invalidate)."""
    path = tmp_path / "token"
    path.write_text("one")
    now = [0.0]
    tokens = FileToken(str(path), clock=lambda: now[0])
    assert tokens.token() == "one"
    path.write_text("two")
    assert tokens.token() == "one"
    now[0] = 61.0
    assert tokens.token() == "two"
    path.write_text("three")
    tokens.invalidate()
    assert tokens.token() == "three"


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ("[1, 2]", "not a kubeconfig"),
        ("{clusters: []}", "no current-context"),
        ("{current-context: x, contexts: []}", "context 'x' is not defined"),
        ("{current-context: x, contexts: [{name: x, context: {cluster: c}}], clusters: [{name: c, cluster: {}}]}", "has no server"),
        ("{current-context: x, contexts: [{name: x, context: {cluster: c}}], clusters: [{name: c, cluster: {server: 'ftp://h'}}]}", "not an http(s) URL"),
        ("{current-context: x, contexts: [{name: x, context: {cluster: c, user: u}}], clusters: [{name: c, cluster: {server: 'https://h'}}], users: [{name: u, user: {auth-provider: {name: gcp}}}]}", "auth-provider"),
        ("{current-context: x, contexts: [{name: x, context: {cluster: c}}], clusters: [{name: c, cluster: {server: 'https://h', certificate-authority-data: '!!'}}]}", "not base64"),
    ],
)  # fmt: skip
def test_a_bad_kubeconfig_says_what_is_wrong(tmp_path: Path, doc: str, error: str) -> None:
    """Each kind of broken kubeconfig is one CredentialsError naming the file and the problem."""
    path = tmp_path / "kubeconfig"
    path.write_text(doc)
    with pytest.raises(CredentialsError, match=f"kubeconfig {path}: .*{re.escape(error)}"):
        load_credentials(str(path), {})


def test_basic_auth_and_relative_token_files(tmp_path: Path) -> None:
    """username/password become a Basic header; a tokenFile path is relative to the kubeconfig."""
    (tmp_path / "tok").write_text("secret")
    base = "{current-context: x, contexts: [{name: x, context: {cluster: c, user: u}}], clusters: [{name: c, cluster: {server: 'http://h:8080/prefix/'}}], "
    path = tmp_path / "kc"
    path.write_text(base + "users: [{name: u, user: {username: a, password: b}}]}")
    creds = load_credentials(str(path), {})
    assert creds.authorization() == "Basic " + base64.b64encode(b"a:b").decode()
    assert (creds.scheme, creds.host, creds.port, creds.base_path) == ("http", "h", 8080, "/prefix")
    path.write_text(base + "users: [{name: u, user: {tokenFile: tok}}]}")
    assert load_credentials(str(path), {}).authorization() == "Bearer secret"


# --- calls -------------------------------------------------------------------------------------


def test_a_refusal_is_an_api_error_with_the_servers_words(node_api: RunningApiServer) -> None:
    """A JSON Status becomes ApiError with code, reason and message; a plain-text 404 is `no_such_api`."""
    client = kube(node_api)
    with pytest.raises(ApiError) as err:
        client.get("/api/v1/nodes/other", what="get Node other")
    assert (err.value.status, err.value.reason, err.value.not_found, err.value.no_such_api) == (
        404,
        "NotFound",
        True,
        False,
    )
    assert str(err.value) == 'get Node other: 404 NotFound: nodes "other" not found'
    with pytest.raises(ApiError) as err:
        client.get("/apis/example.com/v1/widgets", what="list widgets")
    assert err.value.no_such_api and err.value.kind == "no-such-api"
    assert str(err.value) == "list widgets: 404 Not Found: 404 page not found"


def test_no_answer_is_status_zero(tmp_path: Path) -> None:
    """Nothing listening: an ApiError with status 0, kind `unreachable`, saying the server did not answer."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    creds = Credentials("http", "127.0.0.1", port, "", None, None, None, "", "test")
    with pytest.raises(ApiError) as err:
        KubeClient(creds, component="test", version="test").get("/api", what="get /api")
    assert err.value.status == NO_ANSWER and err.value.kind == "unreachable"
    assert "no answer from the API server" in str(err.value)


def test_answers_are_bounded(node_api: RunningApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer over the client's limit is refused, not read into memory."""
    monkeypatch.setattr(client_module, "MAX_BODY_BYTES", 200)
    with pytest.raises(ApiError, match="an answer over 200 bytes"):
        kube(node_api).get(f"/api/v1/nodes/{NODE}", what="get node")


def test_every_answer_is_counted_by_verb_and_code(node_api: RunningApiServer) -> None:
    """on_request hears each call's verb and HTTP code."""
    seen: list[tuple[str, int]] = []
    client = kube(node_api, on_request=lambda verb, code: seen.append((verb, code)))
    client.get(f"/api/v1/nodes/{NODE}", what="get")
    with pytest.raises(ApiError):
        client.get("/api/v1/nodes/x", what="get")
    assert seen == [("GET", 200), ("GET", 404)]


def test_a_401_reads_the_token_again(node_api: RunningApiServer, tmp_path: Path) -> None:
    """A rotated token: the call with the old one gets 401 and the next call reads the file again."""
    token = tmp_path / "token"
    token.write_text("stale")
    creds = load_credentials(str(node_api.kubeconfig), {})
    creds = Credentials(
        creds.scheme, creds.host, creds.port, "", creds.ssl_context, None, FileToken(str(token)), "", "t"
    )
    client = KubeClient(creds, component="test", version="test")
    with pytest.raises(ApiError, match="401"):
        client.get(f"/api/v1/nodes/{NODE}", what="get")
    token.write_text(TOKEN)
    assert client.get(f"/api/v1/nodes/{NODE}", what="get")["metadata"]["name"] == NODE


def test_abort_ends_a_call_to_a_frozen_server_at_once(node_api: RunningApiServer) -> None:
    """A server that accepts and never answers: abort() from another thread ends the call now
    (Stopped), and every later call raises Stopped before sending anything."""
    client = kube(node_api, timeout=60.0)
    node_api.state.freeze()
    threading.Timer(0.3, client.abort).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        client.get(f"/api/v1/nodes/{NODE}", what="get")
    assert time.monotonic() - started < 3.0
    before = len(node_api.state.requests)
    with pytest.raises(Stopped):
        client.get(f"/api/v1/nodes/{NODE}", what="get")
    assert len(node_api.state.requests) == before


@pytest.fixture
def unaccepting() -> Iterator[int]:
    """A port whose listener never accepts and whose backlog is full: a connect there hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(8):  # more than the backlog: later SYNs are dropped and connects wait
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(listener.getsockname())
        fillers.append(s)
    yield listener.getsockname()[1]
    for s in fillers:
        s.close()
    listener.close()


def test_abort_ends_a_connect_that_waits(unaccepting: int) -> None:
    """A connect that waits (a server that does not take connections) ends at abort, not at its timeout."""
    creds = Credentials("http", "127.0.0.1", unaccepting, "", None, None, None, "", "test")
    client = KubeClient(creds, component="test", version="test", timeout=30.0, connect_timeout=30.0)
    threading.Timer(0.3, client.abort).start()
    started = time.monotonic()
    with pytest.raises((Stopped, ApiError)):
        client.get("/api", what="get")
    assert time.monotonic() - started < 5.0


class _ResetsBacklog:
    """A listener that never accepts: once the client's socket is being wrapped for TLS and its
    connection waits in the backlog, the listener is closed and the kernel resets that connection
    (an API server going away with connections not taken yet)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.wrapping = threading.Event()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._close_when_one_waits, daemon=True)
        self.thread.start()

    def _close_when_one_waits(self) -> None:
        self.wrapping.wait(30.0)
        select.select([self.listener], [], [], 30.0)
        self.listener.close()
        self.closed.set()

    def stop(self) -> None:
        """However the test went: the thread ends now and the listener is closed."""
        self.wrapping.set()
        if not self.closed.is_set():
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=5):
                pass  # a connection in the backlog wakes the thread's select
        self.thread.join(30.0)


class _WrapAfterTheReset:
    """The client's SSLContext, except that a socket wrapped once connected is wrapped only after
    the server has reset its connection: the moment at which `ssl.SSLSocket._create` raises
    without closing the SSLSocket it made."""

    def __init__(self, context: ssl.SSLContext, server: _ResetsBacklog) -> None:
        self.context = context
        self.server = server

    def wrap_socket(self, sock: socket.socket, **kw: Any) -> ssl.SSLSocket:
        self.server.wrapping.set()
        try:
            sock.getpeername()
        except OSError:
            pass  # not connected yet: wrapped before the connect
        else:
            assert self.server.closed.wait(30.0)

            def reset() -> bool:
                try:
                    sock.getpeername()
                except OSError:
                    return True
                return False

            assert wait_until(reset, 10)
        return self.context.wrap_socket(sock, **kw)


def test_a_server_resetting_before_the_tls_handshake_leaves_no_socket_open(
    node_api: RunningApiServer,
) -> None:
    """A connection reset by the server before the TLS handshake is a failed call (no answer), and
    its socket is closed by the client, not left for the garbage collector to find unclosed."""
    server = _ResetsBacklog()
    client = None
    try:
        tls = load_credentials(str(node_api.kubeconfig), {})
        assert tls.ssl_context is not None
        context: Any = _WrapAfterTheReset(tls.ssl_context, server)
        creds = Credentials("https", "127.0.0.1", server.port, "", context, "127.0.0.1", None, "", "test")
        client = KubeClient(creds, component="test", version="test", timeout=10.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ApiError) as err:
                client.get("/api", what="get /api")
            status = err.value.status
            del err  # its context's frames would keep a leaked socket alive past the collection
            gc.collect()
        assert status == NO_ANSWER
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        server.stop()
        if client is not None:
            client.close()


def test_writes_carry_gpuvisors_field_manager_and_user_agent(node_api: RunningApiServer) -> None:
    """A PATCH sends fieldManager=gpuvisor and the user agent gpuvisor/<version> (linux/<arch>)
    <component>."""
    kube(node_api).request(
        "PATCH",
        f"/api/v1/nodes/{NODE}",
        what="label node",
        body={"metadata": {"labels": {"a": "b"}}},
        content_type=MERGE_PATCH,
    )
    patch = node_api.state.calls("PATCH")[0]
    assert patch.query["fieldManager"] == "gpuvisor" and patch.manager == "gpuvisor"
    assert patch.user_agent == f"gpuvisor/test (linux/{platform.machine()}) test"
    assert node_api.state.nodes[NODE]["metadata"]["labels"]["a"] == "b"


# --- the watch -----------------------------------------------------------------------------------


class Seen:
    """What a watch delivered: each object's labels (None for gone), and a way to wait for one."""

    def __init__(self) -> None:
        self.objects: list[dict[str, str] | None] = []
        self.counts: list[str] = []

    def __call__(self, obj: dict[str, Any] | None) -> None:
        self.objects.append(None if obj is None else dict(obj["metadata"].get("labels") or {}))

    def label(self, key: str = "x") -> str | None:
        last = self.objects[-1] if self.objects else None
        return None if last is None else last.get(key)


def watch(api: RunningApiServer, seen: Seen, **kw: Any) -> ObjectWatch:
    w = ObjectWatch(
        kube(api),
        path="/api/v1/nodes",
        name=NODE,
        what=f"Node {NODE}",
        on_object=seen,
        on_count=seen.counts.append,
        watch_seconds=lambda: 30,
        **{"reconnect": lambda: 0.0, **kw},
    )
    w.start()
    return w


def test_watch_lists_then_follows_changes(node_api: RunningApiServer) -> None:
    """The list gives the object, then each label change arrives; the watch asks from the list's
    resourceVersion for the one node, with bookmarks."""
    seen = Seen()
    w = watch(node_api, seen)
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.state.set_node_label(NODE, "x", "1")
        assert wait_until(lambda: seen.label() == "1")
        node_api.state.set_node_label(NODE, "x", "2")
        assert wait_until(lambda: seen.label() == "2")
        watches = [r for r in node_api.state.calls("GET", "/api/v1/nodes") if r.query.get("watch")]
        assert watches[0].query["fieldSelector"] == f"metadata.name={NODE}"
        assert watches[0].query["allowWatchBookmarks"] == "true"
        assert watches[0].query["resourceVersion"] == "1"
    finally:
        w.stop()


def test_bookmarks_move_the_kept_version(node_api: RunningApiServer) -> None:
    """Another node changes (not ours, filtered out): bookmarks still move our resourceVersion."""
    node_api.state.add_node("other")
    seen = Seen()
    w = watch(node_api, seen)
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.state.set_node_label("other", "x", "1")
        version = node_api.state.version
        assert wait_until(lambda: int(w.resource_version or 0) >= version, timeout=10)
        assert seen.objects == [{"kubernetes.io/hostname": NODE}]  # only the list's
    finally:
        w.stop()


def test_a_dropped_watch_resumes_from_the_kept_version(node_api: RunningApiServer) -> None:
    """A cut connection: the watch starts again from where it was, without a new list, and misses nothing."""
    seen = Seen()
    w = watch(node_api, seen)
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.drop_connections()
        node_api.state.set_node_label(NODE, "x", "after-drop")
        assert wait_until(lambda: seen.label() == "after-drop")
        assert seen.counts.count("list") == 1 and w.relists == 0
    finally:
        w.stop()


def test_a_working_watch_that_breaks_waits_its_spread_before_the_first_retry(
    node_api: RunningApiServer,
) -> None:
    """An API server restart must not bring every node back in the same second (issue 42): the
    first failure after a working watch waits the reconnect spread (random, up to
    RECONNECT_SPREAD_S) instead of the backoff, each later retry until it works again the backoff
    and the spread; a 410 Gone ending a working watch waits it too before the new list. A watch
    that never worked keeps the plain backoff."""
    from common.backoff import Backoff

    failures: list[float] = []
    waits: list[float] = []

    def reconnect() -> float:
        waits.append(time.monotonic())
        return 0.8

    w = ObjectWatch(
        kube(node_api), path="/api/v1/nodes", name=NODE, what=f"Node {NODE}", on_object=Seen(),
        on_count=lambda event: failures.append(time.monotonic()) if event == "failure" else None,
        retry=Backoff(0.05, 0.1), watch_seconds=lambda: 30, reconnect=reconnect,
    )  # fmt: skip
    w.start()
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.stop()
        assert wait_until(lambda: len(failures) >= 4, 15)
        # the break is counted, then the spread, then the first retry; each later one after
        # backoff + spread
        assert failures[1] - waits[0] >= 0.75
        assert all(b - a >= 0.75 for a, b in itertools.pairwise(failures[1:]))
        assert len(waits) >= len(failures)
        node_api.start()
        started = time.monotonic()
        assert wait_until(lambda: w.state == "watching", 15)
        spread = len(waits)
        # "watching" means the server answered the watch, so it holds the watch's epoch: one
        # expiry ends it. (ObjectWatch used to say "watching" before the request was sent, and
        # this test expired again and again, once ending the new watch too under load.)
        node_api.state.expire_watches()
        ok = wait_until(lambda: w.relists == 1, 30)
        assert ok, (
            w.status(),
            len(waits),
            spread,
            [(r.method, r.query, round(r.at - started, 2)) for r in node_api.state.requests][-6:],
            round(time.monotonic() - started, 2),
        )
        assert len(waits) == spread + 1
    finally:
        w.stop()
    never = ObjectWatch(
        kube(node_api), path="/api/v1/nodes", name="absent", what="Node absent", on_object=Seen(),
        retry=Backoff(0.05, 0.1), reconnect=reconnect,
    )  # fmt: skip
    node_api.stop()
    never.start()
    try:
        assert wait_until(lambda: never.failing.count >= 3, 15)
        assert len(waits) == spread + 1
    finally:
        never.stop()


def test_410_gone_lists_again(node_api: RunningApiServer) -> None:
    """An ERROR 410 in the stream (the server compacted past the watch): a new list, and the
    change made meanwhile is seen."""
    seen = Seen()
    w = watch(node_api, seen)
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.state.set_node_label(NODE, "x", "1")
        node_api.state.expire_watches()
        assert wait_until(lambda: w.relists == 1)
        assert wait_until(lambda: seen.label() == "1")
        assert seen.counts.count("gone") == 1 and seen.counts.count("list") == 2
    finally:
        w.stop()


def test_an_outage_is_logged_once_counted_and_recovered(
    node_api: RunningApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes away: failures are counted, one warning is logged for the same error,
    retries back off; when it returns the watch resumes and says it works again."""
    from common.backoff import Backoff

    caplog.set_level(logging.INFO, "gpuvisor.kube")
    seen = Seen()
    w = watch(node_api, seen, retry=Backoff(0.05, 0.1))
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.stop()
        assert wait_until(lambda: w.failing.count >= 3, timeout=15)
        assert w.status()["state"] == "failing" and "no answer" in str(w.status()["error"])
        node_api.start()
        node_api.state.set_node_label(NODE, "x", "back")
        assert wait_until(lambda: seen.label() == "back", timeout=15)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len({r.getMessage() for r in warnings}) == len(warnings) <= 2  # connect refused, maybe the cut
        assert any("works again" in r.getMessage() for r in caplog.records)
        assert w.status()["error"] is None
    finally:
        w.stop()


def test_a_deleted_node_is_none(node_api: RunningApiServer) -> None:
    """The Node is deleted: the watch delivers None."""
    seen = Seen()
    w = watch(node_api, seen)
    try:
        assert wait_until(lambda: w.state == "watching")
        node_api.state.delete_node(NODE)
        assert wait_until(lambda: seen.objects[-1:] == [None])
    finally:
        w.stop()


def test_stop_ends_the_watch_at_once(node_api: RunningApiServer) -> None:
    """stop() during a long watch returns at once and the thread ends."""
    seen = Seen()
    w = watch(node_api, seen)
    assert wait_until(lambda: w.state == "watching")
    started = time.monotonic()
    w.stop(join=5.0)
    assert time.monotonic() - started < 2.0 and w.state == "stopped"


# --- Events --------------------------------------------------------------------------------------


def test_repeats_within_ten_minutes_count_up() -> None:
    """The same type, reason and message again within 10 minutes patches the same Event's count."""
    now = [1000.0]
    c = Correlator(NODE, clock=lambda: now[0])
    first = c.correlate("Warning", "XidCriticalError", "XID 79 on GPU-1")
    now[0] += 599
    again = c.correlate("Warning", "XidCriticalError", "XID 79 on GPU-1")
    assert (first.action, again.action, again.name, again.count) == ("create", "patch", first.name, 2)
    now[0] += 601
    later = c.correlate("Warning", "XidCriticalError", "XID 79 on GPU-1")
    assert later.action == "create" and later.name != first.name
    assert first.name.startswith(f"{NODE}.")


def test_many_distinct_messages_are_combined() -> None:
    """The 10th distinct message of one reason within 10 minutes becomes '(combined from similar events): ...'."""
    c = Correlator(NODE, clock=lambda: 0.0)
    messages = [c.correlate("Warning", "XidCriticalError", f"XID 79 on GPU-{i}").message for i in range(12)]
    assert messages[:9] == [f"XID 79 on GPU-{i}" for i in range(9)]
    assert all(m.startswith("(combined from similar events): ") for m in messages[9:])


def test_the_spam_filter_allows_25_then_one_per_five_minutes() -> None:
    """client-go's spam filter: a burst of 25 Events about the object, then one every 300 s."""
    now = [0.0]
    c = Correlator(NODE, clock=lambda: now[0])
    actions = [c.correlate("Warning", "R", f"m{i % 3}").action for i in range(40)]
    assert actions.count("throttled") == 15
    now[0] += 300
    assert c.correlate("Warning", "R", "m0").action != "throttled"
    assert c.correlate("Warning", "R", "m0").action == "throttled"


def test_events_are_written_as_the_kubelet_writes_node_events(node_api: RunningApiServer) -> None:
    """The Event is a valid core/v1 Event about the Node in `default`; a repeat raises its count;
    an expired Event (its PATCH finds nothing) is written anew."""
    recorder = EventRecorder(kube(node_api), node=NODE)
    assert recorder.emit("Warning", "XidCriticalError", "XID 79 on GPU-1") == "created"
    assert recorder.emit("Warning", "XidCriticalError", "XID 79 on GPU-1") == "counted"
    (event,) = node_api.state.node_events(NODE)
    assert event["count"] == 2 and event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"kind": "Node", "name": NODE, "uid": NODE, "apiVersion": "v1"}
    assert event["source"] == {"component": "gpuvisor", "host": NODE}
    node_api.state.events.clear()
    assert recorder.emit("Warning", "XidCriticalError", "XID 79 on GPU-1") == "created"
    assert node_api.state.node_events(NODE)[0]["count"] == 1
    assert node_api.state.errors == []


# --- the fake's own contract ---------------------------------------------------------------------


def test_fake_merges_node_conditions_by_type_and_keeps_the_others(node_api: RunningApiServer) -> None:
    """A strategic-merge patch of status.conditions adds or updates one condition by type and leaves the kubelet's."""
    client = kube(node_api)
    path = f"/api/v1/nodes/{NODE}/status"
    cond = {
        "type": "GPUUnhealthy",
        "status": "True",
        "reason": "GpuLost",
        "message": "m",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    client.request(
        "PATCH", path, what="patch", body={"status": {"conditions": [cond]}}, content_type=STRATEGIC_MERGE
    )
    client.request(
        "PATCH",
        path,
        what="patch",
        body={"status": {"conditions": [{**cond, "status": "False"}]}},
        content_type=STRATEGIC_MERGE,
    )
    types = [c["type"] for c in node_api.state.nodes[NODE]["status"]["conditions"]]
    assert types == ["MemoryPressure", "Ready", "GPUUnhealthy"]
    assert node_api.state.condition(NODE, "GPUUnhealthy")["status"] == "False"  # type: ignore[index]
    with pytest.raises(
        ApiError, match="422"
    ):  # a JSON merge patch replaces the list: a bad status is refused
        client.request(
            "PATCH",
            path,
            what="patch",
            body={"status": {"conditions": [{**cond, "status": "Maybe"}]}},
            content_type=MERGE_PATCH,
        )
    node_api.state.errors.clear()
    with pytest.raises(ApiError, match="409"):
        client.request(
            "PATCH",
            path,
            what="patch",
            body={"metadata": {"resourceVersion": "1"}, "status": {}},
            content_type=STRATEGIC_MERGE,
        )


def test_fake_refuses_what_rbac_does_not_allow(node_api: RunningApiServer) -> None:
    """With `allow` set, a missing rule is a 403 in the real server's words."""
    node_api.state.allow = {("get", "nodes"), ("list", "nodes"), ("watch", "nodes")}
    client = kube(node_api)
    client.get(f"/api/v1/nodes/{NODE}", what="get")
    with pytest.raises(ApiError) as err:
        client.request(
            "PATCH",
            f"/api/v1/nodes/{NODE}/status",
            what="patch",
            body={"status": {}},
            content_type=STRATEGIC_MERGE,
        )
    assert err.value.forbidden
    assert err.value.message == (
        f'nodes "{NODE}" is forbidden: User "system:serviceaccount:gpuvisor:gpuvisor" cannot patch '
        'resource "nodes/status" in API group "" at the cluster scope'
    )


def test_fake_watch_from_a_compacted_version_is_410(node_api: RunningApiServer) -> None:
    """A watch from a version at or before the last compaction is answered 410 Gone (raised by
    stream() itself, which reads the answer's status before it returns)."""
    node_api.state.set_node_label(NODE, "x", "1")
    node_api.state.compact()
    with pytest.raises(ApiError) as err:
        kube(node_api).stream(
            "/api/v1/nodes", what="watch", query={"watch": "true", "resourceVersion": "1"}, timeout=5
        )
    assert err.value.gone


def test_a_watch_is_open_at_the_server_once_stream_returns(node_api: RunningApiServer) -> None:
    """stream() sends the request and reads the status before it returns, not at the first line:
    the watch is open at the server with no line read (ObjectWatch says "watching" only then), and
    closing the stream unread closes it there."""
    node_api.state.bookmark_s = 0.2  # the server finds a stream's client gone when it next writes
    client = kube(node_api)
    try:
        stream = client.stream(
            "/api/v1/nodes",
            what="watch",
            query={"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "30"},
            timeout=30,
        )
        assert sum(node_api.state.tally.snapshot()[1].values()) == 1
        stream.close()
        assert wait_until(lambda: not node_api.state.tally.snapshot()[1], 10)
    finally:
        client.close()


def test_fake_refuses_events_that_break_the_rules(node_api: RunningApiServer) -> None:
    """An Event about a cluster-scoped object outside `default`, or of an unknown type, is 422."""
    client = kube(node_api)
    good = {
        "metadata": {"name": "n.1"},
        "involvedObject": {"kind": "Node", "name": NODE},
        "type": "Warning",
        "reason": "R",
        "message": "m",
    }
    client.request("POST", "/api/v1/namespaces/default/events", what="create", body=good)
    for namespace, event in (
        ("kube-system", good),
        ("default", {**good, "type": "Error", "metadata": {"name": "n.2"}}),
    ):
        with pytest.raises(ApiError, match="422"):
            client.request("POST", f"/api/v1/namespaces/{namespace}/events", what="create", body=event)
    node_api.state.errors.clear()


def test_fake_streams_chunked_json_lines(node_api: RunningApiServer) -> None:
    """A watch without a version starts with the current objects as ADDED events, as JSON lines."""
    stream = kube(node_api).stream(
        "/api/v1/nodes", what="watch", query={"watch": "true", "timeoutSeconds": "1"}, timeout=5
    )
    first = next(stream)
    assert first["type"] == "ADDED" and first["object"]["metadata"]["name"] == NODE
    assert json.dumps(first)
    stream.close()


# --- failure bookkeeping -------------------------------------------------------------------------


def test_failing_counts_every_failure_and_says_each_distinct_one_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every failure is counted; only one whose text differs from the last is to be said; the
    time of the first of a run is kept; a success says how long the run lasted (None when none
    ran), clears the error and starts the backoff again."""
    now = [1000.0]
    failing = Failing(Backoff(1.0, 8.0), clock=lambda: now[0])
    assert failing.works() is None
    assert failing.failed("no answer") is True
    now[0] += 5
    assert failing.failed("no answer") is False
    assert failing.failed("403 Forbidden") is True
    assert [failing.pause(), failing.pause(), failing.pause()] == [1.0, 2.0, 4.0]
    assert failing.status() == {"failures": 3, "error": "403 Forbidden", "failing_since": 1000.0}
    now[0] += 10
    assert failing.works() == 15.0
    assert failing.status() == {"failures": 3, "error": None, "failing_since": None}
    assert failing.pause() == 1.0
    assert failing.failed("403 Forbidden") is True  # a new run says it again
