"""worker.rpcserver: the workers' blocking servicers served by grpc.aio, with the context
behaviour they rely on from gRPC's sync server (abort, add_callback, is_active)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.helpers import short_tmpdir, wait_until
from worker.rpcserver import RpcServer

SERVICE = "test.Echo"


def _ident(b: bytes) -> bytes:
    return b


class Servicer:
    """Unary Echo (aborts on b"abort"), and Stream: responses until the call is over."""

    def __init__(self) -> None:
        self.ended = threading.Event()  # the stream's add_callback ran
        self.closed = threading.Event()  # the stream's generator was closed (its finally ran)
        self.late_add: bool | None = None  # add_callback after the call was over
        self.contexts: list[Any] = []

    def echo(self, request: bytes, context: Any) -> bytes:
        if request == b"abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to abort")
        return request

    def stream(self, request: bytes, context: Any) -> Iterator[bytes]:
        self.contexts.append(context)
        assert context.add_callback(self.ended.set)
        if request == b"abort":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no slot")
        try:
            for i in range(int(request)):
                yield b"%d" % i
            while context.is_active():
                self.ended.wait(5.0)
        finally:
            self.closed.set()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo, _ident, _ident),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream, _ident, _ident),
            },
        )


@pytest.fixture
def served() -> Iterator[tuple[Servicer, grpc.Channel]]:
    servicer = Servicer()
    pool = futures.ThreadPoolExecutor(4)
    with short_tmpdir() as tmp:
        target = f"unix://{Path(tmp) / 's.sock'}"
        server = RpcServer((servicer.handler(),), pool, max_rpcs=8)
        server.start(target)
        channel = grpc.insecure_channel(target)
        try:
            yield servicer, channel
        finally:
            channel.close()
            server.stop(0.5)
            pool.shutdown(wait=True)


def test_a_unary_call_answers_and_abort_sends_its_code_and_details(
    served: tuple[Servicer, grpc.Channel],
) -> None:
    """A unary servicer's return value is the answer; its `context.abort` ends the call with the
    code and details it gave, as on gRPC's sync server."""
    _servicer, channel = served
    echo = channel.unary_unary(f"/{SERVICE}/Echo", _ident, _ident)
    assert echo(b"hello", timeout=10) == b"hello"
    with pytest.raises(grpc.RpcError) as err:
        echo(b"abort", timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "asked to abort"


def test_a_stream_sends_in_order_and_a_client_cancel_runs_the_callback_and_closes_it(
    served: tuple[Servicer, grpc.Channel],
) -> None:
    """A stream's responses arrive in order; when the client cancels, the callbacks it added run,
    `is_active` turns False and its generator is closed (its `finally` runs), so the servicer's
    stream slots are given back."""
    servicer, channel = served
    call: Any = channel.unary_stream(f"/{SERVICE}/Stream", _ident, _ident)(b"3", timeout=30)
    assert [next(call) for _ in range(3)] == [b"0", b"1", b"2"]
    assert servicer.contexts[0].is_active()
    call.cancel()
    assert servicer.ended.wait(10), "add_callback's callback did not run on a cancel"
    assert servicer.closed.wait(10), "the generator was not closed"
    assert not servicer.contexts[0].is_active()
    assert servicer.contexts[0].add_callback(lambda: None) is False


def test_a_stream_aborted_before_its_first_response_ends_with_the_code(
    served: tuple[Servicer, grpc.Channel],
) -> None:
    """A stream that aborts before yielding (a refused extra stream) ends with its code and
    details, and the callback it added first still runs."""
    servicer, channel = served
    call: Any = channel.unary_stream(f"/{SERVICE}/Stream", _ident, _ident)(b"abort", timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "no slot"
    assert wait_until(servicer.ended.is_set, 10)


def test_a_socket_that_cannot_be_bound_raises_runtime_error() -> None:
    """Serving where no socket can be made raises RuntimeError, as the sync server's
    add_insecure_port does (the callers turn it into their own error)."""
    pool = futures.ThreadPoolExecutor(1)
    try:
        with pytest.raises(RuntimeError):
            RpcServer((), pool, max_rpcs=1).start("unix:///nonexistent-gpuvisor-dir/s.sock")
    finally:
        pool.shutdown()


def test_inline_unary_answers_on_the_loop_and_streams_stay_on_the_pool() -> None:
    """With `inline_unary` a unary method runs on the loop's own thread ("grpc-aio": no thread hop
    each way, for the device plugin's quick Allocate); without it, on the pool; a stream always
    runs on the pool, where it may wait."""
    threads: list[str] = []

    def where(request: bytes, context: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return request

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(where, _ident, _ident)}
    )
    pool = futures.ThreadPoolExecutor(2, thread_name_prefix="pool")
    with short_tmpdir() as tmp:
        for n, inline in enumerate((True, False)):
            target = f"unix://{Path(tmp) / f's{n}.sock'}"
            server = RpcServer((handler,), pool, max_rpcs=4, inline_unary=inline)
            server.start(target)
            try:
                with grpc.insecure_channel(target) as channel:
                    assert channel.unary_unary(f"/{SERVICE}/Echo", _ident, _ident)(b"x", timeout=10) == b"x"
            finally:
                server.stop(0.5)
    pool.shutdown()
    assert threads[0] == "grpc-aio" and threads[1].startswith("pool")
