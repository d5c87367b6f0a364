"""Memory of the process tree (PSS per process and in all), beside the floors and NVIDIA's reference.

PSS shares each shared page among the processes that map it, so the PSS figures add up to what
the tree costs the node; USS is what one process alone would free. Read from
/proc/<pid>/smaps_rollup once the node has settled (every resource registered and listed, a
few heartbeats later).

- One resource (`node.one_resource()`, as NVIDIA's figure was taken): the supervisor, the worker
  zygote and one worker, against 2x NVIDIA's 28 MB (2x its 39 MB on a real H100 under
  `--real-gpu`); beside it the floors of the same run: one bare gRPC plugin process, and an idle
  interpreter.
- Five resources (mig-a100, mixed): every process; and what each further worker costs: the mean
  USS of the workers (its own pages; the pages it shares with the zygote and its siblings are
  counted once already), and the tree's PSS difference to the one-resource tree over four; and
  what those own pages are, each compared with the zygote's page at the same address
  (tests/benchmarks/sharedpages.py); and how many threads a worker runs, gRPC's event engine's
  among them: gRPC core starts clamp(CPUs, 4, 16) of them, CPUs as sysconf(_SC_NPROCESSORS_CONF)
  counts them (the node's, not the container's limit), and each holds its own stack and heap
  pages, so a worker on a node of 16 CPUs or more has 12 more than on a 2-CPU machine.

A caution on PSS here: a page of a shared library is split among every process on the machine
that maps it, the kubelet stand-in in this benchmark's own process included (it maps gRPC and
protobuf too), so a tree's PSS moves with what else runs; USS does not.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import psutil

from tests.benchmarks import floors, node, sharedpages
from tests.benchmarks.common import NVIDIA_PSS_MB, NVIDIA_REAL_PSS_MB, Row, ratio
from tests.harness import SimNode, child_env
from tests.helpers import REPO

MB = 1e6
EVENT_ENGINE_THREAD = "event_engine"  # the name gRPC core gives its event engine's pool threads


def _label(proc: psutil.Process, supervisor_pid: int) -> str:
    if proc.pid == supervisor_pid:
        return "supervisor"
    cmd = proc.cmdline()
    if "--resource" in cmd:
        return "worker " + cmd[cmd.index("--resource") + 1]
    if "worker.zygote" in " ".join(cmd):
        return "zygote"
    return "other " + " ".join(cmd[1:3])


def _rollup(pid: int) -> dict[str, float]:
    """smaps_rollup's fields in bytes (Pss, Private_Dirty, ...)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


class _Proc(NamedTuple):
    label: str
    pss: float  # bytes
    uss: float  # bytes
    pid: int


def thread_names(pid: int) -> collections.Counter[str]:
    """How many threads of process `pid` carry each name (/proc/<pid>/task/<tid>/comm); a thread
    that ends while they are read is left out."""
    names: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as fh:
                names[fh.read().strip()] += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return names


def _tree(sim: SimNode) -> list[_Proc]:
    """Every process of the tree, labelled, with its PSS and USS."""
    assert sim.proc is not None
    out = []
    for proc in [psutil.Process(sim.proc.pid), *sim.workers()]:
        try:
            r = _rollup(proc.pid)
            out.append(
                _Proc(_label(proc, sim.proc.pid), r["Pss"], r["Private_Dirty"] + r["Private_Clean"], proc.pid)
            )
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return out


def _settled(sim: SimNode, resources: list[str], settle: float) -> list[_Proc]:
    sim.wait_listed(resources, 60)
    time.sleep(settle)
    return _tree(sim)


def run(quick: bool) -> list[Row]:
    settle = 1.0 if quick else 3.0
    kind = node.one_resource()  # first: under --real-gpu, a node without a driver fails before the floors
    floor = floors.measure(quick)
    with kind.node() as sim:
        one = _settled(sim, [node.GPU], settle)
    with node.mig_node() as sim:
        five = _settled(sim, node.MIG_RESOURCES, settle)
        kinds = _own_page_kinds(five)
        threads = [thread_names(p.pid) for p in five if p.label.startswith("worker ")]
    one_pss = sum(p.pss for p in one) / MB
    five_pss = sum(p.pss for p in five) / MB
    workers_uss = [p.uss for p in five if p.label.startswith("worker ")]
    ref, where = (NVIDIA_REAL_PSS_MB, " on a real H100") if node.real_gpu() else (NVIDIA_PSS_MB, "")
    one_target = f"<= {2 * ref:.0f} MB (2x NVIDIA's {ref:.0f} MB{where})"
    rows = [
        Row(
            "1 resource: PSS of the tree", one_pss, "MB", one_target,
            f"{len(one)} processes, {kind.what}; USS {sum(p.uss for p in one) / MB:.1f} MB",
        ),
        Row(
            "1 resource: PSS, x the bare plugin", ratio(one_pss, floor.bare_pss_mb), "x", "",
            f"bare gRPC plugin {floor.bare_pss_mb:.1f} MB, idle python {floor.python_pss_mb:.1f} MB, same run",
        ),
    ]  # fmt: skip
    rows += [
        Row(f"1 resource: {label} PSS", pss / MB, "MB", "", f"USS {uss / MB:.1f} MB")
        for label, pss, uss, _ in one
    ]
    rows += [
        Row(f"5 resources: {label} PSS", pss / MB, "MB", "", f"USS {uss / MB:.1f} MB")
        for label, pss, uss, _ in five
    ]
    rows += [
        Row(
            "5 resources: PSS of the tree", five_pss, "MB", "",
            f"{len(five)} processes, {node.five_resources().what}; USS {sum(p.uss for p in five) / MB:.1f} MB",
        ),
        Row(
            "each further worker: its USS, mean", sum(workers_uss) / len(workers_uss) / MB if workers_uss else float("nan"),
            "MB", "<= 6 MB", "the pages a worker adds to the node (what it shares is counted once already)",
        ),
        Row(
            "each further worker: tree PSS difference / 4", (five_pss - one_pss) / 4, "MB", "",
            "(5-resource tree - 1-resource tree) / 4; moves with the shared libraries' other users",
        ),
    ]  # fmt: skip
    if threads:
        total = sum(sum(t.values()) for t in threads) / len(threads)
        engine = sum(t[EVENT_ENGINE_THREAD] for t in threads) / len(threads)
        rows.append(
            Row("each further worker: threads", total, "", "",
                f"mean of the 5; {engine:.0f} of them gRPC's event engine: clamp(CPUs, 4, 16), "
                f"{os.cpu_count()} CPUs here")
        )  # fmt: skip
    if kinds is None:
        rows.append(
            Row("each further worker's own pages, by kind", float("nan"), "MB", "",
                "not available: /proc/<pid>/mem of the zygote and its workers could not be read")
        )  # fmt: skip
    else:
        rows += [
            Row(f"each further worker's own pages: {kind}", size / MB, "MB", "", _KIND_NOTES[kind])
            for kind, size in kinds.items()
        ]
    return rows + _worker_pages()


_KIND_NOTES = {
    "new": "mean of the 5; no zygote page there: thread stacks, new arenas (tests/benchmarks/sharedpages.py)",
    "identical": "the zygote's page copied and written back unchanged (a reference count up and down)",
    "few words": "the zygote's page copied for 1-3 changed words: mostly reference counts",
    "more": "4+ words changed: objects made or changed in place, allocator lists, caches",
}


def _own_page_kinds(tree: list[_Proc]) -> dict[str, float] | None:
    """The mean over the tree's workers of their own pages by kind against the zygote's
    (tests/benchmarks/sharedpages.py); None where that memory cannot be read."""
    zygotes = [p.pid for p in tree if p.label == "zygote"]
    workers = [p.pid for p in tree if p.label.startswith("worker ")]
    if len(zygotes) != 1 or not workers:
        return None
    found = [sharedpages.classify(zygotes[0], pid) for pid in workers]
    if any(f is None for f in found):
        return None
    return {kind: sum(f[kind] for f in found if f is not None) / len(found) for kind in sharedpages.KINDS}


def _worker_pages() -> list[Row]:
    """A forked worker's own pages, step by step of its start (tests/benchmarks/workerpages.py)."""
    with tempfile.TemporaryDirectory(prefix="gvbench-pages-") as where:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.benchmarks.workerpages", where],
            capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=120, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"workerpages failed: {proc.stderr.strip()[-500:]}")
    found = json.loads(proc.stdout)
    rows = [
        Row(
            f"a forked worker's own pages: {step['step']}", step["dirty"] / MB, "MB", "",
            f"written; + {step['clean'] / MB:.2f} MB of library code it is the first to run",
        )
        for step in found["steps"]
    ]  # fmt: skip
    rows.append(
        Row(
            "a forked worker's own pages: these steps in all", found["dirty"] / MB, "MB", "",
            f"written; + {found['clean'] / MB:.2f} MB of library code, shared once a second worker maps it; "
            "what a worker in the tree has beyond: its own objects (book, link, registrar) and threads",
        )
    )  # fmt: skip
    return rows
