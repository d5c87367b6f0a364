"""The DRA driver's side of `gpuvisor run`, the one DRA part the main loop wires: `DraSide`.

Its local half answers planning in device-plugin mode (`hold`): the pool an earlier life
published is withdrawn first (`supervisor.dra.earlier.EarlierPool`), and what the DRA worker's
drain still holds stays out (`supervisor.dra.drain.DraDrain`, told each change of the worker's
heartbeat part through `worker_beat`). The rest is its part of the cluster side.

What a DRA node needs from the API server, started with the cluster side (supervisor/cluster),
after the first registration with the kubelet, on threads of its own:

- the node's ResourceSlices (`supervisor.dra.publish.SlicePublisher`), published while the plans
  hold the DRA worker's plan (mode dra), withdrawn once the node runs as a device plugin (a
  draining DRA plan, or none, after this life published);
- the DRA worker's claims (`supervisor.dra.claims.ClaimFetcher`), fetched on its requests.

The MPS control daemons of MPS claims (`supervisor.mps.claimwiring.ClaimMpsWiring`) are local:
started and stopped on the DRA worker's requests, checked against its checkpoint when it changes,
and adopted (or cleaned up) once the node plans DRA, whether or not the API server is reached.

The main loop names what happened (`plans_applied`, `health_changed`, and each `turn`) and never
waits on it; the side reads the plans in force from the reconciler and asks the workers whether a
device-plugin worker still runs, and `refresh` takes those inputs (the plans, the node, the health
book's conditions, whether device-plugin workers still run). Slices are not
published while a device-plugin worker of this supervisor still runs (a switch from
device-plugin mode): a device it hands out in its last moments must not be offered through DRA
as well; once they are gone, the kubelet's view of what their containers still hold is read
and left out. The API-server layer is imported only in `start`, the slices' module only once
the node plans DRA.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from common.messages import ClaimRequest, DraBeat, Json, Message, WorkerRequest
from common.migmessages import MigClaimReply, MigClaimRequest
from common.model import Node, ResourcePlan
from common.mpsmessages import MpsClaimReply
from supervisor.config import Config
from supervisor.dra.claims import ClaimFetcher
from supervisor.dra.drain import DraDrain
from supervisor.dra.earlier import EarlierPool
from supervisor.health.book import HealthBook
from supervisor.mps.claimwiring import ClaimMpsWiring
from supervisor.mps.wiring import MpsWiring
from supervisor.node.draplan import DRIVER, DraHold
from supervisor.node.planning import device_plugin_resources
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Scheduler
from supervisor.workers.lifecycle import WorkerSet

if TYPE_CHECKING:
    from common.dracheckpoint import PreparedClaim
    from supervisor.dra.claimstatus import ClaimStatusWriter, DeviceHealthView
    from supervisor.dra.migs import Maker, MigRequests
    from supervisor.dra.publish import SlicePublisher
    from supervisor.dra.released import ReleasedResources
    from supervisor.dra.slices import PoolWant
    from supervisor.kube.client import KubeClient

log = logging.getLogger("gpuvisor.dra")

WAIT_FOR_DEVICE_PLUGIN = "the device plugin's workers are still stopping"
NO_MPS = "this supervisor runs no MPS claim daemons"
CLEAN_S = 60.0  # between two clean-ups of MIG devices no claim holds (supervisor.dra.migs)
MIG_SETTLE_S = 0.25  # a MIG change's rediscovery waits this long for the rest of its burst
NO_MIG = "this supervisor makes no MIG devices (gpuvisor.dra.migOnDemand needs NVML)"


class PlanState(Protocol):
    """The plans in force and the node and config they were made for (the reconciler's)."""

    @property
    def plans(self) -> Mapping[str, ResourcePlan]: ...

    @property
    def node(self) -> Node | None: ...

    @property
    def config(self) -> Config: ...


class DraSide:
    def __init__(
        self,
        *,
        node_name: str,
        plugin_dir: str,
        pod_resources_socket: str,
        metrics: Metrics,
        reply: Callable[[str, Message], None],
        workers: WorkerSet,
        reconciler: PlanState,
        connect: Callable[[], Any],
        timers: Scheduler,
        post: Callable[[Callable[[], None]], None],
        rediscover: Callable[[str], object],
        kubelet_plugins_dir: str = "",
        mps: MpsWiring | None = None,
        mig_maker: Callable[[], Maker | None] | None = None,
    ) -> None:
        self.node_name = node_name
        self.workers = workers  # asked whether a device-plugin worker still runs
        self.reconciler = reconciler  # the plans in force, and the node and config they were made for
        # The DRA worker's checkpoint: the prepared claims whose status shows their devices' health.
        self.checkpoint_path = os.path.join(kubelet_plugins_dir, DRIVER, "checkpoint.json")
        self.plugin_dir = plugin_dir  # the device plugins' dir: the kubelet's checkpoint, a fallback
        self.pod_resources_socket = pod_resources_socket
        self.metrics = metrics
        self._reply = reply
        self.claims = ClaimFetcher(reply=reply, on_count=functools.partial(metrics.dra_call, "claim"))
        self.mps_claims = (
            None
            if mps is None
            else ClaimMpsWiring(
                mps=mps,
                kubelet_plugins_dir=kubelet_plugins_dir,
                checkpoint_path=self.checkpoint_path,
                answer=reply,
                on_counts=metrics.set_mps_claim_daemons,
            )
        )
        # The local half of a switch to the device plugin: the pool an earlier life published,
        # withdrawn first (`connect` makes its API client: it runs before the cluster side), and
        # what the DRA worker's drain still holds.
        self.earlier = EarlierPool(
            node_name=node_name,
            plugins_dir=kubelet_plugins_dir,
            connect=connect,
            timers=timers,
            post=post,
            on_done=rediscover,
            on_count=metrics.dra_call,
        )
        self.drain = DraDrain(
            workers=workers, reconciler=reconciler, earlier=self.earlier, rediscover=rediscover
        )
        # MIG devices made on demand (supervisor.dra.migs), made when the first plan asks for them.
        self._mig_maker = mig_maker
        self._rediscover = rediscover
        self._post, self._timers = post, timers
        self.migs: MigRequests | None = None
        self._dra_pid = 0  # the DRA worker process last seen: a new one has what no claim holds cleaned up
        self._next_clean = 0.0  # ...and so does every CLEAN_S
        self.publisher: SlicePublisher | None = None
        self.released: ReleasedResources | None = None
        self.claim_status: ClaimStatusWriter | None = None
        self._claims_seen: tuple[int, int] | None = None
        self._prepared: dict[str, PreparedClaim] = {}
        self._claims_health: dict[str, DeviceHealthView] = {}
        self._device_plugin_names: frozenset[str] = frozenset()  # what the device plugin would serve
        self._want: PoolWant | None = None
        self._key: tuple[object, ...] = ()
        self._dra_planned = False  # this life planned the DRA worker: its slices are ours to keep or withdraw
        self._device_plugin_running = False
        self._inputs: tuple[Mapping[str, ResourcePlan], Node | None, HealthBook | None] = ({}, None, None)

    # ------------------------------------------------------------------ the cluster side's part
    @property
    def wanted(self) -> bool:
        """The API server is needed: the node is (or was, in this life) a DRA node."""
        return bool(self.node_name) and self._dra_planned

    def start(self, client: KubeClient) -> None:
        from supervisor.dra.publish import SlicePublisher
        from supervisor.observe.allocations import current_allocations

        self.publisher = SlicePublisher(
            client,
            node_name=self.node_name,
            allocations=functools.partial(
                current_allocations, self.plugin_dir, None, self.pod_resources_socket
            ),
            on_count=self.metrics.dra_call,
        )
        if self._want is not None:
            self.publisher.want(self._want)
        self.publisher.start()
        self.claims.start(client)
        from supervisor.dra.released import ReleasedResources

        self.released = ReleasedResources(
            client, node_name=self.node_name, plugin_dir=self.plugin_dir, on_count=self.metrics.dra_call
        )
        self.released.want(self._device_plugin_names, self._device_plugin_running)
        self.released.start()
        from supervisor.dra.claimstatus import ClaimStatusWriter

        self.claim_status = ClaimStatusWriter(client, driver=DRIVER, on_count=self.metrics.dra_call)
        self._read_claims()
        self.claim_status.want(self._prepared, self._claims_health)
        self.claim_status.start()

    def stop(self) -> None:
        self.claims.stop()
        if self.publisher is not None:
            self.publisher.stop(join=0.5)
        if self.released is not None:
            self.released.stop()
        if self.claim_status is not None:
            self.claim_status.stop()
        self.publisher, self.released, self.claim_status = None, None, None

    def close(self) -> None:
        self.stop()
        self.claims.close()
        self.earlier.stop()
        if self.mps_claims is not None:
            self.mps_claims.close()  # their daemons keep serving the claims' containers
        if self.migs is not None:
            self.migs.close()

    # ------------------------------------------------------------------ from the main loop
    def request_claim(self, request: WorkerRequest) -> None:
        if isinstance(request, ClaimRequest):
            self.claims.request(request)
        elif isinstance(request, MigClaimRequest):
            migs = self._migs()
            if migs is None:
                self._reply(request.resource, MigClaimReply(request.request_id, error=NO_MIG))
            else:
                migs.request(request)
        elif self.mps_claims is not None:
            self.mps_claims.request(request)
        else:
            self._reply(request.resource, MpsClaimReply(request.request_id, error=NO_MPS))

    def hold(self, config: Config) -> DraHold:
        """Planning asks: what DRA claims hold while the node runs as a device plugin (`DraDrain`)."""
        return self.drain.hold(config)

    def turn(self) -> None:
        """Every loop turn: once the last device-plugin worker is gone, the slices may go out; a
        new DRA worker process has the MIG devices no claim holds cleaned up."""
        self.device_plugin_running(self._device_plugin_workers())
        if self._mig_maker is None:
            return
        live = frozenset(h.pid for h in self.workers.live() if h.resource == DRIVER and h.pid)
        pid, now = max(live, default=0), time.monotonic()
        if pid and (pid != self._dra_pid or now >= self._next_clean):
            reason = f"DRA worker {pid} started" if pid != self._dra_pid else "periodic"
            self._dra_pid, self._next_clean = pid, now + CLEAN_S
            self._clean_migs(live, reason)

    def _migs(self) -> MigRequests | None:
        if self.migs is None and self._mig_maker is not None:
            from supervisor.dra.migs import MigRequests

            self.migs = MigRequests(
                maker=self._mig_maker,
                checkpoint_path=self.checkpoint_path,
                node=lambda: self.reconciler.node,
                answer=self._reply,
                rediscover=lambda trigger: self._post(lambda: self._rediscover_soon(trigger)),
                on_count=self.metrics.dra_call,
            )
        return self.migs

    def _rediscover_soon(self, trigger: str) -> None:
        """After a MIG change (main loop): a new instance at once (its XIDs are told apart from its
        GPU's only once discovery knows it); a destroy or a mode change within MIG_SETTLE_S, one
        for all of a burst, so a pod's claims unprepared one after another do not each wait."""
        if trigger == "mig-create":
            self._timers.cancel("mig-rediscover")
            self._rediscover(trigger)
        elif self._timers.when("mig-rediscover") is None:
            self._timers.call_later("mig-rediscover", MIG_SETTLE_S, lambda: self._rediscover(trigger))

    def _clean_migs(self, live: frozenset[int], reason: str) -> None:
        plan = self.reconciler.plans.get(DRIVER)
        gpus = (
            frozenset(d.gpu_uuid for d in plan.devices if d.partitionable)
            if plan is not None
            else frozenset()
        )
        migs = self._migs() if gpus else None
        if migs is not None:
            migs.reconcile(gpus, live, reason)

    def health_changed(self, book: HealthBook | None) -> None:
        """The health hub decided a change of devices: the pool's taints follow."""
        plans, node = self.reconciler.plans, self.reconciler.node
        self.refresh(plans, node, book, self._device_plugin_workers())

    def plans_applied(self, book: HealthBook | None) -> None:
        """New plans are in place: the pool shows them (or is withdrawn), and a DRA node knows
        which device-plugin resources it may tidy from the Node."""
        self.health_changed(book)
        node, config = self.reconciler.node, self.reconciler.config
        dra_node = node is not None and config.mode == "dra"
        names = device_plugin_resources(node, config) if node is not None and dra_node else frozenset()
        self.device_plugin_resources(names)

    def _device_plugin_workers(self) -> bool:
        return any(h.resource != DRIVER for h in self.workers.live())

    def refresh(
        self,
        plans: Mapping[str, ResourcePlan],
        node: Node | None,
        book: HealthBook | None,
        device_plugin_running: bool,
    ) -> None:
        """What the pool should show now; cheap when nothing that matters changed (and nothing at
        all on a node that never planned DRA: not even the slices module is loaded)."""
        if device_plugin_running != self._device_plugin_running:
            self._device_plugin_running = device_plugin_running
            self._tell_released()  # whichever call sees the last device-plugin worker go first
        plan = plans.get(DRIVER)
        if plan is None and not self._dra_planned:
            return
        if not self._dra_planned and self.mps_claims is not None:
            self.mps_claims.dra_planned()
        self._dra_planned = True
        self._claims_health_now(node, book)
        from supervisor.dra.slices import PoolWant

        publish = plan is not None and plan.dra is not None and not plan.dra.drain
        conditions = tuple(book.conditions()) if book is not None and publish else ()
        # What the slices show of a condition (its repeats move only last_event).
        shown = tuple((c.gpu_uuid, c.gi, c.ci, c.name, c.recovery, c.since) for c in conditions)
        dra = plan.dra if plan is not None else None
        memory = (
            (dra.memory_step, dra.memory_default, dra.memory_minimum) if dra and dra.memory_step else None
        )
        partitions = dra is not None and dra.mig_on_demand
        key = (publish, node, shown, device_plugin_running, memory, partitions)
        if key == self._key:
            return
        self._key = key
        self._inputs = (plans, node, book)
        if publish and node is not None:
            wait = WAIT_FOR_DEVICE_PLUGIN if device_plugin_running else ""
            self._want = PoolWant(True, node, conditions, wait, memory_sharing=memory, partitions=partitions)
        else:
            self._want = PoolWant(False)
        if self.publisher is not None:
            self.publisher.want(self._want)

    def device_plugin_running(self, running: bool) -> None:
        """Every loop turn: once the last device-plugin worker is gone, the slices may go out."""
        if running != self._device_plugin_running:
            self.refresh(*self._inputs, running)

    def device_plugin_resources(self, names: frozenset[str]) -> None:
        """New plans: the resources this node would advertise as a device plugin (on a DRA node,
        those the kubelet may still show at 0 and that are removed once it lets go of them)."""
        self._device_plugin_names = names
        self._tell_released()

    # ------------------------------------------------------------------ the claims' status
    def worker_beat(self, beat: DraBeat) -> None:
        """The DRA worker's part of its heartbeat changed: the drain may plan again, and when its
        checkpoint changed the claims are read again."""
        self.drain.worker_beat(beat)
        seen = (beat.prepared_claims, beat.claims_changes)
        if seen == self._claims_seen:
            return
        self._claims_seen = seen
        if self.mps_claims is not None:
            self.mps_claims.checkpoint_changed()
        self._read_claims()
        if self.claim_status is not None:
            self.claim_status.want(self._prepared, self._claims_health)

    def _read_claims(self) -> None:
        from common.dracheckpoint import CheckpointError, read_claims

        try:
            self._prepared = read_claims(self.checkpoint_path)
        except CheckpointError as exc:  # the DRA worker moves such a file aside itself
            log.warning(
                "the DRA checkpoint %s cannot be read (%s): no claim status written",
                self.checkpoint_path,
                exc,
            )
            self._prepared = {}

    def _claims_health_now(self, node: Node | None, book: HealthBook | None) -> None:
        """The health of the DRA devices, for the claims' status (written only when it changed)."""
        if node is None or book is None or DRIVER not in book.resources:
            return
        from supervisor.dra.claimstatus import DeviceHealthView
        from supervisor.dra.slices import unhealthy_devices

        gravest = unhealthy_devices(node, book.conditions())
        health = {
            device: DeviceHealthView(healthy, reason, since, (gravest.get(device) or ("",))[0])
            for device, (healthy, reason, since) in book.health_for(DRIVER).items()
        }
        if health == self._claims_health:
            return
        self._claims_health = health
        if self.claim_status is not None:
            self.claim_status.want(self._prepared, health)

    def kubelet_restarted(self) -> None:
        if self.released is not None:
            self.released.kubelet_restarted()

    def _tell_released(self) -> None:
        if self.released is not None:
            self.released.want(self._device_plugin_names, self._device_plugin_running)

    def status(self) -> dict[str, Json]:
        out: dict[str, Json] = {"claims": self.claims.status()}
        out["slices"] = self.publisher.status() if self.publisher is not None else None
        out["released"] = self.released.status() if self.released is not None else None
        out["claim_status"] = self.claim_status.status() if self.claim_status is not None else None
        out["mps_claims"] = self.mps_claims.status() if self.mps_claims is not None else None
        out["migs"] = self.migs.status() if self.migs is not None else None
        return out
