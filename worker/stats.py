"""A worker's own figures (RPC counts and latency histograms, counters), sent in heartbeats.

The node has one metrics endpoint, in the supervisor; a worker keeps cumulative numbers and
ships them as a flat `name -> number` map, which the supervisor turns into Prometheus series.
Keys: `rpc_count:<method>`, `rpc_sum:<method>`, `rpc_bucket:<method>:<le>`, `count:<name>`, and
those of the parts `include`d (the DRA worker's request figures: worker/dra/figures.py).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping

BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


def cumulative(bounds: tuple[float, ...], buckets: list[int]) -> tuple[list[tuple[float, float]], float]:
    """A histogram's per-bucket counts as Prometheus reads them: (upper bound, count at or under it)
    for each finite bound, and the total (the +Inf bucket, the last of `buckets`)."""
    out: list[tuple[float, float]] = []
    total = 0
    for le, n in zip((*bounds, float("inf")), buckets, strict=True):
        total += n
        if le != float("inf"):
            out.append((le, float(total)))
    return out, float(total)


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}
        self._hist: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._parts: list[Callable[[], Mapping[str, float]]] = []

    def include(self, part: Callable[[], Mapping[str, float]]) -> None:
        """A part's own figures, keyed as it keys them, added to every snapshot."""
        self._parts.append(part)

    def observe(self, method: str, seconds: float) -> None:
        with self._lock:
            buckets = self._hist.setdefault(method, [0] * (len(BUCKETS) + 1))
            buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
            self._sums[method] = self._sums.get(method, 0.0) + seconds

    def count(self, name: str, by: float = 1.0) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0.0) + by

    def snapshot(self, **gauges: float) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {f"count:{k}": v for k, v in self._counts.items()}
            for method, buckets in self._hist.items():
                under, total = cumulative(BUCKETS, buckets)
                out.update((f"rpc_bucket:{method}:{le}", n) for le, n in under)
                out[f"rpc_count:{method}"] = total
                out[f"rpc_sum:{method}"] = self._sums[method]
        for part in self._parts:
            out.update(part())
        out.update({f"gauge:{k}": float(v) for k, v in gauges.items()})
        return out
