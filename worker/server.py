"""The DevicePlugin gRPC service for one resource, and one start of its server on a unix socket.

`DeviceBook` holds the resource's device list with health and a version counter; every change
wakes the ListAndWatch streams, which always send the *full* list (the kubelet takes each message
as a snapshot). `PluginService` answers the kubelet's calls from the plan through the pure policy
modules (`worker.allocate`, `worker.preferred`). `PluginServer` is one start of a gRPC server on a
fresh socket name: a restart for re-registration makes a new `PluginServer`, and stopping one
ends its streams first, so the kubelet never sees an old stream outlive its successor's
registration (kubernetes#121994).

Streams are bounded so that they can never starve the unary calls: gRPC's sync server gives each
RPC a thread of a pool of `RPC_THREADS` for its whole life, and a ListAndWatch stream lives as long
as its client. A server admits `MAX_STREAMS_PER_SERVER` concurrent streams: the kubelet's, which
is the first to open after the registrar offers the server in a Register (each registration gets a
fresh server), and a few more (a monitoring tool, a client reconnecting), which may never take
the kubelet's slot: a stream that opens before the offer, or an extra beyond
`MAX_STREAMS_PER_SERVER - 1`, gets RESOURCE_EXHAUSTED at once and holds no thread. So Allocate,
GetPreferredAllocation and the rest always have `RPC_THREADS - MAX_STREAMS_PER_SERVER` threads,
and streams that race ahead of the kubelet neither lock it out nor pass for it. `MAX_RPCS`
bounds what gRPC keeps in flight or queued at all.

Socket names are `gpuvisor-<resource name>-<tag><nn>.sock`: the supervisor gives each worker
process a tag (6 hex digits) and records it, and nn counts the process's server starts, so the
supervisor removes only sockets that its own workers made (supervisor/host/rundir.py).

Each server serves the shared service through its own small adapter, so a stream knows which
server it belongs to: a stream the kubelet cancels marks *that* server as cancelled (the
registrar then registers again on a fresh server), while streams we end ourselves on stop do not.
A stream waits on the book's condition with its "done" test evaluated under the book's lock, and
both the end of the RPC (gRPC's `add_callback`) and `stop()` notify that condition, so a cancel
or a stop ends a stream at once instead of at its next poll.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc

from common.kubeletapi import HEALTHY, UNHEALTHY, pb
from common.kubeletapi.rpc import device_plugin_handler, unix_target
from common.model import ResourcePlan
from common.socketnames import new_tag, socket_name
from worker.allocate import AllocationError, Allocator, ContainerResponse
from worker.preferred import PreferredPolicy

log = logging.getLogger("gpuvisor.worker")

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

# A stream re-checks its end conditions this often even if no one wakes it: a safety net only,
# since every event that ends a stream also notifies it.
STREAM_RECHECK_S = 5.0
# Upper bound for in-flight unary RPCs (an Allocate) to finish when a server stops. Streams are
# ended by our own flag before gRPC's stop, so a stop normally returns in about a millisecond.
STOP_GRACE_S = 0.5
# How long a stopped server's connections stay open after its streams ended, for the clients to
# read the end of their streams before gRPC closes the connections (PluginServer.stop).
LINGER_S = 0.2
RPC_THREADS = 8  # a kubelet holds one stream and makes a few unary calls at a time
MAX_STREAMS_PER_SERVER = 3  # the kubelet's stream and two more; the other 5 threads stay for unary calls
MAX_RPCS = 64  # in flight and queued, per server: more get RESOURCE_EXHAUSTED from gRPC itself
# After an in-place plan update, the kubelet may still admit a pod from the list it had a moment
# before (the new list is on its way down the stream): for this long such IDs are still answered
# (see PluginService._previous_allows).
PLAN_GRACE_S = 30.0
ERROR_DETAIL_BUDGET = 4000  # characters of a gRPC error message on the wire (clients cap trailers at 8 KiB)


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str = ""
    since: float = 0.0


class DeviceBook:
    """The resource's devices and their health; a version bump wakes every stream."""

    def __init__(self, plan: ResourcePlan) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._closed = False
        self._health: dict[str, Health] = {}
        self._plan = plan
        self._message = pb.ListAndWatchResponse()
        with self._cond:
            self._rebuild()

    @property
    def plan(self) -> ResourcePlan:
        return self._plan

    def _rebuild(self) -> None:
        devices = []
        for dev in self._plan.devices:
            h = self._health.get(dev.id)
            health = HEALTHY if h is None or h.healthy else UNHEALTHY
            topology = None
            if dev.numa_node is not None and dev.numa_node >= 0:
                topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=dev.numa_node)])
            devices.append(pb.Device(ID=dev.id, health=health, topology=topology))
        self._message = pb.ListAndWatchResponse(devices=devices)
        self._version += 1
        self._cond.notify_all()

    def set_plan(self, plan: ResourcePlan, health: Iterable[tuple[str, Health]] | None = None) -> None:
        """Swap the device list in place (a reload that kept the resource name).

        `health`, when given, replaces the whole health book in the same change (a snapshot that
        covers the new devices), so no stream ever sees the new list without its health.
        """
        with self._cond:
            self._plan = plan
            if health is not None:
                self._health = dict(health)
            self._rebuild()

    def set_health(self, changes: Iterable[tuple[str, Health]], replace: bool = False) -> bool:
        """Apply health changes; `replace` makes them the whole truth (a snapshot)."""
        with self._cond:
            new = {} if replace else dict(self._health)
            for device_id, health in changes:
                new[device_id] = health
            before = {d: self._is_healthy(self._health, d) for d in self._ids()}
            after = {d: self._is_healthy(new, d) for d in self._ids()}
            self._health = new
            if before != after:
                self._rebuild()
                return True
            return False

    def _ids(self) -> list[str]:
        return [d.id for d in self._plan.devices]

    @staticmethod
    def _is_healthy(book: dict[str, Health], device_id: str) -> bool:
        h = book.get(device_id)
        return h is None or h.healthy

    def unhealthy_ids(self) -> frozenset[str]:
        with self._cond:
            return frozenset(d for d in self._ids() if not self._is_healthy(self._health, d))

    def health_of(self, device_id: str) -> Health:
        with self._cond:
            return self._health.get(device_id, Health(True))

    def current(self) -> tuple[int, pb.ListAndWatchResponse]:
        with self._cond:
            return self._version, self._message

    def wait_change(
        self, seen: int, timeout: float, done: Callable[[], bool] = lambda: False
    ) -> tuple[int, pb.ListAndWatchResponse] | None:
        """Wait for a version newer than `seen`; None on timeout, when closed or once `done()`.

        `done` is evaluated under the book's lock, so a `wake()` that follows setting whatever
        `done` reads is never lost between the test and the wait.
        """
        with self._cond:
            if self._version == seen and not self._closed and not done():
                self._cond.wait(timeout)
            if self._closed or self._version == seen or done():
                return None
            return self._version, self._message

    def wake(self, before: Callable[[], None] | None = None) -> None:
        """Wake every stream; `before` runs under the book's lock first (see `wait_change`)."""
        with self._cond:
            if before is not None:
                before()
            self._cond.notify_all()

    def close(self) -> None:
        """End every stream's wait for good (the worker is going away)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


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
        self.socket_tag = new_tag()  # the supervisor gives its own (see the module doc)
        self._servers_started = 0

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
                version, message = changed
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


class PluginServer:
    """One start of the gRPC server for a resource, on its own fresh socket name."""

    def __init__(
        self, service: PluginService, plugin_dir: str, executor: futures.ThreadPoolExecutor | None = None
    ) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        # gRPC never shuts a server's pool down, so successive servers can share one: a
        # re-registration then creates no threads for its RPCs (about a third of its CPU).
        self._executor = executor
        self.name = service.next_socket_name(plugin_dir)
        self.path = os.path.join(plugin_dir, self.name)
        self.stopping = False
        self.cancelled = False  # the kubelet ended one of our streams: this server is done for
        self._server: grpc.Server | None = None
        self._inode: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when an admitted stream's RPC is over
        self._rpcs_open = 0  # admitted streams whose RPC has not ended on our side (status not sent)
        self._closer: threading.Thread | None = None  # stops the gRPC server after LINGER_S (stop())
        self._offered = False  # the registrar offered this server to a kubelet in a Register
        self._had_stream = False  # the kubelet's stream opened (it may have ended since)
        self._kubelet_open = False
        self._extras = 0  # other streams open right now

    @property
    def streams(self) -> int:
        """ListAndWatch streams open on this server right now, the kubelet's and extras."""
        with self._lock:
            return self._extras + int(self._kubelet_open)

    @property
    def kubelet_streams(self) -> int:
        """1 while the kubelet's stream is open, else 0: what readiness waits for."""
        with self._lock:
            return int(self._kubelet_open)

    @property
    def had_stream(self) -> bool:
        """Did the kubelet's stream (the first after the offer) ever open on this server?"""
        with self._lock:
            return self._had_stream

    @property
    def offered(self) -> bool:
        """Was this server named in a Register? Then it is never offered again."""
        with self._lock:
            return self._offered

    def offer(self) -> None:
        """The registrar is about to name this server in a Register: the next stream is the kubelet's."""
        with self._lock:
            self._offered = True

    def admit_stream(self) -> tuple[bool, bool]:
        """Count a new stream if it may open: (admitted, it is the kubelet's).

        The kubelet's slot is never given to an extra: extras get `MAX_STREAMS_PER_SERVER - 1`.
        """
        with self._lock:
            if self._offered and not self._had_stream:
                self._had_stream = self._kubelet_open = True
                self._rpcs_open += 1
                return True, True
            if self._extras >= MAX_STREAMS_PER_SERVER - 1:
                return False, False
            self._extras += 1
            self._rpcs_open += 1
            return True, False

    def rpc_over(self) -> None:
        """An admitted stream's RPC ended on our side (gRPC's termination callback)."""
        with self._lock:
            self._rpcs_open -= 1
            self._idle.notify_all()

    def end_stream(self, kubelet: bool) -> None:
        with self._lock:
            if kubelet:
                self._kubelet_open = False
            else:
                self._extras -= 1

    def start(self) -> None:
        executor = self._executor or futures.ThreadPoolExecutor(
            max_workers=RPC_THREADS, thread_name_prefix="rpc"
        )
        server = grpc.server(executor, options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=MAX_RPCS)
        server.add_generic_rpc_handlers((device_plugin_handler(_ServerView(self.service, self)),))
        server.add_insecure_port(unix_target(self.path))
        self.service.server = self
        server.start()
        self._server = server
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            # Deleted as soon as made (a starting kubelet cleans the dir): socket_present() now
            # says False, and the registrar moves on to a fresh server.
            return
        self._inode = (st.st_dev, st.st_ino)

    def socket_present(self) -> bool:
        """Is our own socket file still there (the same inode we created)?"""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """End the streams, stop serving and remove our socket (only ours, only if it is ours).

        Returns once every stream of this server is over (its end of stream sent, `grace` at most),
        so the kubelet has seen our streams end before we register a successor; a unary call still
        running gets `grace` too.

        Why the gRPC server itself may stop a little later: gRPC destroys a server, closing every
        connection at once, the moment its last call is over on this side, which can be before a
        client has read the end of its stream. That client's next write (an HTTP/2 PING ack, a
        window update) then fails and its stream ends UNAVAILABLE ("Stream removed (sendmsg:
        Broken pipe)") instead of cleanly. So when streams were open, the server is stopped
        LINGER_S after they ended, in the background (`wait_closed` joins it), and a successor
        is not kept waiting.
        """

        def mark() -> None:
            self.stopping = True

        # Set under the book's lock, so a stream between its `done()` test and its wait sees it.
        self.service.book.wake(mark)
        server, self._server = self._server, None
        if server is not None:
            with self._lock:
                had_streams = self._rpcs_open > 0
                self._idle.wait_for(lambda: self._rpcs_open <= 0, timeout=grace)
            if had_streams:
                self._closer = threading.Thread(
                    target=_close_after_linger, args=(server, grace), name="rpc-linger", daemon=True
                )
                self._closer.start()
            else:
                server.stop(grace).wait(grace + 1.0)
        if self.socket_present():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def wait_closed(self, timeout: float = LINGER_S + STOP_GRACE_S + 1.0) -> bool:
        """Wait for a gRPC server that `stop` left lingering to stop; True when it has."""
        closer = self._closer
        if closer is None:
            return True
        closer.join(timeout)
        return not closer.is_alive()


def _close_after_linger(server: grpc.Server, grace: float) -> None:
    time.sleep(LINGER_S)  # the clients' time to read the end of their streams (PluginServer.stop)
    server.stop(grace).wait(grace + 1.0)
