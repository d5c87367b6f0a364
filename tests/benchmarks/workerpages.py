"""Where a forked worker's own pages come from: its start, one step at a time.

`python -m tests.benchmarks.workerpages DIR` becomes a zygote as `worker.zygote.main` makes one
(ssl left out, its own argument parsing, the preload and its gc.freeze), makes a worker's
arguments of the fields the supervisor sends as the zygote does before each fork, forks, and in the child
takes a worker's start step by step (the same calls worker.main and worker.server make), reading
`/proc/self/smaps_rollup` after each: the private pages it added, split into dirty pages (what it
wrote: objects copied from the zygote or made anew, a library's data) and clean ones (a library's
code this process is the first to run: its own while it is the only worker, shared once a
second one maps it). The child
prints one JSON object and exits; DIR holds its sockets. bench_memory reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

STEPS = (
    "the fork itself",
    "logging set up",
    "ZeroMQ context and sockets",
    "gRPC server made (gRPC core's first use)",
    "gRPC server started",
    "gRPC channel, ready (as for Register)",
    "protobuf messages",
)


def own_pages() -> tuple[int, int]:
    """(dirty, clean) private bytes of this process: pages it wrote (objects, a library's data),
    and pages of files it alone has mapped (a library's code it runs first: shared, and no
    longer its own, once another worker maps the same pages).

    Read with os.read and bytes methods only: a text file object (its buffer, decoder and
    codec lookups) copied ~0.6 MB of the zygote's pages into the child the first time, which the
    first step (the fork itself) was charged with."""
    fd = os.open("/proc/self/smaps_rollup", os.O_RDONLY)
    try:
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    return _kb(data, b"Private_Dirty:") * 1024, _kb(data, b"Private_Clean:") * 1024


def _kb(data: bytes, head: bytes) -> int:
    at = data.find(head)
    if at < 0:
        return 0
    return int(data[at + len(head) : data.index(b"kB", at)])


def _child(args: argparse.Namespace) -> dict[str, Any]:
    marks = [own_pages()]
    where = os.path.dirname(args.plan)

    def mark() -> None:
        marks.append(own_pages())

    from common import logs

    logs.setup(args.log_format, args.log_level, role="worker", resource=args.resource)
    mark()
    import zmq

    ctx = zmq.Context()
    dealer, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    dealer.connect(f"ipc://{where}/control")
    sub.connect(f"ipc://{where}/health")
    mark()
    from concurrent import futures

    import grpc

    from worker.server import MAX_RPCS, RPC_THREADS

    executor = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="rpc")
    server = grpc.server(executor, options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=MAX_RPCS)
    mark()
    server.add_insecure_port(f"unix://{where}/plugin.sock")
    server.start()
    mark()
    channel = grpc.insecure_channel(f"unix://{where}/plugin.sock")
    grpc.channel_ready_future(channel).result(timeout=10)
    mark()
    from common.kubeletapi import pb

    pb.RegisterRequest(
        version="v1beta1", endpoint="plugin.sock", resource_name=args.resource
    ).SerializeToString()
    pb.ListAndWatchResponse(
        devices=[pb.Device(ID=f"gpu-{i}", health="Healthy") for i in range(8)]
    ).SerializeToString()
    mark()
    channel.close()
    server.stop(0)
    first = marks[0]
    steps = [{"step": STEPS[0], "dirty": first[0], "clean": first[1]}]
    for name, (a0, f0), (a1, f1) in zip(STEPS[1:], marks[:-1], marks[1:], strict=True):
        steps.append({"step": name, "dirty": a1 - a0, "clean": f1 - f0})
    return {"steps": steps, "dirty": marks[-1][0], "clean": marks[-1][1]}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.benchmarks.workerpages DIR", file=sys.stderr)
        return 2
    where = argv[0]
    import gc

    from common.workerargs import check_args, from_fields
    from worker.process import leave_out_ssl
    from worker.zygote import preload

    argparse.ArgumentParser(prog="gpuvisor-zygote").parse_args([])  # as the zygote's main does
    # What the supervisor sends with each spawn: the worker's arguments, parsed there. Its work
    # here is the supervisor's (made before the preload, its garbage collected there).
    fields = json.dumps(
        check_args(["--resource", "nvidia.com/gpu", "--plan", os.path.join(where, "plan.json")])
    )
    leave_out_ssl()
    preload()
    args = from_fields(json.loads(fields))  # as the zygote does at each spawn, before the fork
    own_pages()  # its first run's writes (a code object's warm-up count) made here, not in the child
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 1
        try:
            gc.collect(0)
            # The result is made before anything is written: a file object opened first would
            # be charged to the first step too.
            data = json.dumps(_child(args)).encode()
            while data:
                data = data[os.write(write_end, data) :]
            code = 0
        except BaseException:  # said here: os._exit below would end the child before Python could
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not text:
        print("the forked child failed", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
