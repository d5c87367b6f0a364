"""What the supervisor should run now: start, reload and rediscovery, each made into an outcome.

A reload (SIGHUP, the config file changing, the `reload` command, a new value of the node's
config label) re-reads the config and the device set; a rediscovery (every
--rediscovery-interval seconds, and the simulator's `sim mig`) re-reads the device set with the
wanted config. Each plans the node and makes one `Outcome`
(supervisor/desired/reconcile.py): a `Desired` state, `Deferred` (NVML is not up yet),
`Unchanged`, or a `Refusal` with its reason. The replanner keeps none of it: it hands the
outcome to the reconciler, the one owner of the desired state, and reads the running state
only through it.

Settings a running supervisor cannot take over (the sockets, the run dir, the simulator, the
metrics address, the log setup) keep their running values, with a line saying a restart is
needed. The config file is watched through its directory (supervisor/host/watches.py); a burst
of events is debounced and a change is judged by the file's content.

With the named configs of `--config-file-srcdir`, which file is the config follows NVIDIA's
config-manager (supervisor/config/named.py): the node's label as the cluster side last read it
(`node_label`), else the default config, else the fallbacks. A new label value is a reload like
SIGHUP's; one that names no config is refused and the running config stays, as it stays on a
node where NVIDIA's config-manager fails. A change in the directory re-applies when the chosen
file's content (or the choice itself) changed. Until the label is read the choice is made as for
a node without one (or with the label an earlier run in this run dir kept: `recall_label`); if
that fails, nothing is planned until the label chooses a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Mapping

from common.exitcodes import EXIT_CONFIG_ERROR
from common.messages import Json
from common.model import Node
from supervisor.config import Config, ConfigError, load_config
from supervisor.config.fingerprint import fingerprint
from supervisor.config.named import ChoiceError, choose_config
from supervisor.desired.discovery import NvmlSession, StartupError
from supervisor.desired.reconcile import Deferred, Desired, Outcome, Reconciler, Refusal, Unchanged
from supervisor.health.policy import HealthPolicy, PolicyError
from supervisor.mps.layout import MpsError
from supervisor.mps.wiring import MpsWiring
from supervisor.node.draplan import DraHold
from supervisor.node.planning import NO_HOLD, PlanningError, plan_resources
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
    "node_health",
    "pod_resources_socket",
)


def file_fingerprint(path: str) -> str:
    """What the config file holds now (through any symlinks), cheap to compare."""
    try:
        return fingerprint(path)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


class Replanner:
    def __init__(
        self,
        *,
        argv_flags: argparse.Namespace | None,
        environ: Mapping[str, str],
        nvml: NvmlSession,
        reconciler: Reconciler,
        mps: MpsWiring,
        timers: Scheduler,
        on_fatal: Callable[[StartupError], None],
        remember_label: Callable[[str], None] = lambda value: None,
        recalled_label: Callable[[], str | None] = lambda: None,
        dra_hold: Callable[[Config], DraHold] = lambda config: NO_HOLD,
    ) -> None:
        self.argv_flags = argv_flags
        self.environ = environ
        self.nvml = nvml
        self.reconciler = reconciler
        self.mps = mps
        self.timers = timers
        self.on_fatal = on_fatal  # the main loop: a later start-up failure ends the run
        self.reloads = 0
        self.rediscoveries = 0
        self.label: str | None = None  # the node's config label as last read (None: not yet)
        self.remember_label = remember_label  # kept for a restart in the same run dir
        self.recalled_label = recalled_label  # what an earlier run in this run dir kept (None: none)
        # What DRA claims hold while the node runs as a device plugin (supervisor/dra/drain.py reads
        # the DRA worker's checkpoint and heartbeat), and what the running plans were made with.
        self.dra_hold = dra_hold
        self.planned_hold: DraHold | None = None
        self.config_fp = self._source_fingerprint()

    # ------------------------------------------------------------------ triggers
    def begin(self) -> None:
        """The start: NVML's first try, then one at each step of its backoff (`nvml-retry`) until
        it answers. Raises StartupError where the first try gives up (--fail-on-init-error) or
        the node cannot be planned."""
        node, delay = self.nvml.attempt(self.reconciler.config.fail_on_init_error)
        if node is None:
            self.timers.call_later("nvml-retry", delay, self._retry_nvml)
            return
        self.start(node)

    def _retry_nvml(self) -> None:
        """A later try: NVML may come up to a config that cannot be planned. That ends the run as
        it would at start (exit 78), rather than leaving it up with nothing planned."""
        try:
            self.begin()
        except StartupError as exc:
            self.on_fatal(exc)

    def start(self, node: Node) -> bool:
        """The first plans, for the node NVML just showed, handed to the reconciler (rediscovery armed
        as after any new config): a config that cannot be planned ends the process as a bad
        config does at start (exit 78), rather than running with nothing."""
        config = self.reconciler.config
        if config.awaiting_label:
            log.warning(
                "discovered %d GPUs; nothing is planned until the node label %s chooses a config: %s",
                len(node.gpus),
                config.node_label,
                config.awaiting_label,
            )
            return False
        hold = self.dra_hold(config)
        try:
            plans = plan_resources(node, config, hold)
            self.mps.validate(config, plans)
        except (PlanningError, MpsError) as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        self._note_hold(hold)
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

    def node_label(self, value: str) -> bool:
        """The node's config label as the API server has it now ("" when it has none): a new value
        is applied through a reload; the same value again changes nothing."""
        if value == self.label:
            return True
        first, self.label = self.label is None, value
        try:
            self.remember_label(value)
        except OSError as exc:  # a full run dir: only a restart's first choice is affected
            log.warning("cannot keep the node label for a restart: %s", exc)
        key = self.reconciler.config.node_label
        log.info(
            "node label %s is %s%s",
            key,
            repr(value) if value else "not set",
            " (read for the first time)" if first else "",
            extra={"trigger": "node-label"},
        )
        return self.reload(f"node label {key}={value}" if value else f"node label {key} not set")

    def recall_label(self) -> bool:
        """At start, before NVML, with named configs: the label an earlier run in this run dir
        read (a container restart). Its config is the one planned first; the watch confirms or
        changes it. False when there is none to recall."""
        value = self.recalled_label() if self.reconciler.config.config_file_srcdir else None
        if value is None:
            return False
        self.label = value
        log.info(
            "node label %s=%r, as an earlier run read it: starting with its config",
            self.reconciler.config.node_label,
            value,
        )
        return self.reload(
            f"node label {self.reconciler.config.node_label}={value} (kept from an earlier run)"
        )

    def rediscover(self, trigger: str) -> bool:
        """Re-read the device set with the wanted config; cheap and silent when nothing changed."""
        if not self.nvml.up:
            return False
        self.rediscoveries += 1
        return self._hand_over(self._replan(self.reconciler.wanted_config, trigger, "rediscovery"))

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
        """The reconciler takes the outcome. A new config (taken or waiting) re-arms the rediscovery
        timer at its interval, even if taking it failed; a refusal leaves the timer as it is."""
        try:
            return self.reconciler.take(outcome)
        finally:
            if isinstance(outcome, (Desired, Deferred)):
                self.schedule_rediscovery(self.reconciler.wanted_config)

    def _reload(self, trigger: str, fingerprint: str | None) -> Outcome:
        # What is read now has been seen, taken or refused: the file watch need not repeat it.
        self.config_fp = fingerprint or self._source_fingerprint()
        try:
            config = self._live_part(load_config(self.argv_flags, self.environ, self.label))
            HealthPolicy.from_config(config)  # refused here, not half-applied later
        except (ConfigError, PolicyError) as exc:
            return Refusal("reload", str(exc), trigger)
        for notice in config.notices:  # inputs taken as NVIDIA takes them, worth saying
            log.warning("%s", notice, extra={"trigger": trigger})
        if not self.nvml.up:
            return Deferred(config, trigger)
        return self._replan(config, trigger, "reload")

    def _check_config_file(self) -> None:
        fingerprint = self._source_fingerprint()
        if fingerprint != self.config_fp:  # else an event that changed nothing we read
            self.reload("config file changed", fingerprint)

    def _source_fingerprint(self) -> str:
        """What the config would be read from now: the chosen file (with the named configs, the
        choice itself too) and its content, cheap to compare."""
        config = self.reconciler.config
        if not config.config_file_srcdir:
            return file_fingerprint(config.config_file) if config.config_file else ""
        try:
            choice = choose_config(
                config.config_file_srcdir, self.label or "", config.default_config, config.fallback_strategies
            )
        except ChoiceError as exc:
            return f"no config: {exc}"
        content = file_fingerprint(choice.path) if choice.path else ""
        return f"{choice.name}|{choice.source}|{content}"

    def _replan(self, config: Config, trigger: str, what: str) -> Outcome:
        running, node_now = self.reconciler.config, self.reconciler.node
        # Armed first: whatever happens below, periodic rediscovery goes on.
        self.schedule_rediscovery(self.reconciler.wanted_config)
        self.nvml.mig_options = config.dra_mig_on_demand  # the MIG options its plan needs
        try:
            node = self.nvml.rediscover(node_now)
        except Exception as exc:  # NVML trouble during rediscovery: keep what runs
            return Refusal(what, f"discovery failed: {exc}", trigger)
        hold = self.dra_hold(config)
        if (
            node == node_now
            and config == running
            and hold == self.planned_hold
            and self.reconciler.pending is None
        ):
            return Unchanged(what, trigger)  # the common case of a periodic rediscovery
        try:
            plans = plan_resources(node, config, hold)
            self.mps.validate(config, plans)
        except (PlanningError, MpsError) as exc:
            return Refusal(what, str(exc), trigger)
        self._note_hold(hold)
        return Desired(config, node, plans, trigger, what)

    def _note_hold(self, hold: DraHold) -> None:
        """The running plans are made with `hold`: one line when what DRA holds changes."""
        before, self.planned_hold = self.planned_hold or NO_HOLD, hold
        if hold == before:
            return
        if not hold.settled:
            log.info("switching from DRA: the DRA worker drains first; the device plugin waits for it")
        elif hold.devices:
            log.info(
                "devices of prepared DRA claims stay with their pods, out of the device plugin, until "
                "unprepared: %s",
                ", ".join(sorted(hold.devices)),
            )
        else:
            log.info("no prepared DRA claim holds a device: every device is the device plugin's")

    def _live_part(self, config: Config) -> Config:
        """`config` with the settings a running supervisor cannot change held at their values."""
        running = self.reconciler.config
        held = {
            name: getattr(running, name)
            for name in RESTART_ONLY
            if getattr(config, name) != getattr(running, name)
        }
        for name in held:
            log.warning("setting %s changed; it takes effect at the next restart", name)
        return dataclasses.replace(config, **held) if held else config

    def status(self) -> dict[str, Json]:
        config = self.reconciler.config
        return {
            "reloads": self.reloads,
            "rediscoveries": self.rediscoveries,
            "config": {
                "name": config.config_name or None,
                "file": config.config_file or None,
                "source": config.config_source,
                "awaiting_label": config.awaiting_label or None,
                "node_label": None
                if not config.config_file_srcdir
                else {"key": config.node_label, "value": self.label},
            },
        }
