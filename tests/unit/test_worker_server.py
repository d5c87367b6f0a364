"""The worker's gRPC side in-process: DeviceBook, PluginService, PluginServer and the Registrar.

Real gRPC servers on real unix sockets in short temp dirs; clients are plain DevicePlugin stubs
or the kubelet stand-in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import re
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from common.kubeletapi import HEALTHY, UNHEALTHY, pb
from common.kubeletapi.rpc import DevicePluginClient, unix_target
from common.model import ResourcePlan
from common.socketnames import socket_name
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from supervisor.sim.kubelet import KubeletStandin
from tests import nodes
from tests.helpers import short_tmpdir, sockets_in, wait_until
from worker.devicebook import DeviceBook
from worker.healthboard import Health
from worker.registrar import Registrar, RegState, kubelet_identity, registration_backoff
from worker.registration import PluginRegistration
from worker.server import MAX_STREAMS_PER_SERVER, PluginServer
from worker.service import OPTIONS, PluginService, error_detail

GPU = "nvidia.com/gpu"


def gpu_plan() -> ResourcePlan:
    return plan_resources(nodes.dgx_h100(), config_from_data(None))[GPU]


@pytest.fixture
def tmpdir_short() -> Iterator[str]:
    with short_tmpdir() as d:
        yield d


class Stream:
    """A client ListAndWatch stream read by a thread into a queue (None marks a clean end)."""

    def __init__(self, path: str) -> None:
        self.channel = grpc.insecure_channel(unix_target(path))
        self.call = DevicePluginClient(self.channel).ListAndWatch(pb.Empty())
        self.messages: queue.Queue[pb.ListAndWatchResponse | grpc.RpcError | None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.put(message)
            self.messages.put(None)
        except grpc.RpcError as exc:
            self.messages.put(exc)

    def next(self) -> pb.ListAndWatchResponse | grpc.RpcError | None:
        return self.messages.get(timeout=10)

    def close(self) -> None:
        self.channel.close()  # cancels the call: the server sees the client go away
        self.thread.join(10)


def plugin_registrar(plugin_dir: str, kubelet_socket: str) -> tuple[PluginRegistration, Registrar]:
    """A device plugin's registration of gpu_plan() and the registrar that runs it."""
    registration = PluginRegistration(PluginService(DeviceBook(gpu_plan())), plugin_dir, kubelet_socket)
    return registration, Registrar(registration)


def health_map(message: object) -> dict[str, str]:
    assert isinstance(message, pb.ListAndWatchResponse), message
    return {d.ID: d.health for d in message.devices}


def test_socket_names_are_fresh_and_carry_the_workers_tag() -> None:
    """Each server start gets a new `gpuvisor-<name>-<tag><nn>.sock` name with the process's tag."""
    plan = plan_resources(
        nodes.mig_a100(), config_from_data({"version": "v1", "flags": {"migStrategy": "mixed"}})
    )
    service = PluginService(DeviceBook(plan["nvidia.com/mig-1g.10gb"]))
    service.socket_tag = "c0ffee"
    names = [service.next_socket_name() for _ in range(50)]
    assert len(set(names)) == 50 and names[0] == "gpuvisor-mig-1g.10gb-c0ffee00.sock"
    assert all(re.fullmatch(r"gpuvisor-mig-1g\.10gb-c0ffee[0-9a-f]{2}\.sock", n) for n in names)
    assert socket_name("nvidia.com/gpu", "abcdef", 255) == "gpuvisor-gpu-abcdefff.sock"


def test_streams_beyond_the_bound_are_refused_and_extras_ending_do_not_unregister(tmpdir_short: str) -> None:
    """A server keeps 3 streams (the first after the offer is the kubelet's); a 4th gets
    RESOURCE_EXHAUSTED, and an extra stream that ends does not count as the kubelet letting us go."""
    cancelled: list[PluginServer] = []
    counted: list[str] = []
    service = PluginService(
        DeviceBook(gpu_plan()), on_stream_cancelled=cancelled.append, count=counted.append
    )
    server = PluginServer(service, tmpdir_short)
    server.start()
    server.offer()
    streams: list[Stream] = []
    try:
        for _ in range(MAX_STREAMS_PER_SERVER):
            streams.append(Stream(server.path))
            assert isinstance(streams[-1].next(), pb.ListAndWatchResponse)
        extra = Stream(server.path)
        streams.append(extra)
        refused = extra.next()
        assert isinstance(refused, grpc.RpcError) and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert counted == ["streams_refused"] and server.streams == MAX_STREAMS_PER_SERVER
        assert server.kubelet_streams == 1
        streams[1].close()
        assert wait_until(lambda: server.streams == MAX_STREAMS_PER_SERVER - 1, 10)
        assert cancelled == [] and not server.cancelled and server.kubelet_streams == 1
        streams[0].close()
        assert wait_until(lambda: cancelled == [server], 10)
        assert server.kubelet_streams == 0
    finally:
        for stream in streams:
            stream.close()
        server.stop()


def test_streams_that_race_ahead_of_the_kubelet_neither_lock_it_out_nor_pass_for_it(
    tmpdir_short: str,
) -> None:
    """Streams opened on a fresh socket before the server is offered in a Register are extras: at
    most MAX_STREAMS_PER_SERVER - 1 of them, they do not count as the kubelet's stream (no
    had_stream, no readiness), and the kubelet's stream after the offer still gets in and is the
    one whose end unregisters."""
    cancelled: list[PluginServer] = []
    service = PluginService(DeviceBook(gpu_plan()), on_stream_cancelled=cancelled.append)
    server = PluginServer(service, tmpdir_short)
    server.start()
    streams: list[Stream] = []
    try:
        for _ in range(MAX_STREAMS_PER_SERVER - 1):
            streams.append(Stream(server.path))
            assert isinstance(streams[-1].next(), pb.ListAndWatchResponse)
        squatter = Stream(server.path)
        streams.append(squatter)
        refused = squatter.next()
        assert isinstance(refused, grpc.RpcError) and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not server.had_stream and server.kubelet_streams == 0
        server.offer()
        kubelet = Stream(server.path)
        streams.append(kubelet)
        assert isinstance(kubelet.next(), pb.ListAndWatchResponse)
        assert server.had_stream and server.kubelet_streams == 1 and server.streams == MAX_STREAMS_PER_SERVER
        streams[0].close()
        assert wait_until(lambda: server.streams == MAX_STREAMS_PER_SERVER - 1, 10)
        assert cancelled == []
        kubelet.close()
        assert wait_until(lambda: cancelled == [server], 10)
    finally:
        for stream in streams:
            stream.close()
        server.stop()


def test_concurrent_streams_all_get_full_lists_on_every_change(tmpdir_short: str) -> None:
    """Two ListAndWatch streams both get the full list at once, then the full list again on a change."""
    plan = gpu_plan()
    book = DeviceBook(plan)
    server = PluginServer(PluginService(book), tmpdir_short)
    server.start()
    streams = [Stream(server.path), Stream(server.path)]
    try:
        ids = [d.id for d in plan.devices]
        for s in streams:
            assert health_map(s.next()) == dict.fromkeys(ids, HEALTHY)
        assert wait_until(lambda: server.streams == 2, 10)
        assert book.set_health([(ids[3], Health(False, "xid 79"))])
        for s in streams:
            got = health_map(s.next())
            assert len(got) == len(ids) and got[ids[3]] == UNHEALTHY
            assert sum(h == HEALTHY for h in got.values()) == len(ids) - 1
        assert not book.set_health([(ids[3], Health(False, "again"))])  # no change: no message
        assert book.set_health([], replace=True)  # a snapshot with nothing bad: all healthy again
        for s in streams:
            assert health_map(s.next()) == dict.fromkeys(ids, HEALTHY)
    finally:
        for s in streams:
            s.close()
        server.stop()


def test_plan_swap_updates_open_streams_in_place(tmpdir_short: str) -> None:
    """set_plan (a reload that kept the resource) sends the new device list on the open stream."""
    plan = gpu_plan()
    book = DeviceBook(plan)
    server = PluginServer(PluginService(book), tmpdir_short)
    server.start()
    stream = Stream(server.path)
    try:
        assert len(health_map(stream.next())) == 8
        book.set_plan(dataclasses.replace(plan, devices=plan.devices[:3]))
        assert list(health_map(stream.next())) == [d.id for d in plan.devices[:3]]
    finally:
        stream.close()
        server.stop()


def test_stop_ends_streams_cleanly_and_removes_only_own_socket(tmpdir_short: str) -> None:
    """stop() ends open streams with OK (not as a cancel), at once, and removes our socket only."""
    cancelled: list[PluginServer] = []
    book = DeviceBook(gpu_plan())
    server = PluginServer(PluginService(book, on_stream_cancelled=cancelled.append), tmpdir_short)
    server.start()
    planted = os.path.join(tmpdir_short, "gpuvisor-other-0000abcd.sock")
    keeper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    keeper.bind(planted)
    keeper.close()
    streams = [Stream(server.path), Stream(server.path)]
    for s in streams:
        assert isinstance(s.next(), pb.ListAndWatchResponse)
    server.stop(grace=30)  # returns when the streams are over, not after the grace
    assert sockets_in(tmpdir_short) == ["gpuvisor-other-0000abcd.sock"]
    for s in streams:
        assert s.next() is None  # a clean end of stream, not an error
        s.close()
    assert not server.cancelled and cancelled == []
    assert server.wait_closed(10)


def test_stop_leaves_a_file_that_replaced_our_socket(tmpdir_short: str) -> None:
    """If our socket path now holds another file, stop() does not delete it."""
    server = PluginServer(PluginService(DeviceBook(gpu_plan())), tmpdir_short)
    server.start()
    os.unlink(server.path)
    with open(server.path, "w", encoding="utf-8") as fh:
        fh.write("someone else's")
    assert not server.socket_present()
    server.stop()
    assert os.path.exists(server.path)


def test_client_cancel_marks_server_and_calls_back(tmpdir_short: str) -> None:
    """A stream cancelled by the client (the kubelet) marks that server cancelled and calls back with it."""
    cancelled: list[PluginServer] = []
    service = PluginService(DeviceBook(gpu_plan()), on_stream_cancelled=cancelled.append)
    server = PluginServer(service, tmpdir_short)
    server.start()
    server.offer()
    try:
        stream = Stream(server.path)
        assert isinstance(stream.next(), pb.ListAndWatchResponse)
        stream.close()
        assert wait_until(lambda: cancelled == [server], 10)
        assert server.cancelled and server.streams == 0
    finally:
        server.stop()


def test_service_answers_options_and_preferred(tmpdir_short: str) -> None:
    """GetDevicePluginOptions offers preferred allocation; GetPreferredAllocation answers with the asked size."""
    plan = gpu_plan()
    server = PluginServer(PluginService(DeviceBook(plan)), tmpdir_short)
    server.start()
    channel = grpc.insecure_channel(unix_target(server.path))
    try:
        client = DevicePluginClient(channel)
        assert client.GetDevicePluginOptions(pb.Empty(), timeout=10) == OPTIONS
        ids = [d.id for d in plan.devices]
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
            ]
        )
        answer = client.GetPreferredAllocation(request, timeout=10).container_responses[0].deviceIDs
        assert len(answer) == 2 and set(answer) <= set(ids)
    finally:
        channel.close()
        server.stop()


def test_backoff_doubles_with_jitter_up_to_the_bound() -> None:
    """The registrar's delays grow exponentially, are jittered (50-100% of the step) and never exceed 5 s."""
    backoff = registration_backoff(random.Random(7))
    delays = [backoff.next() for _ in range(12)]
    steps = [min(0.05 * 2**i, 5.0) for i in range(12)]
    assert all(0.5 * s <= d <= s for d, s in zip(delays, steps, strict=True))
    assert max(delays) <= 5.0 and len(set(delays)) == 12
    backoff.reset()
    assert backoff.next() <= 0.05


def test_kubelet_identity_tells_a_recreated_socket_apart(tmpdir_short: str) -> None:
    """kubelet.sock re-created at the same path counts as a different file (a kubelet restart)."""
    path = os.path.join(tmpdir_short, "kubelet.sock")
    assert kubelet_identity(path) is None
    with KubeletStandin(tmpdir_short) as kubelet:
        first = kubelet_identity(path)
        kubelet.restart()
        assert kubelet_identity(path) not in (None, first)


def test_registrar_ignores_a_trigger_when_nothing_was_lost(
    tmpdir_short: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A trigger while the registration is intact (a late duplicate) does not re-register."""
    caplog.set_level(logging.DEBUG, logger="gpuvisor.worker")
    with KubeletStandin(tmpdir_short) as kubelet:
        registration, registrar = plugin_registrar(tmpdir_short, kubelet.socket_path)
        registrar.start()
        try:
            assert kubelet.wait_listed([GPU], 15)
            for _ in range(3):
                registrar.trigger("kubelet.sock created (late)")
            assert wait_until(lambda: "still registered, nothing to do" in caplog.text, 10)
            assert registration.registrations == 1
            # Then a real one: only this one re-registers, so the count proves the first were ignored.
            os.unlink(registration.server.path if registration.server else "")
            registrar.trigger("socket deleted")
            assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.connected(GPU), 15)
            assert wait_until(
                lambda: registrar.state is RegState.REGISTERED and registration.registrations == 2, 10
            )
        finally:
            registrar.stop()
        assert registrar.state is RegState.STOPPED
        assert sockets_in(tmpdir_short) == ["kubelet.sock"]


def test_serve_answers_on_a_socket_before_start_registers_it(tmpdir_short: str) -> None:
    """serve() starts a server that answers at once and registers nothing; start() then registers
    that same server (its socket name), with no second server start."""
    with KubeletStandin(tmpdir_short) as kubelet:
        registration, registrar = plugin_registrar(tmpdir_short, kubelet.socket_path)
        registrar.serve()
        try:
            assert wait_until(
                lambda: registration.server is not None and registration.server.socket_present(), 10
            )
            assert registration.server is not None
            name = registration.server.name
            with grpc.insecure_channel(unix_target(registration.server.path)) as channel:
                options = DevicePluginClient(channel).GetDevicePluginOptions(pb.Empty(), timeout=5)
            assert options.get_preferred_allocation_available
            assert kubelet.registrations == [] and registrar.state.value == "starting"
            registrar.start()
            assert kubelet.wait_listed([GPU], 15)
            assert [r.endpoint for r in kubelet.registrations] == [name]
        finally:
            registrar.stop()
        assert registrar.state is RegState.STOPPED and sockets_in(tmpdir_short) == ["kubelet.sock"]


def test_a_registrar_stopped_while_only_serving_removes_its_socket(tmpdir_short: str) -> None:
    """stop() before start() (the worker told to stop while its snapshot was on its way) ends the
    waiting thread and removes the socket it served on."""
    with KubeletStandin(tmpdir_short) as kubelet:
        registration, registrar = plugin_registrar(tmpdir_short, kubelet.socket_path)
        registrar.serve()
        assert wait_until(lambda: registration.server is not None, 10)
        registrar.stop()
        assert kubelet.registrations == [] and sockets_in(tmpdir_short) == ["kubelet.sock"]


class HoldingKubelet(KubeletStandin):
    """Holds the first Register open (as a kubelet stuck dialling would) until released."""

    def __init__(self, plugin_dir: str) -> None:
        # A short dial: the held call, once let go, dials a socket that is gone.
        super().__init__(plugin_dir, legacy_keying=True, dial_timeout=1.0)
        self.let_go = threading.Event()
        self.arrived: list[str] = []

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.arrived.append(request.endpoint)
        if len(self.arrived) == 1:
            self.let_go.wait(20)
        return super().Register(request, context)


def test_register_in_flight_is_abandoned_when_our_socket_vanishes(tmpdir_short: str) -> None:
    """If our socket goes while Register is in flight, the registrar moves to a new socket at once."""
    kubelet = HoldingKubelet(tmpdir_short)
    kubelet.start()
    _, registrar = plugin_registrar(tmpdir_short, kubelet.socket_path)
    registrar.start()
    try:
        assert wait_until(lambda: len(kubelet.arrived) == 1, 15)
        os.unlink(os.path.join(tmpdir_short, kubelet.arrived[0]))
        # A second Register, on a new socket, while the first is still held by the kubelet.
        assert wait_until(lambda: len(kubelet.arrived) == 2, 15)
        assert kubelet.arrived[1] != kubelet.arrived[0]
        assert kubelet.wait_listed([GPU], 15)
        assert os.path.basename(kubelet.endpoint_socket(GPU)) == kubelet.arrived[1]
    finally:
        kubelet.let_go.set()
        registrar.stop()
        kubelet.stop()


@pytest.mark.parametrize(
    ("text", "budget", "want"),
    [
        ("short", 100, "short"),
        ("a" * 10, 4, "aaaa... (6 more characters)"),
        ("é" * 10, 12, "éé... (8 more characters)"),  # 2 UTF-8 bytes, 3 wire characters each
        ("100%", 3, "100... (1 more characters)"),  # "%" itself is escaped on the wire
    ],
)
def test_error_detail_fits_the_wire_budget(text: str, budget: int, want: str) -> None:
    """Error texts are cut by their percent-encoded size, saying how much was left out."""
    assert error_detail(text, budget) == want


def test_allocate_with_huge_unknown_ids_gets_invalid_argument(tmpdir_short: str) -> None:
    """Allocate of many long unknown IDs fails with INVALID_ARGUMENT naming the first, not a trailer overflow."""
    server = PluginServer(PluginService(DeviceBook(gpu_plan())), tmpdir_short)
    server.start()
    channel = grpc.insecure_channel(unix_target(server.path))
    try:
        ids = [f"GPU-bogus-{i}-" + "x" * 3000 for i in range(10)]
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        with pytest.raises(grpc.RpcError) as info:
            DevicePluginClient(channel).Allocate(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown device: GPU-bogus-0-" in (info.value.details() or "")
    finally:
        channel.close()
        server.stop()


def _allocate(server: PluginServer, ids: list[str]) -> dict[str, str]:
    """Allocate `ids` over a real channel: the response's envs, or {"error": details}."""
    channel = grpc.insecure_channel(unix_target(server.path))
    try:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        response = DevicePluginClient(channel).Allocate(request, timeout=10)
        return dict(response.container_responses[0].envs)
    except grpc.RpcError as exc:
        return {"error": exc.details() or ""}
    finally:
        channel.close()


def test_ids_of_the_plan_just_replaced_are_answered_for_a_grace_period(
    tmpdir_short: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an in-place update 1 -> 2 time-slicing replicas, an Allocate of a plain ID from the
    kubelet's list of a moment before is answered (same GPU, same answer); an ID whose GPU left the
    plan is not; after PLAN_GRACE_S neither is."""
    import worker.service as service_module

    plain = gpu_plan()
    sliced = plan_resources(
        nodes.dgx_h100(),
        config_from_data(
            {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": GPU, "replicas": 2}]}}}
        ),
    )[GPU]
    book = DeviceBook(plain)
    server = PluginServer(PluginService(book), tmpdir_short)
    server.start()
    try:
        first, last = plain.devices[0], plain.devices[-1]
        assert _allocate(server, [first.id]) == {"NVIDIA_VISIBLE_DEVICES": first.uuid}
        without_last = dataclasses.replace(
            sliced, devices=tuple(d for d in sliced.devices if d.uuid != last.uuid)
        )
        book.set_plan(without_last)
        assert _allocate(server, [first.id]) == {"NVIDIA_VISIBLE_DEVICES": first.uuid}
        assert "unknown device" in _allocate(server, [last.id])["error"]  # its GPU is gone
        assert _allocate(server, [f"{first.uuid}::1"]) == {"NVIDIA_VISIBLE_DEVICES": first.uuid}
        book.set_plan(plain)
        assert _allocate(server, [first.id]) == {"NVIDIA_VISIBLE_DEVICES": first.uuid}  # the plan's own
        monkeypatch.setattr(service_module, "PLAN_GRACE_S", -1.0)
        book.set_plan(sliced)  # an update whose grace is over at once
        assert "unknown device" in _allocate(server, [first.id])["error"]
    finally:
        server.stop()


def test_the_previous_plan_is_not_used_when_more_than_the_list_changed(tmpdir_short: str) -> None:
    """An update that changes how Allocate answers (here the device-ID strategy) answers no ID of
    the previous plan: its answer would no longer be right."""
    plain = gpu_plan()
    by_index = plan_resources(
        nodes.dgx_h100(),
        config_from_data({"version": "v1", "flags": {"plugin": {"deviceIDStrategy": "index"}}}),
    )[GPU]
    renamed = dataclasses.replace(
        by_index, devices=tuple(dataclasses.replace(d, id=d.id + "-x") for d in by_index.devices)
    )
    book = DeviceBook(plain)
    server = PluginServer(PluginService(book), tmpdir_short)
    server.start()
    try:
        book.set_plan(renamed)
        assert "unknown device" in _allocate(server, [plain.devices[0].id])["error"]
    finally:
        server.stop()
