"""What the supervisor should run now: start, reload and rediscovery, each made into an outcome.

A reload (SIGHUP, the config file changing, the `reload` command) re-reads the config and the
device set; a rediscovery (every --rediscovery-interval seconds, and the simulator's `sim mig`)
re-reads the device set with the wanted config. Each plans the node and makes one `Outcome`
(supervisor/desired/reconcile.py): a `Desired` state, `Deferred` (NVML is not up yet),
`Unchanged`, or a `Refusal` with its reason. The replanner keeps none of it: it hands the
outcome to the reconciler, the one owner of the desired state, and reads the running state
only through it.

Settings a running supervisor cannot take over (the sockets, the run dir, the simulator, the
metrics address, the log setup) keep their running values, with a line saying a restart is
needed. The config file is watched through its directory (supervisor/host/watches.py); a burst
of events is debounced and a change is judged by the file's content.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from typing import Protocol

from common.exitcodes import EXIT_CONFIG_ERROR
from common.messages import Json
from common.model import Node
from supervisor.config import Config, ConfigError, load_config
from supervisor.desired.discovery import NvmlLink, StartupError
from supervisor.desired.reconcile import Deferred, Desired, Outcome, Refusal, Unchanged
from supervisor.health.policy import HealthPolicy, PolicyError
from supervisor.mps.layout import MpsError
from supervisor.mps.wiring import MpsWiring
from supervisor.node.planning import PlanningError, plan_resources
from supervisor.scheduler import Scheduler

log = logging.getLogger("gpuvisor.supervisor")

CONFIG_DEBOUNCE_S = 0.3  # a ConfigMap update is a burst of create/rename/delete events
RESTART_ONLY = (
    "kubelet_socket",
    "run_dir",
    "simulate",
    "metrics_address",
    "log_format",
    "log_level",
    "fail_on_init_error",
)


def file_fingerprint(path: str) -> str:
    """What the config file holds now (through any symlinks), cheap to compare."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


class Keeper(Protocol):
    """The owner of the desired state (supervisor.desired.reconcile.Reconciler)."""

    @property
    def config(self) -> Config: ...

    @property
    def node(self) -> Node | None: ...

    @property
    def pending(self) -> Desired | None: ...

    @property
    def wanted_config(self) -> Config: ...

    def take(self, outcome: Outcome) -> bool: ...


class Replanner:
    def __init__(
        self,
        *,
        argv_flags: argparse.Namespace | None,
        environ: Mapping[str, str],
        nvml: NvmlLink,
        keeper: Keeper,
        mps: MpsWiring,
        timers: Scheduler,
    ) -> None:
        self.argv_flags = argv_flags
        self.environ = environ
        self.nvml = nvml
        self.keeper = keeper
        self.mps = mps
        self.timers = timers
        self.reloads = 0
        self.rediscoveries = 0
        config_file = keeper.config.config_file
        self.config_fp = file_fingerprint(config_file) if config_file else ""

    # ------------------------------------------------------------------ triggers
    def start(self, node: Node) -> bool:
        """The first plans, for the node NVML just showed, handed to the keeper (rediscovery armed
        as after any new config): a config that cannot be planned ends the process as a bad
        config does at start (exit 78), rather than running with nothing."""
        config = self.keeper.config
        try:
            plans = plan_resources(node, config)
            self.mps.validate(config, plans)
        except (PlanningError, MpsError) as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        log.info(
            "discovered %d GPUs; resources: %s",
            len(node.gpus),
            ", ".join(f"{r} ({len(p.devices)})" for r, p in plans.items()) or "none",
        )
        return self._hand_over(Desired(config, node, plans, "start"))

    def reload(self, trigger: str, fingerprint: str | None = None) -> bool:
        """Re-read the config and the device set; apply what changed. False if refused or pending.

        `fingerprint`: the config file's, when the caller has just taken it.
        """
        self.reloads += 1
        return self._hand_over(self._reload(trigger, fingerprint))

    def rediscover(self, trigger: str) -> bool:
        """Re-read the device set with the wanted config; cheap and silent when nothing changed."""
        if not self.nvml.up:
            return False
        self.rediscoveries += 1
        return self._hand_over(self._replan(self.keeper.wanted_config, trigger, "rediscovery"))

    def schedule_rediscovery(self, config: Config) -> None:
        interval = config.rediscovery_interval
        if interval > 0 and self.nvml.up:
            self.timers.call_later("rediscovery", interval, lambda: self.rediscover("periodic rediscovery"))
        else:
            self.timers.cancel("rediscovery")

    def config_event(self) -> None:
        """Something changed at the config file: look at it shortly. The first event of a burst
        arms the check and later ones do not push it back, so a steady trickle of events can
        never postpone it forever; an event after the check arms a new one."""
        if self.timers.when("config-check") is None:
            self.timers.call_later("config-check", CONFIG_DEBOUNCE_S, self._check_config_file)

    # ------------------------------------------------------------------ internals
    def _hand_over(self, outcome: Outcome) -> bool:
        """The keeper takes the outcome. A new config (taken or waiting) re-arms the rediscovery
        timer at its interval, even if taking it failed; a refusal leaves the timer as it is."""
        try:
            return self.keeper.take(outcome)
        finally:
            if isinstance(outcome, (Desired, Deferred)):
                self.schedule_rediscovery(self.keeper.wanted_config)

    def _reload(self, trigger: str, fingerprint: str | None) -> Outcome:
        running = self.keeper.config
        if running.config_file:
            # What is read now has been seen, taken or refused: the file watch need not repeat it.
            self.config_fp = fingerprint or file_fingerprint(running.config_file)
        try:
            config = self._live_part(load_config(self.argv_flags, self.environ))
            HealthPolicy.from_config(config)  # refused here, not half-applied later
        except (ConfigError, PolicyError) as exc:
            return Refusal("reload", str(exc), trigger)
        for notice in config.notices:  # inputs taken as NVIDIA takes them, worth saying
            log.warning("%s", notice, extra={"trigger": trigger})
        if not self.nvml.up:
            return Deferred(config, trigger)
        return self._replan(config, trigger, "reload")

    def _check_config_file(self) -> None:
        path = self.keeper.config.config_file
        fingerprint = file_fingerprint(path)
        if fingerprint != self.config_fp:  # else an event that changed nothing we read
            self.reload("config file changed", fingerprint)

    def _replan(self, config: Config, trigger: str, what: str) -> Outcome:
        running, node_now = self.keeper.config, self.keeper.node
        # Armed first: whatever happens below, periodic rediscovery goes on.
        self.schedule_rediscovery(self.keeper.wanted_config)
        try:
            node = self.nvml.rediscover(node_now)
        except Exception as exc:  # NVML trouble during rediscovery: keep what runs
            return Refusal(what, f"discovery failed: {exc}", trigger)
        if node == node_now and config == running and self.keeper.pending is None:
            return Unchanged(what, trigger)  # the common case of a periodic rediscovery
        try:
            plans = plan_resources(node, config)
            self.mps.validate(config, plans)
        except (PlanningError, MpsError) as exc:
            return Refusal(what, str(exc), trigger)
        return Desired(config, node, plans, trigger, what)

    def _live_part(self, config: Config) -> Config:
        """`config` with the settings a running supervisor cannot change held at their values."""
        running = self.keeper.config
        held = {
            name: getattr(running, name)
            for name in RESTART_ONLY
            if getattr(config, name) != getattr(running, name)
        }
        for name in held:
            log.warning("setting %s changed; it takes effect at the next restart", name)
        return dataclasses.replace(config, **held) if held else config

    def status(self) -> dict[str, Json]:
        return {"reloads": self.reloads, "rediscoveries": self.rediscoveries}
