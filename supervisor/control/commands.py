"""The commands the supervisor answers on its control socket.

`gpuvisor status` and `gpuvisor sim ...` are separate processes that send a `Command` to the
running supervisor's ROUTER (`<run dir>/control.sock`, mode 0600 in a 0700 dir: only the
supervisor's own user can talk to it) and print the `Reply` (their side is
`supervisor.control.client`).

Commands see the supervisor only through `CommandTarget`, the few things they need, and a
simulated node's fault injection through `FaultInjector` (what `supervisor.sim.nvml.Simulator`
offers), so this module imports nothing of the supervisor's and each command is tested on a fake.
Arguments arrive as JSON from another process: each is checked for its type here, with an error
that names it, before anything acts on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from common.messages import Command, Json, Reply


class CommandError(Exception):
    """A command that cannot be carried out; its text goes back to the CLI."""


SIM_ACTIONS = ("xid", "ecc", "lose", "restore", "reset", "mig", "create-instance", "instances")


class FaultInjector(Protocol):
    """Fault injection on a simulated node (supervisor.sim.nvml.Simulator)."""

    def inject_xid(
        self, uuid: str, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None
    ) -> None: ...

    def inject_ecc(self, uuid: str, kind: str = "double") -> None: ...

    def lose(self, uuid: str) -> None: ...

    def restore(self, uuid: str) -> None: ...

    def reset(self, uuid: str) -> None: ...

    def set_mig_layout(self, gpu_index: int, profiles: list[str] | None) -> object: ...

    def create_instance(
        self, gpu_uuid: str, gi_profile_id: int, placement_start: int
    ) -> dict[str, str | int]: ...

    def mig_instances(self, gpu_uuid: str) -> list[dict[str, str | int]]: ...


class Replanning(Protocol):
    """Reload and rediscovery (supervisor.desired.replan.Replanner)."""

    def reload(self, trigger: str) -> bool: ...

    def rediscover(self, trigger: str) -> bool: ...


class PlanHolder(Protocol):
    """What commands read of the plans' owner (supervisor.desired.reconcile.Reconciler)."""

    @property
    def plans(self) -> Mapping[str, object]: ...


class Resettable(Protocol):
    """Who hears of a GPU reset (supervisor.health.hub.HealthHub)."""

    def gpu_reset(self, uuid: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class CommandTarget:
    """What commands need of the supervisor: its parts, named, and its status document."""

    status: Callable[[], dict[str, Json]]
    replan: Replanning
    reconciler: PlanHolder
    health: Resettable
    faults: FaultInjector | None  # the simulator's fault injection, or None on real NVML


@dataclass(frozen=True)
class SimRequest:
    """The arguments of `gpuvisor sim`, checked."""

    action: str
    device: str = ""
    xid: int = 0
    gpu_instance: int | None = None
    compute_instance: int | None = None
    kind: str = "double"
    gpu: int = 0
    layout: list[str] | None = None
    reload: bool = True
    gi_profile: int = 0
    placement: int = 0

    @classmethod
    def parse(cls, args: dict[str, Json]) -> SimRequest:
        action = _text(args, "action", "")
        if action not in SIM_ACTIONS:
            raise CommandError(f"unknown sim action {action!r} (one of {', '.join(SIM_ACTIONS)})")
        layout = args.get("layout")
        if layout is not None and not (isinstance(layout, list) and all(isinstance(p, str) for p in layout)):
            raise CommandError(f"sim {action}: layout must be a list of profile names or null")
        return cls(
            action=action,
            device=_text(args, "device", ""),
            xid=_number(args, "xid", 0, required=action == "xid"),
            gpu_instance=_optional_number(args, "gpu_instance"),
            compute_instance=_optional_number(args, "compute_instance"),
            kind=_text(args, "kind", "double"),
            gpu=_number(args, "gpu", 0, required=action == "mig"),
            layout=[str(p) for p in layout] if isinstance(layout, list) else None,
            reload=_flag(args, "reload", True),
            gi_profile=_number(args, "gi_profile", 0, required=action == "create-instance"),
            placement=_number(args, "placement", 0, required=action == "create-instance"),
        )


def _text(args: dict[str, Json], name: str, default: str) -> str:
    value = args.get(name, default)
    if not isinstance(value, str):
        raise CommandError(f"argument {name!r} must be a string, not {type(value).__name__}")
    return value


def _number(args: dict[str, Json], name: str, default: int, *, required: bool = False) -> int:
    if name not in args:
        if required:
            raise CommandError(f"argument {name!r} is required")
        return default
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise CommandError(f"argument {name!r} must be an integer, not {type(value).__name__}")
    return value


def _optional_number(args: dict[str, Json], name: str) -> int | None:
    return None if args.get(name) is None else _number(args, name, 0)


def _flag(args: dict[str, Json], name: str, default: bool) -> bool:
    value = args.get(name, default)
    if not isinstance(value, bool):
        raise CommandError(f"argument {name!r} must be true or false, not {type(value).__name__}")
    return value


def run_command(target: CommandTarget, name: str, args: dict[str, Json]) -> dict[str, Json]:
    """Carry out one control command on the supervisor's main loop."""
    if name == "status":
        return target.status()
    if name == "reload":
        ok = target.replan.reload("control command")
        return {"applied": ok, "plans": list[Json](sorted(target.reconciler.plans))}
    if name == "rediscover":
        ok = target.replan.rediscover("control command")
        return {"applied": ok, "plans": list[Json](sorted(target.reconciler.plans))}
    if name == "sim":
        return _sim(target, args)
    raise CommandError(f"unknown command {name!r}")


def reply_to(target: CommandTarget, command: Command) -> Reply:
    """The Reply for a Command: its result, or the CommandError's text."""
    try:
        return Reply(ok=True, error="", data=run_command(target, command.name, dict(command.args)))
    except CommandError as exc:
        return Reply(ok=False, error=str(exc), data={})


def _sim(target: CommandTarget, args: dict[str, Json]) -> dict[str, Json]:
    sim = target.faults
    if sim is None:
        raise CommandError(
            "this supervisor runs on real NVML, not a simulated node: fault injection is refused"
        )
    req = SimRequest.parse(args)
    result: dict[str, Json] = {"action": req.action, "device": req.device}
    try:
        if req.action == "xid":
            sim.inject_xid(req.device, req.xid, req.gpu_instance, req.compute_instance)
        elif req.action == "ecc":
            sim.inject_ecc(req.device, req.kind)
        elif req.action == "lose":
            sim.lose(req.device)
        elif req.action == "restore":
            sim.restore(req.device)
        elif req.action == "reset":
            sim.reset(req.device)
            # NVML sends no event for a reset: the supervisor learns of it from whoever reset the
            # GPU (here the simulator's command) and clears the until-reset conditions.
            target.health.gpu_reset(req.device)
        elif req.action == "create-instance":
            # A MIG device made by hand, as an operator's `nvidia-smi mig` makes one; the reload
            # shows it at once, like the layout change below.
            result["instance"] = dict(sim.create_instance(req.device, req.gi_profile, req.placement))
            if req.reload:
                target.replan.reload("MIG instance created")
        elif req.action == "instances":
            result["instances"] = [dict(m) for m in sim.mig_instances(req.device)]
        else:  # mig
            sim.set_mig_layout(req.gpu, req.layout)
            # Like a `nvidia-smi mig` run by an operator; the reload makes the change show at
            # once. `reload: false` leaves it to the periodic rediscovery (its tests use that).
            if req.reload:
                target.replan.reload("MIG layout changed")
    except (KeyError, ValueError, TypeError, LookupError) as exc:
        raise CommandError(f"sim {req.action}: {exc}") from None
    except Exception as exc:  # the simulator raises NVMLError for unknown devices and such
        raise CommandError(f"sim {req.action}: {type(exc).__name__}: {exc}") from None
    return result
