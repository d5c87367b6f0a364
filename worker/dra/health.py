"""The DRA worker's devices' health as the kubelet's health stream shows it.

The worker holds the supervisor's health of its devices (the clone pattern, worker.healthcopy)
on a health board (worker.healthboard, the device-plugin worker's too); `response` turns it into
a `NodeWatchResourcesResponse`: every device of the pool, each time, with HEALTHY, UNHEALTHY or
UNKNOWN (not told yet), the reason as the message (1.36 shows it in the pod's status) and the
time of the answer as `last_updated_time`. So a new reason is a change to show, as is a first
record (the board's default `shown`). The kubelet marks a device UNKNOWN once its last report is
older than `health_check_timeout_seconds` (30 s by default), so streams also resend the whole
list every `RESEND_S` when nothing changed.
"""

from __future__ import annotations

from common.draapi import healthpb
from worker.healthboard import HealthBoard

RESEND_S = 10.0  # a third of the kubelet's default timeout: a lost answer or two cost nothing
TIMEOUT_S = 30  # what each device's report tells the kubelet to wait for the next (its default)
MAX_MESSAGE = 1024  # the kubelet cuts longer messages (dra-health v1alpha1 `message`)


def response(board: HealthBoard, now: float) -> healthpb.NodeWatchResourcesResponse:
    """Every device of the pool with its health, as of `now` (wall seconds)."""
    plan, health = board.records()
    pool = plan.dra.pool if plan.dra is not None else ""
    devices = []
    for device in plan.devices:
        h = health.get(device.id)
        status = healthpb.UNKNOWN if h is None else healthpb.HEALTHY if h.healthy else healthpb.UNHEALTHY
        message = "" if h is None else h.reason
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        devices.append(
            healthpb.DeviceHealth(
                device=healthpb.DeviceIdentifier(pool_name=pool, device_name=device.id),
                health=status,
                last_updated_time=int(now),
                health_check_timeout_seconds=TIMEOUT_S,
                message=message,
            )
        )
    return healthpb.NodeWatchResourcesResponse(devices=devices)
