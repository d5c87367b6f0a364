"""The DevicePlugin gRPC servicer for one resource: what the kubelet's calls are answered with.

`PluginService` answers from the device book (worker.devicebook) and the plan, through the pure
policy modules (`worker.allocate`, `worker.preferred`). It is shared by the resource's successive
servers (worker.server), each serving it through its own small adapter (`handler_for`), so a
stream knows which server it belongs to: a stream the kubelet cancels marks *that* server as
cancelled (the registrar then registers again on a fresh server), while streams we end ourselves
on stop do not. A stream waits on the book's condition with its "done" test evaluated under the
book's lock, and both the end of the RPC (gRPC's `add_callback`) and a server's stop notify that
condition, so a cancel or a stop ends a stream at once instead of at its next poll.

Streams are bounded so that they can never starve the unary calls (worker.server says how many
a server admits and why); a stream the server does not admit gets RESOURCE_EXHAUSTED at once and
holds no thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from common.kubeletapi import pb
from common.kubeletapi.rpc import device_plugin_handler
from common.model import ResourcePlan
from common.socketnames import new_tag, socket_name
from worker.allocate import AllocationError, Allocator, ContainerResponse
from worker.devicebook import DeviceBook
from worker.preferred import PreferredPolicy
from worker.server import MAX_STREAMS_PER_SERVER, PluginServer

log = logging.getLogger("gpuvisor.worker")

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

# A stream re-checks its end conditions this often even if no one wakes it: a safety net only,
# since every event that ends a stream also notifies it.
STREAM_RECHECK_S = 5.0
# After an in-place plan update, the kubelet may still admit a pod from the list it had a moment
# before (the new list is on its way down the stream): for this long such IDs are still answered
# (see PluginService._previous_allows).
PLAN_GRACE_S = 30.0
ERROR_DETAIL_BUDGET = 4000  # characters of a gRPC error message on the wire (clients cap trailers at 8 KiB)


class PluginService:
    """The `v1beta1.DevicePlugin` servicer for one resource, shared by its successive servers."""

    def __init__(
        self,
        book: DeviceBook,
        on_stream_cancelled: Callable[[PluginServer], None] | None = None,
        observe: Callable[[str, float], None] | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.book = book
        self._allocator = Allocator(book.plan)
        self._preferred = PreferredPolicy(book.plan)
        self._plan_seen = book.plan
        # The plan before the last in-place update, its allocator, and until when its IDs are
        # still answered (monotonic); None when there was no update or it may not be used.
        self._previous: tuple[ResourcePlan, Allocator, float] | None = None
        self.server: PluginServer | None = None  # the newest server started
        # Called (from a gRPC thread) when the kubelet ends one of a server's streams.
        self.on_stream_cancelled = on_stream_cancelled
        self._observe = observe or (lambda method, seconds: None)
        self._count = count or (lambda name: None)  # an event, counted in the worker's figures
        # Called (from a gRPC thread) when the kubelet's stream opens or closes: the supervisor
        # hears of it at once, so its readiness and status follow that stream, not a heartbeat.
        self.on_streams_changed: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._refused_logged = False
        self.socket_tag = new_tag()  # the supervisor gives its own (worker.server says why)
        self._servers_started = 0

    def handler_for(self, server: PluginServer) -> grpc.GenericRpcHandler[Any, Any]:
        """The service as `server` serves it: its streams are tied to that server."""
        return device_plugin_handler(_ServerView(self, server))

    def next_socket_name(self, plugin_dir: str = "") -> str:
        """A fresh socket file name for one server start: `gpuvisor-<name>-<tag><nn>.sock`."""
        with self._lock:
            n = self._servers_started
            self._servers_started += 1
        return socket_name(self.book.plan.resource, self.socket_tag, n, plugin_dir)

    def _policies(self) -> tuple[Allocator, PreferredPolicy]:
        plan = self.book.plan
        if plan is not self._plan_seen:  # a reload swapped the plan: rebuild the lookup tables once
            old, old_allocator = self._plan_seen, self._allocator
            self._previous = None
            if old.allocate == plan.allocate and "mps" not in (old.sharing, plan.sharing):
                self._previous = (old, old_allocator, time.monotonic() + PLAN_GRACE_S)
            # Not strict: a required IMEX channel missing now refuses Allocate (it says why)
            # rather than failing the RPC that noticed the new plan.
            self._allocator = Allocator(plan, strict_imex=False)
            self._preferred = PreferredPolicy(plan)
            self._plan_seen = plan
        return self._allocator, self._preferred

    def _previous_allows(self, ids: Sequence[str]) -> Allocator | None:
        """The previous plan's allocator when these IDs may still be answered by it: within
        PLAN_GRACE_S of an in-place update that changed only the device list (same Allocate
        settings, no MPS on either side: a label flip or SIGHUP between time-slicing replica
        counts), every ID is one of the previous plan's, and each one's GPU or MIG device is still
        in the new plan. The answer is the one the worker gave for those IDs a moment before, for
        hardware that is still there."""
        previous = self._previous
        if previous is None or time.monotonic() > previous[2] or not ids:
            return None
        old, allocator, _until = previous
        old_ids = {d.id: d.uuid for d in old.devices}
        backing = {d.uuid for d in self._plan_seen.devices}
        if all(i in old_ids and old_ids[i] in backing for i in ids):
            return allocator
        return None

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        """A stream not tied to a server (direct use); servers go through `stream()`."""
        return self.stream(self.server, context)

    def stream(
        self, server: PluginServer | None, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        """ListAndWatch on `server`: the full list at once, then again on every change."""
        ended = threading.Event()  # the RPC is over (the client cancelled, or the call finished)

        def done() -> bool:
            return ended.is_set() or (server is not None and server.stopping)

        # The first stream after the server was offered in a Register is the kubelet's (each
        # registration gets a fresh server); only its end means the kubelet let us go. An extra
        # stream ending is just that.
        kubelet = False
        admitted = server is None
        if server is not None:
            admitted, kubelet = server.admit_stream()

        def on_end() -> None:
            ended.set()
            self.book.wake()
            if server is not None and admitted:
                server.rpc_over()  # its status is sent: what stop() waits for

        if not context.add_callback(on_end):
            on_end()  # the RPC is already over
        if not admitted:  # (a stream with no server is always admitted)
            self._count("streams_refused")
            with self._lock:
                first, self._refused_logged = not self._refused_logged, True
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "refused a ListAndWatch stream: %d extra streams are open on this server already, the "
                "other slot is kept for the kubelet (count:streams_refused counts them)",
                MAX_STREAMS_PER_SERVER - 1,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_STREAMS_PER_SERVER} ListAndWatch streams per device plugin socket, "
                "one of them kept for the kubelet",
            )
        if kubelet:
            self._streams_changed()
        log.debug("ListAndWatch stream opened")
        by_us = False
        try:
            version, message = self.book.current()
            start = time.perf_counter()
            yield message
            self._observe("ListAndWatch", time.perf_counter() - start)
            while True:
                changed = self.book.wait_change(version, STREAM_RECHECK_S, done)
                if done() or not context.is_active():
                    break
                if changed is None:
                    continue
                version, message = self.book.current()  # the newest list, maybe newer than `changed`
                start = time.perf_counter()
                yield message
                self._observe("ListAndWatch", time.perf_counter() - start)
        finally:
            by_us = server is not None and server.stopping
            if server is not None:
                server.end_stream(kubelet)
            if kubelet:
                self._streams_changed()
            if by_us or server is None:
                log.debug("ListAndWatch stream closed by us")
            elif not kubelet:
                log.debug("an extra ListAndWatch stream ended")
            else:
                # The kubelet never reopens a stream: only a new Register brings us back. (The
                # registrar logs the re-registration this leads to: one line, not two.)
                log.debug("ListAndWatch stream ended by the kubelet")
                server.cancelled = True
                if self.on_stream_cancelled is not None:
                    self.on_stream_cancelled(server)

    def _streams_changed(self) -> None:
        if self.on_streams_changed is not None:
            self.on_streams_changed()

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        start = time.perf_counter()
        _, policy = self._policies()
        lost = self.book.unhealthy_ids()
        responses = []
        for creq in request.container_requests:
            ids = policy.select(
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
                lost,
            )
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        self._observe("GetPreferredAllocation", time.perf_counter() - start)
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        start = time.perf_counter()
        allocator, _ = self._policies()
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            try:
                result = self._allocate(allocator, ids)
            except AllocationError as exc:
                detail = error_detail(str(exc))
                log.warning("Allocate refused: %s", detail)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)
            responses.append(to_pb(result))
        self._observe("Allocate", time.perf_counter() - start)
        return pb.AllocateResponse(container_responses=responses)

    def _allocate(self, allocator: Allocator, ids: list[str]) -> ContainerResponse:
        """The current plan's answer, or for IDs of the plan just replaced, that plan's (see
        `_previous_allows`); the current plan's error when neither can answer."""
        try:
            return allocator.allocate(ids)
        except AllocationError as exc:
            previous = self._previous_allows(ids)
            if previous is None:
                raise
            try:
                result = previous.allocate(ids)
            except AllocationError:
                raise exc from None
        log.info(
            "Allocate of %s answered by the previous plan: the kubelet's list was a moment behind the plan update",
            ",".join(ids),
        )
        self._count("previous_plan_allocations")
        return result

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class _ServerView:
    """The service as one server serves it: streams are tied to that server."""

    def __init__(self, service: PluginService, server: PluginServer) -> None:
        self._service = service
        self._server = server
        self.GetDevicePluginOptions = service.GetDevicePluginOptions
        self.GetPreferredAllocation = service.GetPreferredAllocation
        self.Allocate = service.Allocate
        self.PreStartContainer = service.PreStartContainer

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        return self._service.stream(self._server, context)


def error_detail(text: str, budget: int = ERROR_DETAIL_BUDGET) -> str:
    """`text` cut to fit gRPC's status-message trailer, which is percent-encoded.

    Clients refuse trailers over 8 KiB (RESOURCE_EXHAUSTED instead of our INVALID_ARGUMENT), and a
    request full of long unknown IDs makes a long error; each byte outside printable ASCII costs
    three characters on the wire.
    """
    used = 0
    for i, ch in enumerate(text):
        used += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8"))
        if used > budget:
            return text[:i] + f"... ({len(text) - i} more characters)"
    return text


def to_pb(result: ContainerResponse) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=result.envs,
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in result.mounts
        ],
        devices=[
            pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in result.devices
        ],
        annotations=result.annotations,
        cdi_devices=[pb.CDIDevice(name=n) for n in result.cdi_devices],
    )
