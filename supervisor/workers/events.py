"""What the supervisor does with what its workers and the kubelet dir tell it.

The control endpoint (supervisor/control/endpoint.py) hands over typed messages from checked senders;
the kubelet watch (supervisor/host/watches.py) reports kubelet.sock created and files deleted.
Here they become worker-lifecycle facts (heartbeats, registrations, sockets), registration
metrics, health snapshots for workers, plan catch-ups, and re-registration requests; and each
lifecycle transition what it means for the rest (a dead worker's route and sockets go).

Registration metrics carry the trigger the supervisor knows, not only the worker's words: a
worker's first registration is a start, and after a kubelet restart a worker may first report
its cancelled stream; the supervisor saw the kubelet restart and knows which worker life has
registered before, so it names the trigger.
"""

from __future__ import annotations

import logging
import os

# The constant-time comparison hmac.compare_digest makes (hmac takes OpenSSL's copy of it where it has
# one); importing hmac would load OpenSSL, about 3.5 MB, for nothing else.
from _operator import _compare_digest
from collections.abc import Callable, Mapping
from typing import Protocol

from common.messages import (
    ClaimReply,
    DraBeat,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Message,
    Reregister,
    StatusReport,
    WorkerRequest,
)
from common.migmessages import MigClaimReply, MigClaimRequest
from common.model import ResourcePlan
from common.mpsmessages import MpsClaimReply, MpsClaimRequest
from common.socketnames import KUBELET_SOCKET_NAME, SOCKET_PREFIX
from supervisor.control.endpoint import Binding
from supervisor.health.hub import HealthHub
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Clock
from supervisor.workers.lifecycle import StateListener, WorkerHandle, WorkerSet, WState

log = logging.getLogger("gpuvisor.supervisor")


class Routes(Protocol):
    """The control endpoint's routes to the workers (supervisor.control.endpoint.ControlEndpoint)."""

    def tell(self, resource: str, message: Message) -> bool:
        """Send to the resource's current worker; False when it has not said hello yet."""
        ...

    def unbind(self, resource: str) -> None:
        """The resource's worker is gone or replaced: its route speaks for nobody any more."""
        ...


class Sockets(Protocol):
    """The one rule for the sockets workers leave (supervisor.host.rundir.WorkerSockets)."""

    def worker_gone(self, resource: str, tag: str) -> None:
        """The worker of this spawn tag is dead: its dead sockets go."""
        ...


class PlanOwner(Protocol):
    """What worker events need of the plans' owner (supervisor.desired.reconcile.Reconciler)."""

    @property
    def plans(self) -> Mapping[str, ResourcePlan]: ...

    def worker_started(self, resource: str) -> None:
        """A new worker process reads the plan file as it is now."""
        ...

    def catch_up(self, resource: str) -> None:
        """Send the current plan to the resource's worker if it has an older one."""
        ...


def metered(metrics: Metrics) -> StateListener:
    """A lifecycle listener that keeps the worker state gauge and restart counters."""

    def listener(handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        metrics.worker_transition(
            handle.resource,
            new.value,
            wanted=handle.wanted,
            restart_causes=handle.restart_causes,
            reason=reason,
        )

    return listener


class WorkerEvents:
    def __init__(
        self,
        *,
        workers: WorkerSet,
        reconciler: PlanOwner,
        control: Routes,
        hub: HealthHub,
        metrics: Metrics,
        clock: Clock,
        sockets: Sockets,
        claims: Callable[[WorkerRequest], None] | None = None,
        on_dra: tuple[Callable[[DraBeat], None], ...] = (),
    ) -> None:
        self.workers = workers
        self.reconciler = reconciler
        self.control = control
        self.hub = hub
        self.metrics = metrics
        self.clock = clock
        self.sockets = sockets
        # The DRA worker's claim requests go to the API-server side (supervisor/dra/claims.py);
        # without it each is answered at once with why not.
        self.claims = claims or self._no_claims
        self.on_dra = on_dra  # told each change of the DRA worker's part of its heartbeat
        self._metered = metered(metrics)
        self._registered_life: dict[str, int] = {}  # resource -> pid of the worker life that registered
        self._kubelet_restarted: set[str] = (
            set()
        )  # resources whose next registration follows a kubelet restart

    # ------------------------------------------------------------------ ControlHandlers
    def accept_hello(self, hello: Hello) -> Binding | None:
        handle = self.workers.running(hello.resource)
        if handle is None or handle.pid != hello.pid or not handle.secret:
            return None
        if not _compare_digest(handle.secret.encode(), hello.secret.encode()):
            return None
        return Binding(hello.resource, hello.pid)

    def on_bound(self, binding: Binding) -> None:
        self.reconciler.catch_up(binding.resource)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        handle = self.workers.heartbeat(
            beat.resource, beat.pid, beat.registered, beat.socket_path, self.clock.monotonic()
        )
        if handle is None:
            return
        if beat.stats:  # empty: unchanged since the worker's last report
            handle.stats = dict(beat.stats)
            self.metrics.worker_stats(beat.resource, beat.stats, pid=beat.pid)
            if beat.registered and beat.stats.get("gauge:streams", 0) >= 1:
                self.workers.served(beat.resource, beat.pid)
        if beat.dra != handle.dra:  # every beat carries it: only a change is news
            handle.dra = beat.dra
            if beat.dra is not None:
                for listener in self.on_dra:
                    listener(beat.dra)

    def on_status_report(self, report: StatusReport) -> None:
        log.debug("worker %s: %s (%s)", report.resource, report.event, report.detail)
        handle = self.workers.running(report.resource)
        if handle is None:
            return
        self._count_registration(handle, report.event, report.detail)
        handle.registration = f"{report.event} ({report.detail})" if report.detail else report.event
        if report.event == "registered":
            self.workers.heartbeat(
                report.resource, handle.pid, True, handle.socket_path, self.clock.monotonic()
            )

    def on_claim_request(self, request: WorkerRequest) -> None:
        self.claims(request)

    def _no_claims(self, request: WorkerRequest) -> None:
        if isinstance(request, MigClaimRequest):
            reply: Message = MigClaimReply(request.request_id, error="this supervisor makes no MIG devices")
        elif isinstance(request, MpsClaimRequest):
            reply = MpsClaimReply(request.request_id, error="this supervisor runs no MPS claim daemons")
        else:
            reply = ClaimReply(request.request_id, error="this supervisor fetches no ResourceClaims")
        self.control.tell(request.resource, reply)

    def snapshot_for(self, resource: str) -> HealthSnapshot | None:
        # A resource a reload just removed has no snapshot: its worker is being stopped.
        return self.hub.snapshot(resource) if resource in self.reconciler.plans else None

    # ------------------------------------------------------------------ lifecycle listener
    def on_worker_state(self, handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        """Every worker lifecycle transition (already logged by change_state). The metrics see it
        first, before routes and registration records are forgotten."""
        self._metered(handle, old, new, reason)
        if new is WState.STARTING:
            # A new process: its predecessor's route speaks for nobody now, and it reads the
            # plan file as it is now.
            self._unbind(handle.resource)
            self.reconciler.worker_started(handle.resource)
        elif new in (WState.BACKOFF, WState.STOPPED, WState.FATAL):
            self._unbind(handle.resource)  # nobody is there to talk to
            if new is WState.STOPPED and not handle.wanted:
                self._registered_life.pop(handle.resource, None)
                self._kubelet_restarted.discard(handle.resource)
            self.sockets.worker_gone(handle.resource, handle.socket_tag)  # SIGKILL leaves them

    def _unbind(self, resource: str) -> None:
        self.control.unbind(resource)

    def _count_registration(self, handle: WorkerHandle, event: str, detail: str) -> None:
        """Feed a worker's registration report to the metrics with the trigger the supervisor knows."""
        resource = handle.resource
        first = self._registered_life.get(resource) != handle.pid
        if event == "registering":
            if first:
                detail = "start"
            elif resource in self._kubelet_restarted:
                detail = "kubelet restart"
        elif event == "registered":
            if not first and resource in self._kubelet_restarted:
                self.metrics.registration_report(resource, "registering", "kubelet restart")
            self._kubelet_restarted.discard(resource)
            self._registered_life[resource] = handle.pid
        self.metrics.registration_report(resource, event, detail)

    # ------------------------------------------------------------------ the kubelet dir
    def kubelet_created(self) -> None:
        """kubelet.sock appeared (a kubelet restart): every worker registers again."""
        self._kubelet_restarted.update(self.workers.by_resource())
        reason = "kubelet.sock created"
        log.info(
            "kubelet restarted (%s): every worker re-registers", reason, extra={"trigger": "kubelet-restart"}
        )
        for resource in self.workers.by_resource():
            self.tell(resource, Reregister(reason=reason))

    def file_deleted(self, name: str) -> None:
        if name == KUBELET_SOCKET_NAME:
            # The kubelet is going (or restarting): the registrations that follow are its doing.
            self._kubelet_restarted.update(self.workers.by_resource())
            return
        if not name.startswith(SOCKET_PREFIX):
            return
        for resource, handle in self.workers.by_resource().items():
            if handle.socket_path and os.path.basename(handle.socket_path) == name:
                self.tell(resource, Reregister(reason=f"socket {name} deleted"))

    def tell(self, resource: str, message: Reregister) -> bool:
        return self.control.tell(resource, message)
