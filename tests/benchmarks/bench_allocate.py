"""Allocate latency through a real worker process, beside a bare gRPC echo in the same run.

The absolute latency of a Python gRPC call on this machine is mostly gRPC and the scheduler; what
gpuvisor adds is the ratio to the floor. So one run measures both, interleaved call by call so
they share the same noise:
- Allocate: a standalone worker (`python -m worker`, dgx-h100-like plan, 8 GPUs) registered with
  the kubelet stand-in; the stand-in calls Allocate as the kubelet does (`allocate_ids`, 1 or 2
  GPU IDs, shuffled).
- Echo: a separate process serving one unary method that returns its request bytes (gRPC generic
  handler, the same thread-pool size as the worker), on a unix socket in the same dir, called
  with the same request bytes over a plain channel.
This module is also the echo server: `python -m tests.benchmarks.bench_allocate --echo PATH`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
from concurrent import futures
from typing import Any

import grpc

from common.kubeletapi import pb
from common.kubeletapi.rpc import unix_target
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from supervisor.sim.kubelet import KubeletStandin
from tests import nodes
from tests.benchmarks.common import Row, Timer, p50, p99
from tests.harness import child_env
from tests.helpers import REPO, short_tmpdir

GPU = "nvidia.com/gpu"
ECHO_METHOD = "/gpuvisor.bench.Echo/Echo"


def _identity(data: bytes) -> bytes:
    return data


def serve_echo(path: str) -> None:
    """Serve the echo method on `path` until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "gpuvisor.bench.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(
                echo, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(unix_target(path))
    server.start()
    print("ready", flush=True)
    stop.wait()
    server.stop(None).wait()
    if os.path.exists(path):
        os.unlink(path)


def run(quick: bool) -> list[Row]:
    calls = 300 if quick else 2000
    warmup = 50
    plan = plan_resources(nodes.dgx_h100(), config_from_data(None))[GPU]
    ids = [d.id for d in plan.devices]
    procs: list[subprocess.Popen[Any]] = []
    with short_tmpdir("gvb") as d:
        kubelet = KubeletStandin(d, legacy_keying=True)
        kubelet.start()
        try:
            plan_path = os.path.join(d, "plan.json")
            with open(plan_path, "w", encoding="utf-8") as fh:
                fh.write(plan.to_json())
            worker = subprocess.Popen(
                [sys.executable, "-m", "worker", "--resource", GPU, "--plan", plan_path,
                 "--kubelet-socket", kubelet.socket_path, "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                cwd=REPO, env=child_env(),
            )  # fmt: skip
            procs.append(worker)
            echo_path = os.path.join(d, "echo.sock")
            echo = subprocess.Popen(
                [sys.executable, "-m", "tests.benchmarks.bench_allocate", "--echo", echo_path],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=REPO, env=child_env(),
            )  # fmt: skip
            procs.append(echo)
            if not kubelet.wait_listed([GPU], 30):
                raise RuntimeError("the worker did not register within 30 s")
            assert echo.stdout is not None
            if echo.stdout.readline().strip() != b"ready":
                raise RuntimeError("the echo server did not start")
            channel = grpc.insecure_channel(unix_target(echo_path))
            try:
                call = channel.unary_unary(
                    ECHO_METHOD, request_serializer=_identity, response_deserializer=_identity
                )
                allocate, bare = _measure(kubelet, call, ids, calls, warmup)
            finally:
                channel.close()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            kubelet.stop()
    a50, a99, e50, e99 = p50(allocate.ms()), p99(allocate.ms()), p50(bare.ms()), p99(bare.ms())
    note = f"{len(allocate.samples)} calls each, interleaved"
    return [
        Row("allocate p50", a50, "ms", "", "worker process via the stand-in, 1-2 GPUs"),
        Row("allocate p99", a99, "ms"),
        Row("echo p50", e50, "ms", "", "bare gRPC echo process, same request bytes"),
        Row("echo p99", e99, "ms"),
        Row("ratio p50", a50 / e50, "x", "<= 1.3x", note),
        Row("ratio p99", a99 / e99, "x", "<= 1.3x", note),
    ]


def _measure(
    kubelet: KubeletStandin,
    echo: grpc.UnaryUnaryMultiCallable[bytes, bytes],
    ids: list[str],
    calls: int,
    warmup: int,
) -> tuple[Timer, Timer]:
    rng = random.Random(3)
    allocate, bare = Timer(), Timer()
    for i in range(warmup + calls):
        chosen = rng.sample(ids, 1 + i % 2)
        payload = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]
        ).SerializeToString()
        if i < warmup:
            kubelet.allocate_ids(GPU, chosen)
            echo(payload, timeout=10)
            continue
        # Alternate which goes first, so neither always follows the other's cache effects.
        order = (0, 1) if i % 2 else (1, 0)
        for which in order:
            if which == 0:
                with allocate:
                    kubelet.allocate_ids(GPU, chosen)
            else:
                with bare:
                    echo(payload, timeout=10)
    return allocate, bare


def _main() -> int:
    p = argparse.ArgumentParser(description="the bare gRPC echo server of bench_allocate")
    p.add_argument("--echo", required=True, metavar="SOCKET")
    serve_echo(p.parse_args().echo)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
