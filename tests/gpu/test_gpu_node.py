"""gpuvisor on a real NVIDIA GPU: discovery, events, serving, an application XID, MPS and labels.

Run where an NVIDIA driver and GPU are present (`pytest -m gpu`); everywhere else each test skips
with the reason (tests/gpu/conftest.py). The supervisor runs on the real `pynvml` binding with no
`--simulate`, in a temp dir, registering with the kubelet stand-in. No test changes a GPU's
settings, and each leaves no process, MPS daemon or file behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pynvml
import pytest

from supervisor.node.events import EventWatch
from supervisor.node.nvml import Nvml
from tests.gpu.conftest import CLIENT_SUM, Cuda, DriverGpu
from tests.harness import GPU, SimNode, metrics_url, sample
from tests.helpers import gone, short_tmpdir, wait_until
from tests.labelsrun import run_labels

# The labels GFD v0.20.0 writes for a node of full GPUs with no sharing (../shared/gfd-golden's
# h100-none set), less gpu.clique, which only a GPU attached to an NVLink fabric has.
GFD_KEYS = {
    "nvidia.com/cuda.driver-version.full", "nvidia.com/cuda.driver-version.major",
    "nvidia.com/cuda.driver-version.minor", "nvidia.com/cuda.driver-version.revision",
    "nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor", "nvidia.com/cuda.driver.rev",
    "nvidia.com/cuda.runtime-version.full", "nvidia.com/cuda.runtime-version.major",
    "nvidia.com/cuda.runtime-version.minor", "nvidia.com/cuda.runtime.major", "nvidia.com/cuda.runtime.minor",
    "nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor", "nvidia.com/gpu.count", "nvidia.com/gpu.family",
    "nvidia.com/gpu.machine", "nvidia.com/gpu.memory", "nvidia.com/gpu.mode", "nvidia.com/gpu.product",
    "nvidia.com/gpu.replicas", "nvidia.com/gpu.sharing-strategy", "nvidia.com/mig.capable",
    "nvidia.com/mps.capable", "nvidia.com/vgpu.present",
}  # fmt: skip


def full_gpus(driver: list[DriverGpu]) -> list[DriverGpu]:
    """The GPUs advertised as nvidia.com/gpu with the default `none` MIG strategy: all of them."""
    return sorted(driver, key=lambda g: g.index)


def test_discovery_matches_what_the_driver_reports(driver: list[DriverGpu]) -> None:
    """The NVML adapter finds every GPU nvidia-smi lists: index, UUID, name, memory, MIG mode and
    compute capability."""
    nvml = Nvml(pynvml)
    nvml.init()
    try:
        node = nvml.discover()
    finally:
        nvml.shutdown()
    found = [(g.index, g.uuid, g.name, g.memory_mib, g.mig_enabled, g.compute_capability) for g in node.gpus]
    expected = [
        (g.index, g.uuid, g.name, g.memory_mib, bool(g.mig_enabled), g.compute_capability)
        for g in full_gpus(driver)
    ]
    assert found == expected


def test_every_gpu_registers_its_health_events(driver: list[DriverGpu]) -> None:
    """The event set takes XID critical errors (at least) on every GPU, and a wait returns."""
    nvml = Nvml(pynvml)
    nvml.init()
    try:
        with EventWatch.open(nvml) as watch:
            xid_bit = int(pynvml.nvmlEventTypeXidCriticalError)
            assert watch.skipped == {}
            assert {uuid: mask & xid_bit for uuid, mask in watch.registered.items()} == {
                g.uuid: xid_bit for g in driver
            }
            watch.wait(100)  # an event or a timeout: no error
    finally:
        nvml.shutdown()


def test_run_registers_every_gpu_and_allocate_hands_out_device_nodes_that_exist(
    driver: list[DriverGpu],
) -> None:
    """`gpuvisor run` on real NVML: every GPU is advertised Healthy, and Allocate (envvar plus
    device specs) names the allocated GPU and only device nodes that exist on this host."""
    with SimNode(None, args=["--pass-device-specs"]) as node:
        node.wait_listed([GPU], timeout=60)
        devices = node.kubelet.devices(GPU)
        assert sorted(devices) == sorted(g.uuid for g in driver)
        assert {d.health for d in devices.values()} == {"Healthy"}
        chosen, response = node.kubelet.allocate(GPU, 1)
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == chosen[0]
        paths = {spec.container_path: spec.host_path for spec in response.devices}
        assert "/dev/nvidiactl" in paths and any(re.fullmatch(r"/dev/nvidia\d+", p) for p in paths)
        assert all(os.path.exists(host) for host in paths.values()), paths


def test_an_application_xid_is_counted_logged_and_ignored(driver: list[DriverGpu], cuda: Cuda) -> None:
    """A CUDA kernel writing to an invalid address raises XID 31 on its GPU: the supervisor counts
    it, logs one line naming the GPU and that it is ignored as an application error, and the GPU
    stays Healthy (NVIDIA's policy). The fault runs on a GPU without MIG, where a CUDA program
    can use the whole GPU by its UUID."""
    plain = [g for g in full_gpus(driver) if not g.mig_enabled]
    if not plain:
        pytest.skip("every GPU has MIG enabled: the fault needs a GPU a CUDA program can use whole")
    victim = plain[0]
    with SimNode(None, args=["--metrics-address", "127.0.0.1:0"]) as node:
        node.wait_listed([GPU], timeout=60)
        url = metrics_url(node)
        before = sample(url, "gpuvisor_xid_events_total", xid="31") or 0.0
        faulted = cuda.run(cuda.fault_argv, {**os.environ, "CUDA_VISIBLE_DEVICES": victim.uuid})
        said = faulted.stdout + faulted.stderr
        assert faulted.returncode != 0 and "illegal" in said.lower(), (
            f"the kernel did not fault with an illegal address ({cuda.how}): {said}"
        )
        assert wait_until(lambda: (sample(url, "gpuvisor_xid_events_total", xid="31") or 0.0) > before, 30), (
            node.log()[-4000:]
        )
        line = f"XID 31 on {victim.uuid}: ignored as an application error"
        assert wait_until(lambda: line in node.log(), 10), node.log()[-4000:]
        assert node.health(GPU, victim.uuid) == "Healthy"


def test_mps_daemon_serves_a_cuda_client_with_the_allocate_answer(
    driver: list[DriverGpu], cuda: Cuda, mps_control: str
) -> None:
    """MPS sharing with the driver's control daemon: gpuvisor's daemon comes up (the replicas turn
    Healthy), and a CUDA client run with the Allocate answer's CUDA_MPS_PIPE_DIRECTORY (its host
    side) completes through it. Stopping the supervisor quits the daemon and says so."""
    if any(g.mig_enabled for g in driver):
        pytest.skip("MPS sharing is refused on a MIG-enabled GPU")
    with short_tmpdir("gvmps") as base:
        root = Path(base) / "mps"
        config = Path(base) / "config.yaml"
        config.write_text(
            "version: v1\nsharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 2\n"
        )
        args = ["--config-file", str(config), "--mps-root", str(root), "--mps-control-binary", mps_control]
        with SimNode(None, args=args) as node:
            node.wait_listed([GPU], timeout=60)
            assert wait_until(lambda: node.kubelet.allocatable(GPU) == 2 * len(driver), 60), node.log()[
                -4000:
            ]
            pid = int((root / GPU / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
            _chosen, response = node.kubelet.allocate(GPU, 1)
            pipe = response.envs["CUDA_MPS_PIPE_DIRECTORY"]
            host_pipe = next(m.host_path for m in response.mounts if m.container_path == pipe)
            env = {
                **os.environ,
                "CUDA_MPS_PIPE_DIRECTORY": host_pipe,
                "CUDA_VISIBLE_DEVICES": response.envs["NVIDIA_VISIBLE_DEVICES"].split("::")[0],
            }
            done = cuda.run(cuda.client_argv, env)
            assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == str(CLIENT_SUM), (
                done.stderr
            )
            control_log = (root / GPU / "log" / "control.log").read_text()
            assert "NEW CLIENT" in control_log.upper(), control_log[-2000:]
            assert node.stop_supervisor() == 0
            assert f"MPS daemon for {GPU} stopped" in node.log(), node.log()[-4000:]
            assert wait_until(lambda: gone([pid]), 15), f"MPS control daemon {pid} still runs"


def test_labels_oneshot_writes_gfds_label_set(driver: list[DriverGpu]) -> None:
    """`gpuvisor labels --oneshot` on the real driver writes GFD's keys, with the values the driver
    reports for count, product, memory, compute capability and driver version."""
    gpu = full_gpus(driver)[0]
    with short_tmpdir("gvlabels") as base:
        out = Path(base) / "gfd"
        done = run_labels(
            "--oneshot", "--no-timestamp", "--use-node-feature-api=false", "--output-file", str(out)
        )
        assert done.returncode == 0, done.stderr
        labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert set(labels) >= GFD_KEYS, sorted(GFD_KEYS - set(labels))
    assert labels["nvidia.com/gpu.count"] == str(len(driver))
    assert labels["nvidia.com/gpu.product"] == gpu.name.replace(" ", "-")
    assert labels["nvidia.com/gpu.memory"] == str(gpu.memory_mib)
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == tuple(
        map(str, gpu.compute_capability)
    )
    assert labels["nvidia.com/cuda.driver-version.full"] == gpu.driver_version
