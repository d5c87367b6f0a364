"""A DRA kubelet stand-in: the kubelet's side of the DRA plugin APIs, on real unix sockets.

Beside the device-plugin stand-in (`supervisor.sim.kubelet`), this one behaves as the kubelet's
plugin manager and DRA manager do (kubernetes/kubernetes pkg/kubelet/pluginmanager and
pkg/kubelet/cm/dra, v1.34), so tests and benchmarks exercise the DRA worker the way a node would:

- The plugin watcher: a socket that appears in the registry dir (or is there at start) is dialed
  and asked `GetInfo` (1 s timeout); an unknown plugin type, or supported services none of which
  this kubelet speaks, is refused with `NotifyRegistrationStatus(false, why)`; else the first
  service of the plugin's list that this kubelet supports is chosen, the endpoint recorded, and
  `NotifyRegistrationStatus(true)` sent. A refused or failed socket is tried again each round
  while it stays; a socket that goes away unregisters its plugin. `versions` is what this
  kubelet speaks (a 1.34 kubelet: v1 and v1beta1; give one to test the other).
- The DRA manager's calls: `prepare` / `unprepare` with the chosen version's client, 45 s timeout.
- The health stream (ResourceHealthStatus): when the plugin lists `v1alpha1.DRAResourceHealth`,
  a `NodeWatchResources` stream is kept open, re-opened when it ends, and each message's devices
  recorded with the time they arrived.
- `restart()`: streams end, registrations are forgotten, and the watcher starts over: as the
  real kubelet, it deletes nothing in the registry dir and finds the sockets that are there. Given
  an API client and the node's name (`api`, `node_name`), it first deletes every ResourceSlice of
  the node, as the kubelet does when it starts (a DeleteCollection by `spec.nodeName`).

`ClaimStore` stands in for the API server and the scheduler: it writes allocated
ResourceClaims (resource.k8s.io/v1 JSON, as the API server serves them) where the DRA worker's
`--dra-claims-dir` source reads them.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from common.draapi import (
    HEALTH_SERVICE,
    PLUGIN_TYPE,
    V1_SERVICE,
    V1BETA1_SERVICE,
    healthpb,
    regpb,
    v1,
    v1beta1,
)
from common.draapi.rpc import DraV1beta1Client, DraV1Client, HealthClient, WatcherRegistrationClient

if TYPE_CHECKING:
    from supervisor.kube.client import KubeClient

log = logging.getLogger("gpuvisor.drakubelet")

GET_INFO_TIMEOUT_S = 1.0  # the plugin watcher's GetInfo deadline
NOTIFY_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 45.0  # the DRA manager's default per-call timeout
SCAN_S = 0.05  # the real watcher is inotify-driven: a short poll keeps tests quick
HEALTH_RETRY_S = 0.2
KUBELET_VERSIONS = (V1_SERVICE, V1BETA1_SERVICE)


@dataclass(frozen=True)
class Notification:
    """A registration attempt, as the stand-in answered it."""

    socket: str
    name: str
    registered: bool
    error: str
    at: float


@dataclass(frozen=True)
class DeviceHealthSeen:
    health: str  # "UNKNOWN", "HEALTHY", "UNHEALTHY"
    message: str
    last_updated: int
    timeout_s: int
    at: float  # monotonic, when the stand-in received it


@dataclass
class Plugin:
    """A registered DRA plugin (one driver, one endpoint)."""

    driver: str
    endpoint: str
    service: str  # the chosen DRAPlugin service
    socket: str  # its registration socket
    identity: tuple[int, int, int]
    channel: grpc.Channel
    health: bool
    health_updates: int = 0
    devices: dict[tuple[str, str], DeviceHealthSeen] = field(default_factory=dict)
    closed: bool = False
    stream: Any = None


class DraKubeletStandin:
    """The kubelet's DRA side, in-process, watching `registry_dir`."""

    def __init__(
        self,
        registry_dir: str,
        *,
        versions: Sequence[str] = KUBELET_VERSIONS,
        health_streams: bool = True,
        scan_interval: float = SCAN_S,
        api: KubeClient | None = None,
        node_name: str = "",
    ) -> None:
        self.registry_dir = os.path.abspath(registry_dir)
        self.api = api
        self.node_name = node_name
        self.wipes = 0
        self.versions = tuple(versions)
        self.health_streams = health_streams
        self.scan_interval = scan_interval
        self.notifications: list[Notification] = []
        self._plugins: dict[str, Plugin] = {}  # by driver name
        self._seen: dict[str, tuple[int, int, int]] = {}  # socket -> identity at its last attempt
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._epoch = 0

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        os.makedirs(self.registry_dir, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(self._stop,), name="plugin-watcher", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._cond:
            plugins, self._plugins = list(self._plugins.values()), {}
            self._seen.clear()
            self._epoch += 1
            self._cond.notify_all()
        for plugin in plugins:
            self._close(plugin)

    def restart(self) -> None:
        """A kubelet restart: streams end, registrations go, the node's ResourceSlices are deleted
        (with an API client), the registry dir is read again."""
        self.stop()
        if self.api is not None:
            self.wipe_slices()
        self.start()

    def wipe_slices(self) -> None:
        """What the kubelet's DRA manager does at its start: DeleteCollection of the node's slices."""
        assert self.api is not None
        self.api.request(
            "DELETE",
            "/apis/resource.k8s.io/v1/resourceslices",
            what=f"delete the ResourceSlices of Node {self.node_name}",
            query={"fieldSelector": f"spec.nodeName={self.node_name}"},
        )
        self.wipes += 1

    def __enter__(self) -> DraKubeletStandin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- the watcher
    def _watch(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._scan()
            except Exception:  # a stand-in bug must show, not end the watcher silently
                log.exception("plugin watcher round failed")
            stop.wait(self.scan_interval)

    def _sockets(self) -> dict[str, tuple[int, int, int]]:
        found: dict[str, tuple[int, int, int]] = {}
        try:
            entries = list(os.scandir(self.registry_dir))
        except FileNotFoundError:
            return found
        for entry in entries:
            if entry.name.startswith("."):
                continue  # the plugin watcher ignores hidden files
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[entry.path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        return found

    def _scan(self) -> None:
        sockets = self._sockets()
        with self._cond:
            gone = [p for p in self._plugins.values() if sockets.get(p.socket) != p.identity]
            for plugin in gone:
                del self._plugins[plugin.driver]
                log.info("DRA plugin %s unregistered (%s went away)", plugin.driver, plugin.socket)
            for path in list(self._seen):
                if path not in sockets:
                    del self._seen[path]
            registered = {p.socket for p in self._plugins.values()}
            todo = [(path, ident) for path, ident in sockets.items() if path not in registered]
            epoch = self._epoch
            self._cond.notify_all()
        for plugin in gone:
            self._close(plugin)
        for path, ident in todo:
            self._register(path, ident, epoch)

    def _register(self, path: str, identity: tuple[int, int, int], epoch: int) -> None:
        channel = grpc.insecure_channel(f"unix://{path}")
        client = WatcherRegistrationClient(channel)
        try:
            try:
                info = client.GetInfo(regpb.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
            except grpc.RpcError as exc:
                self._record(path, "", False, f"failed to get plugin info using RPC GetInfo: {_text(exc)}")
                return
            error = self._validate(info)
            if error:
                self._notify(client, path, info.name, False, error)
                return
            chosen = next(s for s in info.supported_versions if s in self.versions)
            plugin = Plugin(
                driver=info.name,
                endpoint=info.endpoint or path,
                service=chosen,
                socket=path,
                identity=identity,
                channel=grpc.insecure_channel(f"unix://{info.endpoint or path}"),
                health=self.health_streams and HEALTH_SERVICE in info.supported_versions,
            )
            with self._cond:
                if epoch != self._epoch:  # restarted meanwhile: this registration is no more
                    plugin.channel.close()
                    return
                old = self._plugins.get(plugin.driver)
                if old is not None and old.endpoint == plugin.endpoint and old.socket != path:
                    error = (
                        f"endpoint {plugin.endpoint} already registered for DRA driver plugin {plugin.driver}"
                    )
                else:
                    self._plugins[plugin.driver] = plugin
                self._cond.notify_all()
            if error:
                plugin.channel.close()
                self._notify(client, path, info.name, False, error)
                return
            if old is not None:
                self._close(old)
            if plugin.health:
                threading.Thread(target=self._health, args=(plugin,), name="dra-health", daemon=True).start()
            self._notify(client, path, info.name, True, "")
            log.info("DRA plugin %s registered at %s (%s)", plugin.driver, plugin.endpoint, plugin.service)
        finally:
            channel.close()

    def _validate(self, info: regpb.PluginInfo) -> str:
        if info.type != PLUGIN_TYPE:
            return f"no handler registered for plugin type: {info.type}"
        if not info.supported_versions:
            return "empty list of supported gRPC services (aka supported versions)"
        if not any(s in self.versions for s in info.supported_versions):
            return (
                f"none of services supported by the plugin ({list(info.supported_versions)}) "
                f"are supported by the kubelet ({list(self.versions)})"
            )
        return ""

    def _notify(self, client: WatcherRegistrationClient, path: str, name: str, ok: bool, error: str) -> None:
        try:
            client.NotifyRegistrationStatus(
                regpb.RegistrationStatus(plugin_registered=ok, error=error), timeout=NOTIFY_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            if ok:  # the plugin refused our good news: it is not registered after all
                with self._cond:
                    plugin = self._plugins.get(name)
                    if plugin is not None and plugin.socket == path:
                        del self._plugins[name]
                error = f"failed to send registration status: {_text(exc)}"
                ok = False
        self._record(path, name, ok, error)

    def _record(self, path: str, name: str, ok: bool, error: str) -> None:
        with self._cond:
            self.notifications.append(Notification(path, name, ok, error, time.monotonic()))
            self._cond.notify_all()

    def _close(self, plugin: Plugin) -> None:
        with self._cond:
            plugin.closed = True
            stream = plugin.stream
        if stream is not None:
            stream.cancel()
        plugin.channel.close()

    # ----------------------------------------------------------------------------- health stream
    def _health(self, plugin: Plugin) -> None:
        client = HealthClient(plugin.channel)
        while True:
            with self._cond:
                if plugin.closed:
                    return
                try:
                    stream = client.NodeWatchResources(healthpb.NodeWatchResourcesRequest())
                except ValueError:  # the channel was closed under us
                    return
                plugin.stream = stream
            try:
                for response in stream:
                    self._health_update(plugin, response)
            except grpc.RpcError as exc:
                log.debug("health stream of %s ended: %s", plugin.driver, _text(exc))
            except ValueError:
                return
            if self._stop.wait(HEALTH_RETRY_S):
                return

    def _health_update(self, plugin: Plugin, response: healthpb.NodeWatchResourcesResponse) -> None:
        now = time.monotonic()
        with self._cond:
            for d in response.devices:
                plugin.devices[(d.device.pool_name, d.device.device_name)] = DeviceHealthSeen(
                    health=healthpb.HealthStatus.Name(d.health),
                    message=d.message,
                    last_updated=int(d.last_updated_time),
                    timeout_s=int(d.health_check_timeout_seconds),
                    at=now,
                )
            plugin.health_updates += 1
            self._cond.notify_all()

    # ----------------------------------------------------------------------------- queries
    def plugin(self, driver: str) -> Plugin | None:
        with self._cond:
            return self._plugins.get(driver)

    def registered(self, driver: str) -> bool:
        return self.plugin(driver) is not None

    def device_health(self, driver: str, pool: str, device: str) -> str:
        """ "HEALTHY", "UNHEALTHY" or "UNKNOWN" as the last health message said; "" when never seen."""
        with self._cond:
            plugin = self._plugins.get(driver)
            seen = plugin.devices.get((pool, device)) if plugin is not None else None
            return seen.health if seen is not None else ""

    def health_seen(self, driver: str) -> dict[tuple[str, str], DeviceHealthSeen]:
        with self._cond:
            plugin = self._plugins.get(driver)
            return dict(plugin.devices) if plugin is not None else {}

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Wait until `predicate()` (evaluated under the stand-in's lock) holds; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def wait_registered(self, driver: str, timeout: float = 10.0) -> bool:
        return self.wait_for(lambda: driver in self._plugins, timeout)

    # ----------------------------------------------------------------------------- the DRA manager's calls
    def _client(self, driver: str) -> DraV1Client | DraV1beta1Client:
        """The chosen version's client; LookupError with the kubelet's words when not registered."""
        plugin = self.plugin(driver)
        if plugin is None:
            raise LookupError(f"DRA driver {driver} is not registered")
        if plugin.service == V1_SERVICE:
            return DraV1Client(plugin.channel)
        return DraV1beta1Client(plugin.channel)

    def prepare(
        self, driver: str, claims: Iterable[tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S
    ) -> Any:
        """NodePrepareResources for (namespace, name, uid) claims with the chosen version's client;
        the response message of that version."""
        client = self._client(driver)
        if isinstance(client, DraV1Client):
            return client.NodePrepareResources(
                v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
                ),
                timeout=timeout,
            )
        return client.NodePrepareResources(
            v1beta1.NodePrepareResourcesRequest(
                claims=[v1beta1.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
            ),
            timeout=timeout,
        )

    def unprepare(
        self, driver: str, claims: Iterable[tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S
    ) -> Any:
        client = self._client(driver)
        if isinstance(client, DraV1Client):
            return client.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(
                    claims=[v1.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
                ),
                timeout=timeout,
            )
        return client.NodeUnprepareResources(
            v1beta1.NodeUnprepareResourcesRequest(
                claims=[v1beta1.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
            ),
            timeout=timeout,
        )


def _text(exc: grpc.RpcError) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    text = details() if callable(details) else str(exc)
    name = code().name if callable(code) else "UNKNOWN"
    return f"rpc error: code = {name} desc = {text}"


# ---------------------------------------------------------------------------------- the API server's part


class ClaimStore:
    """Allocated ResourceClaims in `<dir>/<namespace>/<name>.json`, as the API server serves them
    once the scheduler allocated them (what the DRA worker's `--dra-claims-dir` reads)."""

    def __init__(
        self, directory: str, *, driver: str = "gpu.nvidia.com", device_class: str = "gpu.nvidia.com"
    ) -> None:
        self.directory = directory
        self.driver = driver
        self.device_class = device_class

    def allocate(
        self,
        namespace: str,
        name: str,
        pool: str,
        devices: Sequence[str],
        *,
        request: str = "gpu",
        uid: str | None = None,
        extra_results: Sequence[dict[str, Any]] = (),
    ) -> tuple[str, str, str]:
        """A claim with one request of `len(devices)` devices, allocated to them; (namespace, name, uid)."""
        claim_uid = uid or str(uuid.uuid4())
        results = [{"request": request, "driver": self.driver, "pool": pool, "device": d} for d in devices]
        obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": claim_uid, "resourceVersion": "1"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": request,
                            "exactly": {"deviceClassName": self.device_class, "count": len(devices)},
                        }
                    ]
                }
            },
            "status": {
                "allocation": {
                    "devices": {"results": [*results, *extra_results]},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
                        ]
                    },
                }
            },
        }
        self.put(obj)
        return namespace, name, claim_uid

    def put(self, obj: dict[str, Any]) -> None:
        """Store a claim object as given (a test may hand one the API server would never serve)."""
        meta = obj["metadata"]
        folder = os.path.join(self.directory, meta["namespace"])
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{meta['name']}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(obj, fh)
        os.replace(tmp, path)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        with open(os.path.join(self.directory, namespace, f"{name}.json"), encoding="utf-8") as fh:
            obj: dict[str, Any] = json.load(fh)
            return obj

    def delete(self, namespace: str, name: str) -> None:
        os.unlink(os.path.join(self.directory, namespace, f"{name}.json"))
