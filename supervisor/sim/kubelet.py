"""A kubelet stand-in: the kubelet's side of the device-plugin API, on a real unix socket.

It serves `v1beta1.Registration` on `<plugin dir>/kubelet.sock` and behaves as the kubelet's
device manager does (docs/architecture.md, "The kubelet's side of the device-plugin API"), so tests, the demo and the benchmarks exercise a
plugin the way a node would:

- Register validates the version and the resource name with the kubelet's texts, then, still
  inside the Register call, dials the plugin's socket (blocking, 10 s) and calls
  GetDevicePluginOptions; a failure there fails Register with `failed to get device plugin
  options: ...`. Only after Register returned does it start ListAndWatch.
- ListAndWatch messages are taken as full snapshots; capacity = all devices, allocatable =
  devices whose health is exactly "Healthy". When a stream ends, every device of that resource
  turns unhealthy and nothing retries: only a new Register recovers.
- Re-registration of a resource replaces the previous endpoint. In `legacy_keying` mode (the
  default, like kubelets up to 1.35, kubernetes#121994) the end of an *old* endpoint's stream
  after a newer one registered also disconnects the newer one: a plugin must close its old
  streams before it registers again, and this stand-in catches one that does not.
- `allocate()` calls GetPreferredAllocation (when the plugin offers it) and then Allocate with
  the IDs in random order, one container request each, as the kubelet does at pod admission.
- `restart()` closes every stream, deletes every socket file in the plugin dir (regular files and
  folders stay) and creates a fresh kubelet.sock.
- `serve_pod_resources(path)` serves the kubelet's pod-resources API (`v1.PodResourcesLister/List`)
  there: each `allocate()` is one pod's container holding its devices until `release()`, as the
  kubelet lists them (what gpuvisor reads to keep device-plugin-held devices out of DRA slices).
- A gone plugin's resource, the checkpoint (`write_checkpoint`) and the Node's status
  (`node_status(sink, interval)`) follow the device manager's rules: supervisor/sim/kubeletnode.py.
"""

from __future__ import annotations

import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.kubeletapi import HEALTHY, KUBELET_SOCKET_NAME, VERSION, pb
from common.kubeletapi.rpc import DevicePluginClient, registration_handler, unix_target
from supervisor.sim.kubeletnode import (
    is_extended_resource_name,
    pod_resources_server,
    status_setter,
    write_checkpoint,
)

log = logging.getLogger("gpuvisor.kubelet")

DIAL_TIMEOUT_S = 10.0
# pkg/kubelet/cm/devicemanager/types.go: endpointStopGracePeriod = time.Duration(5) * time.Minute
ENDPOINT_STOP_GRACE_S = 300.0
CHECKPOINT_NAME = "kubelet_internal_checkpoint"  # types.go: kubeletDeviceManagerCheckpoint


@dataclass
class DeviceState:
    id: str
    health: str
    numa_nodes: tuple[int, ...]


@dataclass
class PluginEndpoint:
    """One registered plugin instance (a resource served from one socket)."""

    resource: str
    socket_path: str
    options: pb.DevicePluginOptions
    channel: grpc.Channel
    client: DevicePluginClient
    registered_at: float
    generation: int
    stream: Any = None  # the ListAndWatch call, cancellable; set under the stand-in's lock
    connected: bool = True
    closed: bool = False  # _close_endpoint ran: no ListAndWatch may start on it any more
    updates: int = 0


@dataclass
class Resource:
    name: str
    devices: dict[str, DeviceState] = field(default_factory=dict)
    endpoint: PluginEndpoint | None = None
    allocated: set[str] = field(default_factory=set)
    stopped_at: float | None = None  # when its plugin went (or the kubelet restarted without one)

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        if self.endpoint is None or not self.endpoint.connected:
            return 0
        return sum(1 for d in self.devices.values() if d.health == HEALTHY)


@dataclass(frozen=True)
class RegisterCall:
    """A record of one Register call (accepted or not)."""

    resource: str
    endpoint: str
    at: float
    error: str = ""


class KubeletStandin:
    """The kubelet's device manager, in-process, on a real unix socket in `plugin_dir`."""

    def __init__(
        self,
        plugin_dir: str,
        *,
        legacy_keying: bool = True,
        drop_fresh: int = 0,
        stream_end_delay: float = 0.0,
        seed: int = 0,
        dial_timeout: float = DIAL_TIMEOUT_S,
        grace_s: float = ENDPOINT_STOP_GRACE_S,
        write_checkpoint: bool = False,
    ) -> None:
        """As the v1.32 kubelet, a new registration leaves the old client running until its stream
        ends. `legacy_keying` (the kubelet's `runClient`, up to 1.35, so on by default):
        when a client's stream ends, the client registered *now* for that resource is
        disconnected, whichever it is: an older stream ending after a re-registration closes the
        new client's connection (kubernetes#121994). `drop_fresh`: drop this many freshly registered endpoints
        before their ListAndWatch starts (the kubelet lost them), so no stream ever opens.
        `stream_end_delay`: the kubelet notices a stream's end this much later (a busy kubelet),
        which with `legacy_keying` lets an old stream's end land after the next registration."""
        self.dial_timeout = dial_timeout
        self.grace_s = grace_s
        self.write_checkpoint = write_checkpoint
        self.plugin_dir = os.path.abspath(plugin_dir)
        self.socket_path = os.path.join(self.plugin_dir, KUBELET_SOCKET_NAME)
        self.legacy_keying = legacy_keying
        self.drop_fresh = drop_fresh
        self.stream_end_delay = stream_end_delay
        self._cond = threading.Condition()
        self._resources: dict[str, Resource] = {}
        self._server: grpc.Server | None = None
        self._generation = 0
        self._random = random.Random(seed)
        self.registrations: list[RegisterCall] = []
        self._epoch = 0  # bumped by restart(): a Register begun before it must not install after it
        self.listeners: list[Callable[[str, list[DeviceState]], None]] = []
        self._pods: dict[str, tuple[str, list[str]]] = {}  # pod name -> (resource, device IDs held)
        self._pod_count = 0
        self._pod_resources: grpc.Server | None = None
        self._status_stop = threading.Event()
        self.forgotten: dict[str, float] = {}  # resource -> when the device manager forgot it
        self._status_thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kubelet"))
        server.add_generic_rpc_handlers((registration_handler(self),))
        server.add_insecure_port(unix_target(self.socket_path))
        server.start()
        self._server = server
        log.info("kubelet stand-in listening on %s", self.socket_path)

    def serve_pod_resources(self, path: str) -> None:
        """The pod-resources API on `path` (stopped by stop())."""

        def pods() -> list[tuple[str, tuple[str, list[str]]]]:
            with self._cond:
                return sorted((name, (resource, list(ids))) for name, (resource, ids) in self._pods.items())

        self._pod_resources = pod_resources_server(path, pods)

    def stop(self) -> None:
        """Stop serving and close every plugin stream; leaves kubelet.sock removed."""
        self._status_stop.set()
        if self._status_thread is not None:
            self._status_thread.join(5)
            self._status_thread = None
        self._stop_serving()

    def _stop_serving(self) -> None:
        if self._pod_resources is not None:
            self._pod_resources.stop(grace=None).wait()
            self._pod_resources = None
        with self._cond:
            endpoints = [r.endpoint for r in self._resources.values() if r.endpoint is not None]
        for ep in endpoints:
            self._close_endpoint(ep)
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def restart(self) -> None:
        """Simulate a kubelet restart: close streams, delete every socket, fresh kubelet.sock."""
        with self._cond:
            self._epoch += 1
        self._stop_serving()  # the node's status goes on being written, as by the kubelet that starts
        with self._cond:
            now = time.monotonic()
            for res in self._resources.values():
                # readCheckpoint: each registered resource gets a stopped endpoint and no devices
                # ("resource capacity will stay zero till the corresponding device plugin
                # re-registers"), with a fresh grace period.
                res.endpoint = None
                res.devices = {}
                res.stopped_at = now
            self._cond.notify_all()
        self._checkpoint()
        for entry in os.scandir(self.plugin_dir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        self.start()

    def __enter__(self) -> KubeletStandin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- Registration
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        with self._cond:
            epoch = self._epoch
        error = self._validate(request)
        endpoint: PluginEndpoint | None = None
        if not error:
            try:
                endpoint = self._dial(request)
            except Exception as exc:  # any dial or options failure fails Register
                error = f"failed to get device plugin options: {exc}"
        with self._cond:
            self.registrations.append(
                RegisterCall(request.resource_name, request.endpoint, time.monotonic(), error)
            )
            self._cond.notify_all()
        if error or endpoint is None:
            log.info("registration of %r refused: %s", request.resource_name, error)
            context.abort(grpc.StatusCode.UNKNOWN, error)
        if not self._install(endpoint, epoch):
            # A real kubelet that restarts mid-Register takes the call down with it.
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarted during Register")
        return pb.Empty()

    def _validate(self, request: pb.RegisterRequest) -> str:
        if request.version != VERSION:
            return (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported version is ["{VERSION}"]'
            )
        if not is_extended_resource_name(request.resource_name):
            return f'the ResourceName "{request.resource_name}" is invalid'
        return ""

    def _dial(self, request: pb.RegisterRequest) -> PluginEndpoint:
        path = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.insecure_channel(unix_target(path))
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
            client = DevicePluginClient(channel)
            options = client.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise RuntimeError(f"dial unix {path}: timed out after {self.dial_timeout:g}s") from None
        except grpc.RpcError as exc:
            channel.close()
            raise RuntimeError(_rpc_text(exc)) from None
        with self._cond:
            self._generation += 1
            generation = self._generation
        return PluginEndpoint(
            resource=request.resource_name,
            socket_path=path,
            options=options,
            channel=channel,
            client=client,
            registered_at=time.monotonic(),
            generation=generation,
        )

    def _install(self, endpoint: PluginEndpoint, epoch: int) -> bool:
        with self._cond:
            if epoch != self._epoch:
                endpoint.channel.close()
                return False
            res = self._resources.setdefault(endpoint.resource, Resource(endpoint.resource))
            res.endpoint = endpoint  # the old client, if any, runs on until its stream ends
            res.stopped_at = None
            drop = self.drop_fresh > 0
            if drop:
                self.drop_fresh -= 1
            self._cond.notify_all()
        if drop:
            log.info(
                "%s: dropping the freshly registered endpoint %s", endpoint.resource, endpoint.socket_path
            )
            self._close_endpoint(endpoint)
        thread = threading.Thread(
            target=self._watch, args=(endpoint,), name=f"law-{endpoint.resource}", daemon=True
        )
        thread.start()
        return True

    def _watch(self, endpoint: PluginEndpoint) -> None:
        # Whatever happens, the endpoint ends in _disconnect: it marks the resource's devices
        # and runs the legacy-keying check, which a thread dying on an exception would skip.
        reason = "stream ended"
        try:
            with self._cond:
                # Decided under the lock that _close_endpoint takes: either it sees our stream
                # and cancels it, or we see `closed` and never call on its closed channel.
                if endpoint.closed:
                    reason = "endpoint closed before ListAndWatch started"
                    return
                stream = endpoint.client.ListAndWatch(pb.Empty())  # returns at once; the call runs later
                endpoint.stream = stream
            for response in stream:
                self._apply(endpoint, response)
        except grpc.RpcError as exc:
            reason = _rpc_text(exc)
        except Exception as exc:  # a closed channel (ValueError), a listener's bug: still disconnect
            reason = f"ListAndWatch failed: {exc!r}"
            log.warning("%s: %s", endpoint.resource, reason)
        finally:
            if self.stream_end_delay:
                time.sleep(self.stream_end_delay)  # a kubelet busy elsewhere: the end is seen late
            self._disconnect(endpoint, reason)

    def _apply(self, endpoint: PluginEndpoint, response: pb.ListAndWatchResponse) -> None:
        devices = [
            DeviceState(d.ID, d.health, tuple(int(n.ID) for n in d.topology.nodes)) for d in response.devices
        ]
        with self._cond:
            res = self._resources[endpoint.resource]
            if res.endpoint is not endpoint:
                return
            res.devices = {d.id: d for d in devices}
            endpoint.updates += 1
            self._cond.notify_all()
        self._checkpoint()
        for listener in list(self.listeners):
            listener(endpoint.resource, devices)

    def _disconnect(self, endpoint: PluginEndpoint, reason: str) -> None:
        victim: PluginEndpoint | None = None
        with self._cond:
            endpoint.connected = False
            res = self._resources.get(endpoint.resource)
            newer = res.endpoint if res is not None else None
            if res is not None and newer is endpoint:
                res.stopped_at = time.monotonic()  # PluginDisconnected: setStopTime(time.Now())
            if newer is not None and newer is not endpoint:  # noqa: SIM102 - the comment belongs to the inner test
                if self.legacy_keying and endpoint.generation < newer.generation:
                    # kubernetes#121994: the old instance's stream ending disconnects the new one,
                    # as runClient does it: the current client's connection is closed, so its
                    # stream ends (or, not started yet, never starts).
                    log.warning("%s: old endpoint's stream ended after re-registration", endpoint.resource)
                    newer.connected = False
                    victim = newer
            self._cond.notify_all()
        endpoint.channel.close()
        if victim is not None:
            self._close_endpoint(victim)
        self._checkpoint()
        log.info("%s: ListAndWatch ended (%s)", endpoint.resource, reason)

    # ----------------------------------------------------------------------------- the device manager
    def get_capacity(self) -> tuple[dict[str, int], dict[str, int], list[str]]:
        """The device manager's `GetCapacity`: capacity and allocatable of each resource it has,
        and the resources it forgot in this call (each is named once, when its plugin has been
        gone for the grace period: the `stopGracePeriodExpired` test)."""
        capacity: dict[str, int] = {}
        allocatable: dict[str, int] = {}
        removed: list[str] = []
        now = time.monotonic()
        with self._cond:
            for name, res in list(self._resources.items()):
                if res.stopped_at is not None and now - res.stopped_at > self.grace_s:
                    del self._resources[name]
                    removed.append(name)
                    self.forgotten[name] = now
                    continue
                capacity[name] = res.capacity
                allocatable[name] = res.allocatable
            if removed:
                self._cond.notify_all()
        if removed:
            self._checkpoint()  # needsUpdateCheckpoint
        return capacity, allocatable, removed

    def _checkpoint(self) -> None:
        """writeCheckpoint: registered devices from the healthy ones (a resource whose plugin went
        is listed with none), and the pods' devices; one write at a time, as CreateCheckpoint holds
        the checkpoint manager's mutex (pkg/kubelet/checkpointmanager/checkpoint_manager.go)."""
        if not self.write_checkpoint:
            return
        with self._cond:
            registered = {
                name: sorted(d.id for d in res.devices.values() if d.health == HEALTHY and res.allocatable)
                for name, res in sorted(self._resources.items())
            }
            entries = [
                {"PodUID": pod, "ContainerName": "main", "ResourceName": resource,
                 "DeviceIDs": {"-1": list(ids)}, "AllocResp": ""}
                for pod, (resource, ids) in sorted(self._pods.items())
            ]  # fmt: skip
            write_checkpoint(os.path.join(self.plugin_dir, CHECKPOINT_NAME), registered, entries)

    def node_status(
        self, sink: Callable[[Callable[[dict[str, Any]], None]], object], interval: float = 10.0
    ) -> None:
        """Run the node-status setter every `interval` (the kubelet's nodeStatusUpdateFrequency,
        10 s) until stop(): `sink` is given the change to make to the Node's status."""
        self._status_stop.clear()

        def run() -> None:
            while not self._status_stop.wait(interval):
                self.sync_node_status(sink)

        self._status_thread = threading.Thread(target=run, name="kubelet-node-status", daemon=True)
        self._status_thread.start()

    def sync_node_status(self, sink: Callable[[Callable[[dict[str, Any]], None]], object]) -> None:
        """One node status update, the device manager's part of pkg/kubelet/nodestatus/setters.go
        `MachineInfo`: each resource's capacity is set; a removed one is set to 0, never deleted
        ("Set the capacity of the removed resource to 0 instead of removing the resource from the
        node status"); allocatable loses the extended keys absent from capacity, takes every
        capacity value, then the device manager's allocatable over it."""
        sink(status_setter(*self.get_capacity()))

    def _close_endpoint(self, endpoint: PluginEndpoint) -> None:
        with self._cond:
            endpoint.closed = True
            stream = endpoint.stream
            if stream is None:
                endpoint.connected = False
        if stream is not None:
            stream.cancel()  # its _watch sees the stream end and disconnects
        else:
            # No stream yet, and none will start (`closed`): its _watch goes straight to
            # _disconnect. Closing the channel here covers an endpoint whose _watch never runs.
            endpoint.channel.close()

    # ----------------------------------------------------------------------------- queries
    def resource(self, name: str) -> Resource | None:
        with self._cond:
            return self._resources.get(name)

    def resource_names(self) -> list[str]:
        with self._cond:
            return sorted(self._resources)

    def capacity(self, name: str) -> int:
        with self._cond:
            res = self._resources.get(name)
            return res.capacity if res else 0

    def allocatable(self, name: str) -> int:
        with self._cond:
            res = self._resources.get(name)
            return res.allocatable if res else 0

    def devices(self, name: str) -> dict[str, DeviceState]:
        with self._cond:
            res = self._resources.get(name)
            return dict(res.devices) if res else {}

    def connected(self, name: str) -> bool:
        with self._cond:
            res = self._resources.get(name)
            return bool(res and res.endpoint and res.endpoint.connected and res.endpoint.updates > 0)

    def endpoint_socket(self, name: str) -> str:
        with self._cond:
            res = self._resources.get(name)
            return res.endpoint.socket_path if res and res.endpoint else ""

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Wait until `predicate()` (evaluated under the stand-in's lock) holds; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def wait_listed(self, names: Iterable[str], timeout: float = 10.0) -> bool:
        """Wait until every named resource is registered, connected and has sent a list."""
        wanted = list(names)

        def ready() -> bool:
            for name in wanted:
                res = self._resources.get(name)
                if not (res and res.endpoint and res.endpoint.connected and res.endpoint.updates > 0):
                    return False
            return True

        return self.wait_for(ready, timeout)

    # ----------------------------------------------------------------------------- allocation
    def _client(self, name: str) -> tuple[Resource, PluginEndpoint]:
        with self._cond:
            res = self._resources.get(name)
            if res is None or res.endpoint is None or not res.endpoint.connected:
                raise LookupError(f"resource {name} has no registered plugin")
            return res, res.endpoint

    def preferred(
        self, name: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        _, ep = self._client(name)
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response = ep.client.GetPreferredAllocation(request, timeout=DIAL_TIMEOUT_S)
        return list(response.container_responses[0].deviceIDs)

    def allocate_ids(self, name: str, ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        """Call Allocate with exactly these IDs (shuffled, as the kubelet's map order does)."""
        _, ep = self._client(name)
        shuffled = list(ids)
        self._random.shuffle(shuffled)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=shuffled)])
        response = ep.client.Allocate(request, timeout=DIAL_TIMEOUT_S)
        return response.container_responses[0]

    def allocate(
        self, name: str, count: int, must_include: Sequence[str] = ()
    ) -> tuple[list[str], pb.ContainerAllocateResponse]:
        """Admit a container asking for `count` devices: preferred allocation, then Allocate."""
        res, ep = self._client(name)
        with self._cond:
            available = sorted(
                d.id for d in res.devices.values() if d.health == HEALTHY and d.id not in res.allocated
            )
        if len(available) < count:
            raise LookupError(f"{name}: {count} requested, {len(available)} available")
        chosen: list[str] = []
        if ep.options.get_preferred_allocation_available:
            preferred = self.preferred(name, available, must_include, count)
            chosen = [i for i in preferred if i in available][:count]
        for device_id in list(must_include) + available:  # the kubelet fills in what is missing
            if len(chosen) >= count:
                break
            if device_id not in chosen:
                chosen.append(device_id)
        response = self.allocate_ids(name, chosen)
        with self._cond:
            res.allocated.update(chosen)
            self._pod_count += 1
            self._pods[f"pod-{self._pod_count}"] = (name, list(chosen))
        self._checkpoint()
        return chosen, response

    def release(self, name: str, ids: Iterable[str]) -> None:
        gone = set(ids)
        with self._cond:
            res = self._resources.get(name)
            if res is not None:
                res.allocated.difference_update(gone)
            for pod, (resource, held) in list(self._pods.items()):
                if resource == name:
                    held[:] = [i for i in held if i not in gone]
                    if not held:
                        del self._pods[pod]

    def held(self, name: str) -> set[str]:
        """The device IDs of `name` that containers hold now."""
        with self._cond:
            res = self._resources.get(name)
            return set(res.allocated) if res is not None else set()


def _rpc_text(exc: grpc.RpcError) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    text = details() if callable(details) else str(exc)
    name = code().name if callable(code) else "UNKNOWN"
    return f"rpc error: code = {name} desc = {text}"
