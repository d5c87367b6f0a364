"""The real NVML binding, tier 1: gpuvisor's NVML adapter over the real `pynvml` and the project's
fake libnvidia-ml (tests/fakenvml), for every node profile: the simulator's built-ins and NVIDIA's
mock NVML profiles (`../shared/mocknvml/configs`, read by the simulator's own loader).

The differential: for each profile, the adapter runs in a child process over the real binding and
the C library, and in this process over the Python simulator; what it discovers (the node, GPU
Feature Discovery's facts, the health probes) must be the same, field by field. The library's own
answers are tested in test_fakenvml.py, `gpuvisor run` over it in test_realnvml_node.py, and what
the loader reads from NVIDIA's profiles in test_mockprofile.py.

Which tier covers what. The simulator tier (`supervisor/sim/nvml` in place of the `pynvml` module)
tests gpuvisor's logic; this tier proves that the logic meets the real binding's ctypes structs,
`_v2` variants, return codes and event sets the same way:

| behaviour | real binding + fake library | simulator |
| --- | --- | --- |
| discovery (UUIDs, bus ids, NUMA, names, memory, minors, NVLinks, MIG devices, versions) | here, every profile | test_nvml |
| GFD's facts (MIG engines, PCI class, fabric clique) | here; labels: test_labels_fakenvml | test_labels_golden, test_simulator_labels |
| event-set registration, a wait timing out, no spinning while idle | here | test_nvml, test_health_monitor |
| XID / ECC through the event set, MIG GI/CI ids, recovery | test_realnvml_node, test_fakenvml | test_health_e2e, test_health_monitor |
| lost GPU, remapped rows, wait failing, init failing, no library | test_realnvml_node | test_health_monitor, test_supervisor |
| the oldest accepted nvidia-ml-py (NUMA from sysfs) | here, test_realnvml_node | test_nvml (sysfs fallback) |
| MIG layout changes by an operator (`sim mig`; the library's node file is fixed per process) | - | test_health_e2e, test_replan |
| MIG on demand through NVML (placements, GPU/compute instances made and destroyed, MIG mode) | test_mig_on_demand (both doubles, step for step) | test_simulator_migcreate |
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pynvml
import pytest

from common.model import node_to_json
from supervisor.node.facts import facts_from_nvml
from supervisor.node.nvml import Nvml, sysfs_bus_id
from supervisor.sim.nvml import Simulator, list_profiles
from supervisor.sim.nvml.pcitree import write_sysfs
from tests import fakenvml
from tests.helpers import short_tmpdir

PROFILES = fakenvml.profiles()
WAIT_MS = 250
WANTED = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
)


def simulator_report(profile: str, sysfs: str | None = None) -> dict[str, Any]:
    """What the adapter finds over the Python simulator of the same node, as the child reports it."""
    nvml = Nvml(Simulator(fakenvml.spec_for(profile)), sysfs_root=sysfs)
    nvml.init()
    node = nvml.discover()
    uuids = [g.uuid for g in node.gpus] + [m.uuid for g in node.gpus for m in g.mig_devices]
    return {
        "node": json.loads(node_to_json(node)),
        "facts": json.loads(json.dumps(dataclasses.asdict(facts_from_nvml(nvml)))),
        "probes": {u: dataclasses.asdict(nvml.probe(u)) for u in uuids},
    }


@pytest.fixture(scope="module")
def reports(fake_nvml_libdir: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """One adapter report per profile over the real binding; the children run side by side."""
    with short_tmpdir() as base:

        def one(profile: str) -> dict[str, Any]:
            node = fakenvml.FakeNode(_mkdir(os.path.join(base, profile)), profile)
            return fakenvml.child_report(
                node.environ(fake_nvml_libdir), "--sysfs", "none", "--wait-ms", str(WAIT_MS)
            )

        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {p: pool.submit(one, p) for p in PROFILES}
            yield {p: f.result() for p, f in futures.items()}


def _mkdir(path: str) -> str:
    os.makedirs(path)
    return path


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_profile_is_exercised() -> None:
    """The tier runs every built-in simulator profile and every profile of NVIDIA's mock present
    (all seven NVIDIA ships, where ../shared has them)."""
    assert set(list_profiles()) <= set(PROFILES)
    mock = fakenvml.mock_profiles()
    if fakenvml.MOCK_CONFIGS.is_dir():
        assert {"a100", "b200", "gb200", "gb300", "h100", "l40s", "t4"} <= set(mock)
    assert set(mock) <= set(PROFILES)


def test_discovered_node_is_the_simulators(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """The node the adapter discovers over the real binding and the fake library (GPUs, MIG devices,
    NUMA, topology, NVLinks, versions) equals what it discovers over the simulator, field by field."""
    assert reports[profile]["node"] == simulator_report(profile)["node"]


def test_gfd_facts_are_the_simulators(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """GFD's facts (MIG capability and engines, PCI class from NVML, fabric clique, versions) over
    the real binding equal the simulator's."""
    assert reports[profile]["facts"] == simulator_report(profile)["facts"]


def test_health_probes_are_the_simulators(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """The health probe of every GPU and MIG device over the real binding answers as over the simulator."""
    assert reports[profile]["probes"] == simulator_report(profile)["probes"]


def test_the_node_is_the_description(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """What the binding discovered is the description, not an empty or default node: every GPU by
    UUID, bus id and MIG devices in order."""
    spec = fakenvml.spec_for(profile)
    gpus = reports[profile]["node"]["gpus"]
    assert [(g["uuid"], sysfs_bus_id(g["pci_bus_id"])) for g in gpus] == [
        (g.uuid, sysfs_bus_id(g.pci_bus_id)) for g in spec.gpus
    ]
    assert [[m["uuid"] for m in g["mig_devices"]] for g in gpus] == [
        [m.uuid for m in g.mig] if g.mig_enabled else [] for g in spec.gpus
    ]


def test_addressing_mode_crosses_the_real_binding(reports: dict[str, dict[str, Any]]) -> None:
    """nvmlDeviceGetAddressingMode through nvidia-ml-py's versioned struct: the coherent-memory node
    (gh200) reads ATS, as NVIDIA's DRA driver would publish it; a node whose NVML answers
    NotSupported (dgx-h100) reads none."""
    assert [g["addressing_mode"] for g in reports["gh200"]["node"]["gpus"]] == ["ATS"]
    assert {g["addressing_mode"] for g in reports["dgx-h100"]["node"]["gpus"]} == {""}


def test_event_set_registers_what_each_gpu_supports(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """Every GPU is registered for the XID and ECC events it supports (ECC where the description
    says so), none skipped."""
    report, spec = reports[profile], fakenvml.spec_for(profile)
    assert report["skipped"] == {}
    assert report["registered"] == {
        g.uuid: pynvml.nvmlEventTypeXidCriticalError | (WANTED if g.ecc_events else 0) for g in spec.gpus
    }


def test_event_wait_times_out_as_asked(reports: dict[str, dict[str, Any]], profile: str) -> None:
    """With nothing pending, a wait returns no event after the timeout asked for, not at once and not much later."""
    (wait,) = reports[profile]["waits"]
    assert wait["event"] is None
    assert WAIT_MS * 0.9 <= wait["elapsed_ms"] <= WAIT_MS + 1500, wait


def test_idle_health_loop_does_not_spin(fake_nvml_libdir: Path) -> None:
    """The supervisor's health thread over the real binding, idle for 3 s with 1 s probes, uses
    near-zero CPU: it blocks in the event wait instead of spinning (NVIDIA #1937 burns a core)."""
    with short_tmpdir() as tmp:
        node = fakenvml.FakeNode(tmp, "dgx-a100")
        report = fakenvml.child_report(
            node.environ(fake_nvml_libdir), "--idle-seconds", "3", "--probe-interval", "1"
        )
    idle = report["idle"]
    assert idle["errors"] == 0 and idle["events"] == 0
    assert idle["probes"] >= 2 * 8, idle  # the thread was alive and probing every GPU
    share = idle["health_thread_cpu_s"] / idle["seconds"]
    print(
        f"idle health thread: {share:.3%} of a core; whole process {idle['process_cpu_s'] / idle['seconds']:.3%}"
    )
    # A spinning loop takes a core (NVIDIA's #1937: 100 %). An idle one reads 0.1-1 % of one, and
    # up to 2.2 % in a busy hour on these shared machines (0.7-0.9 % typical then, as the bare
    # plugin's floor read 7x its quiet-hour figure): the bound separates the two, not the hours.
    assert share < 0.10, idle


def render_sysfs(profile: str, root: str) -> str:
    """The profile's PCIe tree as a node's sysfs has it (the simulator's `write_sysfs`): each GPU's
    `numa_node` under its root complex."""
    write_sysfs(fakenvml.spec_for(profile).gpus, root)
    return root


@pytest.mark.parametrize("profile", ["dgx-h100", "mig-a100", "h100"])
def test_oldest_binding_discovers_the_same_node_with_numa_from_sysfs(
    fake_nvml_libdir: Path, oldest_binding: str, profile: str
) -> None:
    """The oldest nvidia-ml-py pyproject.toml accepts lacks nvmlDeviceGetNumaNodeId (and
    nvmlDeviceGetAddressingMode): the adapter reads NUMA from sysfs instead, and the whole discovered
    node, MIG, PCIe root and sysfs NUMA node included, is still the simulator's over the same tree."""
    if profile not in PROFILES:
        pytest.skip(f"profile {profile} is not here (NVIDIA's mock profiles are read from ../shared)")
    with short_tmpdir() as tmp:
        node = fakenvml.FakeNode(_mkdir(os.path.join(tmp, "n")), profile)
        env = node.environ(fake_nvml_libdir, pythonpath=[oldest_binding])
        sysfs = render_sysfs(profile, os.path.join(tmp, "sys"))
        report = fakenvml.child_report(env, "--sysfs", sysfs)
        assert report["binding"].startswith(oldest_binding)
        assert report["has_numa_function"] is False
        assert report["node"] == simulator_report(profile, sysfs)["node"]
        assert all(g["pcie_root"] and g["pci_numa_node"] is not None for g in report["node"]["gpus"])
