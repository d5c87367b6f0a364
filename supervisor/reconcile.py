"""The plan reconciler: the wanted plans against what runs, as actions, then applied.

`plan_actions` is the pure part: the plans the workers run now and the plans wanted, each as
`resource -> plan JSON`, give one action per resource: START (a new resource), UPDATE (same
resource, other plan: the running worker takes it in place, same process, same ListAndWatch
stream, so allocatable never drops), STOP (a resource no longer wanted) or KEEP.

`Reconciler` applies a `Desired` state (config, node, plans), from the first discovery, a
reload or a rediscovery alike. The plan files are written first, all or nothing: if that fails
for a passing reason (a full or read-only run dir), nothing changes, the running plans keep
serving, and the desired state stays *pending*: retried with the backoff until it applies,
shown in status and counted in the metrics. A newer desired state replaces a pending one. Once
the files are written, `ReconcileHooks.adopt` brings the rest of the supervisor in step (the
config, health book, CDI spec, MPS daemons: before any worker hears of the plan) and the
workers are started, updated in place or stopped.

A reload refused because the config is invalid is not pending (trying again cannot help): the
refusal is kept for status until a valid config arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from common.backoff import Backoff
from common.config import Config
from common.messages import Json, PlanUpdate
from common.model import Node, ResourcePlan
from supervisor.scheduler import Scheduler
from supervisor.workers import WorkerSet

log = logging.getLogger("gpuvisor.supervisor")

RETRY_START_S = 0.5
RETRY_MAX_S = 30.0
TIMER = "pending-reload"
ADOPT_TIMER = "adopt-retry"


class ActionKind(Enum):
    START = "start"
    UPDATE = "update"
    STOP = "stop"
    KEEP = "keep"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    resource: str


def plan_actions(current: Mapping[str, str], wanted: Mapping[str, str]) -> list[Action]:
    """One action per resource of either side: stops first, then the rest by resource name."""
    stops = [Action(ActionKind.STOP, r) for r in sorted(set(current) - set(wanted))]
    rest = []
    for resource, text in sorted(wanted.items()):
        if resource not in current:
            rest.append(Action(ActionKind.START, resource))
        elif current[resource] != text:
            rest.append(Action(ActionKind.UPDATE, resource))
        else:
            rest.append(Action(ActionKind.KEEP, resource))
    return stops + rest


@dataclass
class Desired:
    """What the supervisor should run: a config, the node it was planned on, and the plans."""

    config: Config
    node: Node
    plans: dict[str, ResourcePlan]
    trigger: str
    plan_json: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.plan_json = {r: p.to_json() for r, p in self.plans.items()}


@dataclass(frozen=True)
class Refusal:
    """A config (or its plans) that could not be taken: what was refused, why, and what asked."""

    what: str  # "reload" or "rediscovery"
    text: str
    trigger: str

    def __str__(self) -> str:
        return f"{self.what} refused: {self.text} ({self.trigger})"


class PlanFiles(Protocol):
    """Where plans are written for the workers (supervisor.rundir.RunDir)."""

    plans_dir: str

    def plan_path(self, resource: str) -> str: ...

    def write_plans(self, texts: Mapping[str, str]) -> None:
        """resource -> plan JSON, all or none; raises OSError."""
        ...


class ReconcileHooks(Protocol):
    def adopt(self, desired: Desired) -> None:
        """The plan files are written: bring config, health, CDI and MPS in step, before workers."""
        ...


class Reconciler:
    def __init__(
        self,
        rundir: PlanFiles,
        workers: WorkerSet,
        tell: Callable[[str, PlanUpdate], bool],
        hooks: ReconcileHooks,
        timers: Scheduler,
        on_pending: Callable[[bool], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.rundir = rundir
        self.workers = workers
        self.tell = tell
        self.hooks = hooks
        self.timers = timers
        self.on_pending = on_pending or (lambda pending: None)
        self.on_error = on_error or (lambda step: None)
        self.plans: dict[str, ResourcePlan] = {}
        self.plan_json: dict[str, str] = {}
        self.worker_plan: dict[str, str] = {}  # resource -> plan JSON its current worker has
        self.pending: Desired | None = None
        self.pending_error = ""
        self.pending_since = 0.0
        self.refusal: Refusal | None = None  # the last refused config, until a valid one arrives
        self.refused = 0
        self.backoff = Backoff(RETRY_START_S, RETRY_MAX_S, jitter=0.2)
        self.adopt_backoff = Backoff(RETRY_START_S, RETRY_MAX_S, jitter=0.2)

    # ------------------------------------------------------------------ desired state
    def want(self, desired: Desired) -> bool:
        """Apply `desired` now, or keep it pending (and retry) when its plans cannot be written."""
        if self.pending is None:
            self.pending_since = self.timers.clock.monotonic()
            self.backoff.reset()
        self.pending = desired
        return self.retry()

    def retry(self) -> bool:
        desired = self.pending
        if desired is None:
            return True
        actions = plan_actions(self.plan_json, desired.plan_json)
        error = self._write(
            [a.resource for a in actions if a.kind in (ActionKind.START, ActionKind.UPDATE)], desired
        )
        if error:
            self._keep_pending(desired, error)
            return False
        if self.pending_error:
            self.on_pending(False)
        self.pending = None
        self.pending_error = ""
        self.timers.cancel(TIMER)
        self._apply(desired, actions)
        return True

    def drop_pending(self, why: str) -> None:
        """Forget a pending desired state: a newer config replaced it and was refused."""
        if self.pending is None:
            return
        log.warning("the pending %s is dropped: %s", self.pending.trigger, why)
        if self.pending_error:
            self.on_pending(False)
        self.pending = None
        self.pending_error = ""
        self.timers.cancel(TIMER)

    def refuse(self, refusal: Refusal) -> None:
        """A config (or its plans) that cannot be taken: the running one stays; status says why."""
        self.refused += 1
        self.refusal = refusal

    # ------------------------------------------------------------------ workers
    def worker_started(self, resource: str) -> None:
        """A new worker process reads the plan file as it is now."""
        self.worker_plan[resource] = self.plan_json.get(resource, "")

    def catch_up(self, resource: str) -> None:
        """Send the current plan to the resource's worker if it has an older one."""
        text = self.plan_json.get(resource, "")
        if (
            text
            and self.worker_plan.get(resource) != text
            and self.tell(resource, PlanUpdate(plan_json=text))
        ):
            self.worker_plan[resource] = text

    # ------------------------------------------------------------------ internals
    def _write(self, resources: list[str], desired: Desired) -> str:
        """Write these plan files, all or none; why not, or "" when written."""
        try:
            self.rundir.write_plans({r: desired.plan_json[r] for r in resources})
        except OSError as exc:
            return f"cannot write {exc.filename or self.rundir.plans_dir}: {exc.strerror or exc}"
        return ""

    def _keep_pending(self, desired: Desired, error: str) -> None:
        delay = self.backoff.next()
        if error != self.pending_error:
            log.error(
                "%s refused, keeping the running plans: %s; the wanted config stays pending, retried with backoff",
                desired.trigger,
                error,
                extra={"trigger": desired.trigger},
            )
        else:
            log.debug("pending reload still cannot be applied (%s); next try in %.1fs", error, delay)
        self.pending_error = error
        self.timers.call_later(TIMER, delay, self.retry)
        self.on_pending(True)

    def _apply(self, desired: Desired, actions: list[Action]) -> None:
        old = self.plans
        self.plans = dict(desired.plans)
        self.plan_json = dict(desired.plan_json)
        try:
            self._adopt(desired)
        finally:  # the workers follow the written plans whatever became of the rest
            self._act(desired, actions, quiet=not old)

    def _adopt(self, desired: Desired) -> None:
        """The hooks, retried with the backoff until they go through (a thread that could not
        start, a spec dir that failed): a supervisor half in step is never left that way."""
        self.timers.cancel(ADOPT_TIMER)
        try:
            self.hooks.adopt(desired)
        except Exception:
            delay = self.adopt_backoff.next()
            log.exception("%s: bringing the supervisor in step with the new plans failed; retrying in %.1fs", desired.trigger, delay)
            self.on_error("adopt")
            self.timers.call_later(ADOPT_TIMER, delay, lambda: self._readopt(desired))
            return
        self.adopt_backoff.reset()

    def _readopt(self, desired: Desired) -> None:
        if self.plan_json == desired.plan_json:  # else a newer state was applied (and adopted) since
            self._adopt(desired)

    def _act(self, desired: Desired, actions: list[Action], quiet: bool) -> None:
        """Start, update in place and stop workers (`quiet`: the first plans, named elsewhere)."""
        now = self.timers.clock.monotonic()
        for action in actions:
            resource, plan = action.resource, self.plans.get(action.resource)
            if action.kind is ActionKind.STOP:
                log.info("%s: resource %s removed", desired.trigger, resource)
                self.workers.unwant(resource, now)
                self.worker_plan.pop(resource, None)
            elif action.kind is ActionKind.START and plan is not None:
                if not quiet:
                    log.info(
                        "%s: resource %s added (%d devices)", desired.trigger, resource, len(plan.devices)
                    )
                self.workers.want(resource, self.rundir.plan_path(resource), plan_changed=True)
            elif action.kind is ActionKind.UPDATE and plan is not None:
                log.info(
                    "%s: resource %s updated in place (%d devices)",
                    desired.trigger,
                    resource,
                    len(plan.devices),
                )
                self.workers.want(resource, self.rundir.plan_path(resource), plan_changed=True)
                self.catch_up(resource)

    # ------------------------------------------------------------------ views
    def status(self) -> dict[str, Json]:
        pending: Json = None
        if self.pending is not None:
            nxt = self.timers.when(TIMER)
            pending = {
                "trigger": self.pending.trigger,
                "reason": self.pending_error,
                "for_seconds": round(self.timers.clock.monotonic() - self.pending_since, 1),
                "next_retry_in": None
                if nxt is None
                else round(max(0.0, nxt - self.timers.clock.monotonic()), 1),
                "attempts": self.backoff.attempts,
            }
        refused = str(self.refusal) if self.refusal is not None else None
        return {"pending": pending, "refused": refused, "refusals": self.refused}
