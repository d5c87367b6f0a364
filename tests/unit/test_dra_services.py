"""The DRA worker's gRPC side in-process, on real unix sockets, against the DRA kubelet stand-in:
serve then register, the plugin watcher's handshake, both DRAPlugin versions, the health stream,
and the sockets kept up (stale ones cleared, deleted ones made again, only our own removed)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.draapi import HEALTH_SERVICE, V1_SERVICE, V1BETA1_SERVICE, healthpb, v1
from common.draapi.rpc import (
    HealthClient,
    dra_v1_handler,
    dra_v1beta1_handler,
    health_handler,
    registration_handler,
)
from common.dracheckpoint import Checkpoint
from common.procutil import unix_socket_listening
from supervisor.config import config_from_data
from supervisor.node.draplan import dra_plan
from supervisor.sim.drakubelet import ClaimStore, DraKubeletStandin
from tests import nodes
from tests.helpers import short_tmpdir, wait_until
from worker.dra import services as services_module
from worker.dra.claims import DirectoryClaimSource
from worker.dra.prepare import Preparer
from worker.dra.services import DraPluginService, HealthService, RegistrationService
from worker.dra.sockets import Endpoint, SocketBusy, WatcherRegistration, clear_stale
from worker.healthboard import Health, HealthBoard
from worker.registrar import Registrar, RegState

DRIVER = "gpu.nvidia.com"
POOL = "node-a"


class Plugin:
    """A DRA worker's servers and registrar, in this process, in a short temp dir."""

    def __init__(self, base: str) -> None:
        config = config_from_data(
            {
                "version": "v1",
                "gpuvisor": {
                    "mode": "dra",
                    "kubeletPluginsDir": f"{base}/plugins",
                    "kubeletRegistryDir": f"{base}/registry",
                    "draClaimsDir": f"{base}/claims",
                },
            },
            flags={"node_name": POOL},
            source="test",
        )
        self.plan = dra_plan(nodes.pcie_l4(), config)
        assert self.plan.dra is not None
        self.store = ClaimStore(self.plan.dra.claims_dir)
        self.board = HealthBoard(self.plan)
        self.board.set_health(((d.id, Health(True)) for d in self.plan.devices), replace=True)
        checkpoint = Checkpoint(self.plan.dra.plugin_dir)
        preparer = Preparer(
            self.plan, DirectoryClaimSource(self.plan.dra.claims_dir), checkpoint, health=self.board.health_of
        )
        self.service = DraPluginService(preparer)
        self.health = HealthService(self.board)
        self.states: list[RegState] = []
        self.service_path = os.path.join(self.plan.dra.plugin_dir, "dra.sock")
        self.reg_path = os.path.join(self.plan.dra.registry_dir, f"{DRIVER}-reg.sock")
        self.registration = RegistrationService(
            DRIVER, self.service_path, lambda ok, err: self.registrar.notified(ok, err)
        )
        executor = futures.ThreadPoolExecutor(max_workers=8)
        sockets = WatcherRegistration(
            Endpoint(
                self.service_path,
                (
                    dra_v1_handler(self.service.v1),
                    dra_v1beta1_handler(self.service.v1beta1),
                    health_handler(self.health),
                ),
                executor,
            ),
            Endpoint(self.reg_path, (registration_handler(self.registration),), executor),
            check_interval=0.05,
        )
        self.registrar = Registrar(sockets, on_state=lambda state, detail: self.states.append(state))

    def stop(self) -> None:
        self.health.stop()
        self.registrar.stop()
        self.board.close()


def identity(path: str) -> tuple[int, int] | None:
    """Which file is at `path` (a re-made socket may get the same inode back, not the same ctime)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


@pytest.fixture
def base() -> Iterator[str]:
    with short_tmpdir("gvdra") as d:
        yield d


@pytest.fixture
def plugin(base: str) -> Iterator[Plugin]:
    p = Plugin(base)
    yield p
    p.stop()


@pytest.fixture
def kubelet(base: str) -> Iterator[DraKubeletStandin]:
    k = DraKubeletStandin(f"{base}/registry", scan_interval=0.02)
    k.start()
    yield k
    k.stop()


def test_the_service_socket_answers_before_the_registration_socket_exists(plugin: Plugin) -> None:
    """Serve, then register: whenever the registration socket is there, the service socket answers."""
    seen: list[bool] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if os.path.exists(plugin.reg_path):
                seen.append(unix_socket_listening(plugin.service_path))
                return

    thread = threading.Thread(target=watch)
    thread.start()
    plugin.registrar.start()
    assert wait_until(lambda: bool(seen), 10)
    stop.set()
    thread.join()
    assert seen == [True]


def test_the_kubelet_registers_it_with_v1_first(plugin: Plugin, kubelet: DraKubeletStandin) -> None:
    """GetInfo says DRAPlugin, the driver, the service socket and v1, v1beta1, health; the stand-in
    picks v1 and confirms; the worker's state follows the kubelet's answer."""
    info = plugin.registration.info
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, plugin.service_path)
    assert list(info.supported_versions) == [V1_SERVICE, V1BETA1_SERVICE, HEALTH_SERVICE]
    plugin.registrar.start()
    assert kubelet.wait_registered(DRIVER)
    found = kubelet.plugin(DRIVER)
    assert found is not None and found.service == V1_SERVICE and found.endpoint == plugin.service_path
    assert wait_until(lambda: plugin.registrar.state is RegState.REGISTERED, 5)
    assert plugin.states[:2] == [RegState.REGISTERING, RegState.REGISTERED]


def test_a_v1beta1_kubelet_prepares_through_v1beta1(base: str, plugin: Plugin) -> None:
    """A kubelet that speaks only v1beta1 chooses it and prepares and unprepares through it."""
    with DraKubeletStandin(f"{base}/registry", versions=(V1BETA1_SERVICE,), scan_interval=0.02) as kubelet:
        plugin.registrar.start()
        assert kubelet.wait_registered(DRIVER)
        plugin_seen = kubelet.plugin(DRIVER)
        assert plugin_seen is not None and plugin_seen.service == V1BETA1_SERVICE
        ref = plugin.store.allocate("default", "c1", POOL, ["gpu-1"])
        response = kubelet.prepare(DRIVER, [ref])
        assert type(response).__module__.endswith("dra_v1beta1_pb2")
        devices = response.claims[ref[2]].devices
        assert [d.device_name for d in devices] == ["gpu-1"] and devices[0].cdi_device_ids
        assert kubelet.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""


def test_a_kubelet_that_speaks_no_offered_version_refuses_and_the_worker_records_it(
    base: str, plugin: Plugin
) -> None:
    """The kubelet's refusal (NotifyRegistrationStatus false) reaches the worker with its words."""
    with DraKubeletStandin(f"{base}/registry", versions=("v9.DRAPlugin",), scan_interval=0.02) as kubelet:
        plugin.registrar.start()
        assert kubelet.wait_for(lambda: any(not n.registered for n in kubelet.notifications), 10)
        assert wait_until(lambda: plugin.registrar.state is RegState.REFUSED, 5)
        assert "none of services supported by the plugin" in kubelet.notifications[0].error
        assert not kubelet.registered(DRIVER)


def test_prepare_through_v1_answers_every_claim_and_carries_share_ids(
    plugin: Plugin, kubelet: DraKubeletStandin
) -> None:
    """v1: a claim with a share ID gets it back; a claim without a UID gets an error entry of its
    own and the RPC still succeeds for the others."""
    plugin.registrar.start()
    assert kubelet.wait_registered(DRIVER)
    shared = {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-2", "shareID": "s-1"}
    ref = plugin.store.allocate("default", "c1", POOL, [], extra_results=[shared])
    response = kubelet.prepare(DRIVER, [ref, ("default", "c2", "")])
    good = response.claims[ref[2]]
    assert good.error == "" and good.devices[0].share_id == "s-1"
    assert "uid are all required" in response.claims["default/c2"].error


def test_the_health_stream_sends_every_device_then_changes_then_resends(
    plugin: Plugin, kubelet: DraKubeletStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first message lists every device HEALTHY with the kubelet's timeout; a change arrives
    at once with its reason as the message; with nothing changing the list is sent again."""
    monkeypatch.setattr(services_module, "RESEND_S", 0.2)
    plugin.registrar.start()
    assert kubelet.wait_registered(DRIVER)
    assert kubelet.wait_for(lambda: len(kubelet.health_seen(DRIVER)) == 4, 10)
    seen = kubelet.health_seen(DRIVER)
    assert {s.health for s in seen.values()} == {"HEALTHY"} and {s.timeout_s for s in seen.values()} == {30}
    plugin.board.set_health([("gpu-3", Health(False, "XID 79 (GPU has fallen off the bus)"))])
    assert kubelet.wait_for(lambda: kubelet.device_health(DRIVER, POOL, "gpu-3") == "UNHEALTHY", 5)
    assert kubelet.health_seen(DRIVER)[(POOL, "gpu-3")].message.startswith("XID 79")
    found = kubelet.plugin(DRIVER)
    assert found is not None
    updates = found.health_updates
    assert kubelet.wait_for(lambda: found.health_updates >= updates + 2, 5)  # resent, unchanged


def test_health_streams_are_bounded(plugin: Plugin) -> None:
    """Beyond three streams at once, one more is refused with RESOURCE_EXHAUSTED at once."""
    plugin.registrar.start()
    assert wait_until(lambda: unix_socket_listening(plugin.service_path), 10)
    channels = [grpc.insecure_channel(f"unix://{plugin.service_path}") for _ in range(4)]
    try:
        streams: list[Any] = [
            HealthClient(ch).NodeWatchResources(healthpb.NodeWatchResourcesRequest()) for ch in channels[:3]
        ]
        for stream in streams:
            next(iter(stream))  # each admitted: its first list arrived
        extra: Any = HealthClient(channels[3]).NodeWatchResources(
            healthpb.NodeWatchResourcesRequest(), timeout=5
        )
        with pytest.raises(grpc.RpcError) as info:
            next(iter(extra))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for ch in channels:
            ch.close()


def test_a_deleted_registration_socket_is_made_again_and_registered_again(
    plugin: Plugin, kubelet: DraKubeletStandin
) -> None:
    """Someone deletes the registration socket: the kubelet drops the plugin, the worker makes it
    again, and the kubelet registers the plugin again."""
    plugin.registrar.start()
    assert kubelet.wait_registered(DRIVER)
    os.unlink(plugin.reg_path)
    assert kubelet.wait_for(lambda: sum(n.registered for n in kubelet.notifications) >= 2, 10)
    assert kubelet.wait_registered(DRIVER) and os.path.exists(plugin.reg_path)


def test_a_deleted_service_socket_brings_both_back(plugin: Plugin, kubelet: DraKubeletStandin) -> None:
    """The service socket gone: it is served again, then the registration socket made anew, so the
    kubelet validates the new endpoint; a prepare works afterwards."""
    plugin.registrar.start()
    assert kubelet.wait_registered(DRIVER)
    first = identity(plugin.reg_path)
    os.unlink(plugin.service_path)
    assert wait_until(
        lambda: os.path.exists(plugin.service_path) and identity(plugin.reg_path) not in (first, None), 10
    )
    assert kubelet.wait_for(lambda: sum(n.registered for n in kubelet.notifications) >= 2, 10)
    ref = plugin.store.allocate("default", "c1", POOL, ["gpu-0"])
    assert kubelet.prepare(DRIVER, [ref]).claims[ref[2]].error == ""


def test_a_stale_socket_is_cleared_and_a_live_one_is_waited_for(base: str, plugin: Plugin) -> None:
    """A dead socket at our path is removed; one somebody serves on is not taken (the registrar
    retries until it is free); a regular file there is never removed."""
    os.makedirs(os.path.dirname(plugin.service_path), exist_ok=True)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(plugin.service_path)
    live.listen(1)
    with pytest.raises(SocketBusy):
        clear_stale(plugin.service_path)
    plugin.registrar.start()
    assert wait_until(lambda: plugin.registrar.state is RegState.RETRYING, 5)
    assert not os.path.exists(plugin.reg_path)
    live.close()  # a dead socket file stays behind: stale now
    assert wait_until(lambda: plugin.registrar.state is RegState.REGISTERING, 10)
    regular = Path(base) / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(OSError, match="is not a socket"):
        clear_stale(str(regular))
    assert regular.exists()


def test_stop_removes_both_sockets_registration_first(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean stop removes both sockets, the registration socket first (the kubelet drops the
    plugin before its endpoint goes)."""
    plugin.registrar.start()
    assert wait_until(lambda: os.path.exists(plugin.reg_path), 10)
    gone: list[str] = []
    real_stop = Endpoint.stop

    def stop(endpoint: Endpoint) -> None:
        real_stop(endpoint)
        gone.append(os.path.basename(endpoint.path))

    monkeypatch.setattr(Endpoint, "stop", stop)
    plugin.registrar.stop()
    assert gone[:2] == ["gpu.nvidia.com-reg.sock", "dra.sock"]
    assert not os.path.exists(plugin.service_path) and not os.path.exists(plugin.reg_path)


def test_prepare_over_grpc_is_timed_for_the_metrics(plugin: Plugin) -> None:
    """Each DRAPlugin call is observed (gpuvisor_rpc_duration_seconds{method})."""
    seen: list[str] = []
    service = DraPluginService(plugin.service.preparer, observe=lambda method, s: seen.append(method))
    service.prepare([v1.Claim(namespace="default", name="x", uid="u")])
    service.unprepare([v1.Claim(namespace="default", name="x", uid="u")])
    assert seen == ["NodePrepareResources", "NodeUnprepareResources"]


def test_an_unregistered_driver_cannot_be_called(kubelet: DraKubeletStandin) -> None:
    """The stand-in says what the kubelet says for a driver with no plugin."""
    with pytest.raises(LookupError, match=r"DRA driver gpu\.nvidia\.com is not registered"):
        kubelet.prepare(DRIVER, [("default", "c", "u")])


def test_a_bug_in_the_preparer_is_each_claims_error_not_a_failed_call(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception under prepare or unprepare becomes every claim's error (logged with
    its traceback); the call itself returns normally."""

    def broken(*args: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin.service.preparer, "prepare", broken)
    monkeypatch.setattr(plugin.service.preparer, "unprepare", broken)
    claims = [v1.Claim(namespace="default", name="x", uid="u")]
    assert "internal error: RuntimeError('boom')" in plugin.service.prepare(claims)["u"].error
    assert "internal error" in plugin.service.unprepare(claims)["u"]
