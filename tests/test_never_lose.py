"""Never lose a resource (issue 14), against a real supervisor, real workers and the kubelet
stand-in: kill storms, a worker that cannot start for a while, stray entries in the kubelet dir."""

from __future__ import annotations

import os
import signal

from tests.benchmarks.bench_killstorm import storm
from tests.harness import SimNode
from tests.helpers import wait_until

GPU = "nvidia.com/gpu"


def metric(node: SimNode, name: str) -> float:
    import urllib.request

    url = str(node.command("status")["metrics_url"])
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_kill_storm_never_makes_the_worker_fatal() -> None:
    """8 SIGKILLs of the registered worker, 1 s after each recovery: each comes back, no backoff, never FATAL."""
    with SimNode("dgx-h100", args=["--metrics-address", "127.0.0.1:0"]) as node:
        recoveries = storm(node, 8, 1.0)
        assert len(recoveries) == 8, node.log()[-3000:]
        print(f"\nrecoveries (ms): {[round(r) for r in recoveries]}")
        assert "-> FATAL" not in node.log() and "restart in" not in node.log(), "a backoff or FATAL"
        [worker] = node.command("status")["workers"]
        assert worker["state"] == "RUNNING" and worker["restarts"] == 8
        assert metric(node, "gpuvisor_workers_fatal") == 0.0


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
        assert wait_until(lambda: node.command("status")["workers"][0]["state"] == "FATAL", 20), node.log()[-3000:]
        worker = node.command("status")["workers"][0]
        assert worker["next_retry_in"] is not None and "retried until it serves" in worker["reason"]
        assert metric(node, "gpuvisor_workers_fatal") == 1.0
        assert wait_until(lambda: node.log().count("FATAL -> STARTING") >= 2, 30), node.log()[-3000:]
        with open(plan, "w", encoding="utf-8") as fh:
            fh.write(good)
        assert wait_until(lambda: node.command("status")["workers"][0]["state"] == "RUNNING", 60), node.log()[-3000:]
        node.wait_listed([GPU])
        assert node.kubelet.allocatable(GPU) == 4
        assert metric(node, "gpuvisor_workers_fatal") == 0.0
