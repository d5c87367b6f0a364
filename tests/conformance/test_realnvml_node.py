"""The real NVML binding, tier 2: `gpuvisor run` with no `--simulate`, over the real `pynvml` and
NVIDIA's mock libnvidia-ml, with the kubelet stand-in, real workers and real sockets.

Faults reach the running supervisor the way the mock offers them: a `MOCK_NVML_OVERRIDES` file that
the library re-reads every 100 ms and merges over the profile. A fault trips on the next guarded
device call, which the supervisor's periodic probe makes (every 0.3 s here). NVML has no event for a
GPU reset, so an until-reset fault stays on a real node until the GPU is lost and found again or
gpuvisor restarts (`gpuvisor sim reset` is for simulated nodes). Which tier covers what is listed
in `tests/conformance/test_realnvml.py`.
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
from typing import Any

import pytest
import yaml

from tests import mocknvml
from tests.harness import SimNode, gpuvisor_status, run_supervisor
from tests.helpers import REPO, gone, short_tmpdir, sockets_in, wait_until

GPU = "nvidia.com/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
H100 = mocknvml.expected_node("h100") if mocknvml.skip_reason() is None else None
FAULT_CONFIG = {"version": "v1", "gpuvisor": {"health": {"transientQuietSeconds": 1}}}
FAST = ["--probe-interval", "0.3", "--rediscovery-interval", "1"]


def uuids(profile: str) -> list[str]:
    return [g.uuid for g in mocknvml.expected_node(profile).gpus]


def unhealthy(node: SimNode) -> set[str]:
    return {d.id for d in node.kubelet.devices(GPU).values() if d.health != HEALTHY}


def conditions(node: SimNode, gpu: str) -> list[dict[str, Any]]:
    return [c for c in node.command("status")["conditions"] if c["gpu"] == gpu]


def condition_names(node: SimNode, gpu: str) -> set[str]:
    return {c["name"] for c in conditions(node, gpu)}


def status_reason(node: SimNode, gpu: str) -> str:
    devices = {d["id"]: d for d in node.command("status")["resources"][GPU]}
    return str(devices[gpu]["reason"])


# ------------------------------------------------------------------ a healthy node


@pytest.fixture(scope="module")
def h100(mock_nvml_libdir: str) -> Iterator[SimNode]:
    with mocknvml.real_node(mock_nvml_libdir, "h100") as node:
        node.wait_listed([GPU], 60)
        yield node


def test_registers_every_gpu_of_the_profile_healthy_with_numa(h100: SimNode) -> None:
    """The kubelet sees nvidia.com/gpu with the profile's UUIDs as IDs, all Healthy, each on its NUMA node."""
    assert H100 is not None
    devices = h100.kubelet.devices(GPU)
    assert sorted(devices) == sorted(g.uuid for g in H100.gpus)
    assert all(d.health == HEALTHY for d in devices.values())
    assert {g.uuid: [g.numa_node] for g in H100.gpus} == {d.id: list(d.numa_nodes) for d in devices.values()}
    assert h100.kubelet.capacity(GPU) == h100.kubelet.allocatable(GPU) == len(H100.gpus)
    (registration,) = [r for r in h100.kubelet.registrations if r.resource == GPU]
    assert not registration.error


def test_preferred_allocation_keeps_a_request_on_one_numa_node(h100: SimNode) -> None:
    """Over the real topology answers (NVLink to every peer, one PCI root per NUMA node), a request
    for 4 of 8 GPUs is answered with the 4 GPUs of one NUMA node, as NVIDIA's scoring prefers."""
    assert H100 is not None
    by_numa: dict[int | None, set[str]] = {}
    for g in H100.gpus:
        by_numa.setdefault(g.numa_node, set()).add(g.uuid)
    for size in (2, 4):
        chosen = h100.kubelet.preferred(GPU, sorted(h100.kubelet.devices(GPU)), [], size)
        assert len(chosen) == size
        assert any(set(chosen) <= group for group in by_numa.values()), (size, chosen)


def test_allocate_returns_exactly_the_allocated_uuids(h100: SimNode) -> None:
    """Allocate of two GPUs answers NVIDIA_VISIBLE_DEVICES with exactly those UUIDs."""
    ids, response = h100.kubelet.allocate(GPU, 2)
    try:
        assert sorted(response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(ids)
    finally:
        h100.kubelet.release(GPU, ids)


def test_status_json_reports_real_nvml_up_and_every_device(h100: SimNode) -> None:
    """`gpuvisor status --json` on real NVML: not simulated, NVML up at the first attempt, ready, the
    worker registered, and every device of the profile Healthy."""
    assert H100 is not None
    # The stand-in lists the devices a moment before the worker's report reaches the supervisor.
    assert wait_until(lambda: h100.command("status")["ready"], 15), h100.command("status")
    proc = gpuvisor_status(h100, "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["simulated"] is False, status
    assert (status["nvml"], status["ready"]) == ({"up": True, "error": "", "attempts": 1}, True), status
    assert [(w["resource"], w["state"], w["registered"]) for w in status["workers"]] == [
        (GPU, "RUNNING", True)
    ], status
    assert {d["id"]: d["health"] for d in status["resources"][GPU]} == {g.uuid: HEALTHY for g in H100.gpus}


def test_sigterm_stops_cleanly(mock_nvml_libdir: str) -> None:
    """SIGTERM on real NVML: exit 0, no worker left, no socket left but the kubelet's, no traceback."""
    with mocknvml.real_node(mock_nvml_libdir, "t4") as node:
        node.wait_listed([GPU], 60)
        pids = [p.pid for p in node.workers()]
        assert pids
        assert node.stop_supervisor(signal.SIGTERM) == 0
        assert wait_until(lambda: gone(pids), 10)
        assert sockets_in(node.plugin_dir) == ["kubelet.sock"]
        assert sockets_in(node.run_dir) == []
        assert "Traceback" not in node.log()


# ------------------------------------------------------------------ faults at run time


@pytest.fixture(scope="module")
def faults(mock_nvml_libdir: str) -> Iterator[tuple[SimNode, str]]:
    """An a100 node whose mock re-reads an override file every 100 ms; probes every 0.3 s,
    rediscovery every 1 s, a 1 s transient quiet period. Each test faults its own GPU."""
    with short_tmpdir() as base:
        overrides = mocknvml.overrides_file(base)
        config = os.path.join(base, "config.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            yaml.safe_dump(FAULT_CONFIG, fh)
        args = ["--config-file", config, *FAST]
        with mocknvml.real_node(mock_nvml_libdir, "a100", args, overrides=overrides) as node:
            node.wait_listed([GPU], 60)
            yield node, overrides


@contextmanager
def fault(faults: tuple[SimNode, str], index: int, spec: dict[str, Any]) -> Iterator[tuple[str, set[str]]]:
    """Fault GPU `index` of the a100 profile for the block; yields its UUID and the GPUs that were
    unhealthy before. The override file is cleared on the way out, however the block ends."""
    node, overrides = faults
    before = unhealthy(node)
    try:
        mocknvml.write_overrides(overrides, {index: spec})
        yield uuids("a100")[index], before
    finally:
        mocknvml.write_overrides(overrides)


def test_xid_48_marks_only_its_gpu_until_a_reset(faults: tuple[SimNode, str]) -> None:
    """An XID 48 through the event set marks only that GPU Unhealthy, as a whole-GPU condition;
    once the fault is gone, probes pass and the quiet period is over, it is still Unhealthy:
    XID 48 is until-reset."""
    node, _ = faults
    with fault(faults, 2, mocknvml.xid_fault(48)) as (gpu, before):
        assert wait_until(lambda: "xid:48" in condition_names(node, gpu), 15), node.log()[-3000:]
        node.wait_health(GPU, [gpu], UNHEALTHY)
        assert unhealthy(node) == before | {gpu}
        (xid,) = [c for c in conditions(node, gpu) if c["name"] == "xid:48"]
        assert (xid["recovery"], xid["gpu_instance"], xid["compute_instance"]) == ("until-reset", None, None)
    # The mock's uncorrectable error also fails row remapping: that probe finding goes with the fault.
    assert wait_until(lambda: condition_names(node, gpu) == {"xid:48"}, 15), conditions(node, gpu)
    # Two rediscoveries (1 s apart) later the 1 s quiet period is over and probes have passed.
    seen = node.command("status")["rediscoveries"]
    assert wait_until(lambda: node.command("status")["rediscoveries"] >= seen + 2, 15)
    assert node.health(GPU, gpu) == UNHEALTHY
    assert "XID 48" in status_reason(node, gpu)


def test_transient_xid_recovers_once_quiet_and_a_probe_passes(faults: tuple[SimNode, str]) -> None:
    """XID 94 (transient by default) marks only its GPU Unhealthy; once the fault is gone it comes
    back Healthy by itself after the quiet period and a passing probe."""
    node, _ = faults
    with fault(faults, 4, mocknvml.xid_fault(94)) as (gpu, before):
        assert wait_until(lambda: "xid:94" in condition_names(node, gpu), 15), node.log()[-3000:]
        node.wait_health(GPU, [gpu], UNHEALTHY)
        assert unhealthy(node) == before | {gpu}
    node.wait_health(GPU, [gpu], HEALTHY, timeout=20)
    assert condition_names(node, gpu) == set()


def test_lost_gpu_stays_listed_unhealthy_and_recovers_when_it_answers(faults: tuple[SimNode, str]) -> None:
    """A lost GPU stays in the device list (across rediscoveries) as Unhealthy, alone; when NVML
    answers for it again it is Healthy with no restart."""
    node, _ = faults
    with fault(faults, 3, mocknvml.LOST) as (gpu, before):
        node.wait_health(GPU, [gpu], UNHEALTHY)
        assert unhealthy(node) == before | {gpu}
        assert "GPU lost" in status_reason(node, gpu)
        seen = node.command("status")["rediscoveries"]
        assert wait_until(lambda: node.command("status")["rediscoveries"] >= seen + 2, 15)
        assert gpu in node.kubelet.devices(GPU) and node.health(GPU, gpu) == UNHEALTHY
        assert node.kubelet.capacity(GPU) == 8
    node.wait_health(GPU, [gpu], HEALTHY)
    assert condition_names(node, gpu) == set()


def test_fallen_off_the_bus_with_xid_79_recovers_when_found(faults: tuple[SimNode, str]) -> None:
    """A GPU that falls off the bus with XID 79 is lost and carries the XID; both end when it answers again."""
    node, _ = faults
    with fault(faults, 5, mocknvml.FELL_OFF_BUS) as (gpu, before):
        assert wait_until(lambda: {"lost", "xid:79"} <= condition_names(node, gpu), 15), node.log()[-3000:]
        node.wait_health(GPU, [gpu], UNHEALTHY)
        assert unhealthy(node) == before | {gpu}
    node.wait_health(GPU, [gpu], HEALTHY)
    assert condition_names(node, gpu) == set()


@pytest.mark.parametrize(
    ("index", "rows", "reason"),
    [
        (1, {"pending": True}, "remapped rows pending a reset"),
        (6, {"failure_occurred": True}, "row remapping failed"),
    ],
)
def test_remapped_rows_mark_the_gpu_until_a_probe_passes(
    faults: tuple[SimNode, str], index: int, rows: dict[str, bool], reason: str
) -> None:
    """Remapped rows pending (or failed), which send no event, are found by the probe: only that GPU
    is Unhealthy, with the reason, until a probe passes."""
    node, _ = faults
    with fault(faults, index, {"remapped_rows": rows}) as (gpu, before):
        node.wait_health(GPU, [gpu], UNHEALTHY)
        assert unhealthy(node) == before | {gpu}
        assert reason in status_reason(node, gpu)
    node.wait_health(GPU, [gpu], HEALTHY)


def test_gpu_lost_before_start_is_left_out_then_joins_with_its_events(mock_nvml_libdir: str) -> None:
    """A GPU lost when gpuvisor starts cannot be described: the others are served without it; once
    it answers, rediscovery adds it Healthy and its XIDs are watched."""
    t4 = uuids("t4")
    with short_tmpdir() as tmp:
        overrides = mocknvml.overrides_file(tmp, {1: mocknvml.LOST})
        with mocknvml.real_node(mock_nvml_libdir, "t4", FAST, overrides=overrides) as node:
            node.wait_listed([GPU], 60)
            assert sorted(node.kubelet.devices(GPU)) == sorted(t4[:1] + t4[2:])
            assert not unhealthy(node)
            assert "GPU 1 is lost; leaving it out of discovery" in node.log()
            mocknvml.write_overrides(overrides)
            assert wait_until(lambda: sorted(node.kubelet.devices(GPU)) == sorted(t4), 15), node.log()[-3000:]
            node.wait_health(GPU, t4, HEALTHY)
            mocknvml.write_overrides(overrides, {1: mocknvml.xid_fault(48)})
            assert wait_until(lambda: "xid:48" in condition_names(node, t4[1]), 15), node.log()[-3000:]
            node.wait_health(GPU, [t4[1]], UNHEALTHY)
            assert unhealthy(node) == {t4[1]}


# ------------------------------------------------------------------ no library, oldest binding


@pytest.fixture
def no_library(mock_nvml_libdir: str) -> Iterator[str]:
    """An empty directory first on LD_LIBRARY_PATH, on a machine with no libnvidia-ml of its own."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a libnvidia-ml of its own: 'no library at all' cannot be shown")
    with short_tmpdir("gvlib") as empty:
        yield empty


def test_no_library_exits_with_what_to_check(no_library: str) -> None:
    """No libnvidia-ml.so.1 with --fail-on-init-error (default): the real binding's LibraryNotFound
    becomes one clear line on stderr and exit status 3, no traceback, no socket left."""
    with short_tmpdir() as tmp:
        proc = run_supervisor(tmp, [], mocknvml.environ(no_library))
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
    mock_nvml_libdir: str, no_library: str
) -> None:
    """--fail-on-init-error=false and no library: the supervisor stays up, not ready, no workers,
    retrying; once libnvidia-ml.so.1 appears on the library path it comes up and registers."""
    with mocknvml.real_node(no_library, None, ["--fail-on-init-error=false"]) as node:
        assert wait_until(lambda: os.path.exists(os.path.join(node.run_dir, "control.sock")), 15)
        assert wait_until(lambda: node.command("status")["nvml"]["attempts"] >= 2, 15), node.log()[-3000:]
        status = node.command("status")
        assert (status["nvml"]["up"], status["ready"], status["workers"]) == (False, False, [])
        assert "NVML Shared Library Not Found" in status["nvml"]["error"]
        assert "NVML still unavailable (attempt 2)" in node.log()
        for name in (mocknvml.LIB_NAME, mocknvml.SONAME):
            os.symlink(os.path.join(mock_nvml_libdir, name), os.path.join(no_library, name))
        node.wait_listed([GPU], 60)
        assert wait_until(lambda: node.command("status")["ready"], 15)
        assert len(node.kubelet.devices(GPU)) == 8  # the mock's default node
        assert "Traceback" not in node.log()


def test_oldest_binding_runs_the_node_and_delivers_xids(mock_nvml_libdir: str, oldest_binding: str) -> None:
    """`gpuvisor run` on the oldest nvidia-ml-py pyproject.toml accepts: every GPU registered (NUMA
    through the sysfs fallback: none on this machine), and an XID through its event structs marks the GPU."""
    t4 = uuids("t4")
    with short_tmpdir() as tmp:
        overrides = mocknvml.overrides_file(tmp)
        env = mocknvml.environ(mock_nvml_libdir, "t4", overrides=overrides, pythonpath=[oldest_binding])
        which = subprocess.run(
            [sys.executable, "-c", "import pynvml; print(pynvml.__file__, hasattr(pynvml, 'nvmlDeviceGetNumaNodeId'))"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert which.stdout.split() == [os.path.join(oldest_binding, "pynvml.py"), "False"]
        with mocknvml.real_node(
            mock_nvml_libdir, "t4", FAST, overrides=overrides, pythonpath=[oldest_binding]
        ) as node:
            node.wait_listed([GPU], 60)
            assert sorted(node.kubelet.devices(GPU)) == sorted(t4)
            assert all(not d.numa_nodes for d in node.kubelet.devices(GPU).values())
            mocknvml.write_overrides(overrides, {2: mocknvml.xid_fault(48)})
            assert wait_until(lambda: "xid:48" in condition_names(node, t4[2]), 15), node.log()[-3000:]
            node.wait_health(GPU, [t4[2]], UNHEALTHY)
            assert unhealthy(node) == {t4[2]}
