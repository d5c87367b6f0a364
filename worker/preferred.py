"""GetPreferredAllocation as a pure policy: plain IDs in, plain IDs out, and it never raises.

The kubelet treats an error from GetPreferredAllocation as a failed pod, and the answer is only
advice anyway (the kubelet fills in or ignores what it does not like). NVIDIA's plugin returned
errors when its topology library could not query a lost GPU, which failed every pod on the node
(NVIDIA #2038). So `PreferredPolicy.select` guards its whole body: whatever the input (unknown
IDs, devices of lost GPUs, duplicates, a size larger than what is available, a negative size),
it answers with the best it can, down to a plain "must-include, then available in order" list.

Two policies, chosen once per plan:

- **Full GPUs** (no sharing, no MIG, no replicas): topology-aware. A pair of GPUs scores by its
  nearest common PCI ancestor (across NUMA nodes 10, same NUMA node 20, same host bridge 30,
  several switches 40, one switch 50, same board 60) plus 100 per NVLink; a set scores the sum
  over its pairs; the best size-k set that holds the must-include devices wins, ties going to
  the lowest GPU indexes. Small searches are exhaustive (8 GPUs: at most C(8,4) = 70 sets); large
  ones use a greedy growth from the best pair, so the call stays in the low milliseconds.
  A pair without a `GpuPair` in the plan falls back to its NUMA nodes (same: 20, different: 10).
- **Replicas and MIG devices**: greedy over "backing devices". `distributed` (default) first
  spreads a request over backing devices it has not used yet (so k replicas land on k GPUs when
  k GPUs have free replicas: gpu-operator #386), then prefers the ones with the fewest replicas
  already allocated; `packed` prefers the most allocated, so whole GPUs stay free. A replica is
  "allocated" when it is neither in `available` nor in `must_include`. The counts are kept at two
  levels, the backing device (a replicated GPU or MIG device) and its physical GPU, so plain MIG
  devices spread (or pack) across GPUs and replicated MIG devices across MIG devices first.

Devices that are lost (their ID, backing UUID or GPU UUID is in `lost`) are only used to fill
up when nothing else is left, and after them IDs the plan does not know.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.model import (
    TOPOLOGY_HOSTBRIDGE,
    TOPOLOGY_INTERNAL,
    TOPOLOGY_MULTIPLE,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
    AllocatableDevice,
    ResourcePlan,
)

ANCESTOR_SCORE = {
    TOPOLOGY_SYSTEM: 10,
    TOPOLOGY_NODE: 20,
    TOPOLOGY_HOSTBRIDGE: 30,
    TOPOLOGY_MULTIPLE: 40,
    TOPOLOGY_SINGLE: 50,
    TOPOLOGY_INTERNAL: 60,
}
NVLINK_SCORE = 100
# Above this many (sets x (pairs per set + 1)) the topology search turns greedy: about 0.5 ms of
# Python here. 8 GPUs never get there (worst case C(8,5) x 11 = 616); 16 GPUs choosing 4 or more
# (C(16,4) x 7 = 12740) mostly do.
EXHAUSTIVE_BUDGET = 8_000


@dataclass(frozen=True)
class _Info:
    """What the policy needs about one allocatable device ID."""

    position: int  # place in the plan's device list: the deterministic tie-break
    device: AllocatableDevice
    lost_keys: tuple[str, ...]


class PreferredPolicy:
    """Preferred-allocation policy for one resource plan (lookup tables built once)."""

    def __init__(self, plan: ResourcePlan) -> None:
        self._plan = plan
        self._info: dict[str, _Info] = {}
        for position, device in enumerate(plan.devices):
            if device.id not in self._info:
                keys = (device.id, device.uuid, device.gpu_uuid)
                self._info[device.id] = _Info(position, device, keys)
        self._topology = plan.sharing == "none" and all(
            not d.is_mig and d.replica is None and d.replicas <= 1 for d in plan.devices
        )
        self._packed = plan.shared_policy == "packed"
        # How many devices of this resource each backing device / GPU has (for "allocated").
        self._total_backing: dict[str, int] = {}
        self._total_gpu: dict[str, int] = {}
        for device in plan.devices:
            self._total_backing[device.uuid] = self._total_backing.get(device.uuid, 0) + 1
            self._total_gpu[device.gpu_uuid] = self._total_gpu.get(device.gpu_uuid, 0) + 1
        self._numa = {d.gpu_index: d.numa_node for d in plan.devices}
        self._pair: dict[tuple[int, int], int] = {}
        for link in plan.links:
            a, b = min(link.a, link.b), max(link.a, link.b)
            self._pair[(a, b)] = ANCESTOR_SCORE.get(link.ancestor, 0) + NVLINK_SCORE * max(link.nvlinks, 0)
        # The full pair-score matrix by GPU index, built once so the searches only index into it.
        gpu_indexes = sorted(self._numa) if self._topology else []
        self._matrix: dict[int, dict[int, int]] = {
            a: {b: self.pair_score(a, b) for b in gpu_indexes} for a in gpu_indexes
        }

    def pair_score(self, a: int, b: int) -> int:
        """Score of two GPUs by index: common PCI ancestor plus NVLinks (NUMA fallback without a link)."""
        if a == b:
            return 0
        key = (a, b) if a < b else (b, a)
        score = self._pair.get(key)
        if score is not None:
            return score
        numa_a, numa_b = self._numa.get(a), self._numa.get(b)
        if numa_a is None or numa_b is None:
            return 0
        return ANCESTOR_SCORE[TOPOLOGY_NODE] if numa_a == numa_b else ANCESTOR_SCORE[TOPOLOGY_SYSTEM]

    def select(
        self,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        lost: frozenset[str] = frozenset(),
    ) -> list[str]:
        """The preferred IDs for one container request; never raises."""
        try:
            return self._select(available, must_include, size, lost)
        except Exception:
            # Reaching this is a bug in this module, but a pod must not fail for it (NVIDIA #2038).
            return _fallback(available, must_include, size)

    def _select(
        self, available: Sequence[str], must_include: Sequence[str], size: int, lost: frozenset[str]
    ) -> list[str]:
        size = int(size)
        if size <= 0:
            return []
        must = _unique(must_include)
        if len(must) >= size:
            return must[:size]
        taken = set(must)
        good: list[str] = []
        lost_known: list[str] = []
        unknown: list[str] = []
        for device_id in _unique(available):
            if device_id in taken:
                continue
            info = self._info.get(device_id)
            if info is None:
                unknown.append(device_id)
            elif lost and any(k in lost for k in info.lost_keys):
                lost_known.append(device_id)
            else:
                good.append(device_id)
        need = size - len(must)
        if need >= len(good):
            picked = sorted(good, key=lambda i: self._info[i].position)
        elif self._topology:
            picked = self._by_topology(must, good, need)
        else:
            picked = self._by_sharing(available, must, good, need)
        result = must + picked
        for rest in (lost_known, unknown):
            if len(result) >= size:
                break
            result.extend(rest[: size - len(result)])
        return result

    def _by_topology(self, must: list[str], good: list[str], need: int) -> list[str]:
        must_gpus = [self._info[i].device.gpu_index for i in must if i in self._info]
        candidates = sorted(good, key=lambda i: (self._info[i].device.gpu_index, self._info[i].position))
        gpus = [self._info[i].device.gpu_index for i in candidates]
        # What each candidate adds with the must-include GPUs, whatever else is picked.
        matrix = self._matrix
        base = [sum(matrix[g].get(m, 0) for m in must_gpus) for g in gpus]
        n = len(candidates)
        pairs_per_set = need * (need - 1) // 2 + 1
        if math.comb(n, need) * pairs_per_set <= EXHAUSTIVE_BUDGET:
            chosen: Sequence[int] = self._exhaustive(gpus, base, need)
        else:
            chosen = self._greedy(gpus, base, need, seeded=bool(must_gpus))
        return [candidates[k] for k in sorted(chosen)]

    def _exhaustive(self, gpus: list[int], base: list[int], need: int) -> tuple[int, ...]:
        n = len(gpus)
        if need == 1:
            return (max(range(n), key=lambda k: (base[k], -k)),)
        matrix = self._matrix
        # Rows of the score matrix in candidate order, looked up by GPU index per pair.
        rows = [matrix[g] for g in gpus]
        best: tuple[int, ...] = tuple(range(need))
        best_score = -1
        # combinations() walks sets in lexicographic order of candidate positions (sorted by GPU
        # index), so keeping only strictly better sets makes ties go to the lowest indexes.
        for combo in itertools.combinations(range(n), need):
            total = 0
            for x, i in enumerate(combo):
                row = rows[i]
                total += base[i]
                for j in combo[x + 1 :]:
                    total += row[gpus[j]]
            if total > best_score:
                best, best_score = combo, total
        return best

    def _greedy(self, gpus: list[int], base: list[int], need: int, seeded: bool) -> list[int]:
        n = len(gpus)
        matrix = self._matrix
        gain = list(base)
        chosen: list[int] = []
        free = set(range(n))
        if not seeded and need >= 2:
            # Without must-include devices to grow from, start from the best pair.
            best_pair = (0, 1)
            best = -1
            for i in range(n):
                for j in range(i + 1, n):
                    s = matrix[gpus[i]][gpus[j]]
                    if s > best:
                        best_pair, best = (i, j), s
            for k in best_pair:
                chosen.append(k)
                free.discard(k)
            for k in free:
                row = matrix[gpus[k]]
                gain[k] += row[gpus[best_pair[0]]] + row[gpus[best_pair[1]]]
        while len(chosen) < need:
            pick = min(free, key=lambda k: (-gain[k], k))
            chosen.append(pick)
            free.discard(pick)
            for k in free:
                gain[k] += matrix[gpus[k]][gpus[pick]]
        return chosen

    def _by_sharing(self, available: Sequence[str], must: list[str], good: list[str], need: int) -> list[str]:
        info = self._info
        present_backing: dict[str, int] = {}
        present_gpu: dict[str, int] = {}
        chosen_backing: dict[str, int] = {}
        chosen_gpu: dict[str, int] = {}
        for device_id in _unique(itertools.chain(available, must)):
            entry = info.get(device_id)
            if entry is not None:
                d = entry.device
                present_backing[d.uuid] = present_backing.get(d.uuid, 0) + 1
                present_gpu[d.gpu_uuid] = present_gpu.get(d.gpu_uuid, 0) + 1
        for device_id in must:
            entry = info.get(device_id)
            if entry is not None:
                d = entry.device
                chosen_backing[d.uuid] = chosen_backing.get(d.uuid, 0) + 1
                chosen_gpu[d.gpu_uuid] = chosen_gpu.get(d.gpu_uuid, 0) + 1
        # Free candidates per backing device, in plan order (lowest replica number first).
        queues: dict[str, list[str]] = {}
        for device_id in sorted(good, key=lambda i: info[i].position):
            queues.setdefault(info[device_id].device.uuid, []).append(device_id)
        heads = dict.fromkeys(queues, 0)
        groups = [(u, info[q[0]].device.gpu_uuid, info[q[0]].position) for u, q in queues.items()]
        allocated_backing = {u: self._total_backing[u] - present_backing.get(u, 0) for u, _, _ in groups}
        allocated_gpu = {g: self._total_gpu[g] - present_gpu.get(g, 0) for _, g, _ in groups}

        picked: list[str] = []
        while len(picked) < need:
            best_key: tuple[int, ...] | None = None
            best_group = ""
            for u, g, position in groups:
                if heads[u] >= len(queues[u]):
                    continue
                cu, cg = chosen_backing.get(u, 0), chosen_gpu.get(g, 0)
                if self._packed:
                    key: tuple[int, ...] = (-(allocated_backing[u] + cu), -(allocated_gpu[g] + cg), position)
                else:
                    key = (cu, cg, allocated_backing[u], allocated_gpu[g], position)
                if best_key is None or key < best_key:
                    best_key, best_group = key, u
            if best_key is None:
                break
            queue = queues[best_group]
            device_id = queue[heads[best_group]]
            heads[best_group] += 1
            picked.append(device_id)
            gpu = info[device_id].device.gpu_uuid
            chosen_backing[best_group] = chosen_backing.get(best_group, 0) + 1
            chosen_gpu[gpu] = chosen_gpu.get(gpu, 0) + 1
        return picked


def preferred_allocation(
    plan: ResourcePlan,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    lost: frozenset[str] = frozenset(),
) -> list[str]:
    """One-shot form of `PreferredPolicy(plan).select(...)` (build the policy once in a server)."""
    return PreferredPolicy(plan).select(available, must_include, size, lost)


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _fallback(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """Topology-unaware answer for when the policy itself failed: must-include, then available."""
    try:
        limit = max(int(size), 0)
        return _unique(itertools.chain(must_include, available))[:limit]
    except Exception:
        return []
