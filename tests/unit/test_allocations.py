"""supervisor/observe/allocations.py: allocations from the kubelet checkpoint and the pod-resources API."""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.cli import format_status
from supervisor.observe.allocations import (
    CHECKPOINT_NAME,
    Allocation,
    current_allocations,
    parse_checkpoint,
    read_checkpoint,
)
from supervisor.observe.podresources import LIST_METHOD, lister_handler, prpb
from tests.helpers import REPO, short_tmpdir

OURS = {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"}
RESP = base64.b64encode(b"\x0a\x00").decode()  # stands in for a ContainerAllocateResponse


def checkpoint(entries: list[Any], **data: Any) -> str:
    return json.dumps(
        {
            "Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"nvidia.com/gpu": ["GPU-a"]}, **data},
            "Checksum": 12345,
        }
    )


def entry(uid: str, container: str, resource: str, ids: Any, **extra: Any) -> dict[str, Any]:
    return {
        "PodUID": uid,
        "ContainerName": container,
        "ResourceName": resource,
        "DeviceIDs": ids,
        "AllocResp": RESP,
        **extra,
    }


def test_numa_keyed_checkpoint_is_read_and_filtered() -> None:
    """1.20+ DeviceIDs ({numa: [ids]}) give one allocation per entry of our resources only."""
    text = checkpoint(
        [
            entry("uid-1", "train", "nvidia.com/gpu", {"0": ["GPU-a", "GPU-b"], "1": ["GPU-c"]}, Future="x"),
            entry("uid-2", "infer", "nvidia.com/mig-1g.10gb", {"-1": ["MIG-x"]}),
            entry("uid-3", "nic", "example.com/nic", {"0": ["eth1"]}),
        ],
        Unknown=True,
    )
    got, warnings = parse_checkpoint(text, OURS)
    assert warnings == []
    assert got == [
        Allocation("uid-1", "train", "nvidia.com/gpu", ("GPU-a", "GPU-b", "GPU-c")),
        Allocation("uid-2", "infer", "nvidia.com/mig-1g.10gb", ("MIG-x",)),
    ]


def test_plain_list_checkpoint_before_1_20() -> None:
    """Pre-1.20 DeviceIDs (a plain list) read the same; a device under two NUMA keys counts once."""
    got, _ = parse_checkpoint(checkpoint([entry("u", "c", "nvidia.com/gpu", ["GPU-b", "GPU-a"])]), OURS)
    assert got[0].devices == ("GPU-b", "GPU-a")
    got, _ = parse_checkpoint(
        checkpoint([entry("u", "c", "nvidia.com/gpu", {"0": ["GPU-a"], "1": ["GPU-a"]})]), OURS
    )
    assert got[0].devices == ("GPU-a",)


@pytest.mark.parametrize(
    ("text", "count", "warning"),
    [
        ("{not json", 0, "not valid JSON"),
        ('["Data"]', 0, 'no "Data" object'),
        ('{"Data": 3}', 0, 'no "Data" object'),
        ('{"Data": {"PodDeviceEntries": {}}}', 0, "is not a list"),
        ('{"Data": {}}', 0, ""),
        ('{"Data": {"PodDeviceEntries": null}}', 0, ""),
        (
            checkpoint([entry("u", "c", "nvidia.com/gpu", ["GPU-a"]), 7, {"PodUID": 1}]),
            1,
            "skipped 2 malformed entries",
        ),
        (checkpoint([entry("u", "c", "nvidia.com/gpu", {"0": "GPU-a"})]), 0, "skipped 1 malformed entry"),
        (checkpoint([entry("u", "c", "nvidia.com/gpu", 5)]), 0, "skipped 1 malformed entry"),
        (checkpoint([entry("u", "c", "nvidia.com/gpu", None)]), 1, ""),
    ],
)
def test_malformed_checkpoints_give_warnings_not_errors(text: str, count: int, warning: str) -> None:
    """A broken checkpoint yields what is readable plus a warning naming the problem; never raises."""
    got, warnings = parse_checkpoint(text, OURS, where="CP")
    assert len(got) == count
    if warning:
        assert len(warnings) == 1 and warning in warnings[0] and warnings[0].startswith("CP")
    else:
        assert warnings == []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["Data", "PodDeviceEntries", "PodUID", "ContainerName", "ResourceName", "DeviceIDs", "0"]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_json)
def test_any_json_shape_is_survived(doc: Any) -> None:
    """Whatever JSON the file holds, parsing returns lists and never raises."""
    got, warnings = parse_checkpoint(json.dumps(doc), None)
    assert isinstance(got, list) and isinstance(warnings, list)


def test_a_missing_checkpoint_is_no_allocations_without_a_warning(tmp_path: Path) -> None:
    """No checkpoint is normal (nothing allocated yet): no allocations, no warning, the checkpoint
    still the source; one that cannot be read (a directory in its place) is a warning with the path."""
    assert read_checkpoint(str(tmp_path / CHECKPOINT_NAME), OURS) == ([], [])
    view = current_allocations(str(tmp_path), OURS, pod_resources_socket="")
    assert (view.allocations, view.warnings, view.source) == ([], [], "checkpoint")
    (tmp_path / CHECKPOINT_NAME).mkdir()
    got, warnings = read_checkpoint(str(tmp_path / CHECKPOINT_NAME), OURS)
    assert got == [] and "cannot read" in warnings[0] and str(tmp_path) in warnings[0]


def test_checkpoint_is_used_without_the_pod_resources_socket(tmp_path: Path) -> None:
    """current_allocations reads <plugin dir>/kubelet_internal_checkpoint when no API socket exists."""
    (tmp_path / CHECKPOINT_NAME).write_text(checkpoint([entry("uid-1", "c", "nvidia.com/gpu", ["GPU-a"])]))
    view = current_allocations(str(tmp_path), OURS, pod_resources_socket=str(tmp_path / "absent.sock"))
    assert view.source == "checkpoint" and view.warnings == []
    assert view.to_status() == [
        {
            "pod": "uid-1",
            "pod_uid": "uid-1",
            "namespace": "",
            "container": "c",
            "resource": "nvidia.com/gpu",
            "devices": ["GPU-a"],
        }
    ]


def _pods() -> prpb.ListPodResourcesResponse:
    return prpb.ListPodResourcesResponse(
        pod_resources=[
            prpb.PodResources(
                name="trainer-0",
                namespace="ml",
                containers=[
                    prpb.ContainerResources(
                        name="main",
                        devices=[
                            prpb.ContainerDevices(
                                resource_name="nvidia.com/gpu", device_ids=["GPU-a", "GPU-b"]
                            ),
                            prpb.ContainerDevices(resource_name="example.com/nic", device_ids=["eth1"]),
                        ],
                    ),
                    prpb.ContainerResources(name="sidecar"),
                ],
            ),
            prpb.PodResources(
                name="web", namespace="default", containers=[prpb.ContainerResources(name="app")]
            ),
        ]
    )


@pytest.fixture
def kubelet_pod_resources() -> Iterator[str]:
    """A real gRPC server for v1.PodResourcesLister/List on a unix socket."""
    with short_tmpdir() as d:
        path = os.path.join(d, "kubelet.sock")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers((lister_handler(lambda request, context: _pods()),))
        server.add_insecure_port(f"unix:{path}")
        server.start()
        try:
            yield path
        finally:
            server.stop(0).wait(5)


def test_pod_resources_api_is_preferred_and_names_pods(kubelet_pod_resources: str, tmp_path: Path) -> None:
    """With the pod-resources socket present, allocations come from List with namespace/name."""
    (tmp_path / CHECKPOINT_NAME).write_text(checkpoint([entry("uid-9", "c", "nvidia.com/gpu", ["GPU-z"])]))
    view = current_allocations(str(tmp_path), OURS, pod_resources_socket=kubelet_pod_resources)
    assert view.source == "pod-resources" and view.warnings == []
    assert view.allocations == [
        Allocation("", "main", "nvidia.com/gpu", ("GPU-a", "GPU-b"), pod_name="trainer-0", namespace="ml")
    ]
    table = format_status({"pid": 1, "workers": [], "resources": {}, "allocations": view.to_status()})
    assert "ml/trainer-0" in table and "GPU-a,GPU-b" in table


def test_a_dead_pod_resources_socket_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """A socket file nobody answers on: a warning, then the checkpoint's allocations."""
    (tmp_path / CHECKPOINT_NAME).write_text(checkpoint([entry("uid-1", "c", "nvidia.com/gpu", ["GPU-a"])]))
    with short_tmpdir() as d:
        path = os.path.join(d, "kubelet.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(path)  # bound, never listening: connections are refused
            view = current_allocations(str(tmp_path), OURS, pod_resources_socket=path, timeout=5)
    assert view.source == "checkpoint"
    assert [a.pod_uid for a in view.allocations] == ["uid-1"]
    assert "pod-resources API" in view.warnings[0] and "falling back" in view.warnings[0]


def test_regenerating_pod_resources_stubs_changes_nothing(tmp_path: Path) -> None:
    """Regenerating api_pb2.py/.pyi from the pod-resources api.proto gives the committed files."""
    pytest.importorskip("grpc_tools")
    from supervisor.observe.podresources.generate import OUTPUTS, generate

    generate(tmp_path)
    for name in OUTPUTS:
        fresh = (tmp_path / "supervisor" / "observe" / "podresources" / name).read_bytes()
        committed = (Path(REPO) / "supervisor" / "observe" / "podresources" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run python -m supervisor.observe.podresources.generate"


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        ("ListPodResourcesResponse", {"pod_resources": 1}),
        ("PodResources", {"name": 1, "namespace": 2, "containers": 3}),
        ("ContainerResources", {"name": 1, "devices": 2}),
        ("ContainerDevices", {"resource_name": 1, "device_ids": 2}),
    ],
)
def test_pod_resources_field_numbers(message: str, fields: dict[str, int]) -> None:
    """Field names and numbers match k8s.io/kubelet/pkg/apis/podresources/v1/api.proto."""
    descriptor = getattr(prpb, message).DESCRIPTOR
    assert {f.name: f.number for f in descriptor.fields} == fields
    assert descriptor.full_name == f"v1.{message}"


def test_list_method_path() -> None:
    """The call goes to /v1.PodResourcesLister/List, as the kubelet serves it."""
    assert LIST_METHOD == "/v1.PodResourcesLister/List"
    assert (
        prpb.DESCRIPTOR.services_by_name["PodResourcesLister"].methods_by_name["List"].full_name
        == "v1.PodResourcesLister.List"
    )
