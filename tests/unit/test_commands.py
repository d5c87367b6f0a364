"""The control socket's commands (supervisor/control/commands.py) on a fake supervisor: what each
command asks of which part, and the clear refusals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from common.messages import Command, Json
from supervisor.control.commands import CommandError, CommandTarget, reply_to, run_command


@dataclass
class Parts:
    """The supervisor's parts as commands see them, recording what they were asked."""

    plans: Mapping[str, object] = field(default_factory=lambda: {"nvidia.com/gpu": object()})
    asked: list[str] = field(default_factory=list)
    applied: bool = True

    def reload(self, trigger: str) -> bool:
        self.asked.append(f"reload: {trigger}")
        return self.applied

    def rediscover(self, trigger: str) -> bool:
        self.asked.append(f"rediscover: {trigger}")
        return self.applied

    def gpu_reset(self, uuid: str) -> None:
        self.asked.append(f"reset: {uuid}")

    def status(self) -> dict[str, Json]:
        return {"ready": True}

    # FaultInjector
    def inject_xid(
        self, uuid: str, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None
    ) -> None:
        if not uuid.startswith("GPU-"):
            raise KeyError(f"no GPU or MIG device with UUID {uuid!r}")
        self.asked.append(f"xid {xid} on {uuid} ({gpu_instance}, {compute_instance})")

    def inject_ecc(self, uuid: str, kind: str = "double") -> None:
        self.asked.append(f"ecc {kind} on {uuid}")

    def lose(self, uuid: str) -> None:
        self.asked.append(f"lose {uuid}")

    def restore(self, uuid: str) -> None:
        self.asked.append(f"restore {uuid}")

    def reset(self, uuid: str) -> None:
        self.asked.append(f"sim reset {uuid}")

    def set_mig_layout(self, gpu_index: int, profiles: list[str] | None) -> object:
        self.asked.append(f"mig {gpu_index} {profiles}")
        return profiles

    def create_instance(
        self, gpu_uuid: str, gi_profile_id: int, placement_start: int
    ) -> dict[str, str | int]:
        self.asked.append(f"create-instance {gpu_uuid} {gi_profile_id} {placement_start}")
        return {"gpu_uuid": gpu_uuid, "gi_id": 2, "ci_id": 0}

    def mig_instances(self, gpu_uuid: str) -> list[dict[str, str | int]]:
        self.asked.append(f"instances {gpu_uuid}")
        return [{"gpu_uuid": gpu_uuid, "gi_id": 2, "ci_id": 0}]


def target(parts: Parts, *, simulated: bool = True) -> CommandTarget:
    return CommandTarget(
        status=parts.status, replan=parts, reconciler=parts, health=parts, faults=parts if simulated else None
    )


def test_reload_and_rediscover_ask_the_replanner_and_name_the_plans() -> None:
    """Both say whether they applied and which resources are planned afterwards."""
    parts = Parts(applied=False)
    assert run_command(target(parts), "reload", {}) == {"applied": False, "plans": ["nvidia.com/gpu"]}
    assert run_command(target(parts), "rediscover", {}) == {"applied": False, "plans": ["nvidia.com/gpu"]}
    assert parts.asked == ["reload: control command", "rediscover: control command"]


def test_a_simulated_reset_tells_the_health_book_as_well() -> None:
    """NVML sends no event for a reset: the command resets the GPU and tells the health part."""
    parts = Parts()
    run_command(target(parts), "sim", {"action": "reset", "device": "GPU-1"})
    assert parts.asked == ["sim reset GPU-1", "reset: GPU-1"]


def test_a_mig_change_reloads_unless_asked_not_to() -> None:
    """`sim mig` changes the layout and reloads at once; `reload: false` leaves it to rediscovery."""
    parts = Parts()
    run_command(target(parts), "sim", {"action": "mig", "gpu": 2, "layout": ["3g.40gb"]})
    run_command(target(parts), "sim", {"action": "mig", "gpu": 2, "layout": None, "reload": False})
    assert parts.asked == ["mig 2 ['3g.40gb']", "reload: MIG layout changed", "mig 2 None"]


def test_a_hand_made_instance_is_created_shown_and_reloads() -> None:
    """`sim create-instance` makes the instance, returns it and reloads (unless `reload: false`);
    `sim instances` returns the GPU's instances."""
    parts = Parts()
    made = run_command(
        target(parts),
        "sim",
        {"action": "create-instance", "device": "GPU-1", "gi_profile": 9, "placement": 4},
    )
    listed = run_command(target(parts), "sim", {"action": "instances", "device": "GPU-1"})
    assert made["instance"] == {"gpu_uuid": "GPU-1", "gi_id": 2, "ci_id": 0}
    assert listed["instances"] == [{"gpu_uuid": "GPU-1", "gi_id": 2, "ci_id": 0}]
    assert parts.asked == ["create-instance GPU-1 9 4", "reload: MIG instance created", "instances GPU-1"]


def test_fault_injection_is_refused_on_real_nvml() -> None:
    """A supervisor that is not simulated refuses fault injection, saying why."""
    with pytest.raises(CommandError, match="not a simulated node: fault injection is refused"):
        run_command(target(Parts(), simulated=False), "sim", {"action": "xid", "device": "GPU-x", "xid": 48})


@pytest.mark.parametrize(
    ("name", "args", "words"),
    [
        ("sim", {"action": "burn"}, "unknown sim action 'burn'"),
        ("sim", {"action": "xid", "device": "GPU-1"}, "argument 'xid' is required"),
        (
            "sim",
            {"action": "xid", "device": "GPU-1", "xid": True},
            "argument 'xid' must be an integer, not bool",
        ),
        ("sim", {"action": "xid", "device": "nope", "xid": 48}, "no GPU or MIG device with UUID 'nope'"),
        ("sim", {"action": "mig", "gpu": 0, "layout": [1]}, "layout must be a list of profile names or null"),
        (
            "sim",
            {"action": "create-instance", "device": "GPU-1", "placement": 4},
            "argument 'gi_profile' is required",
        ),
        (
            "sim",
            {"action": "create-instance", "device": "GPU-1", "gi_profile": 9},
            "argument 'placement' is required",
        ),
        (
            "sim",
            {"action": "create-instance", "device": "GPU-1", "gi_profile": "9", "placement": 4},
            "argument 'gi_profile' must be an integer, not str",
        ),
        ("restart", {}, "unknown command 'restart'"),
    ],
)
def test_bad_commands_are_refused_with_what_is_wrong(name: str, args: dict[str, Json], words: str) -> None:
    """Arguments come from another process: each is checked, and a refusal names it."""
    reply = reply_to(target(Parts()), Command(name=name, args=args))
    assert not reply.ok and words in reply.error
