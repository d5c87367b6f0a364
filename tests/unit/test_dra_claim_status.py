"""The `Healthy` condition gpuvisor writes into a ResourceClaim's status.devices (supervisor/dra/
claimstatus.py), checked with the fake API server's copy of apimachinery's condition rules."""

from __future__ import annotations

import pytest

from supervisor.dra.claimstatus import DeviceHealthView, condition_of
from tests.kubeapi import condition_list_problems


@pytest.mark.parametrize(
    ("health", "status", "reason"),
    [
        (DeviceHealthView(True, "", 1_700_000_000.0), "True", "DeviceHealthy"),
        (
            DeviceHealthView(False, "XID 48 (double-bit ECC)", 1_700_000_100.0, "xid:48"),
            "False",
            "XidCriticalError",
        ),
        (DeviceHealthView(False, "GPU lost", 0.0, "lost"), "False", "GpuLost"),
        (DeviceHealthView(False, "", 0.0, ""), "False", "GpuUnhealthy"),
        (None, "Unknown", "HealthUnknown"),
    ],
)
def test_each_health_makes_a_condition_the_api_server_takes(
    health: DeviceHealthView | None, status: str, reason: str
) -> None:
    """Healthy, unhealthy with the Node's reason for its gravest condition, or unknown: each is a
    valid metav1.Condition (type, status, CamelCase reason, lastTransitionTime, generation)."""
    cond = condition_of(health, generation=3)
    assert (cond["type"], cond["status"], cond["reason"], cond["observedGeneration"]) == (
        "Healthy",
        status,
        reason,
        3,
    )
    assert condition_list_problems([cond], "conditions") == []


def test_a_long_reason_is_cut_to_a_bounded_message() -> None:
    """A reason of 5,000 characters becomes a message of at most 1,024."""
    cond = condition_of(DeviceHealthView(False, "x" * 5000, 0.0, "probe"), generation=0)
    assert len(cond["message"]) == 1024 and cond["message"].endswith("...")
