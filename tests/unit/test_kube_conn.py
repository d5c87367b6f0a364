"""The API client's connections and its bounds, against the fake API server (tests/kubeapi/).

Kept-alive connections (reused, a bounded pool, a stale one retried once only for a GET, abort
still ending everything), the limiter shared by a process's clients, a 429's `Retry-After`
honoured, and client-go's watch timeout and backoff.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

import pytest

from supervisor.kube import client as client_module
from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.kube.errors import ApiError, Stopped
from supervisor.kube.limiter import TokenBucket
from supervisor.kube.watch import MIN_WATCH_S, ObjectWatch, ReflectorBackoff, watch_seconds
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

NODE = "gpu-node-1"
PATH = f"/api/v1/nodes/{NODE}"


def kube(api: RunningApiServer, **kw: Any) -> KubeClient:
    return KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test", **kw)


@pytest.fixture
def node_api(api: RunningApiServer) -> RunningApiServer:
    api.state.add_node(NODE)
    return api


def _served(api: RunningApiServer) -> int:
    """Connections the fake API server holds open now (busy or idle)."""
    return len(api.live)


# --- kept-alive connections ---------------------------------------------------------------------


def test_calls_reuse_one_kept_alive_connection(node_api: RunningApiServer) -> None:
    """Ten calls in a row (answers and refusals alike) go over one connection, as Go's transport
    reuses one: one TLS handshake, not ten. The fake keeps it open as kube-apiserver does."""
    client = kube(node_api)
    try:
        for _ in range(5):
            client.get(PATH, what="get")
        for _ in range(5):
            with pytest.raises(ApiError, match="404"):
                client.get("/api/v1/nodes/absent", what="get")
        assert (client.connections, client.requests) == (1, 10)
        assert _served(node_api) == 1
    finally:
        client.close()
    assert wait_until(lambda: _served(node_api) == 0)


def test_concurrent_calls_use_a_bounded_pool(node_api: RunningApiServer) -> None:
    """Calls from several threads at once each get a connection of their own; afterwards at
    most MAX_IDLE are kept, the others are closed."""
    client = kube(node_api, qps=-1)
    node_api.state.freeze()
    threads = [threading.Thread(target=client.get, args=(PATH,), kwargs={"what": "get"}) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: len(node_api.state.calls("GET")) == 6)
        node_api.state.thaw()
        for t in threads:
            t.join(10)
        assert client.connections == 6
        assert len(client._idle) == client_module.MAX_IDLE
        assert wait_until(lambda: _served(node_api) == client_module.MAX_IDLE)
    finally:
        node_api.state.thaw()
        client.close()


def test_a_connection_the_server_closed_while_idle_is_not_used(node_api: RunningApiServer) -> None:
    """The server closes an idle kept connection (its IdleTimeout, 90 s on kube-apiserver): the
    next call sees it closed before sending and opens a new one; nothing is sent twice."""
    node_api.state.idle_timeout_s = 0.3
    client = kube(node_api)
    try:
        client.get(PATH, what="get")
        assert wait_until(lambda: _served(node_api) == 0)  # the fake's idle close
        before = len(node_api.state.calls("GET"))
        client.get(PATH, what="get")
        assert (client.connections, client.retries) == (2, 0)
        assert len(node_api.state.calls("GET")) == before + 1
    finally:
        client.close()


def test_a_connection_idle_past_the_idle_timeout_is_closed_by_the_client(node_api: RunningApiServer) -> None:
    """One idle for IDLE_S (Go's default transport's 90 s) is closed, not used: a new one is opened."""
    now = [0.0]
    client = kube(node_api, clock=lambda: now[0])
    try:
        client.get(PATH, what="get")
        now[0] += client_module.IDLE_S - 1
        client.get(PATH, what="get")
        assert client.connections == 1
        now[0] += client_module.IDLE_S
        client.get(PATH, what="get")
        assert client.connections == 2
    finally:
        client.close()


def _close_under_the_client(api: RunningApiServer, client: KubeClient) -> None:
    """The race a kept connection loses: the server closes it just as a request goes out. Here
    the server's end is cut after the client has found it quiet (the server closed it unanswered)."""
    real = client_module._quiet

    def quiet_then_closed(call: Any) -> bool:
        ok = real(call)
        api.drop_connections()
        time.sleep(0.05)  # the FIN/RST reaches the client's socket
        client_module._quiet = real  # only once
        return ok

    client_module._quiet = quiet_then_closed


def test_a_get_whose_kept_connection_was_closed_unanswered_is_sent_once_more(
    node_api: RunningApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET on a kept connection that the server closed before any byte of an answer is sent
    again, once, on a new connection (Go's transport retries a replayable request that way:
    net/http transport.go shouldRetryRequest); it is counted in `retries`."""
    monkeypatch.setattr(client_module, "_quiet", client_module._quiet)
    client = kube(node_api)
    try:
        client.get(PATH, what="get")
        _close_under_the_client(node_api, client)
        assert client.get(PATH, what="get")["metadata"]["name"] == NODE
        assert (client.retries, client.connections) == (1, 2)
    finally:
        client.close()


def test_a_write_whose_kept_connection_was_closed_is_not_sent_again(
    node_api: RunningApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PATCH in the same race is a failed call (no answer), never sent twice: only the caller,
    with its backoff, may try it again."""
    monkeypatch.setattr(client_module, "_quiet", client_module._quiet)
    client = kube(node_api)
    try:
        client.get(PATH, what="get")
        _close_under_the_client(node_api, client)
        patches = len(node_api.state.calls("PATCH"))
        with pytest.raises(ApiError) as err:
            client.request(
                "PATCH",
                PATH,
                what="patch",
                body={"metadata": {"labels": {"a": "b"}}},
                content_type=client_module.MERGE_PATCH,
            )
        assert err.value.status == 0
        assert client.retries == 0
        assert len(node_api.state.calls("PATCH")) <= patches + 1
    finally:
        client.close()


def test_abort_shuts_idle_connections_and_ends_a_call_in_flight(node_api: RunningApiServer) -> None:
    """abort() still ends every call at once with kept connections: the one in flight raises
    Stopped, the idle ones are shut down (the server sees them close), later calls send nothing."""
    client = kube(node_api, qps=-1, timeout=60.0)
    try:
        for _ in range(2):
            threading.Thread(target=client.get, args=(PATH,), kwargs={"what": "get"}).start()
        assert wait_until(lambda: client.requests == 2 and len(client._idle) >= 1)
        node_api.state.freeze()
        threading.Timer(0.3, client.abort).start()
        started = time.monotonic()
        with pytest.raises(Stopped):
            client.get(PATH, what="get")
        assert time.monotonic() - started < 3.0
        node_api.state.thaw()
        assert wait_until(lambda: _served(node_api) == 0)
        with pytest.raises(Stopped):
            client.get(PATH, what="get")
    finally:
        node_api.state.thaw()
        client.close()


def test_a_watch_has_a_connection_of_its_own(node_api: RunningApiServer) -> None:
    """A watch never takes a kept connection nor leaves its own in the pool: its list and the
    calls beside it go on the kept one, the stream on one of its own, closed when it ends."""
    client = kube(node_api)
    seen: list[Any] = []
    watch = ObjectWatch(client, path="/api/v1/nodes", name=NODE, what="Node", on_object=seen.append)
    try:
        client.get(PATH, what="get")
        watch.start()
        assert wait_until(lambda: watch.state == "watching")
        client.get(PATH, what="get")
        assert client.connections == 2  # the kept one (GET, list, GET) and the stream's
        assert len(client._idle) == 1
        assert _served(node_api) == 2
    finally:
        watch.stop()
        client.close()
    assert wait_until(lambda: _served(node_api) == 0)


# --- the limiter and 429 ------------------------------------------------------------------------


def test_clients_sharing_a_limiter_share_its_rate(node_api: RunningApiServer) -> None:
    """Two clients given the process's one bucket spend its burst together: one limit per
    process, not per client (gpuvisor run's clients, gpuvisor labels' two)."""
    bucket = TokenBucket(0.5, 3)
    first, second = kube(node_api, limiter=bucket), kube(node_api, limiter=bucket)
    try:
        for client in (first, second, first):
            client.get(PATH, what="get")
        started = time.monotonic()
        threading.Timer(0.5, second.abort).start()
        with pytest.raises(Stopped):  # the 4th request of the process waits ~2 s for a token
            second.get(PATH, what="get")
        assert time.monotonic() - started < 2.0
        assert bucket.try_accept() is False
    finally:
        first.close()
        second.close()


def test_a_429_with_retry_after_holds_every_request_of_the_process(node_api: RunningApiServer) -> None:
    """The API server's 429 (priority and fairness: `Retry-After` and plain text) is an ApiError
    of kind `throttled` carrying the wait, and no request of any client of the limiter leaves
    before the wait is over (client-go waits out Retry-After before its retry: rest/with_retry.go
    checkWait, rest/request.go retryAfterSeconds)."""
    bucket = TokenBucket(-1, 1)
    client, other = kube(node_api, limiter=bucket), kube(node_api, limiter=bucket)
    try:
        node_api.state.throttle(1, "1")
        with pytest.raises(ApiError) as err:
            client.get(PATH, what="get")
        assert (err.value.status, err.value.kind, err.value.retry_after) == (429, "throttled", 1.0)
        assert "retry after 1s" in str(err.value)
        thrown = node_api.state.calls("GET")[-1].at
        other.get(PATH, what="get")
        assert node_api.state.calls("GET")[-1].at - thrown >= 0.95
    finally:
        client.close()
        other.close()


@pytest.mark.parametrize(("header", "held"), [("2", 2.0), ("0", None), ("soon", None), ("3600", 60.0)])
def test_retry_after_is_read_as_client_go_reads_it(
    node_api: RunningApiServer, header: str, held: float | None
) -> None:
    """Whole seconds only (strconv.Atoi); none, 0 or text hold nothing; a huge one is capped at
    MAX_RETRY_AFTER_S, so that a broken header cannot stall the node."""
    bucket = TokenBucket(-1, 1, wait=lambda seconds: False)
    client = kube(node_api, limiter=bucket)
    try:
        node_api.state.throttle(1, header)
        with pytest.raises(ApiError) as err:
            client.get(PATH, what="get")
        assert err.value.retry_after == {"2": 2.0, "0": 0.0, "soon": None, "3600": 60.0}[header]
        assert bucket.held == (1 if held else 0)
        if held:
            assert bucket.reserve() == pytest.approx(held, abs=0.5)
    finally:
        client.close()


def test_a_throttled_watch_waits_at_least_retry_after(node_api: RunningApiServer) -> None:
    """A watch's list refused with 429 is retried after max(backoff, Retry-After), not sooner."""
    client = kube(node_api)
    seen: list[Any] = []
    watch = ObjectWatch(client, path="/api/v1/nodes", name=NODE, what="Node", on_object=seen.append)
    node_api.state.throttle(1, "2")
    try:
        watch.start()
        assert wait_until(lambda: seen, 10)
        lists = [r.at for r in node_api.state.calls("GET", "/api/v1/nodes") if "watch" not in r.query]
        assert len(lists) == 2 and lists[1] - lists[0] >= 1.95
        assert watch.failing.count == 1
    finally:
        watch.stop()
        client.close()


# --- the watch's timeout and backoff ------------------------------------------------------------


def test_watch_timeouts_are_client_gos() -> None:
    """timeoutSeconds is random in [5 min, 10 min] (client-go reflector.go: defaultMinWatchTimeout
    5 min, twice it at most), so a fleet's watches do not end together."""
    drawn = {watch_seconds() for _ in range(500)}
    assert MIN_WATCH_S == 300
    assert min(drawn) >= 300 and max(drawn) <= 600 and len(drawn) > 100


def test_the_watch_backoff_is_client_gos_reflector_backoff() -> None:
    """wait.Backoff{800ms, Cap 30s, Factor 2, Jitter 1.0} (client-go reflector.go defaultBackoff*):
    the n-th delay in [d, 2d) with d = min(0.8 * 2**(n-1), 30); a success starts it again."""
    retry = ReflectorBackoff(rng=random.Random(7))
    steps = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    delays = [retry.next() for _ in steps]
    for delay, step in zip(delays, steps, strict=True):
        assert step <= delay < 2 * step
    assert len({round(d / s, 3) for d, s in zip(delays, steps, strict=True)}) > 4  # jittered
    retry.reset()
    assert 0.8 <= retry.next() < 1.6


def test_a_failing_watch_backs_off_as_client_go(node_api: RunningApiServer) -> None:
    """An API server refusing the list three times (429 without a usable Retry-After): the retries
    come at the reflector's jittered intervals (the first in [0.8, 1.6) s, the next in [1.6, 3.2) s), not in a loop."""
    client = kube(node_api)
    watch = ObjectWatch(client, path="/api/v1/nodes", name=NODE, what="Node", on_object=lambda o: None)
    node_api.state.throttle(3, "x")  # a 429 without a usable Retry-After: the backoff alone
    try:
        watch.start()
        assert wait_until(lambda: watch.state == "watching", 15)
        lists = [r.at for r in node_api.state.calls("GET", "/api/v1/nodes") if "watch" not in r.query]
        gaps = [b - a for a, b in itertools.pairwise(lists)]
        assert len(gaps) == 3
        assert 0.75 <= gaps[0] < 1.7 and 1.55 <= gaps[1] < 3.3 and 3.15 <= gaps[2] < 6.5
    finally:
        watch.stop()
        client.close()


# --- the settings of `gpuvisor run` -------------------------------------------------------------


def test_gpuvisor_run_takes_kube_api_qps_and_burst_as_nvidias_dra_driver() -> None:
    """`--kube-api-qps` (a Go float) and `--kube-api-burst` (a Go int), env KUBE_API_QPS and
    KUBE_API_BURST, defaults 5 and 10: NVIDIA's DRA driver v0.4.1 pkg/flags/kubeclient.go, and
    the labeller's rows; a flag wins over the env var; NaN and a negative burst are refused."""
    from supervisor.config import ConfigError, load_config
    from tests.unit.test_config import parse_flags

    default = load_config(parse_flags(), {})
    assert (default.kube_api_qps, default.kube_api_burst) == (5.0, 10)
    env = load_config(parse_flags(), {"KUBE_API_QPS": "2.5", "KUBE_API_BURST": "0x10"})
    assert (env.kube_api_qps, env.kube_api_burst) == (2.5, 16)
    flags = load_config(parse_flags("--kube-api-qps=-1", "--kube-api-burst", "3"), {"KUBE_API_QPS": "9"})
    assert (flags.kube_api_qps, flags.kube_api_burst) == (-1.0, 3)
    with pytest.raises(ConfigError, match="KUBE_API_QPS"):
        load_config(parse_flags(), {"KUBE_API_QPS": "NaN"})
    with pytest.raises(ConfigError, match="kube-api-burst"):
        load_config(parse_flags("--kube-api-burst=-2"), {})


def test_the_supervisors_clients_share_one_limiter_made_from_its_settings() -> None:
    """gpuvisor run's ProcessLimiter: one bucket at the settings' rate for every client of the
    process (the cluster side's and the DRA side's own), made at its first use."""
    from supervisor.cluster.side import ProcessLimiter

    limiter = ProcessLimiter(2.5, 4)
    bucket = limiter.get()
    assert limiter.get() is bucket
    assert (bucket.qps, bucket.burst) == (2.5, 4)
