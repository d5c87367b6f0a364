"""Configs the kubelet could never receive (issue 14 item 3): how fast and how small the refusal is.

For each config, on `gpuvisor run --simulate dgx-h100`: the whole process from start to its
config-error exit (interpreter, imports, discovery and zygote included) and its peak RSS (from
wait4), and, in this process, the config handling alone (load the file, plan: the refusal comes
from counts before any device list is built).
"""

from __future__ import annotations

import contextlib
import time

from supervisor.config import ConfigError, config_from_data, parse_config_text
from supervisor.node.planning import PlanningError, plan_resources
from tests import nodes
from tests.benchmarks.common import Row, p50
from tests.harness import run_to_exit, time_slicing

CASES = (
    ("replicas 200000", 200_000),
    ("replicas 1e9", 1_000_000_000),
    ("replicas 10000 (5 MiB answer)", 10_000),
)


def _handling_ms(replicas: int, rounds: int) -> list[float]:
    node = nodes.dgx_h100()
    text = time_slicing(replicas)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        with contextlib.suppress(ConfigError, PlanningError):  # every case here is refused
            plan_resources(node, config_from_data(parse_config_text(text, "bench.yaml"), source="bench.yaml"))
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def run(quick: bool) -> list[Row]:
    rounds = 1 if quick else 3
    rows = []
    for label, replicas in CASES:
        exits = [run_to_exit(time_slicing(replicas)) for _ in range(rounds)]
        codes = sorted({status for status, *_ in exits})
        note = f"{rounds} run(s), exit status {codes}"
        rows.append(
            Row(f"{label}: process start -> exit p50", p50([s * 1000 for *_, s in exits]), "ms", "", note)
        )
        rows.append(
            Row(f"{label}: peak RSS", max(rss for _, _, rss, _ in exits) / 1024, "MiB", "< 200 MiB", note)
        )
        rows.append(Row(f"{label}: config handling p50", p50(_handling_ms(replicas, 5 if quick else 50)), "ms", "< 1000 ms",
                        "load_config + plan_resources, in process"))  # fmt: skip
    return rows
