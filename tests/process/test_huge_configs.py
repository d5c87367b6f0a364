"""Configs the kubelet could never receive, on a real `gpuvisor run --simulate dgx-h100` (issue 14 item 3).

At start such a config is a config error (exit 78, one line naming the resource or key, the
count and the limit) and the process never grows: no device list is built. At reload (SIGHUP)
it is refused: the running config keeps serving and `gpuvisor status` keeps answering.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from supervisor.config import EXIT_CONFIG_ERROR
from tests.harness import config_node, reloads, run_to_exit, sighup_and_wait, time_slicing
from tests.helpers import wait_until

GPU = "nvidia.com/gpu"
RSS_LIMIT_KIB = 200 * 1024


@pytest.mark.parametrize(
    ("replicas", "error"),
    [
        (200_000, "sharing.timeSlicing.resources[0].replicas: 200000 replicas is more than gpuvisor's limit of 65536"),
        (1_000_000_000, "sharing.timeSlicing.resources[0].replicas: 1000000000 replicas is more than gpuvisor's limit of 65536"),
        (10_000, "resource nvidia.com/gpu would have 80000 devices, a ListAndWatch answer of up to 5271120 bytes: "
                 "over gpuvisor's limit of 3670016 bytes (the kubelet accepts at most 4194304)"),
    ],
)  # fmt: skip
def test_huge_config_at_start_is_a_config_error(replicas: int, error: str) -> None:
    """A config whose devices the kubelet could never receive exits 78 with one line naming the limit, and never grows."""
    status, output, rss_kib, _ = run_to_exit(time_slicing(replicas))
    assert status == EXIT_CONFIG_ERROR, output[-3000:]
    assert error in output, output[-3000:]
    assert "Traceback" not in output
    assert rss_kib < RSS_LIMIT_KIB, f"peak RSS {rss_kib} KiB"


@pytest.mark.parametrize("replicas", [1_000_000_000, 10_000])
def test_huge_config_at_reload_is_refused_and_the_running_one_keeps_serving(
    tmp_path: Path, replicas: int
) -> None:
    """SIGHUP with a config the kubelet could never receive is refused: the 16 devices stay listed, status answers, memory stays flat."""
    node, config = config_node(tmp_path, time_slicing(2), "dgx-h100")
    with node:
        node.wait_listed([GPU])
        assert wait_until(lambda: len(node.kubelet.devices(GPU)) == 16, 30)
        assert node.proc is not None
        supervisor = psutil.Process(node.proc.pid)
        pids = {p.pid for p in node.workers()}
        registrations = len(node.kubelet.registrations)
        before = reloads(node)
        config.write_text(time_slicing(replicas))
        sighup_and_wait(node)
        assert wait_until(lambda: "refused, keeping the running config" in node.log(), 10), node.log()[-4000:]
        status = node.command("status")  # still answering, with the old plan
        assert status["reloads"] > before
        assert len(node.kubelet.devices(GPU)) == 16 and node.kubelet.allocatable(GPU) == 16
        assert {p.pid for p in node.workers()} == pids and len(node.kubelet.registrations) == registrations
        assert supervisor.memory_info().rss < RSS_LIMIT_KIB * 1024
        _ids, response = node.kubelet.allocate(GPU, 1)  # and the running plan still serves Allocate
        assert response.envs["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
