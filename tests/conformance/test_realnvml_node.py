"""The real NVML binding, tier 2: `gpuvisor run` with no `--simulate`, over the real `pynvml` and the
project's fake libnvidia-ml (tests/fakenvml), with the kubelet stand-in, real workers and sockets.

Faults reach the running supervisor the way a node produces them: the test appends a command to
the library's control file and the supervisor's next NVML call sees it (an event wait blocked in
the health thread wakes at once). NVML has no event for a GPU reset, so an until-reset fault stays
on a real node until the GPU is lost and found again or gpuvisor restarts (`gpuvisor sim reset`
is for simulated nodes). Which tier covers what is listed in test_realnvml.py.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import fakenvml
from tests.fakenvml import FakeNode
from tests.harness import SimNode, gpuvisor_status, run_supervisor
from tests.helpers import REPO, gone, short_tmpdir, sockets_in, wait_until

GPU = "nvidia.com/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
# XID 94 keeps its GPU in service by default (NVIDIA's Xid catalog: restart the application);
# these nodes map it to transient to exercise the recovery of a transient condition.
FAULT_CONFIG = {
    "version": "v1",
    "gpuvisor": {"health": {"transientQuietSeconds": 1, "xids": {"94": "transient"}}},
}
FAST = ["--probe-interval", "0.3", "--rediscovery-interval", "1"]


def unhealthy(node: SimNode, resource: str = GPU) -> set[str]:
    return {d.id for d in node.kubelet.devices(resource).values() if d.health != HEALTHY}


def conditions(node: SimNode, device: str) -> list[dict[str, Any]]:
    return [c for c in node.command("status")["conditions"] if device in (c["gpu"], c.get("device"))]


def condition_names(node: SimNode, device: str) -> set[str]:
    return {c["name"] for c in conditions(node, device)}


def status_reason(node: SimNode, device: str, resource: str = GPU) -> str:
    devices = {d["id"]: d for d in node.command("status")["resources"][resource]}
    return str(devices[device]["reason"])


@contextmanager
def fake_node(
    libdir: Path, profile: str, args: list[str] | None = None, pythonpath: list[str] | None = None
) -> Iterator[tuple[SimNode, FakeNode]]:
    """`gpuvisor run` over the fake library describing `profile`, with a fast fault config."""
    with short_tmpdir() as base:
        fake = FakeNode(base, profile)
        config = os.path.join(base, "config.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            yaml.safe_dump(FAULT_CONFIG, fh)
        env = fake.environ(libdir, pythonpath=pythonpath or [])
        with fakenvml.real_node(env, ["--config-file", config, *FAST, *(args or [])]) as node:
            yield node, fake


# ------------------------------------------------------------------ a healthy node


@pytest.fixture(scope="module")
def h100(fake_nvml_libdir: Path) -> Iterator[tuple[SimNode, FakeNode]]:
    with fake_node(fake_nvml_libdir, "dgx-h100") as (node, fake):
        node.wait_listed([GPU], 60)
        yield node, fake


def test_registers_every_gpu_of_the_profile_healthy_with_numa(h100: tuple[SimNode, FakeNode]) -> None:
    """The kubelet sees nvidia.com/gpu with the profile's UUIDs as IDs, all Healthy, each on its NUMA node."""
    node, fake = h100
    devices = node.kubelet.devices(GPU)
    assert sorted(devices) == sorted(fake.uuids)
    assert all(d.health == HEALTHY for d in devices.values())
    assert {g.uuid: [g.numa_node] for g in fake.spec.gpus} == {
        d.id: list(d.numa_nodes) for d in devices.values()
    }
    assert node.kubelet.capacity(GPU) == node.kubelet.allocatable(GPU) == len(fake.spec.gpus)
    (registration,) = [r for r in node.kubelet.registrations if r.resource == GPU]
    assert not registration.error


def test_preferred_allocation_keeps_a_request_on_one_numa_node(h100: tuple[SimNode, FakeNode]) -> None:
    """Over the real topology answers (NVLink through NVSwitches, PCI ancestors per NUMA node), a
    request for 2 or 4 of 8 GPUs is answered with GPUs of one NUMA node, as NVIDIA's scoring prefers."""
    node, fake = h100
    by_numa: dict[int | None, set[str]] = {}
    for g in fake.spec.gpus:
        by_numa.setdefault(g.numa_node, set()).add(g.uuid)
    for size in (2, 4):
        chosen = node.kubelet.preferred(GPU, sorted(node.kubelet.devices(GPU)), [], size)
        assert len(chosen) == size
        assert any(set(chosen) <= group for group in by_numa.values()), (size, chosen)


def test_allocate_returns_exactly_the_allocated_uuids(h100: tuple[SimNode, FakeNode]) -> None:
    """Allocate of two GPUs answers NVIDIA_VISIBLE_DEVICES with exactly those UUIDs."""
    node, _ = h100
    ids, response = node.kubelet.allocate(GPU, 2)
    try:
        assert sorted(response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(ids)
    finally:
        node.kubelet.release(GPU, ids)


def test_status_json_reports_real_nvml_up_and_every_device(h100: tuple[SimNode, FakeNode]) -> None:
    """`gpuvisor status --json` on real NVML: not simulated, NVML up at the first attempt, ready, the
    worker registered, and every device of the profile Healthy."""
    node, fake = h100
    assert wait_until(lambda: node.command("status")["ready"], 15), node.command("status")
    proc = gpuvisor_status(node, "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["simulated"] is False, status
    assert (status["nvml"], status["ready"]) == ({"up": True, "error": "", "attempts": 1}, True), status
    assert [(w["resource"], w["state"], w["registered"]) for w in status["workers"]] == [
        (GPU, "RUNNING", True)
    ], status
    assert {d["id"]: d["health"] for d in status["resources"][GPU]} == {u: HEALTHY for u in fake.uuids}


def test_sigterm_stops_cleanly(fake_nvml_libdir: Path) -> None:
    """SIGTERM on real NVML: exit 0, no worker left, no socket left but the kubelet's, no traceback."""
    with fake_node(fake_nvml_libdir, "pcie-l4") as (node, _):
        node.wait_listed([GPU], 60)
        pids = [p.pid for p in node.workers()]
        assert pids
        assert node.stop_supervisor(signal.SIGTERM) == 0
        assert wait_until(lambda: gone(pids), 10)
        assert sockets_in(node.plugin_dir) == ["kubelet.sock"]
        assert sockets_in(node.run_dir) == []
        assert "Traceback" not in node.log()


# ------------------------------------------------------------------ MIG


MIG_RESOURCES = {
    "nvidia.com/mig-3g.40gb": 3,  # GPU 0 one, GPU 3 two
    "nvidia.com/mig-2g.20gb": 4,
    "nvidia.com/mig-1g.10gb": 9,
    "nvidia.com/mig-1g.10gb.me": 1,
}


@pytest.fixture(scope="module")
def mixed(fake_nvml_libdir: Path) -> Iterator[tuple[SimNode, FakeNode]]:
    with fake_node(fake_nvml_libdir, "mig-a100", ["--mig-strategy", "mixed"]) as (node, fake):
        node.wait_listed([GPU, *MIG_RESOURCES], 60)
        yield node, fake


def test_mig_mixed_advertises_each_profile_and_the_full_gpus(mixed: tuple[SimNode, FakeNode]) -> None:
    """mig-a100 with --mig-strategy mixed: one resource per MIG profile with the MIG UUIDs as IDs,
    and the four GPUs without MIG as nvidia.com/gpu."""
    node, fake = mixed
    for resource, count in MIG_RESOURCES.items():
        assert node.kubelet.capacity(resource) == count, resource
    migs = {m.uuid for g in fake.spec.gpus for m in g.mig}
    listed = {d for r in MIG_RESOURCES for d in node.kubelet.devices(r)}
    assert listed == migs
    assert sorted(node.kubelet.devices(GPU)) == sorted(g.uuid for g in fake.spec.gpus if not g.mig_enabled)


def test_mig_allocate_names_the_mig_device(mixed: tuple[SimNode, FakeNode]) -> None:
    """Allocate of a MIG resource answers NVIDIA_VISIBLE_DEVICES with the MIG device's UUID."""
    node, _ = mixed
    ids, response = node.kubelet.allocate("nvidia.com/mig-2g.20gb", 1)
    try:
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == ids[0] and ids[0].startswith("MIG-")
    finally:
        node.kubelet.release("nvidia.com/mig-2g.20gb", ids)


def test_ecc_on_a_mig_device_marks_only_that_device(mixed: tuple[SimNode, FakeNode]) -> None:
    """A double-bit ECC event on one MIG device, which NVML delivers with its GI/CI ids, takes out
    only that MIG device, not its GPU's other instances."""
    node, fake = mixed
    gpu = fake.spec.gpus[1]
    target, sibling = gpu.mig[0], gpu.mig[1]  # both 2g.20gb
    fake.control.inject_ecc(target.uuid, "double")
    node.wait_health("nvidia.com/mig-2g.20gb", [target.uuid], UNHEALTHY)
    assert node.health("nvidia.com/mig-2g.20gb", sibling.uuid) == HEALTHY
    assert unhealthy(node, "nvidia.com/mig-2g.20gb") == {target.uuid}


def test_xid_on_a_mig_gpu_with_no_instance_marks_every_mig_device_of_it(
    mixed: tuple[SimNode, FakeNode],
) -> None:
    """An XID 48 that names the GPU but no instance takes out every MIG device of that GPU."""
    node, fake = mixed
    gpu = fake.spec.gpus[3]  # two 3g.40gb
    fake.control.inject_xid(gpu.uuid, 48)
    node.wait_health("nvidia.com/mig-3g.40gb", [m.uuid for m in gpu.mig], UNHEALTHY)
    assert unhealthy(node, "nvidia.com/mig-3g.40gb") == {m.uuid for m in gpu.mig}


def test_mig_single_advertises_mig_devices_as_gpus(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """--mig-strategy single on a node whose every GPU has the same MIG devices: nvidia.com/gpu
    lists the MIG devices, and Allocate answers with a MIG UUID."""
    description = tmp_path / "single.yaml"
    gpus = []
    for i in range(2):
        gpus.append(
            {
                "name": "NVIDIA A100-SXM4-80GB",
                "uuid": f"GPU-00000000-0000-0000-0000-00000000000{i}",
                "minor": i,
                "pci_bus_id": f"00000000:0{i + 1}:00.0",
                "memory_mib": 81920,
                "numa_node": 0,
                "compute_capability": [8, 0],
                "mig": {"enabled": True, "devices": [{"profile": "3g.40gb"}, {"profile": "3g.40gb"}]},
            }
        )
    description.write_text(
        yaml.safe_dump(
            {"driver_version": "550.54.15", "gpus": gpus, "topology": {"default_ancestor": "NODE"}}
        )
    )
    with fake_node(fake_nvml_libdir, str(description), ["--mig-strategy", "single"]) as (node, fake):
        node.wait_listed([GPU], 60)
        migs = sorted(m.uuid for g in fake.spec.gpus for m in g.mig)
        assert sorted(node.kubelet.devices(GPU)) == migs and len(migs) == 4
        ids, response = node.kubelet.allocate(GPU, 1)
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == ids[0] and ids[0] in migs


# ------------------------------------------------------------------ faults at run time


@pytest.fixture(scope="module")
def faults(fake_nvml_libdir: Path) -> Iterator[tuple[SimNode, FakeNode]]:
    """A dgx-a100 node: probes every 0.3 s, rediscovery every 1 s, a 1 s transient quiet period.
    Each test faults its own GPU."""
    with fake_node(fake_nvml_libdir, "dgx-a100") as (node, fake):
        node.wait_listed([GPU], 60)
        yield node, fake


def test_xid_48_marks_only_its_gpu_until_a_reset(faults: tuple[SimNode, FakeNode]) -> None:
    """An XID 48 through the event set marks only that GPU Unhealthy, as a whole-GPU condition; after
    the quiet period and passing probes it is still Unhealthy: XID 48 is until-reset."""
    node, fake = faults
    gpu = fake.uuids[2]
    before = unhealthy(node)
    fake.control.inject_xid(gpu, 48)
    assert wait_until(lambda: "xid:48" in condition_names(node, gpu), 15), node.log()[-3000:]
    node.wait_health(GPU, [gpu], UNHEALTHY)
    assert unhealthy(node) == before | {gpu}
    (xid,) = [c for c in conditions(node, gpu) if c["name"] == "xid:48"]
    assert (xid["recovery"], xid["gpu_instance"], xid["compute_instance"]) == ("until-reset", None, None)
    seen = node.command("status")["rediscoveries"]
    assert wait_until(lambda: node.command("status")["rediscoveries"] >= seen + 2, 15)
    assert node.health(GPU, gpu) == UNHEALTHY
    assert "XID 48" in status_reason(node, gpu)


def test_transient_xid_recovers_once_quiet_and_a_probe_passes(faults: tuple[SimNode, FakeNode]) -> None:
    """XID 94 (transient by this node's config) marks only its GPU Unhealthy; it comes back Healthy by itself
    after the quiet period and a passing probe."""
    node, fake = faults
    gpu = fake.uuids[4]
    before = unhealthy(node)
    fake.control.inject_xid(gpu, 94)
    node.wait_health(GPU, [gpu], UNHEALTHY)
    assert unhealthy(node) == before | {gpu}
    node.wait_health(GPU, [gpu], HEALTHY, timeout=20)
    assert condition_names(node, gpu) == set()


def test_ignored_xid_leaves_the_gpu_healthy_and_is_counted(faults: tuple[SimNode, FakeNode]) -> None:
    """XID 31 (an application's fault, ignored by default as NVIDIA does) is seen and logged, and
    the GPU stays Healthy."""
    node, fake = faults
    gpu = fake.uuids[6]
    fake.control.inject_xid(gpu, 31)
    assert wait_until(lambda: "ignored as an application error" in node.log(), 15), node.log()[-3000:]
    assert node.health(GPU, gpu) == HEALTHY


def test_lost_gpu_stays_listed_unhealthy_and_recovers_when_it_answers(
    faults: tuple[SimNode, FakeNode],
) -> None:
    """A lost GPU (every call GPU_IS_LOST, XID 79) stays in the device list, across rediscoveries, as
    Unhealthy, alone; restored, it is Healthy with no restart."""
    node, fake = faults
    gpu = fake.uuids[3]
    before = unhealthy(node)
    fake.control.lose(gpu)
    node.wait_health(GPU, [gpu], UNHEALTHY)
    assert unhealthy(node) == before | {gpu}
    assert wait_until(lambda: "GPU lost" in status_reason(node, gpu), 15)
    seen = node.command("status")["rediscoveries"]
    assert wait_until(lambda: node.command("status")["rediscoveries"] >= seen + 2, 15)
    assert gpu in node.kubelet.devices(GPU) and node.health(GPU, gpu) == UNHEALTHY
    assert node.kubelet.capacity(GPU) == 8
    fake.control.restore(gpu)
    node.wait_health(GPU, [gpu], HEALTHY)
    assert condition_names(node, gpu) == set()


@pytest.mark.parametrize(
    ("index", "fault", "reason"),
    [
        (1, "set_remapped_rows_pending", "remapped rows pending a reset"),
        (5, "set_row_remap_failure", "row remapping failed"),
        (7, "set_pending_retirement", "retired pages pending a reset"),
    ],
)
def test_memory_faults_mark_the_gpu_until_a_probe_passes(
    faults: tuple[SimNode, FakeNode], index: int, fault: str, reason: str
) -> None:
    """Remapped rows pending, a failed remapping, pages pending retirement (no event; the probe
    finds them): only that GPU is Unhealthy, with the reason, until a probe passes again."""
    node, fake = faults
    gpu = fake.uuids[index]
    before = unhealthy(node)
    getattr(fake.control, fault)(gpu, True)
    node.wait_health(GPU, [gpu], UNHEALTHY)
    assert unhealthy(node) == before | {gpu}
    assert reason in status_reason(node, gpu)
    getattr(fake.control, fault)(gpu, False)
    node.wait_health(GPU, [gpu], HEALTHY)


def test_a_failing_event_wait_takes_every_gpu_out_until_waits_work(fake_nvml_libdir: Path) -> None:
    """The event wait failing (not a lost GPU) marks every GPU Unhealthy, since health can no longer
    be watched; once waits work again, they all come back after the quiet period."""
    with fake_node(fake_nvml_libdir, "pcie-l4") as (node, fake):
        node.wait_listed([GPU], 60)
        fake.control.fail("nvmlEventSetWait_v2", 999)
        node.wait_health(GPU, fake.uuids, UNHEALTHY)
        assert "NVML event wait failed" in node.log()
        fake.control.clear_failures()
        node.wait_health(GPU, fake.uuids, HEALTHY, timeout=30)


def test_gpu_lost_before_start_is_left_out_then_joins_with_its_events(fake_nvml_libdir: Path) -> None:
    """A GPU lost when gpuvisor starts cannot be described: the others are served without it; once
    it answers, rediscovery adds it Healthy and its XIDs are watched."""
    with short_tmpdir() as base:
        fake = FakeNode(base, "pcie-l4")
        fake.control.lose(fake.uuids[1])
        with fakenvml.real_node(fake.environ(fake_nvml_libdir), FAST) as node:
            node.wait_listed([GPU], 60)
            uuids = fake.uuids
            assert sorted(node.kubelet.devices(GPU)) == sorted(uuids[:1] + uuids[2:])
            assert not unhealthy(node)
            assert "GPU 1 is lost; leaving it out of discovery" in node.log()
            fake.control.restore(uuids[1])
            assert wait_until(lambda: sorted(node.kubelet.devices(GPU)) == sorted(uuids), 15), node.log()[
                -3000:
            ]
            node.wait_health(GPU, uuids, HEALTHY)
            fake.control.inject_xid(uuids[1], 48)
            node.wait_health(GPU, [uuids[1]], UNHEALTHY)
            assert unhealthy(node) == {uuids[1]}


# ------------------------------------------------------------------ no library, no driver, oldest binding


@pytest.fixture
def no_library() -> Iterator[str]:
    """An empty directory first on LD_LIBRARY_PATH, on a machine with no libnvidia-ml of its own."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a libnvidia-ml of its own: 'no library at all' cannot be shown")
    with short_tmpdir("gvlib") as empty:
        yield empty


def test_no_library_exits_with_what_to_check(no_library: str) -> None:
    """No libnvidia-ml.so.1 with --fail-on-init-error (default): the real binding's LibraryNotFound
    becomes one clear line on stderr and exit status 3, no traceback, no socket left."""
    with short_tmpdir() as tmp:
        proc = run_supervisor(tmp, [], fakenvml.environ(no_library))
        assert proc.returncode == 3, proc.stderr
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gpuvisor: NVML could not be initialised"), last
        for hint in (
            "NVML Shared Library Not Found",
            "(NVML code 12)",
            "libnvidia-ml.so.1",
            "LD_LIBRARY_PATH",
        ):
            assert hint in last, (hint, last)
        assert not os.path.exists(os.path.join(tmp, "r")) or sockets_in(os.path.join(tmp, "r")) == []


def test_no_library_without_fail_on_init_error_is_not_ready_and_retries(
    fake_nvml_libdir: Path, no_library: str
) -> None:
    """--fail-on-init-error=false and no library: the supervisor stays up, not ready, no workers,
    retrying; once libnvidia-ml.so.1 appears on the library path it comes up and registers."""
    with short_tmpdir() as base:
        fake = FakeNode(base, "pcie-l4")
        env = fakenvml.environ(no_library, fake.node_file, fake.control.path)
        with fakenvml.real_node(env, ["--fail-on-init-error=false"]) as node:
            assert wait_until(lambda: os.path.exists(os.path.join(node.run_dir, "control.sock")), 15)
            assert wait_until(lambda: node.command("status")["nvml"]["attempts"] >= 2, 15), node.log()[-3000:]
            status = node.command("status")
            assert (status["nvml"]["up"], status["ready"], status["workers"]) == (False, False, [])
            assert "NVML Shared Library Not Found" in status["nvml"]["error"]
            assert "NVML still unavailable (attempt 2)" in node.log()
            os.symlink(fake_nvml_libdir / fakenvml.SONAME, os.path.join(no_library, fakenvml.SONAME))
            node.wait_listed([GPU], 60)
            assert wait_until(lambda: node.command("status")["ready"], 15)
            assert sorted(node.kubelet.devices(GPU)) == sorted(fake.uuids)
            assert "Traceback" not in node.log()


def test_driver_not_loaded_exits_saying_so(fake_nvml_libdir: Path) -> None:
    """The library is there but nvmlInit answers DRIVER_NOT_LOADED: with --fail-on-init-error
    (default) gpuvisor exits 3 with the driver's words and no traceback."""
    with short_tmpdir() as tmp:
        fake = FakeNode(tmp, "pcie-l4")
        fake.control.fail_init()
        proc = run_supervisor(tmp, [], fake.environ(fake_nvml_libdir))
        assert proc.returncode == 3, proc.stderr
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gpuvisor: NVML could not be initialised") and "Driver Not Loaded" in last, (
            last
        )


def test_driver_loaded_later_without_fail_on_init_error_comes_up(fake_nvml_libdir: Path) -> None:
    """--fail-on-init-error=false while the driver is not loaded: not ready and retrying; once nvmlInit
    succeeds (the fault cleared) it registers every GPU."""
    with short_tmpdir() as base:
        fake = FakeNode(base, "pcie-l4")
        fake.control.fail_init()
        with fakenvml.real_node(fake.environ(fake_nvml_libdir), ["--fail-on-init-error=false"]) as node:
            assert wait_until(lambda: os.path.exists(os.path.join(node.run_dir, "control.sock")), 15)
            assert wait_until(lambda: node.command("status")["nvml"]["attempts"] >= 2, 15), node.log()[-3000:]
            status = node.command("status")
            assert (status["nvml"]["up"], status["ready"]) == (False, False)
            assert "Driver Not Loaded" in status["nvml"]["error"]
            fake.control.clear_failures()
            node.wait_listed([GPU], 60)
            assert sorted(node.kubelet.devices(GPU)) == sorted(fake.uuids)


def test_oldest_binding_runs_the_node_and_delivers_xids(fake_nvml_libdir: Path, oldest_binding: str) -> None:
    """`gpuvisor run` on the oldest nvidia-ml-py pyproject.toml accepts: every GPU registered (NUMA
    through the sysfs fallback: none on this machine), and an XID through its event structs marks the GPU."""
    with fake_node(fake_nvml_libdir, "pcie-l4", pythonpath=[oldest_binding]) as (node, fake):
        which = subprocess.run(
            [sys.executable, "-c", "import pynvml; print(pynvml.__file__, hasattr(pynvml, 'nvmlDeviceGetNumaNodeId'))"],
            env=node.env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert which.stdout.split() == [os.path.join(oldest_binding, "pynvml.py"), "False"]
        node.wait_listed([GPU], 60)
        assert sorted(node.kubelet.devices(GPU)) == sorted(fake.uuids)
        assert all(not d.numa_nodes for d in node.kubelet.devices(GPU).values())
        fake.control.inject_xid(fake.uuids[2], 48)
        node.wait_health(GPU, [fake.uuids[2]], UNHEALTHY)
        assert unhealthy(node) == {fake.uuids[2]}
