"""Never lose a resource (issue 14), against a real supervisor, real workers and the kubelet
stand-in: kill storms, a worker that cannot start for a while, stray entries in the kubelet dir."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import zmq

from common.messages import Heartbeat, Hello, Shutdown, StatusReport, decode, encode
from tests.benchmarks.bench_killstorm import storm
from tests.harness import ExtraStreams, SimNode, config_node, metrics_url, sample
from tests.helpers import fill_filesystem, plant_stray, tmpfs_at, wait_until

GPU = "nvidia.com/gpu"


def test_a_kill_storm_never_makes_the_worker_fatal() -> None:
    """8 SIGKILLs of the registered worker, 1 s after each recovery: each comes back, no backoff, never FATAL."""
    with SimNode("dgx-h100", args=["--metrics-address", "127.0.0.1:0"]) as node:
        recoveries = storm(node, 8, 1.0)
        assert len(recoveries) == 8, node.log()[-3000:]
        print(f"\nrecoveries (ms): {[round(r) for r in recoveries]}")
        assert "-> FATAL" not in node.log() and "restart in" not in node.log(), "a backoff or FATAL"
        # The kubelet lists the new endpoint a moment before the worker's heartbeat saying it
        # registered reaches the supervisor: wait for that, do not race it.
        assert wait_until(lambda: node.command("status")["workers"][0]["state"] == "RUNNING", 10)
        [worker] = node.command("status")["workers"]
        assert worker["state"] == "RUNNING" and worker["restarts"] == 8
        assert sample(metrics_url(node), "gpuvisor_workers_fatal") == 0.0


def test_a_worker_that_cannot_start_is_retried_while_fatal_and_comes_back() -> None:
    """A worker failing at start goes FATAL, is retried (each try logged once, status shows the next
    try), and serves again once the cause is gone, with no restart of gpuvisor."""
    with SimNode("pcie-l4", args=["--metrics-address", "127.0.0.1:0", "--start-retries", "1"]) as node:
        node.wait_listed([GPU])
        plan = os.path.join(node.run_dir, "plans", "nvidia.com_gpu.json")
        with open(plan, encoding="utf-8") as fh:
            good = fh.read()
        with open(plan, "w", encoding="utf-8") as fh:
            fh.write("{not a plan")  # the next worker exits 78: it cannot use its plan
        os.kill(node.worker_pid(GPU), signal.SIGKILL)
        assert wait_until(lambda: node.command("status")["workers"][0]["state"] == "FATAL", 20), node.log()[
            -3000:
        ]
        worker = node.command("status")["workers"][0]
        assert worker["next_retry_in"] is not None and "retried until it serves" in worker["reason"]
        assert sample(metrics_url(node), "gpuvisor_workers_fatal") == 1.0
        assert wait_until(lambda: node.log().count("FATAL -> STARTING") >= 2, 30), node.log()[-3000:]
        with open(plan, "w", encoding="utf-8") as fh:
            fh.write(good)
        assert wait_until(lambda: node.command("status")["workers"][0]["state"] == "RUNNING", 60), node.log()[
            -3000:
        ]
        node.wait_listed([GPU])
        assert node.kubelet.allocatable(GPU) == 4
        assert sample(metrics_url(node), "gpuvisor_workers_fatal") == 0.0


def test_extra_streams_never_starve_allocate_nor_cut_the_kubelets_stream() -> None:
    """16 extra ListAndWatch streams on the worker: Allocate keeps answering at once, extras beyond
    the bound are refused, and the kubelet's stream still carries health changes."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        extras = ExtraStreams(node.kubelet.endpoint_socket(GPU), 16)
        try:
            assert wait_until(lambda: extras.outcomes.count("RESOURCE_EXHAUSTED") == 14, 20), extras.outcomes
            ids = sorted(node.kubelet.devices(GPU))
            for i in range(40):
                started = time.monotonic()
                response = node.kubelet.allocate_ids(GPU, [ids[i % len(ids)]])
                assert time.monotonic() - started < 2.0 and response.envs["NVIDIA_VISIBLE_DEVICES"]
            node.sim("xid", device=ids[1], xid=48)  # the kubelet's own stream still carries news
            node.wait_health(GPU, [ids[1]], "Unhealthy")
            assert node.kubelet.connected(GPU) and len(node.kubelet.registrations) == 1
        finally:
            extras.close()


def test_stray_entries_named_like_worker_sockets_survive_and_the_supervisor_too() -> None:
    """A directory, a regular file and a symlink named like the worker's sockets (its own tag
    included), then the worker killed twice: nothing of them is removed, the supervisor lives."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        live = os.path.basename(node.kubelet.endpoint_socket(GPU))
        tag = live[len("gpuvisor-gpu-") : len("gpuvisor-gpu-") + 6]
        target = os.path.join(node.base, "victim")
        with open(target, "w") as fh:
            fh.write("must survive")
        strays = {
            f"gpuvisor-gpu-{tag}f0.sock": "dir",
            f"gpuvisor-gpu-{tag}f1.sock": "file",
            f"gpuvisor-gpu-{tag}f2.sock": "link",
            "gpuvisor-gpu-0badc0de.sock": "dir",
        }
        for name, kind in strays.items():
            plant_stray(os.path.join(node.plugin_dir, name), kind, target)
        for _ in range(2):
            before = node.kubelet.endpoint_socket(GPU)
            os.kill(node.worker_pid(GPU), signal.SIGKILL)

            def back(before: str = before) -> bool:
                return node.kubelet.endpoint_socket(GPU) not in ("", before) and node.kubelet.connected(GPU)

            assert wait_until(back, 20)
        assert node.proc is not None and node.proc.poll() is None
        assert set(strays) <= set(os.listdir(node.plugin_dir))
        with open(target) as fh:
            assert fh.read() == "must survive"
        assert "housekeeping" not in node.log() and "Traceback" not in node.log()


def test_a_forged_control_message_is_dropped_and_counted() -> None:
    """A process on the control socket claiming to be the worker (wrong secret) changes nothing;
    its messages are dropped and counted, and the real worker keeps serving."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        pid = node.worker_pid(GPU)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{os.path.join(node.run_dir, 'control.sock')}")
            sock.send_multipart(encode(Hello(resource=GPU, pid=pid, secret="0" * 32), seq=1))
            sock.send_multipart(encode(StatusReport(resource=GPU, event="stopped", detail="forged"), seq=2))
            sock.send_multipart(encode(Heartbeat(GPU, pid, "stopped", False, "/nowhere.sock", {}), seq=3))
            assert sock.poll(10_000), "the forged heartbeat got no Shutdown"
            assert isinstance(decode(sock.recv_multipart()).message, Shutdown)
        finally:
            sock.close(0)
        status = node.command("status")
        assert status["control"]["dropped"] == {"hello refused": 1, "unbound sender": 2}
        [worker] = status["workers"]
        assert worker["state"] == "RUNNING" and worker["registered"] and worker["pid"] == pid
        assert node.worker_pid(GPU) == pid and node.kubelet.allocatable(GPU) == 4


def test_a_reload_that_meets_a_full_run_dir_stays_pending_and_applies_once_there_is_room(
    tmp_path: Path,
) -> None:
    """SIGHUP while the run dir is full: the running plan keeps serving, status and metrics show
    the pending reload and why, and it is applied by itself once space is freed."""
    node, config = config_node(tmp_path, "version: v1\n", args=["--metrics-address", "127.0.0.1:0"])
    with tmpfs_at(node.run_dir, "256k") as mounted, node:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        node.wait_listed([GPU])
        filler = fill_filesystem(node.run_dir)
        config.write_text(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 2}\n"
        )
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGHUP)  # no sighup_and_wait: this reload stays pending
        assert wait_until(lambda: node.command("status")["reconcile"]["pending"], 15), node.log()[-2000:]
        pending = node.command("status")["reconcile"]["pending"]
        assert "No space left on device" in pending["reason"] and pending["trigger"] == "SIGHUP"
        assert sample(metrics_url(node), "gpuvisor_reload_pending") == 1.0
        assert (
            node.kubelet.capacity(GPU) == 4 and node.kubelet.allocatable(GPU) == 4
        )  # the running plan serves
        os.unlink(filler)
        assert wait_until(lambda: node.kubelet.capacity(GPU) == 8, 60), node.log()[-2000:]
        assert node.command("status")["reconcile"]["pending"] is None
        assert sample(metrics_url(node), "gpuvisor_reload_pending") == 0.0


def test_a_stopped_worker_left_by_a_killed_supervisor_is_ended_by_the_next() -> None:
    """SIGSTOP a worker, SIGKILL its supervisor: the stopped worker never notices (it still holds
    its stream); the next supervisor on the same run dir ends it by PID before serving anew."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        stale = node.worker_pid(GPU)
        os.kill(stale, signal.SIGSTOP)
        node.stop_supervisor(signal.SIGKILL)
        assert psutil.pid_exists(stale) and psutil.Process(stale).status() == psutil.STATUS_STOPPED
        node.start_supervisor()
        assert wait_until(lambda: not psutil.pid_exists(stale), 20)
        assert wait_until(
            lambda: node.worker_pid(GPU) not in (0, stale) and node.kubelet.connected(GPU), 30
        ), node.log()[-3000:]
        assert "ended 1 worker(s) an earlier run left behind" in node.log()
