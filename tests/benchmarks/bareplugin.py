"""The smallest Python device plugin: the floor that gpuvisor's start, memory, idle CPU and
re-registration are read beside (`tests.benchmarks.floors`).

`python -m tests.benchmarks.bareplugin --kubelet-socket PATH --devices N` imports only what any
Python plugin must (gRPC and the kubelet API's generated messages), serves GetDevicePluginOptions
and ListAndWatch (N healthy devices, sent once, then held open) on a unix socket in the kubelet's
dir, and registers. When kubelet.sock is created again (a kubelet restart; watched with inotify,
as NVIDIA's plugin watches the dir) it stops its server, serves on a new socket name and
registers again. No health, no supervisor, no allocation policy: what is left is what Python and
gRPC cost. It runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from common.kubeletapi import HEALTHY, KUBELET_SOCKET_NAME, VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, device_plugin_handler, unix_target

IN_CREATE = 0x100
IN_MOVED_TO = 0x80
EVENT_HEAD = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class Plugin:
    """GetDevicePluginOptions and ListAndWatch over a fixed list of healthy devices."""

    def __init__(self, devices: int) -> None:
        self.response = pb.ListAndWatchResponse(
            devices=[pb.Device(ID=f"GPU-bare-{i}", health=HEALTHY) for i in range(devices)]
        )
        self._lock = threading.Lock()
        self._ends: list[threading.Event] = []  # one per open stream: set at its end or at stop()
        self._stopped = False

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        end = threading.Event()
        context.add_callback(end.set)  # the client cancelled or went away
        with self._lock:
            self._ends.append(end)
            if self._stopped:
                end.set()
        yield self.response
        end.wait()  # no periodic wake-up: an idle floor must not burn CPU of its own

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for end in self._ends:
                end.set()

    def GetPreferredAllocation(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "bare plugin")

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "bare plugin")

    def PreStartContainer(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "bare plugin")


def inotify_watch(directory: str) -> int:
    """An inotify fd reporting entries created (or moved) into `directory`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0 or libc.inotify_add_watch(fd, directory.encode(), IN_CREATE | IN_MOVED_TO) < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    return fd


def created_names(fd: int) -> list[str]:
    names = []
    data = os.read(fd, 65536)
    offset = 0
    while offset + EVENT_HEAD.size <= len(data):
        _wd, _mask, _cookie, length = EVENT_HEAD.unpack_from(data, offset)
        start = offset + EVENT_HEAD.size
        names.append(data[start : start + length].rstrip(b"\0").decode(errors="replace"))
        offset = start + length
    return names


def stop(plugin: Plugin, server: grpc.Server, path: str) -> None:
    """End the streams first (the kubelet reads their end), then the server, then its socket."""
    plugin.stop()
    server.stop(0.5).wait()
    if os.path.exists(path):
        os.unlink(path)


def serve(kubelet_socket: str, resource: str, devices: int) -> None:
    plugin_dir = os.path.dirname(kubelet_socket)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: None)
    watch = inotify_watch(plugin_dir)
    executor = futures.ThreadPoolExecutor(max_workers=4)
    plugin: Plugin | None = None
    server: grpc.Server | None = None
    path = ""
    for start in range(1_000_000):
        if server is not None and plugin is not None:
            stop(plugin, server, path)
        plugin = Plugin(devices)
        path = os.path.join(plugin_dir, f"bare-{os.getpid()}-{start}.sock")
        server = grpc.server(executor, options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((device_plugin_handler(plugin),))
        server.add_insecure_port(unix_target(path))
        server.start()
        with grpc.insecure_channel(unix_target(kubelet_socket)) as channel:
            RegistrationClient(channel).Register(
                pb.RegisterRequest(version=VERSION, endpoint=os.path.basename(path), resource_name=resource),
                timeout=15,
            )
        while True:  # until kubelet.sock is made again, or SIGTERM
            ready, _, _ = select.select([watch, wake_r], [], [])
            if wake_r in ready:
                stop(plugin, server, path)
                return
            if KUBELET_SOCKET_NAME in created_names(watch):
                break


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bareplugin")
    p.add_argument("--kubelet-socket", required=True)
    p.add_argument("--resource", default="nvidia.com/gpu")
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    serve(args.kubelet_socket, args.resource, args.devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
