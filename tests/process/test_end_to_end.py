"""The whole path on real processes and sockets: supervisor, worker, kubelet stand-in."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from tests.harness import SimNode
from tests.helpers import gone, sockets_in, wait_until

GPU = "nvidia.com/gpu"


def test_dgx_h100_advertises_eight_healthy_gpus_with_numa() -> None:
    """On dgx-h100 the kubelet sees nvidia.com/gpu 8/8 Healthy, on NUMA nodes 0 and 1."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        devices = node.kubelet.devices(GPU)
        assert len(devices) == 8
        assert node.kubelet.capacity(GPU) == 8 and node.kubelet.allocatable(GPU) == 8
        assert all(d.health == "Healthy" for d in devices.values())
        assert sorted({n for d in devices.values() for n in d.numa_nodes}) == [0, 1]
        assert all(d.id.startswith("GPU-") for d in devices.values())


def test_allocation_returns_exactly_the_allocated_uuids() -> None:
    """Allocating 2 GPUs returns NVIDIA_VISIBLE_DEVICES with exactly those UUIDs."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        ids, response = node.kubelet.allocate(GPU, 2)
        assert len(ids) == 2
        assert sorted(response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(ids)


def test_unknown_device_id_gets_an_error_naming_it() -> None:
    """Allocate with an unknown device ID fails with an error that names the ID."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        with pytest.raises(grpc.RpcError) as info:
            node.kubelet.allocate_ids(GPU, ["GPU-not-a-real-one"])
        assert "unknown device: GPU-not-a-real-one" in (info.value.details() or "")
        assert 'invalid allocation request for "nvidia.com/gpu"' in (info.value.details() or "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_stop_signal_leaves_no_process_and_no_socket(sig: int) -> None:
    """SIGTERM/SIGINT/SIGQUIT: the supervisor stops its workers, removes its sockets and exits 0."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        pids = [p.pid for p in node.workers()]
        assert pids, "no worker process"
        assert node.stop_supervisor(sig) == 0
        assert wait_until(lambda: gone(pids), 5)
        assert sockets_in(node.plugin_dir) == ["kubelet.sock"]
        assert sockets_in(node.run_dir) == []


def test_worker_command_line_names_its_resource() -> None:
    """`ps` shows which worker serves which resource: its command line carries --resource."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        assert node.worker_pid(GPU) > 0


def test_run_dir_is_private() -> None:
    """The run dir is 0700 and its control and health sockets 0600."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU])
        assert os.stat(node.run_dir).st_mode & 0o777 == 0o700
        for name in ("control.sock", "health.sock"):
            assert os.stat(os.path.join(node.run_dir, name)).st_mode & 0o777 == 0o600
