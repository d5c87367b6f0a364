"""GPU health as the Node shows it: the `GPUUnhealthy` condition and the Events, as plain data.

Node Problem Detector's convention, which on-call engineers and autoscalers already read: one
condition type per problem, status `True` while it holds and `False` once it is over, a CamelCase
reason and a message a person can act on; `lastTransitionTime` moves only when the status does.
Here the problem is "a GPU device is out of the kubelet's allocatable": `True` while any device
of any resource is Unhealthy in the health book, with the reason of the gravest condition behind
it (`GpuLost`, `DoubleBitEccError`, `XidCriticalError`, ...) and a message naming the devices,
the GPUs (index and UUID) and what happened to each; `False` (`GpusHealthy`) once all are back.

Each change batch that takes devices out or brings them back is an Event: `Warning` with the
reason of the condition it raised, or `Normal` `GpuRecovered`, worded as the health log's line.

Pure functions of the health book's views; the writer (supervisor/cluster/writer.py) sends them.
Messages are bounded (a node of many GPUs under a storm still writes a short condition).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.health.book import ChangeBatch, ConditionView

CONDITION_TYPE = "GPUUnhealthy"
HEALTHY_REASON = "GpusHealthy"
RECOVERED_REASON = "GpuRecovered"
MAX_MESSAGE = 1024

# The health book's condition names -> reasons, gravest first: the condition's reason is the one
# of the gravest condition behind an Unhealthy device.
_REASONS: tuple[tuple[str, str], ...] = (
    ("lost", "GpuLost"),
    ("ecc:double-bit", "DoubleBitEccError"),
    ("xid:", "XidCriticalError"),
    ("ecc:single-bit", "SingleBitEccError"),
    ("probe", "GpuHealthProbeFailed"),
    ("event-wait", "NvmlEventWaitFailed"),
    ("mps:", "MpsDaemonDown"),
)


def reason_of(condition_name: str) -> str:
    for prefix, reason in _REASONS:
        if condition_name == prefix or (prefix.endswith(":") and condition_name.startswith(prefix)):
            return reason
    return "GpuUnhealthy"


def _gravity(condition_name: str) -> int:
    for rank, (prefix, _reason) in enumerate(_REASONS):
        if condition_name == prefix or (prefix.endswith(":") and condition_name.startswith(prefix)):
            return rank
    return len(_REASONS)


@dataclass(frozen=True)
class NodeCondition:
    status: str  # "True" or "False"
    reason: str
    message: str


@dataclass(frozen=True)
class NodeEvent:
    type: str  # "Warning" or "Normal"
    reason: str
    message: str


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def node_condition(
    unhealthy: Mapping[str, Sequence[str]],
    total: int,
    conditions: Sequence[ConditionView],
    gpu_index: Mapping[str, int],
) -> NodeCondition:
    """The condition for the book as it is: `unhealthy` device IDs by resource, `total` devices,
    the book's conditions, and the GPUs' indexes by UUID."""
    out = {r: list(ids) for r, ids in sorted(unhealthy.items()) if ids}
    count = sum(len(ids) for ids in out.values())
    if not count:
        return NodeCondition("False", HEALTHY_REASON, f"all {total} GPU devices are healthy")
    gravest = min(conditions, key=lambda c: _gravity(c.name), default=None)
    reason = reason_of(gravest.name) if gravest is not None else "GpuUnhealthy"
    devices = "; ".join(
        f"{r}: {', '.join(ids[:8])}{f' and {len(ids) - 8} more' if len(ids) > 8 else ''}"
        for r, ids in out.items()
    )
    causes = []
    for c in sorted(conditions, key=lambda c: (_gravity(c.name), gpu_index.get(c.gpu_uuid, -1))):
        index = gpu_index.get(c.gpu_uuid)
        where = f"GPU {index} ({c.gpu_uuid})" if index is not None else c.gpu_uuid
        if c.gi is not None:
            where += f" GI {c.gi}" + (f" CI {c.ci}" if c.ci is not None else "")
        causes.append(f"{where}: {c.reason}")
    text = f"{count} of {total} GPU devices Unhealthy ({devices}). " + "; ".join(causes)
    return NodeCondition("True", reason, _shorten(text))


def condition_patch(
    current: Mapping[str, Any] | None, wanted: NodeCondition, now: str
) -> dict[str, Any] | None:
    """The strategic-merge patch of the Node's status that makes its GPUUnhealthy condition
    `wanted` (merged by type: no other condition is touched), or None when it already is.
    `lastTransitionTime` is kept unless the status changes."""
    if current is not None and (current.get("status"), current.get("reason"), current.get("message")) == (
        wanted.status,
        wanted.reason,
        wanted.message,
    ):
        return None
    transition = now
    if current is not None and current.get("status") == wanted.status and current.get("lastTransitionTime"):
        transition = str(current["lastTransitionTime"])
    condition = {
        "type": CONDITION_TYPE,
        "status": wanted.status,
        "reason": wanted.reason,
        "message": wanted.message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": transition,
    }
    return {"status": {"conditions": [condition]}}


def health_event(batch: ChangeBatch, line: str) -> NodeEvent:
    """The Event of one change batch: a Warning with its condition's reason when it takes devices
    out, a Normal GpuRecovered when it brings them back; the message is the health log's line."""
    message = _shorten(line.removeprefix("health event: ").removeprefix("health "))
    if any(not c.healthy for c in batch.changes):
        return NodeEvent("Warning", reason_of(batch.raised) if batch.raised else "GpuUnhealthy", message)
    return NodeEvent("Normal", RECOVERED_REASON, message)
