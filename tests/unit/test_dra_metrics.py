"""The DRA request metrics (worker/dra/figures.py, supervisor/observe/drafamilies.py): each claim of
a prepare or unprepare counted by result, timed in NVIDIA's buckets, held in flight while its call
runs, its failure counted by type, and the prepared devices gauged by type, as `gpuvisor_dra_*`.

The names, labels and buckets are NVIDIA's kubelet plugin's (kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1, pkg/metrics/dra_requests.go: `nvidia_dra_requests_total{driver,operation}`,
`nvidia_dra_request_duration_seconds` with `ExponentialBuckets(0.05, 2, 9)`,
`nvidia_dra_requests_inflight`, `nvidia_dra_prepared_devices{node,driver,device_type}`,
`nvidia_dra_node_{prepare,unprepare}_errors_total{driver,error_type}`), under gpuvisor's prefix."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from common.dracheckpoint import Checkpoint, PreparedClaim, PreparedDevice
from supervisor.config import config_from_data
from supervisor.node.draplan import dra_plan
from supervisor.observe.metrics import Metrics
from supervisor.sim.drakubelet import ClaimStore
from tests import nodes
from tests.unit.test_dra_prepare import POOL, plan_for
from worker.dra.claims import ClaimRef, DirectoryClaimSource
from worker.dra.figures import BUCKETS, DraFigures, prepared_devices
from worker.dra.prepare import Preparer, PrepareResult
from worker.dra.services import DraPluginService
from worker.stats import Stats

DRIVER = "gpu.nvidia.com"
# ExponentialBuckets(0.05, 2, 9) (k8s.io/component-base/metrics, as Prometheus's Go client makes
# them: start, then each times the factor), written out.
NVIDIA_BUCKETS = ["0.05", "0.1", "0.2", "0.4", "0.8", "1.6", "3.2", "6.4", "12.8"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scrape(
    figures: Mapping[str, float], pid: int = 1, metrics: Metrics | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a scrape after a DRA worker's heartbeat carried `figures`."""
    metrics = metrics or Metrics()
    metrics.worker_stats(DRIVER, figures, pid=pid)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_buckets_are_nvidias() -> None:
    """The histogram's bucket edges are NVIDIA's ExponentialBuckets(0.05, 2, 9), written as its
    Go client writes them (`le="0.05"` ... `le="12.8"`, then +Inf)."""
    assert [repr(b) for b in BUCKETS] == NVIDIA_BUCKETS
    samples = scrape(DraFigures(POOL).snapshot())
    edges = [
        dict(labels)["le"]
        for (name, labels) in samples
        if name == "gpuvisor_dra_request_duration_seconds_bucket"
        and dict(labels)["operation"] == "prepare"
        and dict(labels)["result"] == "ok"
    ]
    assert sorted(edges, key=float) == [*NVIDIA_BUCKETS, "+Inf"]


def test_a_time_on_an_edge_counts_in_that_bucket() -> None:
    """A bucket counts the times up to and including its edge (Prometheus's `le`); a time past the
    last edge only in +Inf; the sum adds each claim's time."""
    clock = Clock()
    figures = DraFigures(POOL, clock=clock)
    for seconds in (0.1, 0.1000001, 20.0):
        clock.now = 0.0
        started = figures.begin("prepare", 1)
        clock.now = seconds
        figures.end("prepare", started, 1, 1, [])
    samples = scrape(figures.snapshot())

    def bucket(le: str) -> float | None:
        labels = {"driver": DRIVER, "operation": "prepare", "result": "ok", "le": le}
        return value(samples, "gpuvisor_dra_request_duration_seconds_bucket", **labels)

    assert (bucket("0.05"), bucket("0.1"), bucket("0.2"), bucket("12.8"), bucket("+Inf")) == (0, 1, 2, 2, 3)
    labels = {"driver": DRIVER, "operation": "prepare", "result": "ok"}
    assert value(samples, "gpuvisor_dra_request_duration_seconds_count", **labels) == 3
    total = value(samples, "gpuvisor_dra_request_duration_seconds_sum", **labels) or 0.0
    assert abs(total - 20.2000001) < 1e-6


def test_every_series_exists_at_start() -> None:
    """Before any request the counts, histograms and in-flight gauges of both operations and both
    results read 0, as NVIDIA's InitializeDRARequestMetrics makes them, and the prepared-devices
    gauge shows each of NVIDIA's device types at 0 for this node."""
    samples = scrape(DraFigures(POOL).snapshot())
    for op in ("prepare", "unprepare"):
        assert value(samples, "gpuvisor_dra_requests_inflight", driver=DRIVER, operation=op) == 0
        for result in ("ok", "error"):
            assert (
                value(samples, "gpuvisor_dra_requests_total", driver=DRIVER, operation=op, result=result) == 0
            )
    for kind in ("gpu", "mig", "vfio", "unknown"):
        assert (
            value(samples, "gpuvisor_dra_prepared_devices", node=POOL, driver=DRIVER, device_type=kind) == 0
        )


class Setup:
    """A DRA plan of the pcie-l4 node, its claims dir and a service over a real Preparer."""

    def __init__(self, tmp: Path) -> None:
        self.plan = plan_for(tmp)
        assert self.plan.dra is not None
        self.store = ClaimStore(self.plan.dra.claims_dir)
        self.figures = DraFigures(POOL)
        self.inflight_seen: list[float] = []
        source = DirectoryClaimSource(self.plan.dra.claims_dir)
        figures = self.figures

        class Watching:
            """The claims dir, noting the in-flight gauge while a claim is fetched."""

            def __init__(self, seen: list[float]) -> None:
                self.seen = seen

            def get(self, namespace: str, name: str) -> Mapping[str, Any]:
                self.seen.append(figures.snapshot()["gauge:dra_inflight:prepare"])
                return source.get(namespace, name)

        self.preparer = Preparer(
            self.plan, Watching(self.inflight_seen), Checkpoint(self.plan.dra.plugin_dir)
        )
        self.service = DraPluginService(self.preparer, figures=self.figures)


class Claim:
    def __init__(self, namespace: str, name: str, uid: str) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid


def test_each_claim_is_counted_by_result_and_error_type(tmp_path: Path) -> None:
    """A call of three claims (one good, one the API has not, one without its UID) counts one ok and
    two errors, `prepare_devices` for the missing claim and `invalid_request` for the bad one; the
    claims are in flight while the call runs (3, seen from the claim fetch) and not after; an
    unprepare counts its own operation."""
    s = Setup(tmp_path)
    good = Claim(*s.store.allocate("default", "good", POOL, ["gpu-0"]))
    missing = Claim("default", "missing", "9d0b5a6e-0000-4000-8000-000000000001")
    bad = Claim("default", "bad", "")
    results = s.service.prepare([good, missing, bad])
    assert not results[good.uid].error and results[missing.uid].error and results["default/bad"].error
    assert s.inflight_seen and s.inflight_seen[0] == 3
    assert s.service.unprepare([good]) == {good.uid: ""}
    figures = s.figures.snapshot()
    assert figures["dra_count:prepare:ok"] == 1 and figures["dra_count:prepare:error"] == 2
    assert (
        figures["dra_errors:prepare:prepare_devices"] == 1
        and figures["dra_errors:prepare:invalid_request"] == 1
    )
    assert figures["dra_count:unprepare:ok"] == 1 and figures["dra_count:unprepare:error"] == 0
    assert figures["gauge:dra_inflight:prepare"] == 0 and figures["gauge:dra_inflight:unprepare"] == 0
    samples = scrape(figures)
    labels = {"driver": DRIVER, "error_type": "prepare_devices"}
    assert value(samples, "gpuvisor_dra_node_prepare_errors_total", **labels) == 1
    labels = {"driver": DRIVER, "operation": "prepare", "result": "error"}
    assert value(samples, "gpuvisor_dra_requests_total", **labels) == 2
    assert value(samples, "gpuvisor_dra_request_duration_seconds_count", **labels) == 2


def test_a_bug_counts_as_internal(tmp_path: Path) -> None:
    """A Preparer that raises answers every claim with the error and counts each as `internal`,
    for prepare and unprepare, and the in-flight gauges return to 0."""
    s = Setup(tmp_path)

    class Broken(Preparer):
        def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
            raise RuntimeError("a bug")

        def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
            raise RuntimeError("a bug")

    assert s.plan.dra is not None
    service = DraPluginService(Broken(s.plan, None, Checkpoint(s.plan.dra.plugin_dir)), figures=s.figures)
    claims = [Claim("default", f"c{i}", f"9d0b5a6e-0000-4000-8000-00000000001{i}") for i in range(2)]
    assert all(r.error for r in service.prepare(claims).values())
    assert all(service.unprepare(claims).values())
    figures = s.figures.snapshot()
    assert figures["dra_errors:prepare:internal"] == 2 and figures["dra_errors:unprepare:internal"] == 2
    assert figures["gauge:dra_inflight:prepare"] == 0 and figures["gauge:dra_inflight:unprepare"] == 0


def test_prepared_devices_by_type() -> None:
    """The prepared claims' devices are counted by type: a full GPU as `gpu`, a MIG device as `mig`
    (the plan says), a device gone from the plan by its DRA name; every type present."""
    config = config_from_data(
        {"version": "v1", "gpuvisor": {"mode": "dra"}}, flags={"node_name": POOL}, source="test"
    )
    plan = dra_plan(nodes.mig_a100(), config)
    by_id = {d.id: d for d in plan.devices}
    migs = [d.id for d in plan.devices if d.is_mig][:2]
    gpu = next(d.id for d in plan.devices if not d.is_mig)

    def claim(uid: str, *names: str) -> PreparedClaim:
        devices = tuple(
            PreparedDevice(("r",), POOL, n, (f"k8s.gpu.nvidia.com/claim={uid}-{n}",)) for n in names
        )
        return PreparedClaim(uid, "default", uid, devices, time.time())

    claims = [claim("a", gpu), claim("b", *migs), claim("c", "gpu-9-mig-1g10gb-19-0", "gpu-9")]
    assert prepared_devices(claims, by_id) == {"gpu": 2, "mig": 3, "vfio": 0, "unknown": 0}


def test_counts_stay_monotonic_over_a_worker_restart() -> None:
    """A restarted DRA worker counts from 0 again; the exported count and histogram add the dead
    life's figures (a counter that drops reads as a reset to Prometheus)."""
    metrics = Metrics()
    first = DraFigures(POOL)
    for _ in range(3):
        first.end("prepare", first.begin("prepare", 1), 1, 1, [])
    scrape(first.snapshot(), pid=10, metrics=metrics)
    second = DraFigures(POOL)
    second.end("prepare", second.begin("prepare", 1), 1, 1, [])
    samples = scrape(second.snapshot(), pid=11, metrics=metrics)
    labels = {"driver": DRIVER, "operation": "prepare", "result": "ok"}
    assert value(samples, "gpuvisor_dra_requests_total", **labels) == 4
    assert value(samples, "gpuvisor_dra_request_duration_seconds_count", **labels) == 4


def test_dra_gauges_are_not_worker_figures_and_a_device_plugin_node_has_none() -> None:
    """The DRA gauges are exported only as gpuvisor_dra_* (no gpuvisor_worker_dra_*); a node whose
    workers carry no DRA figures (a device plugin) exports no gpuvisor_dra_ request families."""
    stats = Stats()
    stats.include(DraFigures(POOL).snapshot)
    samples = scrape(stats.snapshot(streams=1))
    assert not [name for name, _ in samples if name.startswith("gpuvisor_worker_dra")]
    assert value(samples, "gpuvisor_worker_streams", resource=DRIVER) == 1
    plain = Metrics()
    plain.worker_stats("nvidia.com/gpu", Stats().snapshot(streams=1), pid=1)
    text = plain.render().decode()
    assert "gpuvisor_dra_requests" not in text and "gpuvisor_dra_prepared_devices" not in text
