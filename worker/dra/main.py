"""The DRA worker process: the kubelet plugin of the DRA driver `gpu.nvidia.com`.

Spawned like every worker (the same command line, by the zygote or by exec; `worker.main.main`
hands over when the plan carries DRA settings), restarted by the same lifecycle, and fed health
the same way, through the same link (worker.link): it says hello with its spawn secret, asks for
the health snapshot of its devices, then applies only newer deltas (the clone pattern,
worker.healthcopy), and beats. Only once the snapshot is in does it serve (`worker.dra.sockets`:
the service socket, then the registration socket), so the kubelet's first health report and the
first prepare already know which devices are unhealthy. Without `--control` it runs alone, every
device healthy (the tests of the worker).

What it tells the supervisor: registration states as `StatusReport`s ("registering" once its
sockets are up, "registered" when the kubelet's plugin watcher confirmed, "retrying", "stopped"),
and in each heartbeat `registered`, its figures and its `DraBeat`. `gauge:streams` is 1 while the
kubelet has confirmed the registration: for readiness and the restart rules that confirmation
stands where a device plugin's ListAndWatch stream stands (a DRA kubelet holds no stream unless
its ResourceHealthStatus gate is on; those streams are `gauge:health_streams`). The `DraBeat`
counts the checkpoint's claims (`prepared_claims`) and its writes that added or dropped one
(`claims_changes`; a beat goes at once: the supervisor reads the claims again for their
ResourceClaim status), and says `draining` once a draining plan is in force (the supervisor
plans the device plugin's devices on that confirmation); the figures repeat them for the metrics.
The figures also carry each claim's prepare and unprepare, counted, timed and in flight, and the
prepared devices by type, as NVIDIA's plugin counts them (worker.dra.figures: `gpuvisor_dra_*`).

Claims come from the supervisor (a `ClaimRequest` over the DEALER, answered by a `ClaimReply`:
the supervisor holds the node's API client), or from `--dra-claims-dir` when the plan names one.
An MPS claim's control daemon is the supervisor's too (`mps`, worker.dra.mps.SupervisorMps: an
`MpsClaimRequest` answered by an `MpsClaimReply`); so is a MIG device made on demand (`mig`,
worker.dra.migdemand.SupervisorMig: a `MigClaimRequest` answered by a `MigClaimReply`); without
`--control` there is neither (`mps` and `mig` None).

A plan update with new devices (a MIG change, a reload) waits for their health snapshot and then
swaps the device list in place; prepared claims keep what they were answered. A draining plan (a
switch to device-plugin mode) is taken the same way, in place, as are gpuvisor.dra.memorySharing
(the slices' policy; a claim's share comes in its allocation) and gpuvisor.dra.migOnDemand. A plan update that changes the
DRA settings themselves (sockets' directories, pool, claims dir) ends the process cleanly, so
that the supervisor restarts it on the new plan file with fresh sockets.

Threads: the main thread owns the ZeroMQ sockets; the registrar thread and gRPC's pool reach it
only through the mailbox (a claim request too).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Iterable
from concurrent import futures
from types import FrameType

from common.draapi import SERVICE_SOCKET_NAME, registration_socket_name
from common.draapi.rpc import dra_v1_handler, dra_v1beta1_handler, health_handler, registration_handler
from common.dracheckpoint import Checkpoint, CheckpointError
from common.exitcodes import EXIT_FAILURE
from common.mailbox import Mailbox
from common.messages import (
    ClaimReply,
    ClaimRequest,
    DeviceHealth,
    DraBeat,
    HealthSnapshot,
    Message,
    PlanUpdate,
)
from common.migmessages import MigClaimReply, MigClaimRequest
from common.model import DraSettings, ResourcePlan
from common.mpsmessages import MpsClaimReply, MpsClaimRequest
from worker.dra.claims import ClaimSource, DirectoryClaimSource, SupervisorClaimSource
from worker.dra.claimspec import ClaimSpecs
from worker.dra.figures import DraFigures
from worker.dra.migdemand import SupervisorMig
from worker.dra.mps import SupervisorMps
from worker.dra.prepare import Preparer
from worker.dra.services import DraPluginService, HealthService, RegistrationService
from worker.dra.sharing import TimeSlicer
from worker.dra.sockets import RPC_THREADS, Endpoint, WatcherRegistration
from worker.healthboard import Health, HealthBoard
from worker.healthcopy import HealthApplier
from worker.link import Beat, Link, plan_of_update
from worker.process import parent_ok
from worker.registrar import Registrar, RegState
from worker.stats import Stats

log = logging.getLogger("gpuvisor.worker")

STANDALONE_TICK_S = 1.0


def same_settings(a: ResourcePlan, b: ResourcePlan) -> bool:
    """Do two plans need the same sockets and claim source? (A drain is taken in place, and so is
        the memory-sharing policy: the slices use it; a claim's share comes in its allocation; and MIG on
    demand: the plan's devices say which are made at prepare.)"""
    if a.dra is None or b.dra is None:
        return a.dra is b.dra
    return _sockets_and_source(a.dra) == _sockets_and_source(b.dra)


def _sockets_and_source(dra: DraSettings) -> DraSettings:
    return dataclasses.replace(
        dra, drain=False, memory_step=0, memory_default=0, memory_minimum=0, mig_on_demand=False
    )


class DraWorker:
    def __init__(self, args: argparse.Namespace, plan: ResourcePlan, secret: str = "") -> None:
        if plan.dra is None:
            raise ValueError(f"plan {plan.resource} has no DRA settings")
        dra = plan.dra
        self.args = args
        self.plan = plan
        self.stats = Stats()
        self.mailbox = Mailbox(log)
        self.board = HealthBoard(plan)
        self.checkpoint = Checkpoint(dra.plugin_dir)
        self.checkpoint.load()  # raises CheckpointError: unreadable (the caller says so, exits)
        self.claims: SupervisorClaimSource | None = None
        source: ClaimSource | None = None
        if dra.claims_dir:
            source = DirectoryClaimSource(dra.claims_dir)
        elif args.control:  # the supervisor fetches them from the API server
            self.claims = SupervisorClaimSource(plan.resource, self._ask_claim)
            source = self.claims
        # An MPS claim's daemon: the supervisor runs it (worker/dra/mps.py says why).
        self.mps = SupervisorMps(plan.resource, self._ask_mps) if args.control else None
        # A MIG device made on demand: the supervisor makes it (worker/dra/migdemand.py).
        self.mig = SupervisorMig(plan.resource, self._ask_mig) if args.control else None
        self.preparer = Preparer(
            plan,
            source,
            self.checkpoint,
            health=self.board.health_of,
            count=self.stats.count,
            on_change=self._beat_soon,  # the supervisor reads the claims again (their status)
            mps=self.mps,
            timeslicer=TimeSlicer.on_node(plan.allocate.driver_root),
            specs=ClaimSpecs(plan, dra.cdi_spec_dir) if dra.cdi_spec_dir else None,
            mig=self.mig,
        )
        # NVIDIA's per-claim request figures (gpuvisor_dra_*), in every heartbeat's figures.
        self.figures = DraFigures(dra.pool)
        self.stats.include(self.figures.snapshot)
        self.service = DraPluginService(self.preparer, observe=self.stats.observe, figures=self.figures)
        self.health = HealthService(self.board)
        self.health.on_streams_changed = self._beat_soon
        service_path = os.path.join(dra.plugin_dir, SERVICE_SOCKET_NAME)
        self.registration = RegistrationService(dra.driver, service_path, self._on_notify)
        executor = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="rpc")
        self.sockets = WatcherRegistration(
            Endpoint(
                service_path,
                (
                    dra_v1_handler(self.service.v1),
                    dra_v1beta1_handler(self.service.v1beta1),
                    health_handler(self.health),
                ),
                executor,
            ),
            Endpoint(
                os.path.join(dra.registry_dir, registration_socket_name(dra.driver)),
                (registration_handler(self.registration),),
                executor,
            ),
        )
        self.registrar = Registrar(self.sockets, on_state=self._on_reg_state)
        self.applier = HealthApplier(d.id for d in plan.devices)
        self.link = Link(self, args, plan.resource, secret, self.applier, self.stats, self.mailbox)
        self.stopping = False
        self.exit_code = 0
        self._pending_plan: ResourcePlan | None = None

    # -------------------------------------------------------------- cross-thread plumbing
    def _on_notify(self, registered: bool, error: str) -> None:
        self.registrar.notified(registered, error)

    def _on_reg_state(self, state: RegState, detail: str) -> None:
        self.stats.count(f"registrations_{state.value}")

        def tell() -> None:
            event = {RegState.REFUSED: "retrying", RegState.STARTING: "starting"}.get(state, state.value)
            self.link.report(event, detail)
            self.link.beat_soon()  # the supervisor's view follows the kubelet's at once

        self.mailbox.post(tell)

    def _ask_claim(self, request: ClaimRequest) -> None:
        """A gRPC thread's claim request: sent by the main thread, the DEALER's owner."""
        self.mailbox.post(lambda: self.link.send(request))

    def _ask_mps(self, request: MpsClaimRequest) -> None:
        self.mailbox.post(lambda: self.link.send(request))

    def _ask_mig(self, request: MigClaimRequest) -> None:
        self.mailbox.post(lambda: self.link.send(request))

    def _beat_soon(self) -> None:
        self.mailbox.post(self.link.beat_soon)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    # -------------------------------------------------------------- run
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGQUIT, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.args.supervisor_pid else self._on_signal)
        signal.set_wakeup_fd(self.mailbox.wakeup_fd, warn_on_full_buffer=False)
        log.info(
            "DRA worker for driver %s, pool %s: %d device(s), %d prepared claim(s) in %s",
            self.plan.resource,
            self.plan.dra.pool if self.plan.dra else "",
            len(self.plan.devices),
            len(self.checkpoint),
            self.checkpoint.path,
        )
        try:
            if not self.args.control:
                return self._run_alone()
            return self._run_supervised()
        finally:
            self.health.stop()
            self.registrar.stop()
            self.board.close()
            held = self.preparer.prepared()
            if held:
                log.warning(
                    "%d prepared claim(s) stay in the checkpoint %s: a DRA worker started later unprepares "
                    "them; while none runs (a node switched to mode device-plugin) the kubelet cannot",
                    held,
                    self.checkpoint.path,
                )

    def _run_alone(self) -> int:
        import select

        self.board.set_health(((d.id, Health(True)) for d in self.plan.devices), replace=True)
        self.registrar.start()
        while self.running() and parent_ok(self.args):
            select.select([self.mailbox.fileno()], [], [], STANDALONE_TICK_S)
            self.mailbox.drain()
        return EXIT_FAILURE if self.registrar.failed is not None else self.exit_code

    def _run_supervised(self) -> int:
        self.link.open()
        self.link.run()
        return EXIT_FAILURE if self.registrar.failed is not None else self.exit_code

    # -------------------------------------------------------------- the link's hooks (worker.link.Peer)
    def running(self) -> bool:
        return not self.stopping and self.registrar.failed is None

    def stop(self) -> None:
        self.stopping = True

    def snapshot_in(self) -> None:
        self.registrar.start()  # serve only once the health snapshot is on the board

    def reregister(self, reason: str) -> None:
        self.registrar.trigger(reason)  # the kubelet restarted: our sockets must still be there

    def plan_update(self, message: PlanUpdate) -> None:
        self._update_plan(message.plan_json, message.snapshot)

    def other_message(self, message: Message) -> None:
        if isinstance(message, ClaimReply) and self.claims is not None:
            self.claims.answer(message)
        elif isinstance(message, MpsClaimReply) and self.mps is not None:
            self.mps.answer(message)
        elif isinstance(message, MigClaimReply) and self.mig is not None:
            self.mig.answer(message)

    def closing(self, started: bool) -> None:
        if started:
            self.link.report("stopped", "worker stopping")

    def health_applied(self, records: Iterable[DeviceHealth], replace: bool) -> None:
        items = [(r.device_id, Health(r.healthy, r.reason, r.since)) for r in records]
        plan = self._pending_plan
        if plan is not None and replace:
            # The new device list and the snapshot that covers it go in as one change.
            self.board.set_plan(plan, items)
            was_draining = self.preparer.draining
            self.preparer.set_plan(plan)
            self.plan, self._pending_plan = plan, None
            log.info("plan updated in place: %d devices; unhealthy now: %s", len(plan.devices), self._bad())
            if self.preparer.draining != was_draining:
                log.info(
                    "%s: %d prepared claim(s) kept",
                    "draining (the node runs as a device plugin): new claims are refused, prepared ones "
                    "unprepare"
                    if self.preparer.draining
                    else "taking new claims again",
                    self.preparer.prepared(),
                )
                self.link.beat_soon()  # the supervisor plans on the drain at once
        elif self.board.set_health(items, replace=replace):
            log.info("device health changed; unhealthy now: %s", self._bad())

    def beat(self) -> Beat:
        registered = self.registrar.state is RegState.REGISTERED
        dra = DraBeat(
            draining=self.preparer.draining,
            prepared_claims=self.preparer.prepared(),
            claims_changes=self.preparer.changes,
        )
        self.figures.set_prepared(self.preparer.prepared_devices())
        return Beat(
            state=self.registrar.state.value,
            registered=registered,
            socket_path=self.sockets.service.path,
            gauges={
                "streams": 1 if registered else 0,
                "health_streams": self.health.streams,
                # The DRA part's figures again, for the metrics (gpuvisor_worker_<name>) alone:
                # the supervisor decides on `dra`.
                "prepared_claims": dra.prepared_claims,
                "claims_changes": dra.claims_changes,
                "draining": 1 if dra.draining else 0,
            },
            dra=dra,
        )

    def _bad(self) -> str:
        return ", ".join(self.board.unhealthy()) or "none"

    def _update_plan(self, plan_json: str, snapshot: HealthSnapshot | None) -> None:
        plan = plan_of_update(plan_json, self.plan.resource)
        if plan is None:
            return
        if not same_settings(plan, self.plan):
            log.info(
                "the DRA settings changed (%s -> %s): stopping, to be started again on them",
                self.plan.dra,
                plan.dra,
            )
            self.stopping = True
            return
        self._pending_plan = plan
        self.link.follow((d.id for d in plan.devices), snapshot)  # the plan goes in with its health


def run_dra(
    args: argparse.Namespace, plan: ResourcePlan, secret: str, make: Callable[..., DraWorker] = DraWorker
) -> int:
    """Run the DRA worker for `plan` (called by worker.main.main once the plan is read)."""
    try:
        worker = make(args, plan, secret)
    except CheckpointError as exc:
        # Not a config error: a checkpoint dir that cannot be read now may be readable on the next
        # start, which the supervisor's restart rules retry with backoff.
        log.error("cannot start the DRA worker: %s", exc)
        return EXIT_FAILURE
    return worker.run()
