"""The DRA driver's part of the cluster side in `gpuvisor run`: `DraSide`.

What a DRA node needs from the API server, started with the cluster side (supervisor/cluster),
after the first registration with the kubelet, on threads of its own:

- the node's ResourceSlices (`supervisor.dra.publish.SlicePublisher`), published while the plans
  hold the DRA worker's plan (mode dra), withdrawn once the node runs as a device plugin (a
  draining DRA plan, or none, after this life published);
- the DRA worker's claims (`supervisor.dra.claims.ClaimFetcher`), fetched on its requests.

The main loop tells it what changed (`refresh`: the plans, the node, the health book's
conditions, whether device-plugin workers still run) and never waits on it. Slices are not
published while a device-plugin worker of this supervisor still runs (a switch from
device-plugin mode): a device it hands out in its last moments must not be offered through DRA
as well; once they are gone, the kubelet's view of what their containers still hold is read
and left out. The API-server layer is imported only in `start`, the slices' module only once
the node plans DRA.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from common.messages import ClaimReply, ClaimRequest, Json
from common.model import Node, ResourcePlan
from supervisor.dra.claims import ClaimFetcher
from supervisor.dra.earlier import EarlierPool
from supervisor.health.book import HealthBook
from supervisor.node.draplan import DRIVER
from supervisor.observe.metrics import Metrics

if TYPE_CHECKING:
    from supervisor.dra.publish import SlicePublisher
    from supervisor.dra.released import ReleasedResources
    from supervisor.dra.slices import PoolWant
    from supervisor.kube.client import KubeClient

log = logging.getLogger("gpuvisor.dra")

WAIT_FOR_DEVICE_PLUGIN = "the device plugin's workers are still stopping"


class DraSide:
    def __init__(
        self,
        *,
        node_name: str,
        plugin_dir: str,
        pod_resources_socket: str,
        metrics: Metrics,
        reply: Callable[[str, ClaimReply], None],
        earlier: EarlierPool | None = None,
    ) -> None:
        self.node_name = node_name
        self.earlier = earlier  # the pool an earlier DRA life published, withdrawn in device-plugin mode
        self.plugin_dir = plugin_dir  # the device plugins' dir: the kubelet's checkpoint, a fallback
        self.pod_resources_socket = pod_resources_socket
        self.metrics = metrics
        self.claims = ClaimFetcher(reply=reply, on_count=functools.partial(metrics.dra_call, "claim"))
        self.publisher: SlicePublisher | None = None
        self.released: ReleasedResources | None = None
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

    def hold_reason(self, mode: str) -> str:
        """Planning asks (main loop): why the device plugin may offer nothing yet ("" when it may)."""
        if self.earlier is None:
            return ""
        if mode == "dra":
            self.earlier.keep()
            return ""
        return self.earlier.pending()

    def stop(self) -> None:
        self.claims.stop()
        if self.publisher is not None:
            self.publisher.stop(join=0.5)
        if self.released is not None:
            self.released.stop()
        self.publisher, self.released = None, None

    def close(self) -> None:
        self.stop()
        self.claims.close()
        if self.earlier is not None:
            self.earlier.stop()

    # ------------------------------------------------------------------ from the main loop
    def request_claim(self, request: ClaimRequest) -> None:
        self.claims.request(request)

    def refresh(
        self,
        plans: Mapping[str, ResourcePlan],
        node: Node | None,
        book: HealthBook | None,
        device_plugin_running: bool,
    ) -> None:
        """What the pool should show now; cheap when nothing that matters changed (and nothing at
        all on a node that never planned DRA: not even the slices module is loaded)."""
        self._device_plugin_running = device_plugin_running
        plan = plans.get(DRIVER)
        if plan is None and not self._dra_planned:
            return
        self._dra_planned = True
        from supervisor.dra.slices import PoolWant

        publish = plan is not None and plan.dra is not None and not plan.dra.drain
        conditions = tuple(book.conditions()) if book is not None and publish else ()
        # What the slices show of a condition (its repeats move only last_event).
        shown = tuple((c.gpu_uuid, c.gi, c.ci, c.name, c.recovery, c.since) for c in conditions)
        key = (publish, node, shown, device_plugin_running)
        if key == self._key:
            return
        self._key = key
        self._inputs = (plans, node, book)
        if publish and node is not None:
            wait = WAIT_FOR_DEVICE_PLUGIN if device_plugin_running else ""
            self._want = PoolWant(True, node, conditions, wait)
        else:
            self._want = PoolWant(False)
        if self.publisher is not None:
            self.publisher.want(self._want)

    def device_plugin_running(self, running: bool) -> None:
        """Every loop turn: once the last device-plugin worker is gone, the slices may go out."""
        if running != self._device_plugin_running:
            self.refresh(*self._inputs, running)
            self._tell_released()

    def device_plugin_resources(self, names: frozenset[str]) -> None:
        """New plans: the resources this node would advertise as a device plugin (on a DRA node,
        those the kubelet may still show at 0 and that are removed once it lets go of them)."""
        self._device_plugin_names = names
        self._tell_released()

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
        return out
