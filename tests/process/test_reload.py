"""Reload and rediscovery on real processes: only what changed is touched, nothing drops to 0.

Each test starts a simulated node with a config file, changes something (the file and SIGHUP,
a Kubernetes ConfigMap-style symlink swap with no signal, a MIG layout change) and checks, on
the kubelet stand-in, which workers kept their PID, which registered again, and that the
allocatable count of an updated resource never dropped (sampled on every ListAndWatch message
and by a polling thread during the change).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from supervisor.desired.discovery import keep_vanished_gpus
from supervisor.sim.kubelet import DeviceState
from tests import nodes
from tests.harness import SimNode, config_node, sighup_and_wait, time_slicing
from tests.helpers import REPO, checkout_path, gone, wait_until

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIXED = ["--mig-strategy", "mixed"]

PLAIN = "version: v1\n"


RENAMED_GPU0 = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: gpu.shared
      devices: [0]
      replicas: 2
"""


class Sampler:
    """The lowest allocatable seen per resource: on every ListAndWatch message and by polling."""

    def __init__(self, node: SimNode, resources: list[str]) -> None:
        self.node = node
        self.resources = resources
        self.lowest = {r: node.kubelet.allocatable(r) for r in resources}
        self.messages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _on_message(self, resource: str, devices: list[DeviceState]) -> None:
        self.messages += 1
        if resource in self.lowest:
            healthy = sum(1 for d in devices if d.health == "Healthy")
            self.lowest[resource] = min(self.lowest[resource], healthy)

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            for r in self.resources:
                self.lowest[r] = min(self.lowest[r], self.node.kubelet.allocatable(r))

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        self.node.kubelet.listeners.append(self._on_message)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self.node.kubelet.listeners.remove(self._on_message)


def registrations(node: SimNode) -> int:
    return len(node.kubelet.registrations)


def test_sighup_with_unchanged_config_touches_nothing(tmp_path: Path) -> None:
    """SIGHUP with the same config: same PIDs, no registration, not even a ListAndWatch message."""
    node, _ = config_node(tmp_path, time_slicing(2))
    with node:
        node.wait_listed([GPU])
        pid, regs = node.worker_pid(GPU), registrations(node)
        with Sampler(node, [GPU]).running() as sampler:
            sighup_and_wait(node)
        assert node.worker_pid(GPU) == pid
        assert registrations(node) == regs
        assert sampler.messages == 0
        assert not any(w in node.log() for w in ("updated in place", "added", "removed", "refused, keeping"))


def test_changed_devices_are_updated_in_place(tmp_path: Path) -> None:
    """Replicas 2 -> 4: the same worker streams 16 devices; no re-registration; allocatable never drops."""
    node, path = config_node(tmp_path, time_slicing(2))
    with node:
        node.wait_listed([GPU])
        assert node.kubelet.capacity(GPU) == 8
        pid, regs = node.worker_pid(GPU), registrations(node)
        with Sampler(node, [GPU]).running() as sampler:
            path.write_text(time_slicing(4))
            sighup_and_wait(node)
            assert node.kubelet.wait_for(lambda: node.kubelet.allocatable(GPU) == 16, 15), node.log()[-4000:]
        assert sampler.lowest[GPU] >= 8, sampler.lowest
        assert node.worker_pid(GPU) == pid
        assert registrations(node) == regs
        assert all(d.endswith(("::0", "::1", "::2", "::3")) for d in node.kubelet.devices(GPU))


def test_added_and_removed_resources_start_and_stop_workers(tmp_path: Path) -> None:
    """A new resource starts a worker and one gone stops its worker; the shared resource is updated in place."""
    node, path = config_node(tmp_path, PLAIN)
    with node:
        node.wait_listed([GPU])
        gpu_pid = node.worker_pid(GPU)
        with Sampler(node, [GPU]).running() as sampler:
            path.write_text(RENAMED_GPU0)
            sighup_and_wait(node)
            node.wait_listed([SHARED])
            assert node.kubelet.wait_for(lambda: node.kubelet.capacity(GPU) == 3, 15)
            shared_pid = node.worker_pid(SHARED)
            assert shared_pid not in (0, gpu_pid)
            assert node.kubelet.capacity(SHARED) == 2

            path.write_text(PLAIN)
            sighup_and_wait(node)
            assert wait_until(lambda: gone([shared_pid]), 10)
            assert node.kubelet.wait_for(lambda: node.kubelet.allocatable(GPU) == 4, 15)
        assert sampler.lowest[GPU] >= 3
        assert node.worker_pid(GPU) == gpu_pid

        # The worker's process is gone a moment before the supervisor hears of its exit (from
        # the zygote, on its next turn): its state reads STOPPING until then.
        def states() -> dict[str, str]:
            return {w["resource"]: w["state"] for w in node.command("status")["workers"]}

        wait_until(lambda: states() == {GPU: "RUNNING", SHARED: "STOPPED"}, 10)
        assert states() == {GPU: "RUNNING", SHARED: "STOPPED"}
        log = node.log()
        assert f"resource {SHARED} added" in log and f"resource {SHARED} removed" in log


def test_bad_config_is_refused_with_one_line(tmp_path: Path) -> None:
    """replicas: 1 on reload: one clear refusal line (file, key, reason); the running config stays."""
    node, path = config_node(tmp_path, time_slicing(2))
    with node:
        node.wait_listed([GPU])
        pid, regs = node.worker_pid(GPU), registrations(node)
        path.write_text(time_slicing(1))
        sighup_and_wait(node)
        refusals = [line for line in node.log().splitlines() if "refused, keeping the running config" in line]
        assert len(refusals) == 1, refusals
        for fragment in (
            str(path),
            "sharing.timeSlicing.resources[0].replicas",
            "number of replicas must be >= 2",
        ):
            assert fragment in refusals[0]
        assert "Traceback" not in node.log()
        assert node.kubelet.capacity(GPU) == 8 and node.kubelet.allocatable(GPU) == 8
        assert node.worker_pid(GPU) == pid and registrations(node) == regs
        # The refused file does not stick: a good one afterwards is taken.
        path.write_text(time_slicing(4))
        sighup_and_wait(node)
        assert node.kubelet.wait_for(lambda: node.kubelet.allocatable(GPU) == 16, 15)


def configmap_dir(base: Path, text: str) -> Path:
    """A ConfigMap volume as the kubelet lays it out: config.yaml -> ..data/config.yaml, ..data -> ..<ts>."""
    (base / "..2026_11_22_10_00_00.1").mkdir(parents=True)
    (base / "..2026_11_22_10_00_00.1" / "config.yaml").write_text(text)
    (base / "..data").symlink_to("..2026_11_22_10_00_00.1")
    (base / "config.yaml").symlink_to("..data/config.yaml")
    return base / "config.yaml"


def configmap_update(base: Path, text: str) -> None:
    """What the kubelet does on a ConfigMap update: new dir, new ..data_tmp symlink renamed over ..data."""
    new = base / "..2026_11_22_10_05_00.2"
    new.mkdir()
    (new / "config.yaml").write_text(text)
    (base / "..data_tmp").symlink_to(new.name)
    os.rename(base / "..data_tmp", base / "..data")
    old = base / "..2026_11_22_10_00_00.1"
    (old / "config.yaml").unlink()
    old.rmdir()


def test_configmap_symlink_swap_is_picked_up_without_a_signal(tmp_path: Path) -> None:
    """A ConfigMap-style ..data swap reloads once (the burst is debounced) and updates in place."""
    config = configmap_dir(tmp_path / "cm", time_slicing(2))
    node = SimNode("pcie-l4", args=["--config-file", str(config)])
    with node:
        node.wait_listed([GPU])
        pid, regs = node.worker_pid(GPU), registrations(node)
        with Sampler(node, [GPU]).running() as sampler:
            configmap_update(tmp_path / "cm", time_slicing(4))
            assert node.kubelet.wait_for(lambda: node.kubelet.allocatable(GPU) == 16, 15), node.log()[-4000:]
        assert sampler.lowest[GPU] >= 8
        assert node.worker_pid(GPU) == pid and registrations(node) == regs
        log = node.log()
        assert log.count("config file changed: resource nvidia.com/gpu updated in place") == 1, log[-3000:]


def mig_pids(node: SimNode, resources: list[str]) -> dict[str, int]:
    return {r: node.worker_pid(r) for r in resources}


def test_sim_mig_command_changes_devices_in_place() -> None:
    """`gpuvisor sim mig --gpu 0 --layout 3g.40gb,3g.40gb`: three MIG resources change in place, same workers."""
    resources = [GPU, "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"]
    with SimNode("mig-a100", args=MIXED) as node:
        node.wait_listed([*resources, "nvidia.com/mig-1g.10gb.me"])  # all five, before counting registrations
        pids, regs = mig_pids(node, resources), registrations(node)
        with Sampler(node, resources).running() as sampler:
            argv = [sys.executable, "-m", "supervisor", "sim", "mig", "--run-dir", node.run_dir, "--gpu", "0"]
            result = subprocess.run(
                [*argv, "--layout", "3g.40gb,3g.40gb"],
                capture_output=True, text=True, timeout=30, cwd=REPO, env={**os.environ, "PYTHONPATH": checkout_path()}, check=False,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            want = {"nvidia.com/mig-3g.40gb": 4, "nvidia.com/mig-2g.20gb": 3, "nvidia.com/mig-1g.10gb": 7}
            ok = node.kubelet.wait_for(
                lambda: all(node.kubelet.allocatable(r) == n for r, n in want.items()), 15
            )
            assert ok, node.log()[-4000:]
        assert all(n > 0 for n in sampler.lowest.values()), sampler.lowest
        assert mig_pids(node, resources) == pids and registrations(node) == regs


def test_periodic_rediscovery_picks_up_a_mig_change() -> None:
    """With no signal, the periodic rediscovery sees GPU 2 become 7g.80gb: one resource added, one removed, one updated."""
    resources = [GPU, "nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.me"]
    with SimNode("mig-a100", args=[*MIXED, "--rediscovery-interval", "0.5"]) as node:
        node.wait_listed(resources)
        pids = mig_pids(node, resources)
        node.sim("mig", gpu=2, layout=["7g.80gb"], reload=False)
        node.wait_listed(["nvidia.com/mig-7g.80gb"])
        assert node.kubelet.wait_for(lambda: node.kubelet.allocatable("nvidia.com/mig-1g.10gb") == 3, 15)
        assert wait_until(lambda: gone([pids["nvidia.com/mig-1g.10gb.me"]]), 10)
        assert node.worker_pid("nvidia.com/mig-1g.10gb") == pids["nvidia.com/mig-1g.10gb"]
        assert node.worker_pid(GPU) == pids[GPU]
        assert "periodic rediscovery: resource nvidia.com/mig-7g.80gb added" in node.log()


def test_rediscovery_keeps_a_gpu_it_no_longer_sees() -> None:
    """A GPU missing from a rediscovery (lost: discovery leaves it out) stays in the node; a new one is added."""
    full = nodes.dgx_h100()
    lost = full.gpus[3]
    without = dataclasses.replace(
        full,
        gpus=tuple(g for g in full.gpus if g is not lost),
        links=tuple(link for link in full.links if lost.index not in (link.a, link.b)),
    )
    merged, kept = keep_vanished_gpus(full, without)
    assert merged == full and kept == (lost.uuid,)
    assert keep_vanished_gpus(full, full) == (full, ())
    assert keep_vanished_gpus(None, without) == (without, ())
    # A different GPU at the same index is a replacement, not a vanished one.
    swapped = dataclasses.replace(without, gpus=(*without.gpus, dataclasses.replace(lost, uuid="GPU-new")))
    assert keep_vanished_gpus(full, swapped)[1] == ()
