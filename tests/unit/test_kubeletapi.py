"""The committed v1beta1 stubs: field numbers, service paths, and that regenerating changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.kubeletapi import pb
from tests.helpers import REPO


def test_regenerating_stubs_changes_nothing(tmp_path: Path) -> None:
    """Regenerating api_pb2*.py from api.proto gives byte-for-byte the committed files."""
    pytest.importorskip("grpc_tools")
    from common.kubeletapi.generate import generate

    generate(tmp_path)
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        fresh = (tmp_path / "common" / "kubeletapi" / name).read_bytes()
        committed = (Path(REPO) / "common" / "kubeletapi" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run python -m common.kubeletapi.generate"


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        ("DevicePluginOptions", {"pre_start_required": 1, "get_preferred_allocation_available": 2}),
        ("RegisterRequest", {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}),
        ("Device", {"ID": 1, "health": 2, "topology": 3}),
        ("NUMANode", {"ID": 1}),
        (
            "ContainerPreferredAllocationRequest",
            {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3},
        ),
        (
            "ContainerAllocateResponse",
            {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5},
        ),
        ("Mount", {"container_path": 1, "host_path": 2, "read_only": 3}),
        ("DeviceSpec", {"container_path": 1, "host_path": 2, "permissions": 3}),
        ("CDIDevice", {"name": 1}),
        ("PreStartContainerRequest", {"devices_ids": 1}),
    ],
)
def test_field_numbers_match_the_kubelet_api(message: str, fields: dict[str, int]) -> None:
    """Every message has exactly the kubelet's field names and numbers (docs/architecture.md)."""
    descriptor = getattr(pb, message).DESCRIPTOR
    assert {f.name: f.number for f in descriptor.fields} == fields
    assert descriptor.full_name == f"v1beta1.{message}"


def test_service_method_order_and_paths() -> None:
    """The DevicePlugin service has the kubelet's five methods in order; Registration has Register."""
    services = pb.DESCRIPTOR.services_by_name
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert services["DevicePlugin"].full_name == "v1beta1.DevicePlugin"
    assert [m.name for m in services["Registration"].methods] == ["Register"]
