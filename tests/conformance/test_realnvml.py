"""The real NVML binding, tier 1: gpuvisor's NVML adapter over the real `pynvml` and NVIDIA's mock
libnvidia-ml, for every node profile the mock ships (`../shared/mocknvml/configs`).

The mock reads its library path and profile when a process starts, so each profile runs in a child
process (`tests/mocknvml_child.py`, all profiles at once) and the tests here judge its report
against the profile file, read independently (`tests.mocknvml.expected_node`). `gpuvisor run`
over the mock is tier 2, `tests/conformance/test_realnvml_node.py`. The tier is skipped, with the reason, only
where the mock is not beside the checkout.

Which tier covers what. The simulator tier (`supervisor/sim/nvml` in place of the `pynvml` module)
remains the only cover where the mock cannot show a path:

| behaviour | real binding + mock | simulator |
| --- | --- | --- |
| discovery: UUIDs, bus ids, NUMA, names, memory, minors, NVLinks, versions | here, every profile | test_nvml |
| MIG devices, profile names, GI/CI ids (mock: no MIG instances) | - | test_nvml, test_planning |
| event-set registration, event wait timing out, no spinning | here | test_nvml, test_health_monitor |
| XID through the event set -> only that GPU Unhealthy, policy recovery | test_realnvml_node | test_health_e2e, test_health_monitor |
| ECC single/double-bit events (mock: XID events only) | - | test_health_monitor, test_health_e2e |
| a failing event wait: backoff, no spin, all Unhealthy (mock: SUCCESS/TIMEOUT only) | - | test_health_monitor |
| per-set registration, MIG instance ids on events (mock: every set gets every XID, GI/CI 0/0) | - | test_nvml, test_health_monitor |
| lost GPU, fallen off the bus + XID 79, remapped rows pending/failed | test_realnvml_node | test_health_monitor, test_health_e2e |
| a GPU lost before start (left out, joins when it answers) | test_realnvml_node | test_nvml |
| a GPU reset clearing until-reset faults (NVML has no reset event) | - | test_health_e2e (`sim reset`) |
| no libnvidia-ml at all, both --fail-on-init-error values | test_realnvml_node | test_supervisor |
| the oldest accepted nvidia-ml-py: NUMA from sysfs where it lacks the query | here, test_realnvml_node | test_nvml (sysfs fallback) |
| replicas and MIG instances fanned out from one GPU's fault | - | test_health_e2e, test_health_book |
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.model import Node, node_from_json
from supervisor.node.nvml import sysfs_bus_id
from tests import mocknvml
from tests.helpers import short_tmpdir

# NVIDIA's profiles; where the mock is absent, their names keep the tests listed, and the
# `mock_nvml_libdir` fixture skips each with the reason.
SHIPPED = ["a100", "b200", "gb200", "gb300", "h100", "l40s", "t4"]
PROFILES = mocknvml.profiles() if mocknvml.skip_reason() is None else SHIPPED
WAIT_MS = 250
XID_EVENT = 8  # nvmlEventTypeXidCriticalError: the only event type the mock supports


@pytest.fixture(scope="module")
def reports(mock_nvml_libdir: str) -> dict[str, dict[str, Any]]:
    """One adapter report per profile; the children run side by side (they mostly wait)."""
    with ThreadPoolExecutor(max_workers=len(PROFILES) or 1) as pool:
        futures = {
            p: pool.submit(
                mocknvml.child_report, mocknvml.environ(mock_nvml_libdir, p), "--wait-ms", str(WAIT_MS)
            )
            for p in PROFILES
        }
        return {p: f.result() for p, f in futures.items()}


def discovered(report: dict[str, Any]) -> Node:
    return node_from_json(json.dumps(report["node"]))


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_every_profile_is_exercised(mock_nvml_libdir: str) -> None:
    """The tier runs every profile in the mock's configs/, at least the seven NVIDIA ships."""
    assert set(SHIPPED) <= set(PROFILES) == set(mocknvml.profiles())


def test_gpu_identity_matches_the_profile(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """Every GPU of the profile, by index: UUID, PCI bus id, name, memory, minor, compute capability."""
    node, want = discovered(reports[profile]), mocknvml.expected_node(profile)
    got = [
        (g.index, g.uuid, sysfs_bus_id(g.pci_bus_id), g.name, g.memory_mib, g.minor, g.compute_capability)
        for g in node.gpus
    ]
    expected = [
        (g.index, g.uuid, g.bus_id.lower(), g.name, g.memory_mib, g.minor, g.compute_capability)
        for g in want.gpus
    ]
    assert got == expected


def test_numa_nodes_match_the_profile(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """Each GPU's NUMA node is its root complex's in the profile's pcie_topology (nvmlDeviceGetNumaNodeId)."""
    node, want = discovered(reports[profile]), mocknvml.expected_node(profile)
    assert reports[profile]["has_numa_function"] is True
    assert [g.numa_node for g in node.gpus] == [g.numa_node for g in want.gpus]
    assert all(g.numa_node is not None for g in want.gpus), "the profile names every GPU's root complex"


def test_nvlinks_match_the_profile(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """NVLinks between every GPU pair: links_per_gpu through the profile's NVSwitches, none without."""
    node, want = discovered(reports[profile]), mocknvml.expected_node(profile)
    count = len(want.gpus)
    assert sorted((link.a, link.b) for link in node.links) == [
        (a, b) for a in range(count) for b in range(a + 1, count)
    ]
    assert {link.nvlinks for link in node.links} == {want.nvlinks_per_pair}


def test_driver_and_cuda_versions_match_the_profile(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """The driver version string and the CUDA driver version (major*1000 + minor*10) of the profile."""
    node, want = discovered(reports[profile]), mocknvml.expected_node(profile)
    assert (node.driver_version, node.cuda_driver_version) == (want.driver_version, want.cuda_driver_version)


def test_event_set_registers_what_each_gpu_supports(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """Every GPU is registered in the event set for the wanted types it supports (the mock: XID only), none skipped."""
    report = reports[profile]
    uuids = [g.uuid for g in mocknvml.expected_node(profile).gpus]
    assert report["skipped"] == {}
    assert report["registered"] == {u: report["wanted_mask"] & report["supported_masks"][u] for u in uuids}
    assert set(report["registered"].values()) == {XID_EVENT}


def test_event_wait_times_out_as_asked(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """With nothing pending, a wait returns no event after the timeout asked for, not at once and not much later."""
    (wait,) = reports[profile]["waits"]
    assert wait["event"] == "None"
    assert WAIT_MS * 0.9 <= wait["elapsed_ms"] <= WAIT_MS + 1500, wait


def test_idle_health_loop_does_not_spin(mock_nvml_libdir: str) -> None:
    """The supervisor's health thread over the real binding, idle for 3 s with 1 s probes, uses
    near-zero CPU: it blocks in the event wait instead of spinning (NVIDIA #1937 burns a core)."""
    report = mocknvml.child_report(
        mocknvml.environ(mock_nvml_libdir, "a100"), "--idle-seconds", "3", "--probe-interval", "1"
    )
    idle = report["idle"]
    assert idle["errors"] == 0 and idle["events"] == 0
    assert idle["probes"] >= 2 * 8, idle  # the thread was alive and probing every GPU
    share = idle["health_thread_cpu_s"] / idle["seconds"]
    print(
        f"idle health thread: {share:.3%} of a core; whole process {idle['process_cpu_s'] / idle['seconds']:.3%}"
    )
    assert share < 0.02, idle


def test_oldest_binding_takes_the_sysfs_numa_fallback(mock_nvml_libdir: str, oldest_binding: str) -> None:
    """The oldest nvidia-ml-py pyproject.toml accepts lacks nvmlDeviceGetNumaNodeId: the adapter reads
    NUMA from sysfs instead (the tree the mock's renderer makes from the profile) and the rest of
    discovery and event registration is unchanged."""
    env = mocknvml.environ(mock_nvml_libdir, "h100", pythonpath=[oldest_binding])
    with short_tmpdir() as tmp:
        report = mocknvml.child_report(env, "--sysfs", mocknvml.render_sysfs("h100", tmp), "--wait-ms", "100")
    want = mocknvml.expected_node("h100")
    node = discovered(report)
    assert report["binding"].startswith(oldest_binding)
    assert report["has_numa_function"] is False
    assert [g.numa_node for g in node.gpus] == [g.numa_node for g in want.gpus]
    assert [g.uuid for g in node.gpus] == [g.uuid for g in want.gpus]
    assert {link.nvlinks for link in node.links} == {want.nvlinks_per_pair}
    assert set(report["registered"].values()) == {XID_EVENT}
    assert report["waits"][0]["event"] == "None"
