"""The kubelet stand-in keeps the real kubelet's rules for a device plugin's resource on the Node.

Read in Kubernetes v1.34's source (the stand-in is supervisor/sim/kubelet.py):

- pkg/kubelet/cm/devicemanager/manager.go `PluginDisconnected`: the plugin's devices turn
  unhealthy and its endpoint gets a stop time; `GetCapacity`: while
  `stopGracePeriodExpired` is false (types.go `endpointStopGracePeriod = 5 * time.Minute`) the
  resource is capacity = all its devices, allocatable = healthy ones (none); once it is true the
  resource is deleted, named once in the returned deleted list, and the checkpoint written
  without it (`writeCheckpoint`: `RegisteredDevices` from the manager's resources);
- `readCheckpoint`, at a kubelet start: each registered resource of the checkpoint gets a stopped
  endpoint and no devices ("resource capacity will stay zero till the corresponding device
  plugin re-registers"), so a new grace period;
- pkg/kubelet/nodestatus/setters.go `MachineInfo`: the device manager's capacity and allocatable
  are set on the Node; a deleted resource's capacity is set to 0 ("instead of removing the
  resource from the node status"); no setter deletes an extended resource from capacity;
  allocatable keys absent from capacity are pruned;
- pkg/kubelet/kubelet_node_status.go `tryUpdateNodeStatus`: the setters run on the Node as the
  API server has it and a change is patched: a key someone removed comes back exactly while a
  setter still produces it.

Each test drives the stand-in with a small device plugin of its own (a real gRPC server on a
unix socket) and the fake API server's state in this process, syncing the Node by hand.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from common.kubeletapi import HEALTHY, VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, device_plugin_handler, unix_target
from supervisor.sim.kubelet import CHECKPOINT_NAME, KubeletStandin
from tests.helpers import short_tmpdir, wait_until
from tests.kubeapi import FakeApiServer

GPU = "nvidia.com/gpu"
NODE = "n1"


class Plugin:
    """A device plugin serving two healthy devices until stop()."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "plugin.sock")
        self.done = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((device_plugin_handler(self),))
        self.server.add_insecure_port(unix_target(self.path))
        self.server.start()

    def GetDevicePluginOptions(self, request: Any, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=HEALTHY) for i in ("a", "b")])
        self.done.wait()

    def GetPreferredAllocation(self, request: Any, context: Any) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse()

    def Allocate(self, request: Any, context: Any) -> pb.AllocateResponse:
        return pb.AllocateResponse()

    def PreStartContainer(self, request: Any, context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    def register(self, socket_path: str) -> None:
        channel = grpc.insecure_channel(unix_target(socket_path))
        try:
            RegistrationClient(channel).Register(
                pb.RegisterRequest(version=VERSION, endpoint="plugin.sock", resource_name=GPU), timeout=10
            )
        finally:
            channel.close()

    def stop(self) -> None:
        self.done.set()
        self.server.stop(grace=None).wait()


@pytest.fixture
def node() -> Iterator[tuple[KubeletStandin, FakeApiServer, Plugin, str]]:
    with short_tmpdir() as directory:
        kubelet = KubeletStandin(directory, grace_s=0.5, write_checkpoint=True)
        kubelet.start()
        api = FakeApiServer()
        api.add_node(NODE)
        plugin = Plugin(directory)
        try:
            plugin.register(kubelet.socket_path)
            assert kubelet.wait_listed([GPU])
            yield kubelet, api, plugin, directory
        finally:
            plugin.stop()
            kubelet.stop()


def _sync(kubelet: KubeletStandin, api: FakeApiServer) -> tuple[str | None, str | None]:
    kubelet.sync_node_status(lambda setter: api.kubelet_status(NODE, setter))
    status = api.nodes[NODE]["status"]
    return status.get("capacity", {}).get(GPU), status.get("allocatable", {}).get(GPU)


def _remove(api: FakeApiServer) -> None:
    with api.lock:
        for part in ("capacity", "allocatable"):
            api.nodes[NODE]["status"].get(part, {}).pop(GPU, None)


def _registered(directory: str) -> dict[str, list[str]] | None:
    """The checkpoint's RegisteredDevices (None before the first write)."""
    try:
        with open(os.path.join(directory, CHECKPOINT_NAME), encoding="utf-8") as fh:
            registered: dict[str, list[str]] = json.load(fh)["Data"]["RegisteredDevices"]
    except FileNotFoundError:
        return None
    return registered


def test_a_gone_plugin_is_counted_for_the_grace_period_then_kept_at_zero(
    node: tuple[KubeletStandin, FakeApiServer, Plugin, str],
) -> None:
    """2/2 while served; the plugin goes: 2/0 through the grace period (the checkpoint still lists
    it, with no device), then 0/0 and the checkpoint without it; the key stays at 0 on every
    later update."""
    kubelet, api, plugin, directory = node
    assert _sync(kubelet, api) == ("2", "2")
    assert wait_until(lambda: _registered(directory) == {GPU: ["a", "b"]}, 10)
    plugin.stop()
    assert wait_until(lambda: _registered(directory) == {GPU: []}, 10)
    assert _sync(kubelet, api) == ("2", "0")
    assert wait_until(lambda: _sync(kubelet, api) == ("0", "0"), 10)
    assert _registered(directory) == {}
    for _ in range(3):
        assert _sync(kubelet, api) == ("0", "0")


def test_a_key_removed_in_the_grace_period_comes_back_and_one_removed_after_it_stays_gone(
    node: tuple[KubeletStandin, FakeApiServer, Plugin, str],
) -> None:
    """Removed from the Node while the device manager still has the resource: the next update
    writes it again. Removed once the manager forgot it: no update writes it again."""
    kubelet, api, plugin, _directory = node
    plugin.stop()
    assert wait_until(lambda: not kubelet.connected(GPU), 10)
    _remove(api)
    assert _sync(kubelet, api) == ("2", "0")
    assert wait_until(lambda: _sync(kubelet, api) == ("0", "0"), 10)
    _remove(api)
    for _ in range(3):
        assert _sync(kubelet, api) == (None, None)


def test_a_restart_with_the_resource_in_its_checkpoint_brings_the_zero_back_for_a_grace_period(
    node: tuple[KubeletStandin, FakeApiServer, Plugin, str],
) -> None:
    """The kubelet restarts while its checkpoint lists the resource (the plugin gone): 0/0 is
    written again, even over a removal, until a new grace period has passed; a restart after the
    manager forgot the resource does not bring it back."""
    kubelet, api, plugin, directory = node
    plugin.stop()
    kubelet.restart()
    assert GPU in (_registered(directory) or {})
    _remove(api)
    assert _sync(kubelet, api) == ("0", "0")
    assert wait_until(lambda: _sync(kubelet, api) == ("0", "0") and _registered(directory) == {}, 10)
    _remove(api)
    kubelet.restart()
    assert _sync(kubelet, api) == (None, None)
