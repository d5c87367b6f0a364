"""MPS control daemons tied to health: a resource's GPUs are Unhealthy while its daemon is down.

`MpsDaemons` (supervisor/mps/daemons.py) runs the daemons on a thread of its own and reports each up or
down flip. This part turns those reports into the health condition `mps:<resource>` on the
resource's GPUs (Unhealthy from before its worker starts until its daemon is up), on the main
loop, and keeps the conditions in step when a reload changes which resources use MPS.

Each `MpsDaemons` instance reports under its own generation: a report that a replaced instance
posted before it stopped must not clear the condition its successor holds. The instance (its
module, and its thread, which ticks twice a second) is made when a plan first shares a resource
with MPS: a node without MPS never loads or runs it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from common.messages import Json
from common.model import ResourcePlan
from supervisor.config import Config
from supervisor.health.hub import HealthHub
from supervisor.mps.layout import MpsError

if TYPE_CHECKING:
    from supervisor.mps.daemons import MpsDaemons

log = logging.getLogger("gpuvisor.supervisor")

# The settings behind the daemons' supervision: a change restarts the daemons.
MPS_SETTINGS = ("mps_control_binary", "mps_exclusive_process", "driver_root")


def mps_settings(config: Config) -> tuple[object, ...]:
    return tuple(getattr(config, name) for name in MPS_SETTINGS)


def uses_mps(plans: Mapping[str, ResourcePlan]) -> bool:
    return any(p.sharing == "mps" for p in plans.values())


class MpsWiring:
    def __init__(
        self,
        *,
        config: Config,
        environ: Mapping[str, str],
        nvml_module: Any,
        hub: HealthHub,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.environ = dict(environ)
        self.nvml_module = nvml_module
        self.hub = hub
        self.post = post
        self.config = config
        self.settings = mps_settings(config)
        self.generation = 1  # the daemons of the running MPS settings report under it
        self.plans: dict[str, ResourcePlan] = {}
        self._daemons: MpsDaemons | None = None  # made when a plan first uses MPS
        self.started = False

    @property
    def daemons(self) -> MpsDaemons:
        """The daemon supervisor of the running MPS settings (made, and its module loaded, on first use)."""
        if self._daemons is None:
            generation = self.generation

            def report(resource: str, up: bool, reason: str) -> None:
                self.post(lambda: self._on_change(resource, up, reason, generation))

            self._daemons = self._make(self.config, report)
        return self._daemons

    def _make(self, config: Config, report: Callable[[str, bool, str], None]) -> MpsDaemons:
        from supervisor.mps.daemons import MpsDaemons

        return MpsDaemons(
            report,
            binary=config.mps_control_binary,
            driver_root=config.driver_root,
            environ=self.environ,
            nvml_module=self.nvml_module,
            exclusive_process=config.mps_exclusive_process,
        )

    def validate(self, config: Config, plans: Mapping[str, ResourcePlan]) -> None:
        """Can `config`'s MPS settings run these plans? Raises MpsError; changes nothing."""
        if not uses_mps(plans):
            return
        if mps_settings(config) == self.settings:
            self.daemons.validate(plans)
            return
        self._make(config, lambda resource, up, reason: None).validate(plans)

    # ------------------------------------------------------------------ on the main loop
    def start(self, plans: Mapping[str, ResourcePlan]) -> None:
        """NVML is up: daemons for the first plans. Raises MpsError for what cannot work."""
        self.started = True
        self.plans = dict(plans)
        if not uses_mps(plans):
            return
        self.daemons.set_plans(plans)
        # Before any worker starts, so its first snapshot already has these devices Unhealthy.
        for resource, plan in plans.items():
            if plan.sharing == "mps":
                self.hub.mark_external(_gpus(plan), f"mps:{resource}", "MPS control daemon not started yet")
        self.daemons.start_thread()

    def adopt(self, config: Config) -> None:
        """A taken config: new daemons (restarted, if running) when its MPS settings changed."""
        settings = mps_settings(config)
        if settings == self.settings:
            return
        self.config, self.settings = config, settings
        self.generation += 1
        old, self._daemons = self._daemons, None
        if old is None:
            return  # none running: the next plan that uses MPS makes them with these settings
        new = self.daemons
        if self.started:
            log.info("MPS settings changed: restarting the MPS control daemons")
            old.shutdown()
            new.start_thread()  # the plans follow at once, in `apply`

    def apply(self, plans: Mapping[str, ResourcePlan]) -> None:
        """New plans for the daemons, and the `mps:<resource>` conditions to match them."""
        old, self.plans = self.plans, dict(plans)
        if self._daemons is None:
            if not uses_mps(plans):
                return  # MPS was never used and is not now: no daemon, no condition
            if self.started:
                self.daemons.start_thread()
        try:
            self.daemons.set_plans(plans)
        except MpsError as exc:  # validated before the reload was taken: only a race gets here
            log.error("MPS daemons keep their old plans: %s", exc)
        holding = self.hub.external_holders()
        for resource in sorted({r for r, p in old.items() if p.sharing == "mps"} - set(plans)):
            self.hub.clear_external(f"mps:{resource}")
        for resource, plan in sorted(plans.items()):
            name = f"mps:{resource}"
            if plan.sharing != "mps":
                self.hub.clear_external(name)
                continue
            gpus = _gpus(plan)
            if not self.daemons.is_up(resource):
                # Mark the new GPUs first, then let go of the ones that left: no device flaps.
                self.hub.mark_external(gpus, name, "MPS control daemon not up yet")
            left = holding.get(name, set()) - gpus
            if left:
                self.hub.clear_external(name, left)

    def _on_change(self, resource: str, up: bool, reason: str, generation: int) -> None:
        if generation != self.generation or self._daemons is None:
            return  # from an MpsDaemons that a reload replaced
        if up and not self.daemons.is_up(resource):
            return  # stale: the daemon went down again since
        if up:
            self.hub.clear_external(f"mps:{resource}")
            return
        plan = self.plans.get(resource)
        if plan is not None and plan.sharing == "mps":
            text = reason if "MPS control daemon" in reason else f"MPS control daemon down: {reason}"
            self.hub.mark_external(_gpus(plan), f"mps:{resource}", text)

    def shutdown(self) -> None:
        if self._daemons is not None:
            self._daemons.shutdown()

    # ------------------------------------------------------------------ views
    def not_ready(self) -> str:
        """Why MPS keeps the node from being ready, or "" when every daemon is up."""
        if self._daemons is None or self._daemons.all_up():
            return ""
        down = [f"{r}: {s.reason}" for r, s in sorted(self.daemons.status().items()) if not s.up]
        return "MPS control daemon not up: " + ("; ".join(down) or "starting")

    def status(self) -> dict[str, Json]:
        if self._daemons is None:
            return {}
        return {r: dict(dataclasses.asdict(st)) for r, st in sorted(self._daemons.status().items())}


def _gpus(plan: ResourcePlan) -> set[str]:
    return {d.gpu_uuid for d in plan.devices}
