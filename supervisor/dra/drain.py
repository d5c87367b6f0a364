"""The DRA worker's drain, as planning in device-plugin mode needs it: `DraDrain`.

A switch from DRA to the device plugin turns the DRA worker's plan to draining (in place): the
worker refuses new claims, and the kubelet unprepares the prepared ones as their pods end. The
device plugin must not get a device that a claim may still hold, so planning asks `hold()`
(the replanner's `dra_hold`): while a DRA worker runs that has not confirmed the planned drain
in its heartbeat (`DraBeat.draining`), the hold is not settled; once it has, or once none runs,
the hold is the devices its checkpoint lists, which is final then (a draining worker prepares
nothing). `worker_beat` plans again when the confirmation comes and each time the draining
worker's count of prepared claims moves, so a device goes to the device plugin as soon as its
last claim is unprepared.

The other wait of a start in device-plugin mode is asked here too: the pool an earlier DRA life
published (supervisor/dra/earlier.py) is withdrawn before the device plugin offers anything.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Protocol

from common.messages import DraBeat
from common.model import ResourcePlan
from supervisor.config import Config
from supervisor.dra.earlier import EarlierPool
from supervisor.node.draplan import DRIVER, DraHold
from supervisor.node.planning import NO_HOLD
from supervisor.workers.lifecycle import WorkerSet

log = logging.getLogger("gpuvisor.dra")


class Plans(Protocol):
    """The plans in force (supervisor.desired.reconcile.Reconciler owns them)."""

    @property
    def plans(self) -> Mapping[str, ResourcePlan]: ...


class DraDrain:
    def __init__(
        self,
        *,
        workers: WorkerSet,
        reconciler: Plans,
        earlier: EarlierPool,
        rediscover: Callable[[str], object],
    ) -> None:
        self.workers = workers
        self.reconciler = reconciler
        self.earlier = earlier
        self.rediscover = rediscover  # the main loop: plan again (why)
        self._planned_for: int | None = None  # the prepared claims the last plan-again was for

    def drain_planned(self) -> bool:
        """The plans in force hold the DRA worker's plan, and it drains."""
        plan = self.reconciler.plans.get(DRIVER)
        return plan is not None and plan.dra is not None and plan.dra.drain

    def hold(self, config: Config) -> DraHold:
        """What DRA claims hold while the node runs as a device plugin (planning's input): not
        settled while a DRA worker runs that has not confirmed a planned drain; else the devices
        its checkpoint lists. In mode dra, nothing (and an earlier life's pool is kept)."""
        if config.mode == "dra":
            self.earlier.keep()
            return NO_HOLD
        waiting = self.earlier.pending()  # the first ask in device-plugin mode starts the withdrawal
        handle = self.workers.running(DRIVER)
        confirmed = handle is not None and handle.dra is not None and handle.dra.draining
        if handle is not None and not (self.drain_planned() and confirmed):
            return DraHold(settled=False)
        from common.dracheckpoint import CheckpointError, held_devices  # loaded at planning, not at start

        directory = os.path.join(config.kubelet_plugins_dir, DRIVER)  # the DRA worker's: its checkpoint
        try:
            return DraHold(devices=held_devices(directory), waiting=waiting)
        except CheckpointError as exc:
            # The DRA worker moves such a file aside and starts empty: nothing it lists is held.
            log.warning(
                "the DRA checkpoint in %s cannot be read (%s): no device counts as held", directory, exc
            )
            return DraHold(waiting=waiting)

    def worker_beat(self, beat: DraBeat) -> None:
        """The DRA worker's part of its heartbeat changed: a draining worker confirmed the drain,
        or a claim was unprepared during it: plan again, so the device plugin gets what no
        prepared claim holds any more."""
        if not (beat.draining and self.drain_planned()):
            self._planned_for = None  # the next drain plans again on its confirmation
            return
        if beat.prepared_claims != self._planned_for:
            self._planned_for = beat.prepared_claims
            self.rediscover(f"the draining DRA worker holds {beat.prepared_claims} prepared claim(s)")
