"""Counters and gauges kept as plain numbers, written out at a scrape (observe/exposition.py).

`Metrics` (metrics.py) is built and fed from the first moment of `gpuvisor run`, but its figures
are read only when something scrapes /metrics, asks for a sample, or never (`--metrics-address ""`).
So the series here keep their values in dicts, with the part of the usual client API that
metrics.py uses (`Counter`/`Gauge(name, documentation, labelnames, registry=)`, `labels(...)`,
`inc`, `set`, `remove`), and `Registry` turns them into exposition families only when asked,
beside any collector registered with it.

What a scrape shows is what Prometheus's Python client would show for its own Counter and Gauge:
a counter `x` as `x_total` and `x_created` (the time its series was first made), a labelled
series only once it has been touched, an unlabelled one at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from supervisor.observe.exposition import Family, render, sample_value


class Collector(Protocol):
    """What a registry collects from at scrape time: families, made then."""

    def collect(self) -> Iterator[Family]: ...


class _Series:
    """One labelled (or the unlabelled) series of a metric: its value and when it was made."""

    __slots__ = ("_metric", "created", "value")

    def __init__(self, metric: _Metric) -> None:
        self._metric = metric
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self._metric.add(self, amount)

    def set(self, value: float) -> None:
        self._metric.put(self, value)


class _Metric:
    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: Registry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], _Series] = {}
        if not self.labelnames:
            self._series[()] = _Series(self)  # an unlabelled series exists from the start
        registry.add(self)

    def labels(self, *values: object) -> _Series:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values wanted, got {len(values)}")
        key = tuple(str(v) for v in values)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(self)
            return series

    def remove(self, *values: object) -> None:
        """Drop a labelled series; KeyError when there is none."""
        with self._lock:
            del self._series[tuple(str(v) for v in values)]

    def add(self, series: _Series, amount: float) -> None:
        with self._lock:
            series.value += amount

    def put(self, series: _Series, value: float) -> None:
        with self._lock:
            series.value = float(value)

    def samples(self) -> list[tuple[tuple[str, ...], float, float]]:
        """(label values, value, created) of every series, under the lock (scrape threads)."""
        with self._lock:
            return [(key, s.value, s.created) for key, s in self._series.items()]

    def family(self) -> Family:
        raise NotImplementedError

    def _unlabelled(self) -> _Series:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels: use labels(...) first")
        return self._series[()]


class Counter(_Metric):
    kind = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: Registry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry=registry)

    def add(self, series: _Series, amount: float) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        super().add(series, amount)

    def put(self, series: _Series, value: float) -> None:
        raise AttributeError("a counter is only incremented")

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def family(self) -> Family:
        family = Family(self.name, self.documentation, "counter", self.labelnames)
        for key, value, created in self.samples():
            family.add(key, value, created=created)
        return family


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def family(self) -> Family:
        family = Family(self.name, self.documentation, "gauge", self.labelnames)
        for key, value, _created in self.samples():
            family.add(key, value)
        return family


class Registry:
    """The series of one `Metrics` and the collectors beside them; private to it (no process-wide
    registry), so several in one process never share series."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: list[_Metric] = []
        self._collectors: list[Collector] = []

    def add(self, metric: _Metric) -> None:
        with self._lock:
            self._metrics.append(metric)

    def register(self, collector: Collector) -> None:
        """A collector asked at each scrape (the workers' figures, the process's CPU and memory)."""
        with self._lock:
            self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        with self._lock:
            metrics, collectors = list(self._metrics), list(self._collectors)
        for metric in metrics:
            yield metric.family()
        for collector in collectors:
            yield from collector.collect()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return render(self.collect())

    def get_sample_value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """One sample's value (None when there is no such sample)."""
        return sample_value(self.collect(), name, labels or {})
