"""What the supervisor should run now: reload and rediscovery, handed to the reconciler.

A reload (SIGHUP, the config file changing, the `reload` command) re-reads the config and the
device set; a rediscovery (every --rediscovery-interval seconds, and the simulator's `sim mig`)
re-reads the device set with the wanted config. Both plan the node and hand the result to the
`Reconciler`, which applies it or keeps it pending. What cannot be taken at all (a config that
does not load, plans the node cannot have, MPS that cannot run) is refused: the running config
keeps serving, one log line says why, status shows it until a valid config arrives, and a
metric counts it. A periodic rediscovery repeating the same refusal logs it once.

Settings a running supervisor cannot take over (the sockets, the run dir, the simulator, the
metrics address, the log setup) keep their running values, with a line saying a restart is
needed. The config file is watched through its directory (supervisor/kubeletwatch.py); a burst
of events is debounced and a change is judged by the file's content.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping

from common.config import Config, ConfigError, load_config
from common.messages import Json
from common.model import Node
from common.planning import PlanningError, plan_resources
from supervisor.discovery import NvmlLink
from supervisor.health_policy import HealthPolicy, PolicyError
from supervisor.metrics import Metrics
from supervisor.mps import MpsError
from supervisor.mpswiring import MpsWiring
from supervisor.reconcile import Desired, Reconciler, Refusal
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


def health_policy_for(config: Config) -> HealthPolicy:
    """The health policy a config asks for; raises PolicyError for what the policy refuses."""
    return HealthPolicy.from_settings(
        disable_env=",".join(config.disable_healthchecks) or None,
        enable_env=",".join(config.enable_healthchecks) or None,
        xid_actions=config.health.xid_actions(),
        quiet_seconds=config.health.transient_quiet_seconds,
    )


def file_fingerprint(path: str) -> str:
    """What the config file holds now (through any symlinks), cheap to compare."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


class Replanner:
    def __init__(
        self,
        argv_flags: argparse.Namespace | None,
        environ: Mapping[str, str],
        nvml: NvmlLink,
        reconciler: Reconciler,
        mps: MpsWiring,
        metrics: Metrics,
        timers: Scheduler,
        current: Callable[[], tuple[Config, Node | None]],
        adopt_config: Callable[[Config], None],
    ) -> None:
        self.argv_flags = argv_flags
        self.environ = environ
        self.nvml = nvml
        self.reconciler = reconciler
        self.mps = mps
        self.metrics = metrics
        self.timers = timers
        self.current = current
        self.adopt_config = adopt_config
        self.reloads = 0
        self.rediscoveries = 0
        config, _node = current()
        self.config_fp = file_fingerprint(config.config_file) if config.config_file else ""

    # ------------------------------------------------------------------ triggers
    def reload(self, trigger: str, fingerprint: str | None = None) -> bool:
        """Re-read the config and the device set; apply what changed. False if refused or pending.

        `fingerprint`: the config file's, when the caller has just taken it.
        """
        self.reloads += 1
        running, _node = self.current()
        if running.config_file:
            # What is read now has been seen, taken or refused: the file watch need not repeat it.
            self.config_fp = fingerprint or file_fingerprint(running.config_file)
        try:
            config = self._live_part(load_config(self.argv_flags, self.environ))
            health_policy_for(config)  # refused here, not half-applied later
        except (ConfigError, PolicyError) as exc:
            return self._refuse(trigger, "reload", str(exc))
        self.reconciler.refusal = None  # a valid config arrived: the last refusal is history
        for notice in config.notices:  # inputs taken as NVIDIA takes them, worth saying
            log.warning("%s", notice, extra={"trigger": trigger})
        if not self.nvml.up:
            self.adopt_config(config)
            log.info("reload (%s): config taken; it applies once NVML is up", trigger)
            return True
        return self._replan(config, trigger, "reload")

    def rediscover(self, trigger: str) -> bool:
        """Re-read the device set with the wanted config; cheap and silent when nothing changed."""
        if not self.nvml.up:
            return False
        self.rediscoveries += 1
        pending = self.reconciler.pending
        return self._replan(
            pending.config if pending is not None else self.current()[0], trigger, "rediscovery"
        )

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
    def _check_config_file(self) -> None:
        path = self.current()[0].config_file
        fingerprint = file_fingerprint(path)
        if fingerprint != self.config_fp:  # else an event that changed nothing we read
            self.reload("config file changed", fingerprint)

    def _replan(self, config: Config, trigger: str, what: str) -> bool:
        running, node_now = self.current()
        self.schedule_rediscovery(running)
        quiet = what == "rediscovery"
        try:
            node = self.nvml.rediscover(node_now)
        except Exception as exc:  # NVML trouble during rediscovery: keep what runs
            return self._refuse(trigger, what, f"discovery failed: {exc}", quiet)
        if node == node_now and config == running and self.reconciler.pending is None:
            self._rediscovered(what)
            return True  # the common case of a periodic rediscovery: nothing to do
        try:
            plans = plan_resources(node, config)
            self.mps.validate(config, plans)
        except (PlanningError, MpsError) as exc:
            return self._refuse(trigger, what, str(exc), quiet)
        self._rediscovered(what)
        return self.reconciler.want(Desired(config, node, plans, trigger))

    def _rediscovered(self, what: str) -> None:
        """A rediscovery went through: an earlier rediscovery's refusal (NVML trouble, a layout
        that could not be planned) is history and leaves status."""
        refusal = self.reconciler.refusal
        if what == "rediscovery" and refusal is not None and refusal.what == "rediscovery":
            self.reconciler.refusal = None

    def _refuse(self, trigger: str, what: str, text: str, quiet: bool = False) -> bool:
        """One clear line per refusal; a periodic trigger repeating the same refusal logs once.

        A refused reload also drops a reload still pending: the config file has moved on from it,
        so it must not be applied later behind the user's back.
        """
        last = self.reconciler.refusal
        if what == "reload":
            self.reconciler.drop_pending("a newer config was refused")
        if not (quiet and last is not None and (last.what, last.text) == (what, text)):
            log.error(
                "%s (%s) refused, keeping the running config: %s",
                what,
                trigger,
                text,
                extra={"trigger": trigger},
            )
        self.reconciler.refuse(Refusal(what, text, trigger))
        self.metrics.reload_refused(what)
        return False

    def _live_part(self, config: Config) -> Config:
        """`config` with the settings a running supervisor cannot change held at their values."""
        running = self.current()[0]
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
