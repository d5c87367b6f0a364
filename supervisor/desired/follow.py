"""The parts that follow the desired state: brought in step before any worker hears of a plan.

When the reconciler takes a config, the parts that read settings live take the new ones (the
health policy and probe period, the CDI writer, the MPS daemons' settings, the worker spawner
and the restart policy), and a config chosen anew (another named config, or from another
source) is one log line and the `gpuvisor_config_info` series. When it has written new plan
files, the rest follows in this order: the health book and its monitor (started with the first
plans: one synchronous probe first, so a GPU already bad is Unhealthy in the first list the
kubelet sees), the MPS daemons, the CDI spec (before the workers: none may hand out a CDI name the spec lacks), the node labels, and
the hooks in `after_plans` (the cluster side's Node condition). Only then does the reconciler
start, update or stop workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from supervisor.cdi.sync import CdiSync
from supervisor.config import Config
from supervisor.config.named import SOURCE_FILE, SOURCE_NONE, Choice
from supervisor.desired.reconcile import Desired
from supervisor.health.hub import HealthHub
from supervisor.health.policy import HEALTH_SETTINGS, HealthPolicy, PolicyError
from supervisor.labels.sync import NodeLabels
from supervisor.mps.wiring import MpsWiring
from supervisor.observe.metrics import Metrics
from supervisor.workers.lifecycle import Policy, WorkerSet
from supervisor.workers.spawner import WorkerSpawner

log = logging.getLogger("gpuvisor.supervisor")


def describe_choice(config: Config) -> str:
    """Which config runs and why, in words (a log line's)."""
    if config.config_source == SOURCE_FILE:
        return f"the config file {config.config_file}"
    if config.config_source == SOURCE_NONE:
        return "no config file (defaults, flags and env vars)"
    choice = Choice(config.config_name, config.config_file, config.config_source)
    return f"{choice.describe(config.node_label)} ({config.config_file or 'no file'})"


def worker_policy(config: Config) -> Policy:
    """The restart rules a config asks for."""
    return Policy(**{k: getattr(config, k) for k in ("heartbeat_timeout", "start_retries", "start_seconds")})


class Follow:
    def __init__(
        self,
        *,
        nvml_module: Any,
        hub: HealthHub,
        mps: MpsWiring,
        cdi: CdiSync,
        labels: NodeLabels,
        spawner: WorkerSpawner,
        workers: WorkerSet,
        metrics: Metrics,
        after_plans: tuple[Callable[[], None], ...] = (),
    ) -> None:
        self.nvml_module = nvml_module
        self.hub = hub
        self.mps = mps
        self.cdi = cdi
        self.labels = labels
        self.spawner = spawner
        self.workers = workers
        self.metrics = metrics
        # Called after each plan change once the followers are in step (the cluster side's
        # condition follows the device count).
        self.after_plans = after_plans

    def take_config(self, old: Config, new: Config) -> None:
        which = (new.config_name, new.config_source, new.config_file)
        if which != (old.config_name, old.config_source, old.config_file):
            log.info(
                "config applied: %s",
                describe_choice(new),
                extra={"config": new.config_name, "source": new.config_source},
            )
        self.metrics.set_config(new.config_name, new.config_source)
        if any(getattr(new, n) != getattr(old, n) for n in HEALTH_SETTINGS):
            try:
                self.hub.set_policy(HealthPolicy.from_config(new))
            except PolicyError as exc:  # checked when the reload was read: only a bug gets here
                log.error("health policy unchanged: %s", exc)
        self.hub.set_probe_interval(new.probe_interval)
        self.cdi.configure(new)
        self.mps.adopt(new)
        self.spawner.configure(new)
        self.workers.set_policy(worker_policy(new))

    def take_plans(self, desired: Desired) -> None:
        first = not self.mps.started  # the last step of bringing health and MPS up
        if first:
            self.hub.start(
                nvml_module=self.nvml_module,
                node=desired.node,
                plans=desired.plans,
                probe_interval=desired.config.probe_interval,
            )
            self.mps.start(desired.plans)
        else:
            self.hub.set_node(desired.node)
            self.hub.set_plans(desired.plans)
        self.cdi.sync(desired.plans)  # before the workers: none may hand out a CDI name the spec lacks
        if not first:
            self.mps.apply(desired.plans)
        self.hub.update_gauges()
        self.labels.refresh(desired.config)  # the node labels follow what is advertised, at once
        for hook in self.after_plans:
            hook()
