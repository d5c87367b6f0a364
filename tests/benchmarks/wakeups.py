"""Wake-ups of a process tree, counted in a way the machine's load does not change.

Every time a thread blocks (a sleep, a wait with a timeout, a poll) and is woken, the kernel
counts one voluntary context switch for it (/proc/<pid>/task/<tid>/status,
`voluntary_ctxt_switches`). Counted per thread over an idle window, they show each timer and
poll a process runs, whatever the CPU time they cost on a busy machine: a thread that wakes ten
times a second shows 600 a minute on an idle machine and on a loaded one alike. The threads are
named by /proc/<pid>/task/<tid>/comm (Python's threading names reach it since 3.14 only, so a
Python thread is mostly "python"; gRPC's threads name themselves, e.g. "grpc_global_tim").
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadWakeups:
    pid: int
    process: str  # the process's comm, or the caller's name for it
    tid: int
    thread: str
    per_minute: float


def _switches(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, voluntary context switches) of each thread of `pid` now ({} once it is gone)."""
    out: dict[int, tuple[str, int]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                comm = (task / "comm").read_text().strip()
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[int(task.name)] = (comm, int(line.split()[1]))
    return out


def measure(pids: dict[int, str], window: float) -> list[ThreadWakeups]:
    """Each thread's wake-ups per minute over `window` seconds (threads alive at both ends)."""
    before = {pid: _switches(pid) for pid in pids}
    t0 = time.monotonic()
    time.sleep(window)
    after = {pid: _switches(pid) for pid in pids}
    minutes = (time.monotonic() - t0) / 60.0
    rows = []
    for pid, name in pids.items():
        for tid, (comm, count) in after[pid].items():
            if tid in before[pid]:
                rows.append(ThreadWakeups(pid, name, tid, comm, (count - before[pid][tid][1]) / minutes))
    return rows


def per_process(rows: Sequence[ThreadWakeups]) -> Counter[str]:
    total: Counter[str] = Counter()
    for r in rows:
        total[f"{r.process} ({r.pid})"] += r.per_minute  # type: ignore[assignment]
    return total


def describe(rows: Sequence[ThreadWakeups], top: int = 12) -> str:
    """The busiest threads, `process/thread tid: N/min`, busiest first."""
    busy = sorted((r for r in rows if r.per_minute >= 0.5), key=lambda r: -r.per_minute)[:top]
    return ", ".join(f"{r.process}/{r.thread}[{r.tid}] {r.per_minute:.0f}/min" for r in busy) or "none"
