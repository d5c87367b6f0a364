"""The node's Prometheus figures: one registry in the supervisor, fed by small hook calls.

The supervisor's main loop calls the hooks (`worker_state`, `health_batch`, `registration`, ...)
when something happens; the HTTP thread calls `render()`. The series are `supervisor.observe.series`'
(thread-safe, plain numbers until a scrape writes them out: observe/exposition.py), and the one
piece of state of our own (the workers' figures) has its own lock. The registry is private (no
process-wide one), so tests and several supervisors in one process never share series.

Workers have no endpoint of their own: each heartbeat carries the worker's cumulative figures
(worker/stats.py: `rpc_count:<m>`, `rpc_sum:<m>`, `rpc_bucket:<m>:<le>`, `count:<name>`,
`gauge:<name>`), and a custom collector turns the latest ones into series at scrape time
(`gpuvisor_rpc_duration_seconds`, `gpuvisor_worker_events_total`, `gpuvisor_worker_<name>`, and
the DRA worker's `dra_*` figures as `gpuvisor_dra_*`: observe/drafamilies.py).
A restarted worker starts counting from zero again; to keep the exported counters monotonic
(a counter that drops reads as a reset to Prometheus, and a `rate()` over it would lose the
dead worker's last figures), the figures of each earlier worker life are folded into a
per-resource offset that is added to the current life's. A new life is recognised by a new pid,
or, without a pid, by any cumulative figure going down.
"""

from __future__ import annotations

import contextlib
import platform
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from supervisor.config.version import VERSION
from supervisor.observe.drafamilies import dra_families, is_dra_gauge
from supervisor.observe.exposition import Family, process_families
from supervisor.observe.series import Counter, Gauge, Registry

# Kept in step with supervisor.workers.lifecycle.WState (a test checks): the one-hot state gauge exports
# every state of every worker, so a dashboard can tell "0 workers RUNNING" from "no data".
WORKER_STATES: tuple[str, ...] = ("STARTING", "RUNNING", "BACKOFF", "STOPPING", "STOPPED", "FATAL")

# States in which a worker process is not (or no longer) serving: its gauges are stale.
_DOWN_STATES = frozenset({"BACKOFF", "STOPPING", "STOPPED", "FATAL"})

_NAME_SAFE = re.compile(r"[^a-zA-Z0-9_]")


def registration_trigger(reason: str) -> str:
    """Map a worker's free-text reason for (re-)registering to a small, stable label value."""
    text = reason.lower()
    if text in ("", "start"):
        return "start"
    if "kubelet.sock" in text or "kubelet restart" in text:
        return "kubelet-restart"
    if "socket" in text and "deleted" in text:
        return "socket-deleted"
    if "no listandwatch stream" in text:
        return "no-stream"
    if "stream" in text and "cancel" in text:
        return "stream-cancelled"
    if "ended our listandwatch stream" in text:
        return "stream-ended"
    if "plan" in text:
        return "plan-update"
    return "other"


def restart_cause(reason: str) -> str:
    """The cause part of a worker transition reason ("killed by SIGKILL; restart in 0.00s")."""
    cause = reason.split(";")[0].strip()
    if cause.startswith("spawn failed"):
        return "spawn failed"  # the errno text after the colon would make one series per message
    return cause or "unknown"


@dataclass
class _Figures:
    """One resource's worker figures: this life's latest plus the folded-in earlier lives."""

    pid: int | None = None
    offset: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    def update(self, stats: Mapping[str, float], pid: int | None) -> None:
        cumulative = {k: float(v) for k, v in stats.items() if not k.startswith("gauge:")}
        new_life = (pid is not None and self.pid is not None and pid != self.pid) or any(
            v < self.last.get(k, 0.0) for k, v in cumulative.items()
        )
        if new_life:
            for key, value in self.last.items():
                self.offset[key] = self.offset.get(key, 0.0) + value
        self.last = cumulative
        self.gauges = {k[len("gauge:") :]: float(v) for k, v in stats.items() if k.startswith("gauge:")}
        if pid is not None:
            self.pid = pid

    def totals(self) -> dict[str, float]:
        out = dict(self.offset)
        for key, value in self.last.items():
            out[key] = out.get(key, 0.0) + value
        return out


class _WorkerCollector:
    """Exposes the workers' heartbeat figures at scrape time (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[str, _Figures] = {}

    def update(self, resource: str, stats: Mapping[str, float], pid: int | None) -> None:
        with self._lock:
            self._by_resource.setdefault(resource, _Figures()).update(stats, pid)

    def clear_gauges(self, resource: str) -> None:
        with self._lock:
            figures = self._by_resource.get(resource)
            if figures is not None:
                figures.gauges = {}

    def forget(self, resource: str) -> None:
        with self._lock:
            self._by_resource.pop(resource, None)

    def collect(self) -> Iterator[Family]:
        with self._lock:
            snapshot = {r: (f.totals(), dict(f.gauges)) for r, f in sorted(self._by_resource.items())}
        hist = Family(
            "gpuvisor_rpc_duration_seconds",
            "Time the workers spent answering kubelet calls (ListAndWatch: per message sent), by resource and method.",
            "histogram",
            ["resource", "method"],
        )
        events = Family(
            "gpuvisor_worker_events",
            "Counted worker events (from heartbeats), by resource and event.",
            "counter",
            ["resource", "event"],
        )
        gauges: dict[str, Family] = {}
        for resource, (totals, current) in snapshot.items():
            for method in sorted(k.split(":", 1)[1] for k in totals if k.startswith("rpc_count:")):
                prefix = f"rpc_bucket:{method}:"
                buckets: list[tuple[float, float]] = []
                for key, value in totals.items():
                    if key.startswith(prefix):
                        try:
                            buckets.append((float(key[len(prefix) :]), value))
                        except ValueError:
                            continue  # a key we do not understand is skipped, not fatal to a scrape
                buckets.sort()  # repr() of a float is how Prometheus writes `le` (0.001, 1.0)
                pairs = [(repr(le), value) for le, value in buckets]
                pairs.append(("+Inf", totals[f"rpc_count:{method}"]))
                hist.add_histogram([resource, method], pairs, totals.get(f"rpc_sum:{method}", 0.0))
            for key, value in sorted(totals.items()):
                if key.startswith("count:"):
                    events.add([resource, key[len("count:") :]], value)
            for name, value in sorted(current.items()):
                if is_dra_gauge(name):
                    continue  # a gpuvisor_dra_* series
                metric_name = "gpuvisor_worker_" + _NAME_SAFE.sub("_", name)
                family = gauges.get(metric_name)
                if family is None:
                    family = Family(
                        metric_name, f"Worker figure {name!r} (from heartbeats).", "gauge", ["resource"]
                    )
                    gauges[metric_name] = family
                family.add([resource], value)
        yield hist
        yield events
        yield from gauges.values()
        yield from dra_families(snapshot)


class _ProcessFigures:
    """The supervisor's own CPU and memory (`gpuvisor_process_*`), read at scrape time."""

    def collect(self) -> Iterator[Family]:
        yield from process_families("gpuvisor")


class _BuildInfo:
    """gpuvisor_build_info: the version (supervisor/config/version.py, unless a test names another)."""

    def __init__(self, version: str | None) -> None:
        self._version = VERSION if version is None else version

    def collect(self) -> Iterator[Family]:
        family = Family(
            "gpuvisor_build_info", "Build information (always 1).", "gauge", ["version", "python"]
        )
        family.add([self._version, platform.python_version()], 1)
        yield family


class Metrics:
    """Every gpuvisor_* series of the node, with the hooks the supervisor calls."""

    def __init__(self, version: str | None = None) -> None:
        self.registry = Registry()
        r = self.registry
        self.up = Gauge("gpuvisor_up", "1 while the supervisor runs.", registry=r)
        self.ready = Gauge(
            "gpuvisor_ready", "1 when every planned resource is registered and streaming.", registry=r
        )
        self.worker_states = Gauge(
            "gpuvisor_worker_state",
            "Worker lifecycle state (one-hot), by resource.",
            ["resource", "state"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "gpuvisor_worker_restarts",
            "Worker process deaths that led to a restart, by cause.",
            ["resource", "cause"],
            registry=r,
        )
        self.registrations = Counter(
            "gpuvisor_registrations",
            "Successful registrations with the kubelet, by trigger.",
            ["resource", "trigger"],
            registry=r,
        )
        self.devices = Gauge(
            "gpuvisor_devices",
            "Allocatable devices, by resource and health.",
            ["resource", "health"],
            registry=r,
        )
        self.health_transitions = Counter(
            "gpuvisor_health_transitions",
            "Device health changes, by resource and new health.",
            ["resource", "to"],
            registry=r,
        )
        self.xid_events = Counter(
            "gpuvisor_xid_events", "XID events seen (ignored ones included), by XID.", ["xid"], registry=r
        )
        self.nvml_errors = Counter(
            "gpuvisor_nvml_errors",
            "Failed NVML calls in the supervisor, by function and NVML code.",
            ["function", "code"],
            registry=r,
        )
        self.workers_fatal = Gauge(
            "gpuvisor_workers_fatal",
            "Workers in FATAL (crash-looping; retried at a capped interval), summed over resources.",
            registry=r,
        )
        self._fatal: set[str] = set()
        self.housekeeping_errors = Counter(
            "gpuvisor_housekeeping_errors",
            "Supervisor loop steps and timers that raised (logged with the cause; the loop went on), by step.",
            ["step"],
            registry=r,
        )
        self.reloads_refused = Counter(
            "gpuvisor_reloads_refused",
            "Reloads and rediscoveries refused (the running config kept serving), by kind.",
            ["kind"],
            registry=r,
        )
        self.reload_pending = Gauge(
            "gpuvisor_reload_pending",
            "1 while a wanted config waits to be applied (retried with backoff).",
            registry=r,
        )
        self.control_dropped = Counter(
            "gpuvisor_control_messages_dropped",
            "Control-socket messages dropped (malformed, from a replaced or unknown sender), by reason.",
            ["reason"],
            registry=r,
        )
        # The cluster side (supervisor/cluster): the API server's answers, the Node watch, what
        # is written on the Node, and which named config runs.
        self.api_requests = Counter(
            "gpuvisor_api_requests",
            "Requests to the Kubernetes API server, by verb and HTTP code (0: no answer).",
            ["verb", "code"],
            registry=r,
        )
        self.api_watch_events = Counter(
            "gpuvisor_api_watch",
            "The Node watch: lists, watches started, 410 Gone re-lists and failures (each retried with backoff).",
            ["event"],
            registry=r,
        )
        self.node_health_writes = Counter(
            "gpuvisor_node_health_writes",
            "GPU health on the Node: condition writes and Events by result, and failed passes (retried).",
            ["what", "result"],
            registry=r,
        )
        self.mps_claim_daemons = Gauge(
            "gpuvisor_mps_claim_daemons",
            "The MPS control daemons of DRA claims: up (limits set, answering) or down (starting, "
            "restarting after a death or a hang, or stopping).",
            ["state"],
            registry=r,
        )
        self.dra_api = Counter(
            "gpuvisor_dra_api",
            "The DRA driver's API-server work: ResourceSlice creates, updates and deletes, taint probes, "
            "publishing passes, the slices' watch, and claims fetched for the DRA worker, by result.",
            ["what", "result"],
            registry=r,
        )
        self.config_info = Gauge(
            "gpuvisor_config_info",
            "The config that runs (1): its name among the named configs and where the choice came from.",
            ["name", "source"],
            registry=r,
        )
        self._config_labels: tuple[str, str] | None = None
        self._workers = _WorkerCollector()
        r.register(self._workers)
        r.register(_BuildInfo(version))
        r.register(_ProcessFigures())  # the supervisor's own CPU and memory
        self.up.set(1)
        self.ready.set(0)
        self._restart_seen: dict[str, dict[str, int]] = {}
        self._pending_trigger: dict[str, str] = {}

    # ------------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return self.registry.render()

    # ------------------------------------------------------------------ workers
    def worker_state(self, resource: str, state: str) -> None:
        """Set the one-hot state gauge of a resource's worker (and the count of FATAL workers)."""
        for s in (*WORKER_STATES, *(() if state in WORKER_STATES else (state,))):
            self.worker_states.labels(resource, s).set(1 if s == state else 0)
        if state == "FATAL":
            self._fatal.add(resource)
        else:
            self._fatal.discard(resource)
        self.workers_fatal.set(len(self._fatal))
        if state in _DOWN_STATES:
            self._workers.clear_gauges(resource)

    def worker_restart(self, resource: str, cause: str, count: int = 1) -> None:
        """A worker died and will be restarted (or was killed for a hang)."""
        self.worker_restarts.labels(resource, cause).inc(count)

    def worker_transition(
        self, resource: str, state: str, *, wanted: bool, restart_causes: Mapping[str, int], reason: str
    ) -> None:
        """A worker lifecycle transition (supervisor.workers.lifecycle): the state gauge on every
        one, restarts on BACKOFF and FATAL.

        A worker stopped because its resource left the plan (`wanted` false) takes its gauges with
        it (`forget_resource`); one that comes back starts them again.

        Restart causes are taken from the handle's own `restart_causes` tally (what `gpuvisor
        status` shows) by difference, so both always agree (a hang counts as whatever the tally
        records for it); a transition the tally did not count falls back to the reason text.
        """
        if state == "STOPPED" and not wanted:
            self.forget_resource(resource)  # removed from the plan: its series go
            return
        self.worker_state(resource, state)
        causes = dict(restart_causes)
        if state not in ("BACKOFF", "FATAL"):  # FATAL is restarted too, at a capped interval
            return
        seen = self._restart_seen.get(resource, {})
        if any(causes.get(k, 0) < v for k, v in seen.items()):
            seen = {}  # a fresh handle for a resource that came back: its tally restarted
        counted = False
        for cause, n in sorted(causes.items()):
            if n > seen.get(cause, 0):
                self.worker_restart(resource, cause, n - seen.get(cause, 0))
                counted = True
        if not counted:
            self.worker_restart(resource, restart_cause(reason))
        self._restart_seen[resource] = causes

    def worker_stats(self, resource: str, stats: Mapping[str, float], pid: int | None = None) -> None:
        """The latest cumulative figures from a worker's heartbeat (pass its pid when known)."""
        self._workers.update(resource, stats, pid)

    def registration(self, resource: str, trigger: str) -> None:
        """A worker registered with the kubelet; `trigger` is a `registration_trigger()` value."""
        self.registrations.labels(resource, trigger).inc()

    def registration_report(self, resource: str, event: str, detail: str) -> None:
        """Feed a worker's StatusReport: "registering" remembers why, "registered" counts it.

        Retries of a failing registration report "retry" as their reason; the trigger that
        started the attempt is kept until the registration succeeds.
        """
        if event == "registering":
            if detail != "retry":
                self._pending_trigger[resource] = registration_trigger(detail)
        elif event == "registered":
            self.registration(resource, self._pending_trigger.pop(resource, "start"))

    def forget_resource(self, resource: str) -> None:
        """A resource left the plan: drop its gauges (counters keep their history)."""
        for s in WORKER_STATES:
            _remove(self.worker_states, resource, s)
        for health in ("healthy", "unhealthy"):
            _remove(self.devices, resource, health)
        self._workers.forget(resource)
        self._fatal.discard(resource)
        self.workers_fatal.set(len(self._fatal))
        self._restart_seen.pop(resource, None)
        self._pending_trigger.pop(resource, None)

    # ------------------------------------------------------------------ health
    def health_batch(self, changes: Iterable[tuple[str, str, bool]], xid: int | None) -> None:
        """One health change batch: (resource, device id, healthy) per device, and its XID."""
        if xid is not None:
            self.xid_events.labels(str(xid)).inc()
        for resource, _device, healthy in changes:
            self.health_transitions.labels(resource, "healthy" if healthy else "unhealthy").inc()

    def set_devices(self, resource: str, healthy: int, unhealthy: int) -> None:
        self.devices.labels(resource, "healthy").set(healthy)
        self.devices.labels(resource, "unhealthy").set(unhealthy)

    def nvml_error(self, function: str, code: int) -> None:
        self.nvml_errors.labels(function, str(code)).inc()

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    # ------------------------------------------------------------------ the loop's own troubles
    def housekeeping_error(self, step: str) -> None:
        self.housekeeping_errors.labels(step).inc()

    def reload_refused(self, kind: str) -> None:
        self.reloads_refused.labels(kind).inc()

    def set_pending_reload(self, pending: bool) -> None:
        self.reload_pending.set(1 if pending else 0)

    def control_message_dropped(self, reason: str) -> None:
        self.control_dropped.labels(reason).inc()

    # ------------------------------------------------------------------ the cluster side
    def api_request(self, verb: str, code: int) -> None:
        """Called from the API client's threads (the series take their lock)."""
        self.api_requests.labels(verb, str(code)).inc()

    def api_watch(self, event: str) -> None:
        self.api_watch_events.labels(event).inc()

    def node_health_write(self, what: str, result: str) -> None:
        self.node_health_writes.labels(what, result).inc()

    def dra_call(self, what: str, result: str) -> None:
        """Called from the DRA side's threads."""
        self.dra_api.labels(what, result).inc()

    def set_mps_claim_daemons(self, up: int, down: int) -> None:
        """Called from the MPS claim daemons' thread."""
        self.mps_claim_daemons.labels("up").set(up)
        self.mps_claim_daemons.labels("down").set(down)

    def set_config(self, name: str, source: str) -> None:
        """The config that runs now: one series, moved when it changes."""
        if self._config_labels is not None and self._config_labels != (name, source):
            _remove(self.config_info, *self._config_labels)
        self._config_labels = (name, source)
        self.config_info.labels(name, source).set(1)


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to drop
        metric.remove(*labels)
