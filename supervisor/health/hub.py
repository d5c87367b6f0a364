"""Health on the supervisor's side of the wire: the book, the NVML monitor, and the publisher.

The `HealthBook` is the truth about every device's health; the `HealthMonitor` thread turns NVML
events and probes into findings (supervisor/health/findings.py); this hub applies them to the
book on the main loop and publishes every change batch on the PUB socket (`health.sock`), with
beacons that let a worker notice a lost last delta, and answers workers' snapshot requests.
Each NVML event is one log line with the policy's decision (supervisor/health/eventlog.py,
bursts summarised); each other change batch is one log line; both are counted in the metrics,
and the device gauges follow them.

Until NVML is up there is no book: snapshots are refused and nothing is published.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from common.messages import MAX_MESSAGE_BYTES, HealthBeacon, HealthSnapshot, Json, encode
from common.model import Node, ResourcePlan
from supervisor.health.book import ChangeBatch, HealthBook
from supervisor.health.eventlog import EventLog, HealthEvent, event_line
from supervisor.health.findings import Ecc, Finding, Unattributed, Xid, apply_finding
from supervisor.health.monitor import HealthMonitor
from supervisor.health.policy import HealthAction, HealthPolicy
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Clock

# A beacon reveals a lost last delta, so one follows each change soon; while nothing changes there
# is nothing new to reveal, and the gap doubles up to BEACON_IDLE_S (an idle node's workers are
# not woken every 2 s for the same number).
BEACON_S = 2.0
BEACON_IDLE_S = 30.0

log = logging.getLogger("gpuvisor.supervisor")


def batch_line(batch: ChangeBatch) -> str:
    """The log line of a change batch that no NVML event's line covers (probes, recoveries, ...)."""
    healthy = all(c.healthy for c in batch.changes)
    return "health {}: {} on {} -> {} device(s) {} in {}{}".format(
        batch.cause,
        f"XID {batch.xid}" if batch.xid is not None else "condition",
        batch.gpu_uuid or "all GPUs",
        len(batch.changes),
        "Healthy" if healthy else "Unhealthy",
        ", ".join(batch.resources),
        f" (action {batch.action.value})" if batch.action is not None else "",
    )


class HealthHub:
    def __init__(
        self,
        *,
        endpoint: str,
        policy: HealthPolicy,
        metrics: Metrics,
        clock: Clock,
        epoch: str,
        post: Callable[[Callable[[], None]], None],
        listeners: tuple[Callable[[ChangeBatch, str], None], ...] = (),
    ) -> None:
        self.endpoint = endpoint
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.epoch = epoch  # one supervisor life: workers never mix two lives' sequences
        self.post = post  # runs a call on the main loop (from the monitor thread)
        self.book: HealthBook | None = None
        self.node: Node | None = None
        self.monitor: HealthMonitor | None = None
        self.pub: zmq.Socket[bytes] | None = None
        self.events = EventLog()
        # Told of every batch that changed a device's health, with its log line's words (the
        # cluster side writes them on the Node); called on the main loop, after the workers.
        self.listeners = list(listeners)
        self.on_change: Callable[[], None] = lambda: None  # a delta went out: bring the beacon forward
        self._beacon_gap = BEACON_S
        self._beaconed_seq: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        pub.bind(self.endpoint)
        self.pub = pub

    def start(
        self, *, nvml_module: Any, node: Node, plans: Mapping[str, ResourcePlan], probe_interval: float
    ) -> None:
        """NVML is up: the book for these plans, one synchronous probe of every GPU (devices
        already bad are Unhealthy in the first list the kubelet sees), then the monitor thread."""
        self.node = node
        self.book = HealthBook(plans, self.policy, self.clock.time())
        self.monitor = HealthMonitor(
            nvml_module,
            node,
            self.policy,
            self._report,
            probe_interval=probe_interval,
            on_error=self.metrics.nvml_error,
        )
        for finding in self.monitor.initial_probe():
            self.apply(finding)
        self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        self.events.flush(self.clock.monotonic(), everything=True)  # no held count is lost
        if self.pub is not None:
            self.pub.close(0)
            self.pub = None

    # ------------------------------------------------------------------ changes
    def _report(self, finding: Finding) -> None:
        """The monitor thread's finding: applied on the main loop, the book's one writer."""
        self.post(functools.partial(self.apply, finding))

    def apply(self, finding: Finding) -> None:
        """Apply one finding of the monitor to the book (on the main loop), log it and publish."""
        if self.book is None:
            return
        batch = apply_finding(self.book, finding, self.clock.time())
        event = self._event(finding, batch)
        line = event_line(event, len(batch), batch.resources) if event is not None else None
        self.publish(batch, line=line)  # the workers first, the log after
        if event is not None:  # an NVML event: its own line says what was decided
            self.events.record(event, len(batch), batch.resources, self.clock.monotonic())

    def _event(self, finding: Finding, batch: ChangeBatch) -> HealthEvent | None:
        """The finding as its log line names it, when it is an NVML event: the action is the one
        the book took (`batch.action`), the words the policy's."""
        field: tuple[str, object]
        advised = False  # kept in service, but the catalog asks for something (a reset when convenient)
        match finding:
            case Xid(gpu_uuid, xid, gi, ci):
                what, field = f"XID {xid}", ("xid", xid)
                decision = self.policy.explain_xid(xid, batch.action)
                advised = bool(self.policy.advice_xid(xid, batch.action))
            case Ecc(gpu_uuid, kind, gi, ci):
                what, field = f"{kind.value} ECC error", ("ecc", kind.value)
                decision = self.policy.explain_ecc(kind, batch.action)
            case Unattributed(event_type, data):
                what = f"NVML event type 0x{event_type:x} (data {data})"
                return HealthEvent(
                    "",
                    None,
                    None,
                    what,
                    "ignored: NVML named no GPU it can tell",
                    False,
                    odd=True,
                )
            case _:
                return None
        action = batch.action or HealthAction.IGNORE  # the book names the action of every XID and ECC event
        unhealthy = action is not HealthAction.IGNORE
        return HealthEvent(
            gpu_uuid, gi, ci, what, decision, unhealthy, fields=(field, ("action", action.value)), odd=advised
        )

    def tick(self) -> None:
        """Transient conditions whose quiet period is over recover; held event lines are summarised."""
        self.events.flush(self.clock.monotonic())
        if self.book is not None:
            self.publish(self.book.tick(self.clock.time()))

    def publish(self, batch: ChangeBatch, *, line: str | None = None, decision: bool = True) -> None:
        """Log one change batch as one line (`line`: its event's, which the event log writes),
        count it, publish it to the workers, then tell the listeners when it is a health decision
        (not `decision`: new plans, whose devices just appear)."""
        # Ignored XIDs count too (an empty batch that names its XID).
        self.metrics.health_batch(((c.resource, c.device_id, c.healthy) for c in batch.changes), batch.xid)
        if not batch:
            return
        if line is None:
            line = batch_line(batch)
            log.log(
                logging.INFO if all(c.healthy for c in batch.changes) else logging.WARNING,
                "%s",
                line,
                extra={
                    "device": batch.gpu_uuid,
                    "xid": batch.xid,
                    "action": batch.action.value if batch.action else None,
                },
            )
        if self.pub is not None:
            self.pub.send_multipart(encode(batch.to_delta(self.epoch), seq=batch.seq))
        self.on_change()
        self.update_gauges(batch.resources)
        if decision:
            for listener in self.listeners:
                listener(batch, line)

    def beacon(self) -> float:
        """Publish the current sequence; the seconds until the next beacon: BEACON_S after a
        change, doubling while the sequence stays the same, BEACON_IDLE_S at most."""
        if self.book is None:
            return self._beacon_gap
        seq = self.book.seq
        if self.pub is not None:
            self.pub.send_multipart(encode(HealthBeacon(seq=seq, epoch=self.epoch), seq=seq))
        if seq == self._beaconed_seq:
            self._beacon_gap = min(self._beacon_gap * 2, BEACON_IDLE_S)
        else:
            self._beacon_gap = BEACON_S
        self._beaconed_seq = seq
        return self._beacon_gap

    def quiet(self) -> bool:
        """Nothing here comes due by time alone: no condition held (none waits to recover) and
        no event line waits to be summarised."""
        return (self.book is None or self.book.clear()) and self.events.empty()

    def next_beacon_within(self) -> float:
        """After a change: the longest the next beacon may wait (and the gap starts again)."""
        self._beacon_gap = BEACON_S
        return BEACON_S

    def snapshot(self, resource: str) -> HealthSnapshot | None:
        """The health of a planned resource's devices, or None without a book or plan."""
        if self.book is None or resource not in self.book.resources:
            return None
        seq, devices = self.book.snapshot(resource)
        return HealthSnapshot(seq=seq, resource=resource, devices=tuple(devices), epoch=self.epoch)

    def set_plans(self, plans: Mapping[str, ResourcePlan]) -> None:
        """The plans changed; the caller updates the device gauges once it has applied them all."""
        if self.book is not None:
            self.publish(self.book.set_plans(plans, self.clock.time()), decision=False)

    def set_node(self, node: Node) -> None:
        if node == self.node:
            return
        self.node = node
        if self.monitor is not None:
            self.monitor.set_node(node)

    def set_policy(self, policy: HealthPolicy) -> None:
        """A reloaded `gpuvisor.health` (or DP_*_HEALTHCHECKS): new events and recoveries follow it."""
        self.policy = policy
        if self.book is not None:
            self.book.set_policy(policy)
        if self.monitor is not None:
            self.monitor.policy = policy
            if policy.checks_enabled and not self.monitor.running:
                with contextlib.suppress(RuntimeError):  # a thread runs once; it was never started
                    self.monitor.start()
        log.info("health policy changed: %s", policy.describe())

    def set_probe_interval(self, seconds: float) -> None:
        if self.monitor is not None:
            self.monitor.probe_interval = seconds

    def gpu_reset(self, uuid: str) -> None:
        """A GPU was reset: clear its until-reset conditions (MIG UUIDs map to their GPU)."""
        if self.book is None or self.node is None:
            return
        gpu_uuid = uuid
        for gpu in self.node.gpus:
            if any(m.uuid == uuid for m in gpu.mig_devices):
                gpu_uuid = gpu.uuid
        self.publish(self.book.mark_reset(gpu_uuid, self.clock.time()))

    def mark_external(self, gpu_uuids: set[str], name: str, reason: str) -> None:
        """An outside condition (an MPS daemon down) makes these GPUs' devices Unhealthy."""
        if self.book is not None:
            self.publish(self.book.mark_external(gpu_uuids, name, reason, self.clock.time()))

    def clear_external(self, name: str, gpu_uuids: set[str] | None = None) -> None:
        if self.book is not None:
            self.publish(self.book.clear_external(name, self.clock.time(), gpu_uuids))

    def external_holders(self) -> dict[str, set[str]]:
        """GPU UUIDs under each outside condition, by condition name."""
        holding: dict[str, set[str]] = {}
        for cond in self.book.conditions() if self.book is not None else []:
            holding.setdefault(cond.name, set()).add(cond.gpu_uuid)
        return holding

    def update_gauges(self, resources: tuple[str, ...] | None = None) -> None:
        if self.book is None:
            return
        planned = self.book.resources
        for resource in planned if resources is None else resources:
            if resource in planned:
                _seq, devices = self.book.snapshot(resource)
                healthy = sum(1 for d in devices if d.healthy)
                self.metrics.set_devices(resource, healthy, len(devices) - healthy)

    # ------------------------------------------------------------------ views
    def status(self) -> dict[str, Json]:
        """The hub's keys of the status document: the policy, each device's health, the
        conditions and the event log."""
        return {
            "health_policy": self.policy.describe(),
            "resources": self.resources_view(),
            "conditions": self.conditions_view(),
            "health_events": dict(self.events.status()),
        }

    def resources_view(self) -> dict[str, Json]:
        out: dict[str, Json] = {}
        for resource in self.book.resources if self.book is not None else ():
            _seq, devices = self.book.snapshot(resource) if self.book is not None else (0, [])
            out[resource] = [
                {
                    "id": d.device_id,
                    "health": "Healthy" if d.healthy else "Unhealthy",
                    "reason": d.reason,
                    "since": d.since,
                }
                for d in devices
            ]
        return out

    def conditions_view(self) -> list[Json]:
        return [
            {
                "gpu": c.gpu_uuid,
                "gpu_instance": c.gi,
                "compute_instance": c.ci,
                "name": c.name,
                "recovery": c.recovery.value,
                "reason": c.reason,
                "since": c.since,
                "last_event": c.last_event,
            }
            for c in (self.book.conditions() if self.book is not None else [])
        ]
