"""The DRA driver's request series, `gpuvisor_dra_*`, from the DRA worker's heartbeat figures.

NVIDIA's kubelet plugin exports `nvidia_dra_*` (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1,
pkg/metrics/dra_requests.go); gpuvisor exports the same families under its own prefix, with the
same label names and histogram buckets (`ExponentialBuckets(0.05, 2, 9)`), and a `result` label
("ok" / "error") on the count and the histogram, which NVIDIA's carry only for successes:

| gpuvisor | NVIDIA's |
| --- | --- |
| `gpuvisor_dra_requests_total{driver,operation,result}` | `nvidia_dra_requests_total{driver,operation}` (= result "ok") |
| `gpuvisor_dra_request_duration_seconds{driver,operation,result}` | `nvidia_dra_request_duration_seconds{driver,operation}` |
| `gpuvisor_dra_requests_inflight{driver,operation}` | `nvidia_dra_requests_inflight{driver,operation}` |
| `gpuvisor_dra_prepared_devices{node,driver,device_type}` | `nvidia_dra_prepared_devices{node,driver,device_type}` |
| `gpuvisor_dra_node_prepare_errors_total{driver,error_type}` | `nvidia_dra_node_prepare_errors_total{driver,error_type}` |
| `gpuvisor_dra_node_unprepare_errors_total{driver,error_type}` | `nvidia_dra_node_unprepare_errors_total{driver,error_type}` |

The figures' keys are worker/dra/figures.py's; `driver` is the DRA worker's resource (its driver's
name). A node without a DRA worker exports none of these families.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from supervisor.observe.exposition import Family

PREFIX = "gpuvisor_dra_"
# A worker's figures: (cumulative totals, current gauges), each keyed as the heartbeat keys them.
WorkerFigures = tuple[Mapping[str, float], Mapping[str, float]]


def is_dra_gauge(name: str) -> bool:
    """A gauge of these families (not one for `gpuvisor_worker_<name>`)."""
    return name.startswith("dra_")


def _fields(key: str, kind: str, count: int) -> list[str] | None:
    """The `count` label values after `<kind>:` in a key; None for another kind or a malformed key."""
    if not key.startswith(kind + ":"):
        return None
    parts = key[len(kind) + 1 :].split(":")
    return parts if len(parts) == count and all(parts) else None


def dra_families(by_resource: Mapping[str, WorkerFigures]) -> Iterator[Family]:
    """The families, for every resource whose figures carry them; none when no resource has any."""
    requests = Family(
        PREFIX + "requests",
        "DRA prepare and unprepare requests, one per claim, by driver, operation and result.",
        "counter",
        ["driver", "operation", "result"],
    )
    duration = Family(
        PREFIX + "request_duration_seconds",
        "Duration of DRA prepare and unprepare requests (a claim's: the call's that carried it).",
        "histogram",
        ["driver", "operation", "result"],
    )
    inflight = Family(
        PREFIX + "requests_inflight",
        "Number of in-flight DRA prepare and unprepare requests (claims).",
        "gauge",
        ["driver", "operation"],
    )
    prepared = Family(
        PREFIX + "prepared_devices",
        "Current number of prepared devices by device type.",
        "gauge",
        ["node", "driver", "device_type"],
    )
    errors = {
        "prepare": Family(
            PREFIX + "node_prepare_errors",
            "Failures during DRA node prepare (one per claim), by the step that failed.",
            "counter",
            ["driver", "error_type"],
        ),
        "unprepare": Family(
            PREFIX + "node_unprepare_errors",
            "Failures during DRA node unprepare (one per claim), by the step that failed.",
            "counter",
            ["driver", "error_type"],
        ),
    }
    found = False
    for driver, (totals, gauges) in sorted(by_resource.items()):
        for key, value in sorted(totals.items()):
            if (labels := _fields(key, "dra_count", 2)) is not None:
                found = True
                requests.add([driver, *labels], value)
                duration.add_histogram(
                    [driver, *labels],
                    _buckets(totals, *labels),
                    totals.get(f"dra_sum:{labels[0]}:{labels[1]}", 0.0),
                )
            elif (labels := _fields(key, "dra_errors", 2)) is not None and labels[0] in errors:
                errors[labels[0]].add([driver, labels[1]], value)
        for key, value in sorted(gauges.items()):
            if (labels := _fields(key, "dra_inflight", 1)) is not None:
                found = True
                inflight.add([driver, *labels], value)
            elif (labels := _fields(key, "dra_prepared_devices", 2)) is not None:
                found = True
                prepared.add([labels[0], driver, labels[1]], value)
    if found:
        yield from (requests, duration, inflight, prepared, *errors.values())


def _buckets(totals: Mapping[str, float], operation: str, result: str) -> list[tuple[str, float]]:
    """One series' cumulative buckets in order, `le` as Prometheus writes it, then +Inf."""
    prefix = f"dra_bucket:{operation}:{result}:"
    bounds: list[tuple[float, float]] = []
    for key, value in totals.items():
        if key.startswith(prefix):
            try:
                bounds.append((float(key[len(prefix) :]), value))
            except ValueError:
                continue  # a key we do not understand is skipped, not fatal to a scrape
    bounds.sort()
    return [*((repr(le), value) for le, value in bounds), ("+Inf", totals[f"dra_count:{operation}:{result}"])]
