"""The plan reconciler: the one owner of what the supervisor should run, and making it so.

`plan_actions` is the pure part: the plans the workers run now and the plans wanted, each as
`resource -> plan JSON`, give one action per resource: START (a new resource), UPDATE (same
resource, other plan: the running worker takes it in place, same process, same ListAndWatch
stream, so allocatable never drops), STOP (a resource no longer wanted) or KEEP.

`Reconciler` owns the desired state and nothing else writes it: the running config, the node
and plans it applied, a desired state still pending, and the last refusal. It `take`s what the
replanner (supervisor/desired/replan.py) made of a start, a reload or a rediscovery, an
`Outcome`:

- `Desired` (config, node, plans): applied, or kept pending. The plan files are written first,
  all or nothing: if that fails for a passing reason (a full or read-only run dir), nothing
  changes, the running plans keep serving, and the desired state stays *pending*: retried with
  the backoff until it applies, shown in status and counted in the metrics. A newer desired
  state replaces a pending one. Once the files are written the followers
  (supervisor/desired/follow.py: config, health book, CDI spec, MPS daemons, labels) are
  brought in step before any worker hears of the plan, and the workers are started, updated
  in place or stopped.
- `Deferred`: a valid config while NVML is not up; it is taken now and planned once NVML is.
- `Unchanged`: a reload or rediscovery that found nothing to do.
- `Refusal`: what cannot be taken at all (a config that does not load, plans the node cannot
  have, MPS that cannot run): the running config keeps serving, one log line says why (a
  rediscovery repeating the same refusal logs once), and status shows it until a valid config
  arrives (a reload) or a rediscovery goes through (a rediscovery's refusal). A refused reload
  also drops a reload still pending: the config file has moved on from it, so it must not be
  applied later behind the user's back. Trying again cannot help, so a refusal is not pending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from common.backoff import Backoff
from common.messages import HealthSnapshot, Json, PlanUpdate
from common.model import Node, ResourcePlan
from supervisor.config import Config
from supervisor.scheduler import Scheduler
from supervisor.workers.lifecycle import WorkerSet

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
class PlanAction:
    kind: ActionKind
    resource: str


def plan_actions(current: Mapping[str, str], wanted: Mapping[str, str]) -> list[PlanAction]:
    """One action per resource of either side: stops first, then the rest by resource name."""
    stops = [PlanAction(ActionKind.STOP, r) for r in sorted(set(current) - set(wanted))]
    rest = []
    for resource, text in sorted(wanted.items()):
        if resource not in current:
            rest.append(PlanAction(ActionKind.START, resource))
        elif current[resource] != text:
            rest.append(PlanAction(ActionKind.UPDATE, resource))
        else:
            rest.append(PlanAction(ActionKind.KEEP, resource))
    return stops + rest


@dataclass(frozen=True)
class Desired:
    """What the supervisor should run: a config, the node it was planned on, and the plans.

    `what` is the kind of replan that made it ("start", "reload", "rediscovery")."""

    config: Config
    node: Node
    plans: dict[str, ResourcePlan]
    trigger: str
    what: str = "start"
    plan_json: dict[str, str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan_json", {r: p.to_json() for r, p in self.plans.items()})


@dataclass(frozen=True)
class Deferred:
    """A valid config taken while NVML is not up: it is planned once NVML comes up."""

    config: Config
    trigger: str


@dataclass(frozen=True)
class Unchanged:
    """A reload or rediscovery that found the node and config as they run: nothing to do."""

    what: str
    trigger: str


@dataclass(frozen=True)
class Refusal:
    """A config (or its plans) that could not be taken: what was refused, why, and what asked."""

    what: str  # "reload" or "rediscovery"
    text: str
    trigger: str

    def __str__(self) -> str:
        return f"{self.what} refused: {self.text} ({self.trigger})"


Outcome = Desired | Deferred | Unchanged | Refusal


class PlanFiles(Protocol):
    """Where plans are written for the workers (supervisor.host.rundir.RunDir)."""

    plans_dir: str

    def plan_path(self, resource: str) -> str: ...

    def write_plans(self, texts: Mapping[str, str]) -> None:
        """resource -> plan JSON, all or none; raises OSError."""
        ...


class Followers(Protocol):
    """The parts that follow the desired state (supervisor.desired.follow.Follow)."""

    def take_config(self, old: Config, new: Config) -> None:
        """A config is taken: the parts that read settings live take the new ones."""
        ...

    def take_plans(self, desired: Desired) -> None:
        """The plan files are written: bring health, CDI, MPS and labels in step, before workers."""
        ...


class Reconciler:
    def __init__(
        self,
        *,
        config: Config,
        plan_files: PlanFiles,
        workers: WorkerSet,
        tell: Callable[[str, PlanUpdate], bool],
        snapshot: Callable[[str], HealthSnapshot | None],
        follow: Followers,
        timers: Scheduler,
        on_pending: Callable[[bool], None] = lambda pending: None,
        on_refused: Callable[[str], None] = lambda what: None,
        on_error: Callable[[str], None] = lambda step: None,
    ) -> None:
        self.plan_files = plan_files
        self.workers = workers
        self.tell = tell  # to a resource's worker (the control endpoint)
        self.snapshot = snapshot  # a resource's health now (the health hub), sent with its plan
        self.follow = follow
        self.timers = timers
        self.on_pending = on_pending
        self.on_refused = on_refused
        self.on_error = on_error
        # The desired state, owned here alone.
        self.config = config  # the running config (taken at start, by a reload or an applied plan)
        self.node: Node | None = None  # the node the running plans were made for
        self.plans: dict[str, ResourcePlan] = {}
        self.plan_json: dict[str, str] = {}
        self.pending: Desired | None = None
        self.pending_error = ""
        self.pending_since = 0.0
        self.refusal: Refusal | None = None  # the last refusal, until a valid config arrives
        self.refused = 0
        self.worker_plan: dict[str, str] = {}  # resource -> plan JSON its current worker has
        self.backoff = Backoff(RETRY_START_S, RETRY_MAX_S, jitter=0.2)
        self.adopt_backoff = Backoff(RETRY_START_S, RETRY_MAX_S, jitter=0.2)

    @property
    def wanted_config(self) -> Config:
        """The config the supervisor is heading for: a pending one, else the running one."""
        return self.pending.config if self.pending is not None else self.config

    # ------------------------------------------------------------------ outcomes
    def take(self, outcome: Outcome) -> bool:
        """Keep what a replan made; False when it was refused or stays pending."""
        match outcome:
            case Refusal():
                self._refuse(outcome)
                return False
            case Deferred(config, trigger):
                self.refusal = None  # a valid config arrived: the last refusal is history
                self._take_config(config)
                log.info("reload (%s): config taken; it applies once NVML is up", trigger)
                return True
            case Unchanged(what):
                self._went_through(what)
                return True
            case Desired():
                self._went_through(outcome.what)
                return self.want(outcome)

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
        self._clear_pending()
        self._apply(desired, actions)
        return True

    # ------------------------------------------------------------------ workers
    def worker_started(self, resource: str) -> None:
        """A new worker process reads the plan file as it is now."""
        self.worker_plan[resource] = self.plan_json.get(resource, "")

    def catch_up(self, resource: str) -> None:
        """Send the current plan to the resource's worker if it has an older one, with the health
        of its devices (the followers brought the health book in step with the plan already)."""
        text = self.plan_json.get(resource, "")
        if not text or self.worker_plan.get(resource) == text:
            return
        if self.tell(resource, PlanUpdate(plan_json=text, snapshot=self.snapshot(resource))):
            self.worker_plan[resource] = text

    # ------------------------------------------------------------------ internals
    def _went_through(self, what: str) -> None:
        """A reload read a valid config, or a rediscovery went through: the refusal it answers
        (any, for a reload; an earlier rediscovery's, for a rediscovery) is history."""
        if what == "reload" or (
            what == "rediscovery" and self.refusal is not None and self.refusal.what == what
        ):
            self.refusal = None

    def _refuse(self, refusal: Refusal) -> None:
        """One clear line per refusal; a rediscovery repeating the same refusal logs once."""
        last = self.refusal
        if refusal.what == "reload":
            self._drop_pending("a newer config was refused")
        repeat = last is not None and (last.what, last.text) == (refusal.what, refusal.text)
        if not (refusal.what == "rediscovery" and repeat):
            log.error(
                "%s (%s) refused, keeping the running config: %s",
                refusal.what,
                refusal.trigger,
                refusal.text,
                extra={"trigger": refusal.trigger},
            )
        self.refused += 1
        self.refusal = refusal
        self.on_refused(refusal.what)

    def _drop_pending(self, why: str) -> None:
        if self.pending is not None:
            log.warning("the pending %s is dropped: %s", self.pending.trigger, why)
            self._clear_pending()

    def _clear_pending(self) -> None:
        if self.pending_error:
            self.on_pending(False)
        self.pending = None
        self.pending_error = ""
        self.timers.cancel(TIMER)

    def _take_config(self, config: Config) -> None:
        old, self.config = self.config, config
        self.follow.take_config(old, config)

    def _write(self, resources: list[str], desired: Desired) -> str:
        """Write these plan files, all or none; why not, or "" when written."""
        try:
            self.plan_files.write_plans({r: desired.plan_json[r] for r in resources})
        except OSError as exc:
            return f"cannot write {exc.filename or self.plan_files.plans_dir}: {exc.strerror or exc}"
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

    def _apply(self, desired: Desired, actions: list[PlanAction]) -> None:
        old = self.plans
        self.node = desired.node
        self.plans = dict(desired.plans)
        self.plan_json = dict(desired.plan_json)
        try:
            self._adopt(desired)
        finally:  # the workers follow the written plans whatever became of the rest
            self._act(desired, actions, quiet=not old)

    def _adopt(self, desired: Desired) -> None:
        """The followers, retried with the backoff until they go through (a thread that could
        not start, a spec dir that failed): a supervisor half in step is never left that way."""
        self.timers.cancel(ADOPT_TIMER)
        try:
            self._take_config(desired.config)
            self.follow.take_plans(desired)
        except Exception:
            delay = self.adopt_backoff.next()
            log.exception(
                "%s: bringing the supervisor in step with the new plans failed; retrying in %.1fs",
                desired.trigger,
                delay,
            )
            self.on_error("adopt")
            self.timers.call_later(ADOPT_TIMER, delay, lambda: self._readopt(desired))
            return
        self.adopt_backoff.reset()

    def _readopt(self, desired: Desired) -> None:
        if self.plan_json == desired.plan_json:  # else a newer state was applied (and adopted) since
            self._adopt(desired)

    def _act(self, desired: Desired, actions: list[PlanAction], quiet: bool) -> None:
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
                self.workers.want(resource, self.plan_files.plan_path(resource), plan_changed=True)
            elif action.kind is ActionKind.UPDATE and plan is not None:
                log.info(
                    "%s: resource %s updated in place (%d devices)",
                    desired.trigger,
                    resource,
                    len(plan.devices),
                )
                self.workers.want(resource, self.plan_files.plan_path(resource), plan_changed=True)
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
