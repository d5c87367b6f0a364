"""The DevicePlugin gRPC service for one resource, and one start of its server on a unix socket.

`DeviceBook` holds the resource's device list with health and a version counter; every change
wakes the ListAndWatch streams, which always send the *full* list (the kubelet takes each message
as a snapshot). `PluginService` answers the kubelet's calls from the plan through the pure policy
modules (`worker.allocate`, `worker.preferred`). `PluginServer` is one start of a gRPC server on a
fresh socket name: a restart for re-registration makes a new `PluginServer`, and stopping one
ends its streams first, so the kubelet never sees an old stream outlive its successor's
registration (kubernetes#121994).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from common.kubeletapi import HEALTHY, UNHEALTHY, pb
from common.kubeletapi.rpc import device_plugin_handler, unix_target
from common.model import ResourcePlan
from worker.allocate import AllocationError, Allocator, ContainerResponse
from worker.preferred import PreferredPolicy

log = logging.getLogger("gpuvisor.worker")

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


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

    def set_plan(self, plan: ResourcePlan) -> None:
        """Swap the device list in place (a reload that kept the resource name)."""
        with self._cond:
            self._plan = plan
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

    def wait_change(self, seen: int, timeout: float) -> tuple[int, pb.ListAndWatchResponse] | None:
        """Wait for a version newer than `seen`; None on timeout or when closed."""
        with self._cond:
            if self._version == seen and not self._closed:
                self._cond.wait(timeout)
            if self._closed or self._version == seen:
                return None
            return self._version, self._message

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class PluginService:
    """The `v1beta1.DevicePlugin` servicer for one resource."""

    def __init__(
        self,
        book: DeviceBook,
        on_stream_cancelled: Callable[[PluginServer], None] | None = None,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self.book = book
        self._allocator = Allocator(book.plan)
        self._preferred = PreferredPolicy(book.plan)
        self._plan_seen = book.plan
        self.server: PluginServer | None = None
        self._on_stream_cancelled = on_stream_cancelled
        self._observe = observe or (lambda method, seconds: None)
        self.streams = 0

    def _policies(self) -> tuple[Allocator, PreferredPolicy]:
        plan = self.book.plan
        if plan is not self._plan_seen:  # a reload swapped the plan: rebuild the lookup tables once
            self._allocator = Allocator(plan)
            self._preferred = PreferredPolicy(plan)
            self._plan_seen = plan
        return self._allocator, self._preferred

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        server = self.server
        version, message = self.book.current()
        self.streams += 1
        log.info("%s: ListAndWatch stream opened", self.book.plan.resource)
        try:
            start = time.perf_counter()
            yield message
            self._observe("ListAndWatch", time.perf_counter() - start)
            while context.is_active() and server is not None and not server.stopping:
                changed = self.book.wait_change(version, 1.0)
                if changed is None:
                    continue
                version, message = changed
                if server.stopping:
                    break
                start = time.perf_counter()
                yield message
                self._observe("ListAndWatch", time.perf_counter() - start)
        finally:
            self.streams -= 1
            if server is not None and not server.stopping and self._on_stream_cancelled is not None:
                self._on_stream_cancelled(server)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        start = time.perf_counter()
        _, policy = self._policies()
        lost = self.book.unhealthy_ids()
        responses = []
        for creq in request.container_requests:
            ids = policy.select(
                list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), int(creq.allocation_size), lost
            )
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        self._observe("GetPreferredAllocation", time.perf_counter() - start)
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        start = time.perf_counter()
        allocator, _ = self._policies()
        responses = []
        for creq in request.container_requests:
            try:
                result = allocator.allocate(list(creq.devices_ids))
            except AllocationError as exc:
                log.warning("%s: Allocate refused: %s", self.book.plan.resource, exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            responses.append(to_pb(result))
        self._observe("Allocate", time.perf_counter() - start)
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


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


def socket_name(resource: str) -> str:
    """A fresh socket file name for one server start: `gpuvisor-<name>-<nonce>.sock`."""
    name = resource.split("/", 1)[-1]
    return f"gpuvisor-{name}-{secrets.token_hex(4)}.sock"


SOCKET_PREFIX = "gpuvisor-"


class PluginServer:
    """One start of the gRPC server for a resource, on its own fresh socket name."""

    def __init__(self, service: PluginService, plugin_dir: str) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        self.name = socket_name(service.book.plan.resource)
        self.path = os.path.join(plugin_dir, self.name)
        self.stopping = False
        self._server: grpc.Server | None = None
        self._inode: tuple[int, int] | None = None

    def start(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rpc"),
            options=[("grpc.so_reuseport", 0)],
        )
        server.add_generic_rpc_handlers((device_plugin_handler(self.service),))
        server.add_insecure_port(unix_target(self.path))
        self.service.server = self
        server.start()
        self._server = server
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)

    def socket_present(self) -> bool:
        """Is our own socket file still there (the same inode we created)?"""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def stop(self, grace: float = 0.5) -> None:
        """End the streams, stop serving and remove our socket (only ours, only if it is ours)."""
        self.stopping = True
        self.service.book.wake()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None
        if self.socket_present():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
