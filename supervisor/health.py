"""The NVML side of health: one thread that waits on the event set and probes the GPUs.

The thread never touches the health book: for every finding it posts a small function to the
supervisor's main loop, which applies it to the book and publishes what changed. So the book
has one writer and needs no lock.

- Events: XID critical errors and single/double-bit ECC, waited on 5 s at a time (as NVIDIA's
  plugin). A wait error is never spun on: the watch is dropped, the GPUs are probed to find out
  which are lost (precise, instead of NVIDIA's "everything is unhealthy"), and the next attempt
  waits with exponential backoff. Only when no probe explains the failure are all devices
  marked unhealthy.
- Probes: every `probe_interval` a few cheap NVML queries per GPU catch what sends no event
  (a GPU that fell off the bus, retired pages or remapped rows pending a reset: NVIDIA #267),
  and give the passing probe that transient recovery needs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from common.model import Node
from common.nvml import EventWatch, Nvml, NvmlCallError, NvmlEvent, ProbeResult
from supervisor.health_policy import HealthPolicy
from supervisor.healthbook import ChangeBatch, HealthBook

log = logging.getLogger("gpuvisor.health")

WAIT_MS = 5000
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0

Apply = Callable[[HealthBook, float], list[ChangeBatch]]


class HealthMonitor:
    def __init__(
        self,
        module: Any,
        node: Node,
        policy: HealthPolicy,
        post: Callable[[Callable[[], None]], None],
        apply: Callable[[Apply], None],
        probe_interval: float = 10.0,
    ) -> None:
        self.nvml = Nvml(module)
        self.node = node
        self.policy = policy
        self._post = post
        self._apply = apply
        self.probe_interval = probe_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._lost: set[str] = set()
        self.errors = 0  # NVML errors seen by the loop, for metrics
        self.events = 0

    # ------------------------------------------------------------------ public
    def set_node(self, node: Node) -> None:
        self.node = node  # read by the thread at the next probe: a plain reference swap

    def initial_probe(self, book: HealthBook) -> list[ChangeBatch]:
        """Probe every GPU once, synchronously, before any worker starts (NVIDIA #111)."""
        return [batch for fn in self._probe_all() for batch in fn(book, time.time()) if batch]

    def start(self) -> None:
        if not self.policy.checks_enabled:
            log.warning("health checks are disabled (DP_DISABLE_HEALTHCHECKS): devices stay Healthy")
            return
        self._thread.start()

    def stop(self) -> None:
        # An NVML event wait cannot be interrupted and lasts up to 5 s: the thread is a daemon and
        # is not waited for long, so a stop signal still ends the process promptly.
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=0.2)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        watch: EventWatch | None = None
        backoff = BACKOFF_START_S
        next_probe = time.monotonic() + self.probe_interval
        while not self._stop.is_set():
            try:
                if watch is None:
                    watch = self.nvml.watch_events()
                    if watch.skipped:
                        log.warning("no health events from: %s", ", ".join(f"{k} ({v})" for k, v in watch.skipped.items()))
                timeout = max(1, min(WAIT_MS, int((next_probe - time.monotonic()) * 1000)))
                event = watch.wait(timeout)
                backoff = BACKOFF_START_S
                if event is not None:
                    self.events += 1
                    self._on_event(event)
            except NvmlCallError as exc:
                self.errors += 1
                self._on_wait_error(exc)
                if watch is not None:
                    watch.close()
                    watch = None
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            if time.monotonic() >= next_probe:
                for fn in self._probe_all():
                    self._apply(fn)
                next_probe = time.monotonic() + self.probe_interval
        if watch is not None:
            watch.close()

    def _on_event(self, event: NvmlEvent) -> None:
        uuid = event.gpu_uuid
        if uuid is None:
            log.warning("an NVML event (type 0x%x, data %d) named no known GPU: ignored", event.event_type, event.data)
            return
        if event.kind == "xid":
            xid = event.data

            def apply_xid(book: HealthBook, now: float) -> list[ChangeBatch]:
                return [book.apply_xid(uuid, xid, event.gi_id, event.ci_id, now=now)]

            self._apply(apply_xid)
        elif event.kind in ("single-bit-ecc", "double-bit-ecc"):
            kind = "double" if event.kind == "double-bit-ecc" else "single"

            def apply_ecc(book: HealthBook, now: float) -> list[ChangeBatch]:
                return [book.apply_ecc(uuid, kind, event.gi_id, event.ci_id, now=now)]

            self._apply(apply_ecc)

    def _on_wait_error(self, exc: NvmlCallError) -> None:
        findings = self._probe_all()
        if self._lost or exc.gpu_lost:
            log.warning("NVML event wait failed (%s); lost GPUs: %s", exc, ", ".join(sorted(self._lost)) or "none found")
            for fn in findings:
                self._apply(fn)
            if self._lost:
                return
        log.error("NVML event wait failed (%s): every device is marked unhealthy until NVML recovers", exc)
        reason = f"NVML event wait failed: {exc}"

        def all_bad(book: HealthBook, now: float) -> list[ChangeBatch]:
            return [book.mark_all_unhealthy(reason, now)]

        self._apply(all_bad)
        for fn in findings:
            self._apply(fn)

    def _probe_all(self) -> list[Apply]:
        out: list[Apply] = []
        for gpu in self.node.gpus:
            out.append(self._probe_one(gpu.uuid, self.nvml.probe(gpu.uuid)))
        return out

    def _probe_one(self, uuid: str, result: ProbeResult) -> Apply:
        if result.status == "lost" or result.status == "not-found":
            first = uuid not in self._lost
            self._lost.add(uuid)
            detail = "GPU is lost (fell off the bus)" if result.status == "lost" else "GPU is no longer visible to NVML"

            def lost(book: HealthBook, now: float) -> list[ChangeBatch]:
                if first:
                    return [book.mark_lost(uuid, now, detail)]
                return [book.probe_result(uuid, False, detail, now)]

            return lost
        was_lost = uuid in self._lost
        self._lost.discard(uuid)
        ok = result.ok
        reason = "" if ok else (result.detail or result.status)

        def probed(book: HealthBook, now: float) -> list[ChangeBatch]:
            found = [book.mark_found(uuid, now)] if was_lost else []
            return [*found, book.probe_result(uuid, ok, reason, now)]

        return probed
