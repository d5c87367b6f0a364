"""The committed DRA-side API stubs: regenerating changes nothing, and packages, services, methods,
field names and numbers are the kubelet's (k8s.io/kubelet v0.34.0-v0.36.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.draapi import healthpb, regpb, v1, v1beta1
from tests.helpers import REPO


def test_regenerating_dra_stubs_changes_nothing(tmp_path: Path) -> None:
    """Regenerating every <name>_pb2.py/.pyi from its .proto gives byte for byte the committed files."""
    pytest.importorskip("grpc_tools")
    from common.draapi.generate import OUTPUTS, generate

    generate(tmp_path)
    for name in OUTPUTS:
        fresh = (tmp_path / "common" / "draapi" / name).read_bytes()
        committed = (Path(REPO) / "common" / "draapi" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run python -m common.draapi.generate"


CLAIM = {"namespace": 1, "uid": 2, "name": 3}
PREPARE_ONE = {"devices": 1, "error": 2}


@pytest.mark.parametrize(
    ("module", "message", "fields"),
    [
        (regpb, "PluginInfo", {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}),
        (regpb, "RegistrationStatus", {"plugin_registered": 1, "error": 2}),
        (regpb, "RegistrationStatusResponse", {}),
        (regpb, "InfoRequest", {}),
        (v1, "Claim", CLAIM),
        (v1, "NodePrepareResourcesRequest", {"claims": 1}),
        (v1, "NodePrepareResourcesResponse", {"claims": 1}),
        (v1, "NodePrepareResourceResponse", PREPARE_ONE),
        (
            v1,
            "Device",
            {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5},
        ),
        (v1, "NodeUnprepareResourcesRequest", {"claims": 1}),
        (v1, "NodeUnprepareResourcesResponse", {"claims": 1}),
        (v1, "NodeUnprepareResourceResponse", {"error": 1}),
        (v1beta1, "Claim", CLAIM),
        (v1beta1, "NodePrepareResourceResponse", PREPARE_ONE),
        (v1beta1, "Device", {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}),
        (v1beta1, "NodeUnprepareResourceResponse", {"error": 1}),
        (healthpb, "NodeWatchResourcesRequest", {}),
        (healthpb, "DeviceIdentifier", {"pool_name": 1, "device_name": 2}),
        (
            healthpb,
            "DeviceHealth",
            {
                "device": 1,
                "health": 2,
                "last_updated_time": 3,
                "health_check_timeout_seconds": 4,
                "message": 5,
            },
        ),
        (healthpb, "NodeWatchResourcesResponse", {"devices": 1}),
    ],
)
def test_field_names_and_numbers_are_the_kubelets(module: Any, message: str, fields: dict[str, int]) -> None:
    """Each message has exactly the kubelet's field names and numbers, in the kubelet's package."""
    descriptor = getattr(module, message).DESCRIPTOR
    assert {f.name: f.number for f in descriptor.fields} == fields
    assert descriptor.full_name == f"{module.DESCRIPTOR.package}.{message}"


def test_packages_services_and_methods_are_the_kubelets() -> None:
    """The full service names (the HTTP/2 paths) and their methods in order; the enum's values."""
    assert regpb.DESCRIPTOR.package == "pluginregistration"
    assert v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert healthpb.DESCRIPTOR.package == "v1alpha1"
    methods = {
        s.full_name: [m.name for m in s.methods]
        for mod in (regpb, v1, v1beta1, healthpb)
        for s in mod.DESCRIPTOR.services_by_name.values()
    }
    assert methods == {
        "pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"],
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"],
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"],
        "v1alpha1.DRAResourceHealth": ["NodeWatchResources"],
    }
    watch = healthpb.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"]
    assert watch.server_streaming and not watch.client_streaming
    assert {v.name: v.number for v in healthpb.HealthStatus.DESCRIPTOR.values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }


def test_share_id_is_optional_presence() -> None:
    """v1's share_id (1.35) is `optional`: an unset one is absent on the wire, not the empty string."""
    device = v1.Device(device_name="gpu-0")
    assert not device.HasField("share_id")
    assert v1.Device.FromString(device.SerializeToString()) == device
