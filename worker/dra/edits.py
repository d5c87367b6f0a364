"""What a prepared claim adds to its containers, and the sharing steps that add it.

A claim's devices reach its containers through the claim's own CDI spec (one per claim, written
before the kubelet hears the answer, removed at unprepare). Besides the devices' nodes and the
driver's files, a claim's sharing configuration contributes `ContainerEdits`: an MPS claim's
pipe directory, shm mount and limits, say. The shapes follow the CDI spec's `containerEdits`
(github.com/cncf-tags/container-device-interface, specs-go/config.go), so `to_json` is what the
spec file holds.

`ClaimMps` is the step that runs a claim's MPS control daemon: `start` returns once the daemon
answers with its limits set (or raises `SharingError` having left nothing running), `stop` ends
it; both are idempotent by claim UID, so a prepare or unprepare the kubelet repeats after a
restart is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class SharingError(Exception):
    """A claim's sharing cannot be applied; the text names the setting and why."""


@dataclass(frozen=True)
class CdiMount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostPath": self.host_path, "containerPath": self.container_path}
        if self.options:
            out["options"] = list(self.options)
        return out


@dataclass(frozen=True)
class ContainerEdits:
    """CDI containerEdits: environment ("NAME=value"), mounts."""

    env: tuple[str, ...] = ()
    mounts: tuple[CdiMount, ...] = ()

    def __add__(self, other: ContainerEdits) -> ContainerEdits:
        return ContainerEdits(self.env + other.env, self.mounts + other.mounts)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.env:
            out["env"] = list(self.env)
        if self.mounts:
            out["mounts"] = [m.to_json() for m in self.mounts]
        return out


@dataclass(frozen=True)
class MpsLimits:
    """An MPS claim's settings, decoded and checked (NVIDIA's MpsConfig): each None when unset."""

    active_thread_percentage: int | None = None  # 1..100
    pinned_memory_limit: int | None = None  # bytes, every device of the claim
    per_device_pinned_memory_limit: Mapping[str, int] = field(default_factory=dict)  # GPU UUID -> bytes


class ClaimMps(Protocol):
    def start(self, claim_uid: str, gpu_uuids: Sequence[str], limits: MpsLimits) -> ContainerEdits: ...

    def stop(self, claim_uid: str) -> None: ...
