"""The NVML side of health: one thread that waits on the event set and probes the GPUs.

The thread never touches the health book: it reports every finding as data
(supervisor/health/findings.py) to `report`, and the supervisor applies it on its main loop
(to the book, then publishes what changed). So the book has one writer and needs no lock.

- Events: XID critical errors and single/double-bit ECC, waited on 5 s at a time (as NVIDIA's
  plugin). An XID 79 (fell off the bus) is followed at once by a probe of that GPU, so the book
  knows the GPU is *lost* (recovers when NVML sees it again) rather than only "XID 79"
  (recovers on a reset).
- Wait errors are never spun on (NVIDIA #1937 burns a core): the watch is dropped and rebuilt
  after an exponential backoff (1 s doubling to 30 s). The GPUs are probed first: if some are
  lost, only their devices go unhealthy (precise, where NVIDIA marks everything); only a failure
  no probe explains marks every device unhealthy, logged once. While waits keep failing, probe
  passes are not recorded, so that condition cannot recover (and flap) before NVML works again.
- Probes: every `probe_interval` a few cheap NVML queries per GPU catch what sends no event
  (a GPU that fell off the bus, retired pages or remapped rows pending a reset: NVIDIA #267),
  give the passing probe that transient recovery needs, and notice a lost GPU that is back
  (then the event set is rebuilt, so the GPU's events are registered again). A rediscovery that
  adds GPUs (`set_node`) registers them into the set being waited on at once, from the caller's
  thread (NVML is thread-safe), so they are watched before their devices are advertised; one
  that removes GPUs rebuilds the set after the wait in progress.
- A GPU whose event registration fails is left out of the set (logged with the reason), not
  the whole set: only when every GPU fails does it count as a failed wait.

The probe period is the `--probe-interval` setting (GPUVISOR_PROBE_INTERVAL, seconds, default
10, read by the config package like every setting), passed in by the supervisor as
`probe_interval` and changeable live (the thread reads the attribute each round).

`on_error(function, code)` is told of every failed NVML call of the thread (for the
`gpuvisor_nvml_errors_total` counter); it is called from this thread, so it must be thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from common.backoff import Backoff
from common.model import Node
from supervisor.health.findings import Ecc, Finding, Found, Lost, Probed, Unattributed, WaitFailed, Xid
from supervisor.health.policy import EccKind, HealthPolicy
from supervisor.node.events import EventWatch, NvmlEvent
from supervisor.node.nvml import NVML_ERROR_UNKNOWN, Nvml, NvmlCallError, ProbeResult

log = logging.getLogger("gpuvisor.health")

WAIT_MS = 5000
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
XID_FELL_OFF_BUS = 79
_LOST_STATUSES = ("lost", "not-found")


class HealthMonitor:
    """NVML events and probes turned into health-book updates, on a thread of its own."""

    def __init__(
        self,
        module: Any,
        node: Node,
        policy: HealthPolicy,
        report: Callable[[Finding], None],
        probe_interval: float,
        on_error: Callable[[str, int], None] | None = None,
    ) -> None:
        self.nvml = Nvml(module)
        self.node = node
        self.policy = policy
        self._report = report
        self._on_error = on_error
        self.probe_interval = probe_interval
        if not math.isfinite(self.probe_interval) or self.probe_interval <= 0:
            raise ValueError(
                f"probe_interval must be a positive number of seconds, got {self.probe_interval!r}"
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._watch: EventWatch | None = None
        self._lost: set[str] = set()
        self._failure: str | None = None  # the reason every device is unhealthy, while waits fail
        self._rebuild = False  # a lost GPU is back: register its events again (set by the thread)
        # set_node saw a different set of GPUs: the thread rebuilds the watch between two waits,
        # so a GPU first seen at rediscovery gets its events. An Event: set from another thread.
        self._node_changed = threading.Event()
        self.backoff_start_s = BACKOFF_START_S
        self.backoff_max_s = BACKOFF_MAX_S
        # Figures for metrics and tests.
        self.errors = 0
        self.events = 0
        self.probes = 0

    # ------------------------------------------------------------------ public
    @property
    def failing(self) -> bool:
        """True while event waits fail for a reason no probe explains."""
        return self._failure is not None

    @property
    def lost(self) -> frozenset[str]:
        return frozenset(self._lost)

    @property
    def running(self) -> bool:
        """Is the health thread running (it is not while health checks are disabled)?"""
        return self._thread.is_alive()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def set_node(self, node: Node) -> None:
        """The node as rediscovered (call from one thread, the supervisor's main loop).

        The probes read it at their next round (a plain reference swap). The event set was built
        from the GPUs NVML listed when it was opened: GPUs added are registered into it now; a
        GPU removed asks the thread to rebuild it, after the wait in progress (at most 5 s).
        """
        old, new = {g.uuid for g in self.node.gpus}, {g.uuid for g in node.gpus}
        self.node = node
        if new == old:
            return
        watch = self._watch
        if watch is not None and new > old:
            # Only GPUs added (found again): register them into the set being waited on, before
            # their devices are advertised, instead of after the wait in progress (up to 5 s of
            # XIDs missed). A set the thread closed meanwhile fails here: then it is rebuilt.
            try:
                watch.add(sorted(new - old))
                return
            except NvmlCallError as exc:
                log.debug(
                    "registering the events of the GPUs found again failed (%s): rebuilding the set", exc
                )
        self._node_changed.set()

    def initial_probe(self) -> list[Finding]:
        """Probe every GPU once, synchronously, before any worker starts (NVIDIA #111)."""
        return self._probe_all()

    def start(self) -> None:
        if not self.policy.checks_enabled:
            log.warning("health checks are disabled (DP_DISABLE_HEALTHCHECKS): devices stay Healthy")
            return
        self._thread.start()

    def stop(self, timeout: float = 0.2) -> bool:
        """Ask the thread to end; True when it did within `timeout` seconds."""
        # An NVML event wait cannot be interrupted and lasts up to 5 s: the thread is a daemon and
        # is not waited for long, so a stop signal still ends the process promptly.
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        backoff = Backoff(self.backoff_start_s, self.backoff_max_s)
        retry_at = 0.0
        next_probe = time.monotonic() + self.probe_interval
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_probe:
                self._probe_round()
                next_probe = time.monotonic() + self.probe_interval
            if self._rebuild or self._node_changed.is_set():
                # Cleared before the rebuild: a change that lands meanwhile asks for another one.
                self._rebuild = False
                self._node_changed.clear()
                self._close_watch()
                retry_at = 0.0
            try:
                if self._watch is None:
                    if now < retry_at:
                        self._stop.wait(max(0.0, min(retry_at, next_probe) - now))
                        continue
                    self._watch = self._open_watch()
                timeout = max(1, min(WAIT_MS, int((next_probe - time.monotonic()) * 1000)))
                event = self._watch.wait(timeout)
            except NvmlCallError as exc:
                failure = exc
                self._report_error(exc)
            except Exception as exc:  # a bug or an unexpected binding error must not end health
                log.exception("health loop error")
                failure = NvmlCallError("health loop", NVML_ERROR_UNKNOWN, exc)
            else:
                backoff.reset()
                if self._failure is not None:
                    self._failure = None
                    log.info(
                        "NVML event wait works again: devices recover after the quiet period and a passing probe"
                    )
                if event is not None:
                    self.events += 1
                    try:
                        self._on_event(event)
                    except Exception:  # one bad event must not end health watching
                        log.exception("handling NVML event %s failed", event)
                continue
            if self._stop.is_set():
                break  # a wait woken by shutdown is no fault to report
            self.errors += 1
            self._close_watch()
            delay = backoff.next()
            try:
                self._on_wait_error(failure, delay)
            except Exception:  # reporting the failure failed too: still back off, never spin
                log.exception("handling an NVML event wait failure failed")
            retry_at = time.monotonic() + delay
        self._close_watch()

    def _report_error(self, exc: NvmlCallError) -> None:
        if self._on_error is not None:
            try:
                self._on_error(exc.function, exc.code)
            except Exception:  # a metrics hiccup must not end health watching
                log.exception("reporting an NVML error failed")

    def _open_watch(self) -> EventWatch:
        watch = EventWatch.open(self.nvml)
        if watch.skipped:
            log.warning(
                "no health events from: %s", ", ".join(f"{k} ({v})" for k, v in watch.skipped.items())
            )
        return watch

    def _close_watch(self) -> None:
        if self._watch is not None:
            try:
                self._watch.close()
            except Exception as exc:  # freeing a broken set must not stop the loop
                log.debug("closing the NVML event set failed: %s", exc)
            self._watch = None

    def _on_event(self, event: NvmlEvent) -> None:
        uuid = event.gpu_uuid
        if uuid is None:  # logged on the main loop, a burst summarised (supervisor/health/eventlog.py)
            self._report(Unattributed(event.event_type, event.data))
            return
        gi, ci = event.gi_id, event.ci_id
        gpu = self.node.gpu_by_uuid(uuid)
        if gpu is not None and not gpu.mig_enabled:
            # Instance ids mean nothing on a GPU not in MIG mode (NVIDIA's plugin reads them only
            # for MIG devices); NVIDIA's mock library sends 0/0 there, where a driver sends none.
            gi = ci = None
        if event.kind == "xid":
            self._report(Xid(uuid, event.data, gi, ci))
            if event.data == XID_FELL_OFF_BUS:
                # Only a lost finding is reported: a pass right after the event must not count as
                # the "probe after the last event" that transient recovery waits for.
                result = self._probe(uuid)
                if result.status in _LOST_STATUSES:
                    for finding in self._findings(result):
                        self._report(finding)
        elif event.kind in ("single-bit-ecc", "double-bit-ecc"):
            kind = EccKind.DOUBLE_BIT if event.kind == "double-bit-ecc" else EccKind.SINGLE_BIT
            self._report(Ecc(uuid, kind, gi, ci))

    def _on_wait_error(self, exc: NvmlCallError, backoff: float) -> None:
        results = [self._probe(gpu.uuid) for gpu in self.node.gpus]
        lost = sorted(r.uuid for r in results if r.status in _LOST_STATUSES)
        if lost:
            log.warning(
                "NVML event wait failed (%s); lost GPUs: %s; retrying in %gs", exc, ", ".join(lost), backoff
            )
            self._failure = None
        else:
            reason = f"NVML event wait failed: {exc}"
            if self._failure is None:
                log.error(
                    "%s: every device is marked unhealthy until NVML recovers; retrying in %gs",
                    reason,
                    backoff,
                )
            else:
                log.debug("%s again; retrying in %gs", reason, backoff)
            self._failure = reason
            self._report(WaitFailed(reason))
        for result in results:
            for finding in self._findings(result):
                self._report(finding)

    def _probe_round(self) -> None:
        try:
            if self._failure is not None:
                # Keep the event-wait condition fresh: the quiet period starts when waits work.
                self._report(WaitFailed(self._failure))
            for finding in self._probe_all():
                self._report(finding)
        except Exception:  # an unexpected probe error must not end the health thread
            log.exception("health probe round failed")

    def _probe(self, uuid: str) -> ProbeResult:
        self.probes += 1
        return self.nvml.probe(uuid)

    def _probe_all(self) -> list[Finding]:
        return [finding for gpu in self.node.gpus for finding in self._findings(self._probe(gpu.uuid))]

    def _findings(self, result: ProbeResult) -> list[Finding]:
        """What one probe result says; updates what the thread knows of lost GPUs."""
        uuid = result.uuid
        if result.status in _LOST_STATUSES:
            self._lost.add(uuid)
            detail = (
                "GPU is lost (fell off the bus)"
                if result.status == "lost"
                else "GPU is no longer visible to NVML"
            )
            return [Lost(uuid, detail)]
        out: list[Finding] = []
        if uuid in self._lost:
            self._lost.discard(uuid)
            self._rebuild = True
            log.info("GPU %s answers NVML again", uuid, extra={"device": uuid})
            out.append(Found(uuid))
        # While every device is down for a failed wait, a pass must not start its recovery.
        if not result.ok or self._failure is None:
            out.append(Probed(uuid, result.ok, "" if result.ok else (result.detail or result.status)))
        return out
