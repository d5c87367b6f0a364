"""The fake API server's partitionable devices (KEP-4815; tests/kubeapi/partitions.py): its rules
on `sharedCounters` and `consumesCounters` by the served version, the DRAPartitionableDevices
gate's dropping of them, and `GET /version`; with NVIDIA's DynamicMIG slices (tests/nvidiaparts.py)
as the input a publisher of that format must get through.

Sources (each test names its rule): kubernetes pkg/apis/resource/validation/validation.go of 1.34
(validateResourceSliceSpec, validateDevice, validateCounterSet, validateDeviceCounterConsumption;
read through validation_resourceslice_test.go's cases of that release and kubernetes/api v0.34.0
resource/v1/types.go) and of 1.35 (the same functions, validateSet, validateMap; kubernetes/api
v0.35.0 resource/v1/types.go); pkg/registry/resource/resourceslice/strategy.go
dropDisabledDRAPartitionableDevicesFields and draPartitionableDevicesFeatureInUse;
k8s.io/apimachinery pkg/version/types.go Info (v0.34.0).
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
from typing import Any

import pytest

from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.kube.errors import ApiError
from tests import nvidiaparts as nv
from tests.kubeapi import RunningApiServer
from tests.kubeapi.partitions import counter_problems, drop_partitionable, minor, uses_partitionable
from tests.kubeapi.validation import resource_slice_problems

NODE = "gpu-node-1"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
V134, V135 = "1.34.0", "1.35.0"


def one_gpu(version: str = V134, minor_: int = 0) -> dict[str, Any]:
    """1.34's slice of one GPU: its counter set and its 19 devices."""
    (obj,) = nv.node_slices(NODE, [minor_], version)
    return obj


def bare(name: str = "s", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, **spec},
    }  # fmt: skip


def counters(n: int, prefix: str = "c") -> dict[str, dict[str, str]]:
    return {f"{prefix}{i}": {"value": "1"} for i in range(n)}


def device(name: str, *consumes: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "consumesCounters": [{"counterSet": s, "counters": c} for s, c in consumes]}


# ---------------------------------------------------------------------------------- NVIDIA's layouts


@pytest.mark.parametrize("version", [V134, V135, "1.36.0"])
def test_nvidias_layout_of_eight_h100s_is_accepted_by_its_version(version: str) -> None:
    """NVIDIA's slices of 8 MIG-capable GPUs (19 devices each, 15 counters a set) pass the schema
    and the rules of the version they are made for: 1.34's one slice per GPU (within
    ResourceSliceMaxSharedCounters 32, ResourceSliceMaxCountersPerDevice 32,
    ResourceSliceMaxDeviceCountersPerSlice 1024), 1.35's counter slice of 8 sets
    (ResourceSliceMaxCounterSets 8) and devices-only slices (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters 64)."""
    for obj in nv.node_slices(NODE, range(8), version):
        assert resource_slice_problems(obj, version) == [], obj["metadata"]["name"]


def test_each_layout_is_refused_by_the_other_version() -> None:
    """1.35's validateResourceSliceSpec refuses a slice with both sharedCounters and devices
    ("only one of `sharedCounters` or `devices` is allowed"); 1.34's validateDevice refuses a
    device whose counter set is not in its own slice ("must reference a counterSet defined in
    the ResourceSlice sharedCounters"), so 1.35's devices-only slice fails there."""
    combined = one_gpu(V134)
    assert resource_slice_problems(combined, V135) == [
        'spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed'
    ]
    counter_slice, device_slice = nv.node_slices(NODE, [0], V135)
    assert resource_slice_problems(counter_slice, V134) == []  # counter sets alone are fine in 1.34
    problems = resource_slice_problems(device_slice, V134)
    assert len(problems) == 19
    assert problems[0] == (
        'spec.devices[0].consumesCounters[0].counterSet: Invalid value: "gpu-0-counter-set": '
        "must reference a counterSet defined in the ResourceSlice sharedCounters"
    )


def test_an_empty_devices_list_beside_counter_sets_is_refused_in_135() -> None:
    """1.35 tests `spec.SharedCounters != nil && spec.Devices != nil`: a JSON `"devices": []`
    decodes to a non-nil slice, so a counter-set slice must leave the field out."""
    obj = bare(sharedCounters=[nv.counter_set(0)], devices=[])
    assert "only one of `sharedCounters` or `devices` is allowed" in resource_slice_problems(obj, V135)[0]
    del obj["spec"]["devices"]
    assert resource_slice_problems(obj, V135) == []


# ---------------------------------------------------------------------------------- 1.34's rules


def test_134_total_shared_counters_is_at_most_32() -> None:
    """validateResourceSliceSpec (1.34): the counters of all sets summed at most
    ResourceSliceMaxSharedCounters (32): two GPUs' sets (30) fit, three (45) do not; so
    NVIDIA's format needs a slice per GPU there."""
    two = bare(sharedCounters=[nv.counter_set(0), nv.counter_set(1)])
    assert resource_slice_problems(two, V134) == []
    three = bare(sharedCounters=[nv.counter_set(i) for i in range(3)])
    assert resource_slice_problems(three, V134) == [
        "spec.sharedCounters: Invalid value: 45: the total number of shared counters must not exceed 32"
    ]


def test_134_a_device_and_a_slice_have_counter_limits() -> None:
    """validateDevice (1.34): at most ResourceSliceMaxCountersPerDevice (32) counters over a
    device's consumptions, reported at the device; validateResourceSliceSpec: at most
    ResourceSliceMaxDeviceCountersPerSlice (1024) over the slice's devices (the test file's
    "too-large-consumes-counter" and "too-many-device-counters-in-slice")."""
    sets = [{"name": f"set-{i}", "counters": counters(16)} for i in range(2)]
    big = device("d0", ("set-0", counters(16)), ("set-1", counters(16)))
    assert resource_slice_problems(bare(sharedCounters=sets, devices=[big]), V134) == []
    # 33 sets of one counter, all consumed by one device (the test file's case): both limits
    sets = [{"name": f"set-{i}", "counters": counters(1)} for i in range(33)]
    bigger = device("d0", *((f"set-{i}", counters(1)) for i in range(33)))
    assert resource_slice_problems(bare(sharedCounters=sets, devices=[bigger]), V134) == [
        "spec.devices[0]: Invalid value: 33: the total number of counters must not exceed 32",
        "spec.sharedCounters: Invalid value: 33: the total number of shared counters must not exceed 32",
    ]
    many = [device(f"d{i}", ("set-0", counters(16))) for i in range(65)]
    problems = resource_slice_problems(
        bare(sharedCounters=[{"name": "set-0", "counters": counters(16)}], devices=many), V134
    )
    assert problems == [
        "spec.devices: Invalid value: 1040: the total number of counters in devices must not exceed 1024"
    ]


def test_134_consumption_must_name_the_slices_set_and_counters() -> None:
    """validateDevice (1.34): the set and each counter consumed are defined in this slice's
    sharedCounters ("wrong-sharedcounterref-consumes-counter", "wrong-counterref-consumes-counter");
    a missing set name is Required and unreferenced ("missing-counterset-consumes-counter")."""
    sets = [{"name": "counterset-0", "counters": {"memory": {"value": "1Gi"}}}]
    wrong_set = bare(sharedCounters=sets, devices=[device("d", ("fake", {"memory": {"value": "1Gi"}}))])
    assert resource_slice_problems(wrong_set, V134) == [
        'spec.devices[0].consumesCounters[0].counterSet: Invalid value: "fake": '
        "must reference a counterSet defined in the ResourceSlice sharedCounters"
    ]
    wrong_counter = bare(
        sharedCounters=sets, devices=[device("d", ("counterset-0", {"fake": {"value": "1Gi"}}))]
    )
    assert resource_slice_problems(wrong_counter, V134) == [
        'spec.devices[0].consumesCounters[0].counters: Invalid value: "fake": '
        "must reference a counter defined in the ResourceSlice sharedCounters"
    ]
    unnamed = bare(sharedCounters=sets, devices=[device("d", ("", {"memory": {"value": "1Gi"}}))])
    assert resource_slice_problems(unnamed, V134) == [
        "spec.devices[0].consumesCounters[0].counterSet: Required value",
        'spec.devices[0].consumesCounters[0].counterSet: Invalid value: "": '
        "must reference a counterSet defined in the ResourceSlice sharedCounters",
    ]


def test_134_counter_sets_are_named_dns_labels_unique_and_not_empty() -> None:
    """validateCounterSet (1.34): name required and a DNS label, counters required and each a
    DNS label ("bad-name-shared-counters", "bad-countername-shared-counters",
    "missing-name-shared-counters"); validateSet: names unique, the duplicate at `.name`
    ("duplicate-shared-counters"); a device names each set once (types.go: "There can only be a
    single entry per counterSet")."""
    bad = counter_problems({"sharedCounters": [{"name": "GPU_0"}]}, V134)
    assert bad[0].startswith(
        'spec.sharedCounters[0].name: Invalid value: "GPU_0": a lowercase RFC 1123 label'
    )
    assert bad[1:] == ["spec.sharedCounters[0].counters: Required value"]
    # the schema (kubernetes-validate's) refuses a set without counters before these rules
    assert resource_slice_problems(bare(sharedCounters=[{"name": "s"}]), V134) != []
    bad_counter = counter_problems(
        {"sharedCounters": [{"name": "s", "counters": {"Memory": {"value": "1"}}}]}, V134
    )
    assert bad_counter[0].startswith(
        'spec.sharedCounters[0].counters[Memory]: Invalid value: "Memory": a lowercase'
    )
    unnamed = {"sharedCounters": [{"name": "", "counters": counters(1)}]}
    assert counter_problems(unnamed, V134) == ["spec.sharedCounters[0].name: Required value"]
    twice = bare(sharedCounters=[{"name": "s", "counters": counters(1)}] * 2)
    assert resource_slice_problems(twice, V134) == ['spec.sharedCounters[1].name: Duplicate value: "s"']
    dup = bare(sharedCounters=[{"name": "s", "counters": counters(2)}],
               devices=[device("d", ("s", counters(1)), ("s", counters(1)))])  # fmt: skip
    assert resource_slice_problems(dup, V134) == [
        'spec.devices[0].consumesCounters[1].counterSet: Duplicate value: "s"'
    ]
    empty = {"sharedCounters": [{"name": "s", "counters": counters(1)}], "devices": [device("d", ("s", {}))]}
    assert counter_problems(empty, V134) == ["spec.devices[0].consumesCounters[0].counters: Required value"]
    not_a_quantity = {"sharedCounters": [{"name": "s", "counters": {"a": {"value": "lots"}}}]}
    assert counter_problems(not_a_quantity, V134) == [
        'spec.sharedCounters[0].counters[a].value: Invalid value: "lots": must be a quantity'
    ]


# ---------------------------------------------------------------------------------- 1.35's rules


def test_135_at_most_8_counter_sets_of_32_counters() -> None:
    """validateResourceSliceSpec (1.35): validateSet(sharedCounters, ResourceSliceMaxCounterSets 8)
    stops at a 9th set ("Too many"); validateCounterSet's validateMap at a 33rd counter
    (ResourceSliceMaxCountersPerCounterSet 32). A node of 9 MIG GPUs cannot put all its sets in
    one slice."""
    assert resource_slice_problems(bare(sharedCounters=[nv.counter_set(i) for i in range(8)]), V135) == []
    nine = bare(sharedCounters=[nv.counter_set(i) for i in range(9)])
    assert resource_slice_problems(nine, V135) == [
        "spec.sharedCounters: Too many: 9: must have at most 8 items"
    ]
    wide = bare(sharedCounters=[{"name": "s", "counters": counters(33)}])
    assert resource_slice_problems(wide, V135) == [
        "spec.sharedCounters[0].counters: Too many: 33: must have at most 32 items"
    ]
    twice = bare(sharedCounters=[{"name": "s", "counters": counters(1)}] * 2)
    assert resource_slice_problems(twice, V135) == ['spec.sharedCounters[1]: Duplicate value: "s"']


def test_135_a_device_consumes_from_at_most_two_sets() -> None:
    """validateDevice (1.35): validateSet(consumesCounters,
    ResourceSliceMaxDeviceCounterConsumptionsPerDevice 2), unique by counterSet;
    validateDeviceCounterConsumption: at most 32 counters each
    (ResourceSliceMaxCountersPerDeviceCounterConsumption). What they name is not the API
    server's to check any more: a set no slice defines passes (the scheduler refuses the pool)."""
    ok = bare(devices=[device("d", ("a", counters(32)), ("b", counters(1)))])
    assert resource_slice_problems(ok, V135) == []
    three = bare(devices=[device("d", ("a", counters(1)), ("b", counters(1)), ("c", counters(1)))])
    assert resource_slice_problems(three, V135) == [
        "spec.devices[0].consumesCounters: Too many: 3: must have at most 2 items"
    ]
    dup = bare(devices=[device("d", ("a", counters(1)), ("a", counters(1)))])
    assert resource_slice_problems(dup, V135) == ['spec.devices[0].consumesCounters[1]: Duplicate value: "a"']
    wide = bare(devices=[device("d", ("a", counters(33)))])
    assert resource_slice_problems(wide, V135) == [
        "spec.devices[0].consumesCounters[0].counters: Too many: 33: must have at most 32 items"
    ]
    assert resource_slice_problems(bare(devices=[device("d", ("Bad", counters(1)))]), V135)[0].startswith(
        'spec.devices[0].consumesCounters[0].counterSet: Invalid value: "Bad": a lowercase RFC 1123 label'
    )


def test_135_a_slice_whose_devices_consume_counters_holds_64_devices() -> None:
    """validateResourceSliceSpec (1.35): ResourceSliceMaxDevicesWithTaintsOrConsumesCounters (64)
    where a device consumes counters or has taints, else ResourceSliceMaxDevices (128); 1.34 has
    no such limit. All 8 GPUs' devices (152) in one slice: too many either way."""
    plain = bare(devices=[{"name": f"d{i}"} for i in range(100)])
    assert resource_slice_problems(plain, V135) == []
    counted = bare(devices=[device(f"d{i}", ("a", counters(1))) for i in range(65)])
    assert resource_slice_problems(counted, V135) == [
        "spec.devices: Too many: 65: must have at most 64 items"
    ]
    every = bare(devices=[d for m in range(8) for d in nv.devices(m)])
    assert resource_slice_problems(every, V135) == ["spec.devices: Too many: 152: must have at most 64 items"]


def test_taints_per_device_are_4_in_134_and_16_in_135() -> None:
    """DeviceTaintsMaxLength: 4 in kubernetes/api v0.34.0, 16 in v0.35.0."""
    taint = {"key": "example.com/t", "effect": "NoSchedule"}
    obj = bare(devices=[{"name": "d", "taints": [taint] * 5}])
    assert resource_slice_problems(obj, V134) == [
        "spec.devices[0].taints: Too many: 5: must have at most 4 items"
    ]
    assert resource_slice_problems(obj, V135) == []


def test_versions_are_read_by_their_minor() -> None:
    """kube_version picks 1.34's rules below 1.35 and 1.35's from there ("v1.35.2-gke.1" too)."""
    assert [minor(v) for v in ("1.34.0", "v1.35.2-gke.1", "1.36.1")] == [34, 35, 36]
    with pytest.raises(ValueError, match=r"not a Kubernetes 1\.x version"):
        minor("2.0")


# ---------------------------------------------------------------------------------- the gate


def kube(api: RunningApiServer) -> KubeClient:
    return KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test")


def test_without_the_gate_the_fields_are_dropped_on_create(api: RunningApiServer) -> None:
    """dropDisabledDRAPartitionableDevicesFields (gate off, 1.33-1.35's default): sharedCounters,
    perDeviceNodeSelection and the devices' consumesCounters and node selection are gone from
    what is stored and answered; nothing is refused."""
    client = kube(api)
    try:
        stored = client.request("POST", SLICES, what="create", body=one_gpu())
        assert "sharedCounters" not in stored["spec"]
        assert all("consumesCounters" not in d for d in stored["spec"]["devices"])
        assert len(stored["spec"]["devices"]) == 19 and api.state.errors == []
    finally:
        client.close()
    spec = bare(
        perDeviceNodeSelection=True, devices=[{"name": "d", "nodeName": NODE, "consumesCounters": []}]
    )["spec"]
    assert uses_partitionable(spec)
    drop_partitionable(spec)
    assert spec["devices"] == [{"name": "d"}] and "perDeviceNodeSelection" not in spec


def test_without_the_gate_an_update_keeps_fields_already_stored(api: RunningApiServer) -> None:
    """draPartitionableDevicesFeatureInUse(oldSlice): with the gate off, an update of a slice
    stored with counters (while the gate was on) keeps them; one stored without them gets them
    dropped."""
    client = kube(api)
    try:
        api.state.partitionable_devices = True
        stored = client.request("POST", SLICES, what="create", body=one_gpu())
        assert stored["spec"]["sharedCounters"][0]["name"] == "gpu-0-counter-set"
        api.state.partitionable_devices = False
        stored["spec"]["devices"] = stored["spec"]["devices"][:5]
        again = client.request("PUT", f"{SLICES}/{stored['metadata']['name']}", what="update", body=stored)
        assert again["spec"]["sharedCounters"] and again["spec"]["devices"][1]["consumesCounters"]
        plain = bare("plain", devices=[{"name": "d"}])
        first = client.request("POST", SLICES, what="create", body=plain)
        first["spec"]["devices"] = [device("d", ("a", counters(1)))]
        first["spec"]["sharedCounters"] = [{"name": "a", "counters": counters(1)}]
        second = client.request("PUT", f"{SLICES}/plain", what="update", body=first)
        assert second["spec"] == plain["spec"]
    finally:
        client.close()


def test_with_the_gate_the_fields_are_kept_and_checked(api: RunningApiServer) -> None:
    """Gate on: the stored slice has its counters; a slice against the served version's rules
    (1.35: counters and devices together) is a 422 with the rule's words."""
    api.state.partitionable_devices = True
    api.state.kube_version = V135
    client = kube(api)
    try:
        for obj in nv.node_slices(NODE, range(2), V135):
            stored = client.request("POST", SLICES, what="create", body=obj)
            assert stored["spec"] == obj["spec"]
        with pytest.raises(ApiError) as refused:
            client.request("POST", SLICES, what="create", body=one_gpu(V134, 5))
        assert refused.value.status == 422
        assert "only one of `sharedCounters` or `devices` is allowed" in str(refused.value)
    finally:
        client.close()


# ---------------------------------------------------------------------------------- /version


def _raw_get(api: RunningApiServer, path: str, token: str | None) -> tuple[int, Any]:
    context = ssl.create_default_context(cadata=base64.b64decode(api.ca_data).decode())
    conn = http.client.HTTPSConnection("127.0.0.1", api.port, context=context, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_version_answers_the_served_version_as_kube_apiserver(api: RunningApiServer) -> None:
    """GET /version: k8s.io/apimachinery pkg/version Info for kube_version (major, minor, the
    emulation and minimum-compatibility versions, gitVersion "v1.35.2", ...), to the anonymous
    user too (system:public-info-viewer); an unknown bearer token is still a 401."""
    api.state.kube_version = "1.35.2"
    client = kube(api)
    try:
        info = client.get("/version", what="version")
    finally:
        client.close()
    assert {k: info[k] for k in ("major", "minor", "gitVersion", "emulationMinor", "minCompatibilityMinor")} == {
        "major": "1", "minor": "35", "gitVersion": "v1.35.2", "emulationMinor": "35", "minCompatibilityMinor": "34"
    }  # fmt: skip
    assert set(info) >= {"gitCommit", "gitTreeState", "buildDate", "goVersion", "compiler", "platform"}
    assert _raw_get(api, "/version", None)[0] == 200
    assert _raw_get(api, "/version", "not-a-token")[0] == 401
    api.state.version_overrides = {"minor": "34+", "gitVersion": "v1.34.2-eks-4f9c3a1"}
    status, info = _raw_get(api, "/version", None)
    assert (status, info["minor"], info["gitVersion"]) == (200, "34+", "v1.34.2-eks-4f9c3a1")
    assert api.state.errors == []
