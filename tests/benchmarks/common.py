"""What every benchmark module shares: the result row, percentiles, a timer, the report.

The contract (the runner, `python -m tests.benchmarks`, relies on nothing else):

- A benchmark is a module `tests/benchmarks/<name>.py` listed in `BENCHES` in `__main__.py`.
- It defines `run(quick: bool) -> list[Row]`. `quick` asks for a smaller run (a smoke run of a
  few seconds); the figures must still be meaningful, only noisier.
- Each `Row` is one figure: `name` (unique within the module, e.g. "allocate p50"), `value` (a
  float; NaN when it could not be measured, with the reason in `note`), `unit` ("ms", "x",
  "MiB", ...), `target` (the goal as text, e.g. "<= 30 ms", or ""), `note` (anything a reader
  needs: sample count, what was compared).
- A module reports and does not judge: it never fails because a target was missed. An
  exception out of `run` means the benchmark itself is broken; the runner reports it and exits
  non-zero, after running the others.
- It starts only its own processes (by PID), cleans up everything it made (temp dirs, sockets,
  processes) even when it fails, and keeps its default run under about a minute.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# NVIDIA's k8s-device-plugin v0.20.0, measured by hand beside gpuvisor on this class of machine
# (issue 30: 2 cores, NVIDIA's mock NVML h100 profile, the same kubelet stand-in). NVIDIA's binary
# is no part of the project and is not run here: these figures are quoted, as the targets'
# reference, and each target says which multiple of them it allows.
NVIDIA_START_MS = 59.0  # process start -> registered with 8 healthy devices
NVIDIA_PSS_MB = 28.0  # PSS of the process
NVIDIA_IDLE_CPU_PCT = 0.30  # % of a core while idle, 10 s
NVIDIA_RESTART_MS = 5.0  # kubelet restart -> registered again
# The same binary on a real H100 node (issue 30), the reference under `--real-gpu`: registered in
# 41-58 ms (the slowest is the reference), 39 MB PSS with NVML initialised.
NVIDIA_REAL_START_MS = 58.0
NVIDIA_REAL_PSS_MB = 39.0


@dataclass
class Row:
    name: str
    value: float
    unit: str
    target: str = ""
    note: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def ratio(value: float, floor: float) -> float:
    """`value` as a multiple of `floor` (NaN when either is unknown)."""
    if not (math.isfinite(value) and math.isfinite(floor)) or floor <= 0:
        return math.nan
    return value / floor


def p50(values: Sequence[float]) -> float:
    return percentile(values, 50)


def p99(values: Sequence[float]) -> float:
    return percentile(values, 99)


def ms(seconds: Iterable[float]) -> list[float]:
    return [s * 1000.0 for s in seconds]


class Timer:
    """Collects durations: `with timer: ...` adds one sample (seconds, perf_counter)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self._start)

    def ms(self) -> list[float]:
        return ms(self.samples)


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def row_dict(bench: str, row: Row) -> dict[str, Any]:
    data = asdict(row)
    data["bench"] = bench
    if not math.isfinite(row.value):
        data["value"] = None  # JSON has no NaN/inf
    return data


def format_value(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if value == 0 or abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_table(rows: Sequence[tuple[str, Row]], extra: Sequence[tuple[str, str]] = ()) -> str:
    """One aligned table: benchmark, figure, value, unit, target, note; `extra` adds status lines."""
    header = ("benchmark", "figure", "value", "unit", "target", "note")
    lines: list[tuple[str, ...]] = [header]
    for bench, row in rows:
        lines.append((bench, row.name, format_value(row.value), row.unit, row.target, row.note))
    for bench, status in extra:
        lines.append((bench, status, "", "", "", ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.rjust(widths[i]) if i == 2 and n else cell.ljust(widths[i])
            for i, cell in enumerate(line[:-1])
        ]
        out.append("  ".join([*cells, line[-1]]).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths) + "  ----")
    return "\n".join(out)


# What an import statement adds to a fresh interpreter, measured inside it.
_IMPORT_PROBE = (
    "import time\n"
    "def mem():\n"
    "    rss = int(open('/proc/self/statm').read().split()[1]) * 4096\n"
    "    pss = next(int(l.split()[1]) * 1024 for l in open('/proc/self/smaps_rollup') if l.startswith('Pss:'))\n"
    "    return rss / 2**20, pss / 2**20\n"
    "{before}\n"
    "t, (r, p) = time.perf_counter(), mem()\n"
    "{what}\n"
    "r2, p2 = mem()\n"
    "print(time.perf_counter() - t, r2 - r, p2 - p)\n"
)


def import_cost(what: str, before: str = "", rounds: int = 7) -> tuple[float, float, float]:
    """(ms, RSS MiB, PSS MiB) the statement `what` adds after `before`: medians of `rounds` fresh
    interpreters; NaNs when it fails (a package that is not installed)."""
    import statistics
    import subprocess

    from tests.harness import child_env
    from tests.helpers import REPO

    samples: list[list[float]] = [[], [], []]
    for _ in range(rounds):
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE.format(before=before, what=what)],
            capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=60, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            return math.nan, math.nan, math.nan
        for i, value in enumerate(proc.stdout.split()):
            samples[i].append(float(value) * (1000.0 if i == 0 else 1.0))
    ms, rss, pss = (statistics.median(s) for s in samples)
    return ms, rss, pss
