"""End to end: a real supervisor sharing GPUs with MPS, driving a fake `nvidia-cuda-mps-control`.

The fake is tests/mpsfake.py's (it forks a background daemon that writes its PID
file, answers commands on stdin, and misbehaves when a `fake-behaviour` file beside it says
so). The supervisor runs with `--mps-control-binary` pointing at it and `--mps-root` in a temp
dir; the kubelet stand-in shows what the kubelet would see.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.mps.daemons import PID_FILE
from tests import mpsfake
from tests.harness import SimNode
from tests.helpers import short_tmpdir, wait_until

GPU = "nvidia.com/gpu"
CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 2\n"


class MpsSetup:
    def __init__(self, base: str) -> None:
        self.base = Path(base)
        self.root = self.base / "mps"
        self.binary = mpsfake.install(self.base)
        self.config = self.base / "config.yaml"
        self.config.write_text(CONFIG)

    def behave(self, *flags: str) -> None:
        mpsfake.behave(self.binary, *flags)

    def args(self) -> list[str]:
        return [
            "--config-file",
            str(self.config),
            "--mps-root",
            str(self.root),
            "--mps-control-binary",
            str(self.binary),
        ]

    def log(self) -> list[str]:
        return mpsfake.commands(self.root, GPU)

    def pid_file_pid(self) -> int:
        try:
            return int((self.root / GPU / "pipe" / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return 0


@pytest.fixture
def mps() -> Iterator[MpsSetup]:
    with short_tmpdir("gvm") as base:
        setup = MpsSetup(base)
        try:
            yield setup
        finally:
            mpsfake.kill_daemons(setup.base)  # only the daemons this test's fake started


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_mps_daemon_gates_health_and_is_supervised(mps: MpsSetup) -> None:
    """Devices Unhealthy until the daemon is up, Healthy after; a killed daemon is restarted; Allocate has the MPS env and mounts; shutdown quits it."""
    mps.behave("fail-start")  # the daemon cannot start at first: its devices must not be offered
    with SimNode("pcie-l4", args=mps.args()) as node:
        node.wait_listed([GPU])
        ids = sorted(node.kubelet.devices(GPU))
        assert len(ids) == 8 and all("::" in i for i in ids)
        node.wait_health(GPU, ids, "Unhealthy")
        # Registered and streaming, yet not ready: the readiness names the daemon.
        # The readiness names MPS from the first plans on; the daemon's own entry comes with its
        # thread's first report (a process start later, seconds on a loaded machine).
        assert wait_until(
            lambda: "MPS" in (s := node.command("status"))["ready_detail"] and GPU in s["mps"], 20
        ), node.command("status")
        status = node.command("status")
        assert status["ready"] is False
        assert status["mps"][GPU]["up"] is False
        assert node.kubelet.allocatable(GPU) == 0

        mps.behave()  # the next retry (backoff) starts the daemon
        node.wait_health(GPU, ids, "Healthy", timeout=30)
        assert wait_until(lambda: node.command("status")["ready"], 20), node.command("status")["ready_detail"]
        first = mps.pid_file_pid()
        assert first and _alive(first)
        assert "set_default_active_thread_percentage 50" in mps.log()
        assert (mps.root / ".ready").exists()

        _ids, response = node.kubelet.allocate(GPU, 1)
        pipe = f"/mps/{GPU}/pipe"
        assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        mounts = {m.container_path: m.host_path for m in response.mounts}
        assert mounts == {pipe: str(mps.root / GPU / "pipe"), "/dev/shm": str(mps.root / "shm")}

        # The daemon dies: its devices go Unhealthy, it is restarted, they come back.
        os.kill(first, signal.SIGKILL)
        node.wait_health(GPU, ids, "Unhealthy")
        node.wait_health(GPU, ids, "Healthy", timeout=30)
        second = mps.pid_file_pid()
        assert second not in (0, first) and _alive(second)
        assert node.command("status")["mps"][GPU]["restarts"] >= 1

        assert node.stop_supervisor(signal.SIGTERM) == 0
        assert "quit" in mps.log() and f"MPS daemon for {GPU} stopped" in node.log()
        assert wait_until(lambda: not _alive(second), 10)
        assert not (mps.root / ".ready").exists()


def test_mps_serves_several_replicas_when_fail_requests_greater_than_one_is_off(mps: MpsSetup) -> None:
    """With failRequestsGreaterThanOne: false a real worker answers Allocate of two MPS replicas (one GPU, or two) as NVIDIA does."""
    # NVIDIA internal/rm/rm.go:101-104: the MPS size check applies only with the flag on (its
    # default, api/config/v1/config.go:72-76); the answer is the GPUs plus the MPS pipe and shm.
    mps.config.write_text(
        CONFIG.replace("    resources:", "    failRequestsGreaterThanOne: false\n    resources:")
    )
    with SimNode("pcie-l4", args=mps.args()) as node:
        node.wait_listed([GPU])
        ids = sorted(node.kubelet.devices(GPU))
        node.wait_health(GPU, ids, "Healthy", timeout=30)
        pipe = f"/mps/{GPU}/pipe"
        mounts = {pipe: str(mps.root / GPU / "pipe"), "/dev/shm": str(mps.root / "shm")}
        gpu0 = ids[0].split("::")[0]
        same = node.kubelet.allocate_ids(GPU, [f"{gpu0}::0", f"{gpu0}::1"])
        assert same.envs["NVIDIA_VISIBLE_DEVICES"] == gpu0
        assert same.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert {m.container_path: m.host_path for m in same.mounts} == mounts
        chosen, spread = node.kubelet.allocate(GPU, 2)  # the distributed policy picks two GPUs
        gpus = [i.split("::")[0] for i in chosen]
        assert len(set(gpus)) == 2 and sorted(spread.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(
            gpus
        )
        assert {m.container_path: m.host_path for m in spread.mounts} == mounts
