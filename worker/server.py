"""One start of a resource's DevicePlugin server on a unix socket: its socket, its streams' slots,
start and stop. The servicer it serves is worker.service's; the registrar (worker.registration)
makes a new `PluginServer` for each registration.

A restart for re-registration is a new `PluginServer` on a fresh socket name, and stopping one
ends its streams first, so the kubelet never sees an old stream outlive its successor's
registration (kubernetes#121994).

Streams are bounded so that they can never starve the unary calls: worker.rpcserver gives each
RPC a thread of a pool of `RPC_THREADS` for its whole life, and a ListAndWatch stream lives as long
as its client. A server admits `MAX_STREAMS_PER_SERVER` concurrent streams: the kubelet's, which
is the first to open after the registrar offers the server in a Register (each registration gets a
fresh server), and a few more (a monitoring tool, a client reconnecting), which may never take
the kubelet's slot: a stream that opens before the offer, or an extra beyond
`MAX_STREAMS_PER_SERVER - 1`, is refused and holds no thread. So Allocate,
GetPreferredAllocation and the rest always have `RPC_THREADS - MAX_STREAMS_PER_SERVER` threads,
and streams that race ahead of the kubelet neither lock it out nor pass for it. `MAX_RPCS`
bounds what gRPC keeps in flight or queued at all.

Socket names are `gpuvisor-<resource name>-<tag><nn>.sock`: the supervisor gives each worker
process a tag (6 hex digits) and records it, and nn counts the process's server starts, so the
supervisor removes only sockets that its own workers made (supervisor/host/rundir.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent import futures
from typing import Any, Protocol

import grpc

from common.kubeletapi.rpc import unix_target
from worker.healthboard import HealthBoard
from worker.rpcserver import RpcServer

# Upper bound for in-flight unary RPCs (an Allocate) to finish when a server stops. Streams are
# ended by our own flag before gRPC's stop, so a stop normally returns in about a millisecond.
STOP_GRACE_S = 0.5
# How long a stopped server's connections stay open after its streams ended, for the clients to
# read the end of their streams before gRPC closes the connections (PluginServer.stop).
LINGER_S = 0.2
RPC_THREADS = 8  # a kubelet holds one stream and makes a few unary calls at a time
MAX_STREAMS_PER_SERVER = 3  # the kubelet's stream and two more; the other 5 threads stay for unary calls
MAX_RPCS = 64  # in flight and queued, per server: more get RESOURCE_EXHAUSTED from gRPC itself


class Served(Protocol):
    """What a server serves (worker.service.PluginService)."""

    server: PluginServer | None  # the newest server started

    @property
    def book(self) -> HealthBoard:
        """The board whose streams a stop wakes."""
        ...

    def next_socket_name(self, plugin_dir: str = "") -> str:
        """A fresh socket file name for one server start."""
        ...

    def handler_for(self, server: PluginServer) -> grpc.GenericRpcHandler[Any, Any]:
        """The service as `server` serves it (its streams tied to that server)."""
        ...


class PluginServer:
    """One start of the gRPC server for a resource, on its own fresh socket name."""

    def __init__(
        self, service: Served, plugin_dir: str, executor: futures.ThreadPoolExecutor | None = None
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
        self._server: RpcServer | None = None
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
        server = RpcServer((self.service.handler_for(self),), executor, MAX_RPCS, inline_unary=True)
        self.service.server = self
        server.start(unix_target(self.path))
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
                server.stop(grace)
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


def _close_after_linger(server: RpcServer, grace: float) -> None:
    time.sleep(LINGER_S)  # the clients' time to read the end of their streams (PluginServer.stop)
    server.stop(grace)
