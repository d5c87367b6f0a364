"""The `Healthy` condition gpuvisor writes into a ResourceClaim's status.devices (supervisor/dra/
claimstatus.py), checked with the fake API server's copy of apimachinery's condition rules."""

from __future__ import annotations

from typing import Any

import pytest

from common.dracheckpoint import PreparedClaim, PreparedDevice
from supervisor.dra.claimstatus import ClaimStatusWriter, DeviceHealthView, condition_of
from supervisor.kube.errors import ApiError
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


class ClaimsApi:
    """ResourceClaims by name at a fake API server: GET and PUT of the status, each call recorded;
    a PUT for a name in `refuse` gets the server's 422."""

    stopped = False

    def __init__(self, names: tuple[str, ...], refuse: tuple[str, ...] = ()) -> None:
        self.store: dict[str, Any] = {
            n: {"metadata": {"name": n, "uid": f"uid-{n}", "generation": 1}, "status": {}} for n in names
        }
        self.refuse = refuse
        self.calls: list[tuple[str, str]] = []

    def get(self, path: str, *, what: str) -> Any:
        self.calls.append(("GET", path.rsplit("/", 1)[1]))
        return self.store[path.rsplit("/", 1)[1]]

    def request(self, method: str, path: str, *, what: str, body: Any) -> Any:
        name = path.rsplit("/", 2)[1]
        self.calls.append((method, name))
        if name in self.refuse:
            raise ApiError(what, 422, "Invalid", "must be an allocated device in the claim")
        self.store[name] = body
        return body


def _claim(name: str, device: str) -> PreparedClaim:
    dev = PreparedDevice(requests=("gpu",), pool="n1", device=device, cdi_device_ids=())
    return PreparedClaim(f"uid-{name}", "default", name, (dev,), 1.0)


def test_a_health_change_reads_and_writes_only_the_claims_it_touches() -> None:
    """Two prepared claims on gpu-0 and gpu-1: the first pass writes both; gpu-1 failing then
    reads and writes claim b alone; a pass with nothing changed makes no request at all."""
    client = ClaimsApi(("a", "b"))
    writer = ClaimStatusWriter(client, driver="gpu.nvidia.com")  # type: ignore[arg-type]
    claims = {"uid-a": _claim("a", "gpu-0"), "uid-b": _claim("b", "gpu-1")}
    healthy = {"gpu-0": DeviceHealthView(True), "gpu-1": DeviceHealthView(True)}
    writer._pass(claims, healthy)
    assert client.calls == [("GET", "a"), ("PUT", "a"), ("GET", "b"), ("PUT", "b")]
    client.calls.clear()
    failing = {**healthy, "gpu-1": DeviceHealthView(False, "XID 48", 5.0, "xid:48")}
    writer._pass(claims, failing)
    assert client.calls == [("GET", "b"), ("PUT", "b")]
    client.calls.clear()
    writer._pass(claims, failing)
    assert client.calls == []


def test_a_claim_the_server_refuses_does_not_stop_the_others() -> None:
    """The API server refuses claim a's status (422: its allocation changed meanwhile): claim b is
    still written, and a is counted as refused, not as a failed pass."""
    client = ClaimsApi(("a", "b"), refuse=("a",))
    writer = ClaimStatusWriter(client, driver="gpu.nvidia.com")  # type: ignore[arg-type]
    health = {"gpu-0": DeviceHealthView(True), "gpu-1": DeviceHealthView(True)}
    writer._pass({"uid-a": _claim("a", "gpu-0"), "uid-b": _claim("b", "gpu-1")}, health)
    assert client.store["b"]["status"]["devices"][0]["device"] == "gpu-1"
    assert writer.status()["refused"] == 1 and writer.writes == 1
