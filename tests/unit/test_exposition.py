"""supervisor/observe/exposition.py: the text format /metrics is written in, against
prometheus_client (a test dependency only) writing the same families."""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from supervisor.observe.exposition import Family, go_float, process_families, render, sample_value

SPECIAL = [0.0, -0.0, 1.0, 0.1, 100.0, 1234567.0, 12345678.0, 2.0**53, 1.7e9, 1e-9, -5.5, 1e22]
SPECIAL += [math.inf, -math.inf, math.nan]


def theirs(*families: Metric) -> bytes:
    class Collector:
        def collect(self) -> list[Metric]:
            return list(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return bytes(generate_latest(registry))


def test_counters_gauges_and_histograms_are_written_as_prometheus_client_writes_them() -> None:
    """The same families give the same bytes: HELP and TYPE, a counter's _total and its _created
    under their own HELP/TYPE, label values and help text escaped, histogram buckets, _count and
    _sum, an unlabelled gauge, and values from 1e-9 to +Inf and NaN."""
    counter = Family("x_events", "help with \\ and\nnewline", "counter", ["a", "b"])
    their_counter = CounterMetricFamily("x_events", "help with \\ and\nnewline", labels=["a", "b"])
    for values, value, created in ((["1", 'q"u\\o\nte'], 3.0, 1700000000.123), (["2", "z"], 0.0, None)):
        counter.add(values, value, created=created)
        their_counter.add_metric(values, value, created=created)
    gauge = Family("g", "a gauge", "gauge", ["v"])
    their_gauge = GaugeMetricFamily("g", "a gauge", labels=["v"])
    for value in SPECIAL:
        gauge.add([repr(value)], value)
        their_gauge.add_metric([repr(value)], value)
    hist = Family("h_seconds", "a histogram", "histogram", ["resource", "method"])
    their_hist = HistogramMetricFamily("h_seconds", "a histogram", labels=["resource", "method"])
    buckets = [("0.001", 1.0), ("0.01", 2.0), ("+Inf", 3.0)]
    hist.add_histogram(["nvidia.com/gpu", "Allocate"], buckets, 0.02)
    their_hist.add_metric(["nvidia.com/gpu", "Allocate"], buckets, 0.02)
    alone = Family("up", "unlabelled", "gauge")
    alone.add([], 1.0)
    mine = render([counter, gauge, hist, alone])
    assert mine == theirs(
        their_counter, their_gauge, their_hist, GaugeMetricFamily("up", "unlabelled", value=1.0)
    )


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_every_float_is_written_as_prometheus_client_writes_it(value: float) -> None:
    """Go's shortest 'g' form, as Prometheus's Python client writes it, for any float."""
    assert go_float(value) == floatToGoString(value)  # type: ignore[no-untyped-call]


def test_the_process_figures_are_prometheus_clients_and_this_process_s_own() -> None:
    """The same six families (names, help, kinds) as prometheus_client's ProcessCollector, with
    this process's values: its RSS, start time and open fds as psutil reads them."""
    mine = process_families("gpuvisor")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCollector(namespace="gpuvisor", registry=None))
    described = [(m.name, m.documentation, m.type) for m in registry.collect()]
    assert [(f.name, f.documentation, f.kind) for f in mine] == described
    me = psutil.Process()
    rss = sample_value(mine, "gpuvisor_process_resident_memory_bytes", {})
    assert rss is not None and abs(rss - me.memory_info().rss) < 0.2 * me.memory_info().rss
    start = sample_value(mine, "gpuvisor_process_start_time_seconds", {})
    assert start is not None and abs(start - me.create_time()) < 2.0 and start < time.time()
    fds = sample_value(mine, "gpuvisor_process_open_fds", {})
    assert fds is not None and abs(fds - len(os.listdir("/proc/self/fd"))) <= 2


def test_without_proc_the_process_figures_are_left_out(tmp_path: os.PathLike[str]) -> None:
    """A /proc that cannot be read gives no process family (and no error): the scrape answers."""
    assert process_families("gpuvisor", proc=os.path.join(os.fspath(tmp_path), "missing")) == []


def test_a_family_refuses_a_wrong_use() -> None:
    """Label values that do not match the label names, a series added the wrong way for the
    kind, a histogram without its +Inf bucket, and an unknown kind are errors, not output."""
    gauge = Family("g", "help", "gauge", ["a"])
    with pytest.raises(ValueError, match="label values"):
        gauge.add(["1", "2"], 1.0)
    with pytest.raises(TypeError, match="not a histogram"):
        gauge.add_histogram(["1"], [("+Inf", 1.0)], 1.0)
    hist = Family("h", "help", "histogram")
    with pytest.raises(TypeError, match="add_histogram"):
        hist.add([], 1.0)
    with pytest.raises(ValueError, match=r"\+Inf"):
        hist.add_histogram([], [("1.0", 1.0)], 1.0)
    with pytest.raises(ValueError, match="kind"):
        Family("s", "help", "summary")
