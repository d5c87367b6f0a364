"""gRPC servers that sleep while idle: grpc.aio servers on one event loop, serving the workers'
plain (blocking) servicers.

Why not gRPC's sync server: each one runs a thread (`_serve`) that wakes every 200 ms to check for
signals whether or not anything happens (grpc/_cython completion queue, `_INTERRUPT_CHECK_PERIOD_MS`),
about 300 wake-ups a minute per socket; a DRA worker serves two sockets, a node many. An aio
server waits on its completion queue with no timeout, so an idle worker's servers cost nothing
(tests/benchmarks/bench_idle_cpu.py counts the wake-ups).

The servicers stay as they are, written for a thread each: every call runs on the worker's pool
(`RPC_THREADS` of worker.server, and so the same bounds on streams and unary calls), a stream's
generator in one pool thread from its first response to its last, each response written before
the next is asked for. A server whose unary methods never block (the device plugin's Allocate
and its kin compute their answer from what the worker holds) answers those on the loop's own
thread instead (`inline_unary`): no thread hop each way, most of what an aio call costs over a
sync one. They get a `CallContext`, the part of `grpc.ServicerContext` they use:
`abort` (the call ends with that status and details), `add_callback` (run once when the call is
over on our side, its status sent, or False when it is over already) and `is_active`.

The loop runs in one daemon thread per process ("grpc-aio"), started by the first server; a
forked child starts its own (the zygote never starts one before it forks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import grpc.aio

log = logging.getLogger("gpuvisor.worker")


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CallContext:
    """What the blocking servicers use of a call's context, over grpc.aio's."""

    def __init__(self, call: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None once the call is over

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with `code` and `details` (raises, as grpc.ServicerContext.abort does)."""
        raise _Aborted(code, details)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def is_active(self) -> bool:
        with self._lock:
            return self._callbacks is not None

    def over(self, _call: object = None) -> None:
        """The call is done (aio's done callback, on the loop's thread): run the callbacks, once."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one callback's bug must not cost the others (a stop waits on them)
                log.exception("a call's end callback failed")


class _Loop:
    """The process's event loop, in its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="grpc-aio", daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


_loop_lock = threading.Lock()
_the_loop: _Loop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    global _the_loop
    with _loop_lock:
        if _the_loop is None or _the_loop.pid != os.getpid():
            _the_loop = _Loop()
        return _the_loop.loop


def _unary(
    behaviour: Callable[[Any, Any], Any], pool: futures.ThreadPoolExecutor | None
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        ctx = CallContext(context)
        context.add_done_callback(ctx.over)  # type: ignore[arg-type]  # (the stub's DoneCallback is a class)
        try:
            if pool is None:  # a quick answer, on the loop itself: no thread hop each way
                return behaviour(request, ctx)
            return await asyncio.get_running_loop().run_in_executor(pool, behaviour, request, ctx)
        except _Aborted as exc:
            await context.abort(exc.code, exc.details)

    return call


def _stream(
    behaviour: Callable[[Any, Any], Iterator[Any]], pool: futures.ThreadPoolExecutor
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        ctx = CallContext(context)
        context.add_done_callback(ctx.over)  # type: ignore[arg-type]  # (the stub's DoneCallback is a class)
        loop = asyncio.get_running_loop()

        def pump() -> None:
            # The whole generator in this one pool thread, as the sync server runs it; a write
            # that fails (the call is over) ends it, and it is closed here, its `finally` run.
            responses = behaviour(request, ctx)
            try:
                for response in responses:
                    try:
                        asyncio.run_coroutine_threadsafe(context.write(response), loop).result()
                    except Exception:  # only a call that is over fails a write
                        return
            finally:
                close = getattr(responses, "close", None)
                if close is not None:
                    close()

        try:
            await loop.run_in_executor(pool, pump)
        except _Aborted as exc:
            await context.abort(exc.code, exc.details)

    return call


if TYPE_CHECKING:
    _Handler = grpc.GenericRpcHandler[Any, Any]
else:
    _Handler = grpc.GenericRpcHandler


class _Adapted(_Handler):
    """A servicer's generic handler, its unary and server-streaming methods run on the pool."""

    def __init__(
        self, inner: grpc.GenericRpcHandler[Any, Any], pool: futures.ThreadPoolExecutor, inline_unary: bool
    ) -> None:
        self._inner = inner
        self._pool = pool
        self._unary_pool = None if inline_unary else pool

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(details)
        if handler is None:
            return None
        if handler.request_streaming:  # none of the kubelet's APIs has one
            raise NotImplementedError(f"client-streaming method {details.method}")
        if handler.response_streaming:
            assert handler.unary_stream is not None
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream, self._pool),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        assert handler.unary_unary is not None
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary, self._unary_pool),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class RpcServer:
    """One gRPC server on one unix socket, on the process's loop."""

    def __init__(
        self,
        handlers: Sequence[grpc.GenericRpcHandler[Any, Any]],
        pool: futures.ThreadPoolExecutor,
        max_rpcs: int,
        *,
        inline_unary: bool = False,
    ) -> None:
        """`inline_unary`: the unary methods answer on the loop's thread (they must never block:
        the device plugin's Allocate and its kin compute an answer from what the worker holds)."""
        self._handlers = tuple(_Adapted(h, pool, inline_unary) for h in handlers)
        self._max_rpcs = max_rpcs
        self._loop = _event_loop()
        self._server: grpc.aio.Server | None = None

    def _run(self, coro: Any, timeout: float, what: str) -> Any:
        """Run `coro` on the loop; RuntimeError when it takes over `timeout` (it is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise RuntimeError(f"gRPC server {what} took over {timeout:g}s") from None

    def start(self, target: str, timeout: float = 10.0) -> None:
        """Serve on `target` (`unix://<path>`). Raises RuntimeError when it cannot bind or start."""

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server(
                handlers=self._handlers,
                options=[("grpc.so_reuseport", 0)],
                maximum_concurrent_rpcs=self._max_rpcs,
            )
            server.add_insecure_port(target)
            await server.start()
            return server

        self._server = self._run(start(), timeout, f"start on {target}")

    def stop(self, grace: float) -> None:
        """Stop: calls still running get `grace` seconds, then are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            try:
                self._run(server.stop(grace), grace + 2.0, "stop")
            except RuntimeError as exc:  # a stop never fails its caller: the socket still goes
                log.warning("%s", exc)
