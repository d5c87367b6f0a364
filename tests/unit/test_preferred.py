"""Tests for worker.preferred: topology-aware and distributed/packed preferred allocation that never raises."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.model import (
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
    AllocatableDevice,
    GpuPair,
    ResourcePlan,
)
from worker import preferred
from worker.preferred import PreferredPolicy, preferred_allocation


def gid(i: int) -> str:
    return f"GPU-{i:04d}"


def full_gpu(i: int, numa: int | None) -> AllocatableDevice:
    return AllocatableDevice(
        id=gid(i),
        uuid=gid(i),
        index=str(i),
        gpu_uuid=gid(i),
        gpu_index=i,
        gpu_minor=i,
        numa_node=numa,
        memory_mib=24576,
    )


def replica(i: int, r: int, replicas: int) -> AllocatableDevice:
    return AllocatableDevice(
        id=f"{gid(i)}::{r}",
        uuid=gid(i),
        index=str(i),
        gpu_uuid=gid(i),
        gpu_index=i,
        gpu_minor=i,
        numa_node=0,
        memory_mib=24576,
        replica=r,
        replicas=replicas,
    )


def mig_device(i: int, j: int) -> AllocatableDevice:
    return AllocatableDevice(
        id=f"MIG-{i}-{j}",
        uuid=f"MIG-{i}-{j}",
        index=f"{i}:{j}",
        gpu_uuid=gid(i),
        gpu_index=i,
        gpu_minor=i,
        numa_node=0,
        memory_mib=10240,
        mig_gi=j + 1,
        mig_ci=0,
        mig_profile="1g.10gb",
    )


def topology_plan(numa: Sequence[int | None], links: Sequence[GpuPair]) -> ResourcePlan:
    return ResourcePlan(
        resource="nvidia.com/gpu",
        devices=tuple(full_gpu(i, n) for i, n in enumerate(numa)),
        links=tuple(links),
    )


def pcie_l4() -> ResourcePlan:
    """4 GPUs: 0,1 behind one switch, 2,3 behind another, across NUMA nodes otherwise."""
    single = {(0, 1), (2, 3)}
    links = [
        GpuPair(a, b, TOPOLOGY_SINGLE if (a, b) in single else TOPOLOGY_SYSTEM)
        for a, b in itertools.combinations(range(4), 2)
    ]
    return topology_plan([0, 0, 1, 1], links)


def dgx(nvlinks: int = 12) -> ResourcePlan:
    """8 GPUs all NVLinked (NVSwitch), GPUs 0-3 on NUMA node 0 and 4-7 on NUMA node 1."""
    links = [
        GpuPair(a, b, TOPOLOGY_NODE if a // 4 == b // 4 else TOPOLOGY_SYSTEM, nvlinks)
        for a, b in itertools.combinations(range(8), 2)
    ]
    return topology_plan([i // 4 for i in range(8)], links)


def big_pcie(n: int = 16) -> ResourcePlan:
    """n GPUs in switch pairs, half per NUMA node: large enough for the greedy search."""
    half = n // 2

    def ancestor(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return TOPOLOGY_SINGLE
        return TOPOLOGY_NODE if a // half == b // half else TOPOLOGY_SYSTEM

    links = [GpuPair(a, b, ancestor(a, b)) for a, b in itertools.combinations(range(n), 2)]
    return topology_plan([i // half for i in range(n)], links)


def shared_plan(
    gpus: int = 4, replicas: int = 4, policy: str = "distributed", sharing: str = "time-slicing"
) -> ResourcePlan:
    return ResourcePlan(
        resource="nvidia.com/gpu",
        devices=tuple(replica(i, r, replicas) for i in range(gpus) for r in range(replicas)),
        sharing=sharing,
        shared_policy=policy,
    )


def mig_plan(policy: str = "distributed") -> ResourcePlan:
    return ResourcePlan(
        resource="nvidia.com/mig-1g.10gb",
        devices=tuple(mig_device(i, j) for i in range(2) for j in range(3)),
        shared_policy=policy,
    )


def ids(plan: ResourcePlan) -> list[str]:
    return [d.id for d in plan.devices]


def r(i: int, n: int) -> str:
    return f"{gid(i)}::{n}"


TOPOLOGY_CASES: list[tuple[str, ResourcePlan, list[str], list[str], int, list[str]]] = [
    ("pcie-l4: 2 GPUs on one switch", pcie_l4(), ids(pcie_l4()), [], 2, [gid(0), gid(1)]),
    (
        "pcie-l4: must-include 2 pulls in its switch peer",
        pcie_l4(),
        ids(pcie_l4()),
        [gid(2)],
        2,
        [gid(2), gid(3)],
    ),
    (
        "pcie-l4: 0 busy, 2 GPUs still on one switch",
        pcie_l4(),
        [gid(1), gid(2), gid(3)],
        [],
        2,
        [gid(2), gid(3)],
    ),
    ("pcie-l4: 3 GPUs keep a switch pair", pcie_l4(), ids(pcie_l4()), [], 3, [gid(0), gid(1), gid(2)]),
    ("dgx: 4 GPUs stay on one NUMA node", dgx(), ids(dgx()), [], 4, [gid(i) for i in range(4)]),
    (
        "dgx: must-include 5 picks NUMA node 1",
        dgx(),
        ids(dgx()),
        [gid(5)],
        4,
        [gid(5), gid(4), gid(6), gid(7)],
    ),
    (
        "dgx: 1 busy, the other NUMA node is whole",
        dgx(),
        [gid(i) for i in range(8) if i != 1],
        [],
        4,
        [gid(i) for i in range(4, 8)],
    ),
    (
        "dgx: 1 and 5 busy, lowest indexes on a tie",
        dgx(),
        [gid(i) for i in range(8) if i not in (1, 5)],
        [],
        4,
        [gid(0), gid(2), gid(3), gid(4)],
    ),
    ("dgx: 2 GPUs", dgx(), ids(dgx()), [], 2, [gid(0), gid(1)]),
    ("dgx: all 8", dgx(), ids(dgx()), [], 8, [gid(i) for i in range(8)]),
    (
        "NVLink beats a shared switch",
        topology_plan(
            [0, 0, 0],
            [
                GpuPair(0, 1, TOPOLOGY_SINGLE),
                GpuPair(0, 2, TOPOLOGY_SYSTEM, 2),
                GpuPair(1, 2, TOPOLOGY_SYSTEM),
            ],
        ),
        [gid(0), gid(1), gid(2)],
        [gid(0)],
        2,
        [gid(0), gid(2)],
    ),
    (
        "no links: NUMA nodes decide",
        topology_plan([1, 0, 1, 0], []),
        [gid(i) for i in range(4)],
        [],
        2,
        [gid(0), gid(2)],
    ),
    ("16 GPUs (greedy): 8 on one NUMA node", big_pcie(), ids(big_pcie()), [], 8, [gid(i) for i in range(8)]),
    (
        "16 GPUs (greedy): grows from must-include",
        big_pcie(),
        ids(big_pcie()),
        [gid(9)],
        6,
        [gid(9), gid(8), gid(10), gid(11), gid(12), gid(13)],
    ),
]


@pytest.mark.parametrize(
    ("name", "plan", "available", "must", "size", "expected"),
    TOPOLOGY_CASES,
    ids=[c[0] for c in TOPOLOGY_CASES],
)
def test_topology(
    name: str, plan: ResourcePlan, available: list[str], must: list[str], size: int, expected: list[str]
) -> None:
    """Full GPUs: the highest-scoring set by PCI ancestor and NVLink, must-include first, lowest indexes on ties."""
    assert PreferredPolicy(plan).select(available, must, size) == expected


@pytest.mark.parametrize(
    "plan", [pcie_l4(), dgx(), dgx(0), big_pcie(8)], ids=["pcie-l4", "dgx", "dgx-no-nvlink", "pcie-8"]
)
def test_greedy_agrees_with_exhaustive(plan: ResourcePlan, monkeypatch: pytest.MonkeyPatch) -> None:
    """On regular topologies the greedy fallback finds sets as good as the exhaustive search's (ties may differ)."""
    policy = PreferredPolicy(plan)

    def score(answer: list[str]) -> int:
        gpus = [int(i.removeprefix("GPU-")) for i in answer]
        return sum(policy.pair_score(a, b) for a, b in itertools.combinations(gpus, 2))

    cases = [
        (size, must)
        for size in range(1, len(plan.devices) + 1)
        for must in ([], [gid(len(plan.devices) - 1)])
    ]
    exhaustive = [policy.select(ids(plan), must, size) for size, must in cases]
    monkeypatch.setattr(preferred, "EXHAUSTIVE_BUDGET", 0)
    greedy = [policy.select(ids(plan), must, size) for size, must in cases]
    assert [score(g) for g in greedy] == [score(e) for e in exhaustive]
    assert all(set(must) <= set(g) and len(g) == size for (size, must), g in zip(cases, greedy, strict=True))


def test_pair_scores() -> None:
    """Pair scores: ancestor level (10..60) plus 100 per NVLink; NUMA fallback without a link."""
    plan = topology_plan(
        [0, 0, 1, None],
        [GpuPair(0, 1, TOPOLOGY_SINGLE, 2), GpuPair(1, 2, TOPOLOGY_SYSTEM)],
    )
    policy = PreferredPolicy(plan)
    assert policy.pair_score(1, 0) == 250
    assert policy.pair_score(1, 2) == 10
    assert policy.pair_score(0, 2) == 10  # no link, different NUMA nodes
    assert policy.pair_score(0, 3) == 0  # no link, unknown NUMA node
    assert policy.pair_score(2, 2) == 0


SHARED_CASES: list[tuple[str, ResourcePlan, list[str], list[str], int, list[str]]] = [
    ("distributed: 2 replicas on 2 GPUs", shared_plan(), ids(shared_plan()), [], 2, [r(0, 0), r(1, 0)]),
    (
        "distributed: 4 replicas on 4 GPUs",
        shared_plan(),
        ids(shared_plan()),
        [],
        4,
        [r(i, 0) for i in range(4)],
    ),
    (
        "distributed: 5th goes back to GPU 0",
        shared_plan(),
        ids(shared_plan()),
        [],
        5,
        [*(r(i, 0) for i in range(4)), r(0, 1)],
    ),
    (
        "distributed: least allocated GPU first",
        shared_plan(),
        # allocated: GPU0 3, GPU1 0, GPU2 2, GPU3 1
        [r(0, 3), *(r(1, n) for n in range(4)), r(2, 2), r(2, 3), r(3, 1), r(3, 2), r(3, 3)],
        [],
        2,
        [r(1, 0), r(3, 1)],
    ),
    (
        "distributed: spreads over every GPU with a free replica (gpu-operator #386)",
        shared_plan(),
        [r(0, 3), *(r(1, n) for n in range(4)), r(2, 2), r(2, 3), r(3, 1), r(3, 2), r(3, 3)],
        [],
        4,
        [r(1, 0), r(3, 1), r(2, 2), r(0, 3)],
    ),
    (
        "distributed: a busy GPU still beats reusing a chosen one",
        shared_plan(gpus=2),
        [*(r(0, n) for n in range(4)), r(1, 3)],
        [],
        2,
        [r(0, 0), r(1, 3)],
    ),
    (
        "distributed: must-include GPU is avoided",
        shared_plan(),
        ids(shared_plan()),
        [r(0, 0)],
        3,
        [r(0, 0), r(1, 0), r(2, 0)],
    ),
    (
        "packed: all free, one GPU",
        shared_plan(policy="packed"),
        ids(shared_plan()),
        [],
        3,
        [r(0, 0), r(0, 1), r(0, 2)],
    ),
    (
        "packed: most allocated GPU first, then the next",
        shared_plan(policy="packed"),
        [r(0, 3), *(r(1, n) for n in range(4)), r(2, 2), r(2, 3), r(3, 1), r(3, 2), r(3, 3)],
        [],
        3,
        [r(0, 3), r(2, 2), r(2, 3)],
    ),
    (
        "packed: joins the must-include GPU",
        shared_plan(policy="packed"),
        ids(shared_plan()),
        [r(2, 1)],
        2,
        [r(2, 1), r(2, 0)],
    ),
    ("MPS uses the same greedy", shared_plan(sharing="mps"), ids(shared_plan()), [], 2, [r(0, 0), r(1, 0)]),
    ("MIG distributed: across GPUs", mig_plan(), ids(mig_plan()), [], 2, ["MIG-0-0", "MIG-1-0"]),
    ("MIG packed: one GPU", mig_plan("packed"), ids(mig_plan()), [], 2, ["MIG-0-0", "MIG-0-1"]),
    (
        "MIG distributed: least used GPU first",
        mig_plan(),
        ["MIG-0-2", "MIG-1-0", "MIG-1-1", "MIG-1-2"],
        [],
        1,
        ["MIG-1-0"],
    ),
    (
        "MIG packed: most used GPU first",
        mig_plan("packed"),
        ["MIG-0-2", "MIG-1-0", "MIG-1-1", "MIG-1-2"],
        [],
        1,
        ["MIG-0-2"],
    ),
]


@pytest.mark.parametrize(
    ("name", "plan", "available", "must", "size", "expected"), SHARED_CASES, ids=[c[0] for c in SHARED_CASES]
)
def test_shared(
    name: str, plan: ResourcePlan, available: list[str], must: list[str], size: int, expected: list[str]
) -> None:
    """Replicas and MIG: distributed spreads over the least used GPUs, packed fills the most used first."""
    assert PreferredPolicy(plan).select(available, must, size) == expected


EDGE_CASES: list[tuple[str, ResourcePlan, list[str], list[str], int, frozenset[str], list[str]]] = [
    ("size 0", pcie_l4(), ids(pcie_l4()), [], 0, frozenset(), []),
    ("negative size", pcie_l4(), ids(pcie_l4()), [gid(0)], -3, frozenset(), []),
    ("size above available", pcie_l4(), [gid(3), gid(1)], [], 9, frozenset(), [gid(1), gid(3)]),
    (
        "duplicates",
        pcie_l4(),
        [gid(2), gid(2), gid(3), gid(3)],
        [gid(2), gid(2)],
        2,
        frozenset(),
        [gid(2), gid(3)],
    ),
    (
        "unknown IDs only fill up",
        pcie_l4(),
        ["zzz", gid(2), "yyy"],
        [],
        3,
        frozenset(),
        [gid(2), "zzz", "yyy"],
    ),
    ("unknown must-include kept", pcie_l4(), ids(pcie_l4()), ["ghost"], 2, frozenset(), ["ghost", gid(0)]),
    (
        "must-include longer than size",
        pcie_l4(),
        ids(pcie_l4()),
        [gid(3), gid(2), gid(1)],
        2,
        frozenset(),
        [gid(3), gid(2)],
    ),
    ("lost GPU avoided", pcie_l4(), ids(pcie_l4()), [], 2, frozenset({gid(0)}), [gid(2), gid(3)]),
    (
        "lost GPU used last",
        pcie_l4(),
        ids(pcie_l4()),
        [],
        4,
        frozenset({gid(0)}),
        [gid(1), gid(2), gid(3), gid(0)],
    ),
    (
        "lost replicas (by GPU UUID) avoided",
        shared_plan(gpus=2),
        ids(shared_plan(gpus=2)),
        [],
        2,
        frozenset({gid(0)}),
        [r(1, 0), r(1, 1)],
    ),
    ("lost by device ID", shared_plan(gpus=2), [r(0, 0), r(1, 0)], [], 1, frozenset({r(0, 0)}), [r(1, 0)]),
    ("empty plan", ResourcePlan("nvidia.com/gpu", ()), ["a", "b"], [], 1, frozenset(), ["a"]),
]


@pytest.mark.parametrize(
    ("name", "plan", "available", "must", "size", "lost", "expected"),
    EDGE_CASES,
    ids=[c[0] for c in EDGE_CASES],
)
def test_edge_cases(
    name: str,
    plan: ResourcePlan,
    available: list[str],
    must: list[str],
    size: int,
    lost: frozenset[str],
    expected: list[str],
) -> None:
    """Odd requests get a best-effort answer, never an error (NVIDIA #2038)."""
    assert preferred_allocation(plan, available, must, size, lost) == expected


def test_internal_failure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a bug inside the policy gives a plain must-include-then-available answer, not an exception."""
    policy = PreferredPolicy(pcie_l4())

    def broken(*_: object) -> list[str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(policy, "_by_topology", broken)
    assert policy.select([gid(0), gid(1), gid(2)], [gid(2)], 2) == [gid(2), gid(0)]


# An explicit alphabet: near-miss IDs ("GPU-00", "::1") without Hypothesis' unicode tables.
JUNK = st.text(alphabet="GPUMI-:0123456789ab ", max_size=12)
PLANS = [
    pcie_l4(),
    dgx(),
    big_pcie(),
    shared_plan(),
    shared_plan(policy="packed"),
    mig_plan(),
    mig_plan("packed"),
]


@st.composite
def requests(draw: st.DrawFn) -> tuple[ResourcePlan, list[str], list[str], int, frozenset[str]]:
    plan = draw(st.sampled_from(PLANS))
    known = ids(plan)
    pool = st.one_of(st.sampled_from(known), JUNK)
    available = draw(st.lists(pool, max_size=40))
    must = draw(st.lists(st.sampled_from(available), max_size=4)) if available else []
    size = draw(st.integers(min_value=-2, max_value=45))
    gpu_ids = sorted({d.gpu_uuid for d in plan.devices})
    lost = draw(st.frozensets(st.sampled_from(gpu_ids), max_size=2))
    return plan, available, must, size, lost


@settings(max_examples=300, deadline=None, database=None)
@given(requests())
def test_properties(request: tuple[ResourcePlan, list[str], list[str], int, frozenset[str]]) -> None:
    """Answers are subsets of available plus must-include, hold the must-include, have size IDs when possible, no duplicates, and are deterministic."""
    plan, available, must, size, lost = request
    policy = PreferredPolicy(plan)
    answer = policy.select(available, must, size, lost)
    pool = set(available) | set(must)
    assert set(answer) <= pool
    assert len(answer) == len(set(answer))
    assert len(answer) == min(max(size, 0), len(pool))
    if len(set(must)) <= size:
        assert set(must) <= set(answer)
    assert PreferredPolicy(plan).select(list(available), list(must), size, lost) == answer


@settings(max_examples=300, deadline=None, database=None)
@given(
    plan=st.sampled_from(PLANS),
    available=st.lists(JUNK, max_size=30),
    must=st.lists(JUNK, max_size=6),
    size=st.integers(min_value=-(2**31), max_value=2**31),
    lost=st.frozensets(JUNK, max_size=4),
)
def test_garbage_never_raises(
    plan: ResourcePlan, available: list[str], must: list[str], size: int, lost: frozenset[str]
) -> None:
    """Random garbage never raises and never invents IDs."""
    answer = PreferredPolicy(plan).select(available, must, size, lost)
    assert set(answer) <= set(available) | set(must)


def _time_ms(policy: PreferredPolicy, available: list[str], size: int, rounds: int = 20) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        policy.select(available, [], size)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def test_timing_info() -> None:
    """Prints select() timings for 8 GPUs and 16 GPUs x 64 replicas (information only, nothing asserted)."""
    lines = []
    for plan in (dgx(), big_pcie()):
        policy = PreferredPolicy(plan)
        worst = max(_time_ms(policy, ids(plan), k, rounds=5) for k in range(1, len(plan.devices) + 1))
        lines.append(f"{len(plan.devices)} full GPUs, worst k: {worst:.3f} ms")
    shared = shared_plan(gpus=16, replicas=64)
    policy = PreferredPolicy(shared)
    for k in (1, 8, 64):
        lines.append(f"16 GPUs x 64 replicas, k={k}: {_time_ms(policy, ids(shared), k, rounds=5):.3f} ms")
    print("\n" + "\n".join(lines))
