"""The supervisor survives what an independent review found could end its loop or split a resource."""

from __future__ import annotations

import os
import shutil
import signal

import zmq

from common.messages import Heartbeat, Shutdown, SnapshotRequest, decode, encode
from tests.harness import SimNode, run_supervisor
from tests.helpers import short_tmpdir, wait_until

GPU = "nvidia.com/gpu"


def _dealer(node: SimNode) -> zmq.Socket[bytes]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{os.path.join(node.run_dir, 'control.sock')}")
    return sock


def test_snapshot_request_for_an_unknown_resource_does_not_end_the_supervisor() -> None:
    """A SnapshotRequest naming no planned resource (a resource a reload just removed) is ignored; the supervisor keeps serving."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        sock = _dealer(node)
        try:
            sock.send_multipart(encode(SnapshotRequest(resource="nvidia.com/removed"), seq=1))
            assert node.command("status")["resources"], "the supervisor stopped answering"
        finally:
            sock.close(0)
        assert node.proc is not None and node.proc.poll() is None
        assert node.kubelet.allocatable(GPU) == 4


def test_heartbeat_from_an_unknown_worker_is_told_to_shut_down() -> None:
    """A heartbeat from a worker PID the supervisor did not start is answered with Shutdown."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        sock = _dealer(node)
        try:
            beat = Heartbeat(
                resource=GPU, pid=999_999, state="registered", registered=True, socket_path="/x.sock"
            )
            sock.send_multipart(encode(beat, seq=1))
            assert sock.poll(10_000), "no answer to a stranger's heartbeat"
            assert isinstance(decode(sock.recv_multipart()).message, Shutdown)
        finally:
            sock.close(0)
        assert node.kubelet.allocatable(GPU) == 4  # our own worker is untouched


def test_reload_is_refused_when_the_plans_cannot_be_written() -> None:
    """A reload whose plan files cannot be written is refused with one log line; the running plans and workers stay."""
    with short_tmpdir() as tmp:
        config = os.path.join(tmp, "config.yaml")
        with open(config, "w") as fh:
            fh.write("version: v1\n")
        with SimNode("pcie-l4", args=["--config-file", config]) as node:
            node.wait_listed([GPU])
            pid = node.worker_pid(GPU)
            plans = os.path.join(node.run_dir, "plans")
            shutil.rmtree(plans)
            with open(plans, "w") as fh:  # a file where the directory was: every write fails (even as root)
                fh.write("")
            with open(config, "w") as fh:
                fh.write(
                    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: gpu, replicas: 2}\n"
                )
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGHUP)
            assert wait_until(lambda: "refused, keeping the running plans" in node.log(), 15), node.log()[
                -3000:
            ]
            assert node.proc.poll() is None
            assert node.worker_pid(GPU) == pid
            assert node.kubelet.capacity(GPU) == 4 and node.kubelet.allocatable(GPU) == 4
            os.unlink(plans)


def test_run_dir_too_long_for_a_socket_is_a_config_error() -> None:
    """A run dir whose control socket path would not fit a unix socket exits 78 with a clear line, no traceback."""
    with short_tmpdir() as tmp:
        result = run_supervisor(tmp, ["--simulate", "pcie-l4"], run_dir=os.path.join(tmp, "r" * 110))
        assert result.returncode == 78, result.stderr
        assert "Traceback" not in result.stderr
        assert "too long" in result.stderr.strip().splitlines()[-1]
