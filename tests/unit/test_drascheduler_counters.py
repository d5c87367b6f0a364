"""The scheduler stand-in's counter accounting (tests/drascheduler.py Allocator with
tests/dracounters.py) over NVIDIA's DynamicMIG slices (tests/nvidiaparts.py) as the fake API
server stores them, for Kubernetes 1.34's layout and allocator (counter sets per slice) and
1.35's (per pool).

Sources: kubernetes/dynamic-resource-allocation structured/internal/experimental
allocator_experimental.go `checkAvailableCounters` (v0.34.0: the device's slice's
SharedCounters; v0.35.0: the pool's CounterSets), `isSelectable` (no counter-consuming device
without the gate) and `allocateOne` (no device from an invalid pool); pools_experimental.go
(v0.35.0) `buildPool`, `getAndValidateCounterSets`, `validateDeviceCounterConsumption`.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from tests import nvidiaparts as nv
from tests.dracounters import gather
from tests.drascheduler import Allocator, Unschedulable
from tests.kubeapi import FakeApiServer, RunningApiServer

NODE = "gpu-node-1"
CLASSES = {"gpu.nvidia.com": {"metadata": {"name": "gpu.nvidia.com"}, "spec": {}}}
VERSIONS = ["1.34.0", "1.35.0"]


def store(
    api: RunningApiServer, slices: list[dict[str, Any]], version: str, gate: bool = True
) -> FakeApiServer:
    """The slices created through the fake API server of `version` with the gate on or off (so
    they are what its rules and its gate leave of them); its state."""
    api.state.kube_version = version
    api.state.partitionable_devices = gate
    client = KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test")
    try:
        for obj in slices:
            client.request("POST", "/apis/resource.k8s.io/v1/resourceslices", what="create", body=obj)
    finally:
        client.close()
    assert api.state.errors == []
    return api.state


@pytest.fixture(params=VERSIONS)
def state(request: pytest.FixtureRequest, api: RunningApiServer) -> FakeApiServer:
    """A server of the version with the gate on and two H100s' slices in its layout."""
    return store(api, nv.node_slices(NODE, range(2), request.param), request.param)


def claim(*picks: tuple[int, str, int | None]) -> dict[str, Any]:
    """A claim with one request per (GPU minor, profile, placement start or None)."""
    requests = []
    for i, (gpu, profile, start) in enumerate(picks):
        attrs = "device.attributes['gpu.nvidia.com']"
        expr = f"{attrs}.minor == {gpu} && {attrs}.profile == '{profile}'"
        if start is not None:
            expr += f" && {attrs}.placementStart == {start}"
        requests.append({"name": f"r{i}", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                      "selectors": [{"cel": {"expression": expr}}]}})  # fmt: skip
    name = f"c-{uuid.uuid4().hex[:8]}"
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name, "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": requests}}}  # fmt: skip


def allocate(state: FakeApiServer, *picks: tuple[int, str, int | None]) -> dict[str, Any]:
    """Allocate as the scheduler does and write the claim to the server (its allocation is then
    what every later allocation counts)."""
    obj = Allocator.from_state(state, NODE, CLASSES).allocate(claim(*picks), ("pod", str(uuid.uuid4())))
    state.put_claim(obj)
    return obj


def devices_of(obj: dict[str, Any]) -> list[str]:
    return [r["device"] for r in obj["status"]["allocation"]["devices"]["results"]]


def test_a_full_gpu_and_a_mig_device_of_it_exclude_each_other(state: FakeApiServer) -> None:
    """The full GPU consumes every counter of its set: once it is allocated no MIG device of that
    GPU fits, and once a MIG device is, the full GPU does not; the other GPU is untouched."""
    assert devices_of(allocate(state, (0, "full", None))) == ["gpu-0"]
    with pytest.raises(Unschedulable, match="cannot allocate"):
        allocate(state, (0, "1g.10gb", None))
    assert devices_of(allocate(state, (1, "1g.10gb", 3))) == ["gpu-1-mig-1g10gb-19-3"]
    with pytest.raises(Unschedulable):
        allocate(state, (1, "full", None))


def test_mig_devices_on_disjoint_placements_fit_and_overlapping_ones_do_not(state: FakeApiServer) -> None:
    """Two 3g.40gb (memory slices 0-3 and 4-7) fit on one GPU; a 1g.10gb on slice 2 then does
    not (both placements of 3g hold it); on a fresh GPU 2g.20gb at 0 and 1g.20gb at 2 fit, but
    2g.20gb at 2 overlaps 1g.20gb at 2."""
    assert devices_of(allocate(state, (0, "3g.40gb", 0), (0, "3g.40gb", 4))) == [
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
    ]
    with pytest.raises(Unschedulable):
        allocate(state, (0, "1g.10gb", 2))
    allocate(state, (1, "2g.20gb", 0))
    allocate(state, (1, "1g.20gb", 2))
    with pytest.raises(Unschedulable):
        allocate(state, (1, "2g.20gb", 2))


def test_one_claim_is_searched_for_devices_that_fit_together(state: FakeApiServer) -> None:
    """Counters are checked for the claim's devices together (consumedCounters): a 4g.40gb
    (memory slices 0-3) and the 3g.40gb at 0 (0-3) do not fit together; with the 3g.40gb's
    placement left open the search passes over the one at 0 and takes the one at 4."""
    with pytest.raises(Unschedulable):
        allocate(state, (0, "4g.40gb", None), (0, "3g.40gb", 0))
    assert devices_of(allocate(state, (0, "4g.40gb", None), (0, "3g.40gb", None))) == [
        "gpu-0-mig-4g40gb-5-0",
        "gpu-0-mig-3g40gb-9-4",
    ]


def test_counters_come_back_when_the_claim_is_deallocated(state: FakeApiServer) -> None:
    """A claim deleted (or its allocation cleared) no longer consumes: the full GPU fits again;
    a claim another scheduler allocated (add_claim) counts the same as this one's."""
    first = allocate(state, (0, "7g.80gb", None))
    with pytest.raises(Unschedulable):
        allocate(state, (0, "full", None))
    state.delete_claim("default", first["metadata"]["name"])
    full = allocate(state, (0, "full", None))
    state.delete_claim("default", full["metadata"]["name"])
    state.add_claim("other", "theirs", NODE, ["gpu-0-mig-1g10gb-19-6"])
    with pytest.raises(Unschedulable):
        allocate(state, (0, "full", None))


def test_an_allocators_own_release_frees_its_counters(api: RunningApiServer) -> None:
    """Without the server's claims (the demos' allocator): release(uid) frees what allocate took."""
    server = store(api, nv.node_slices(NODE, range(1), "1.34.0"), "1.34.0")
    allocator = Allocator.from_state(server, NODE, CLASSES)
    allocator.state = None
    taken = allocator.allocate(claim((0, "full", None)), ("p", "u"))
    with pytest.raises(Unschedulable):
        allocator.allocate(claim((0, "1g.10gb", None)), ("p", "u"))
    allocator.release(taken["metadata"]["uid"])
    assert devices_of(allocator.allocate(claim((0, "1g.10gb", None)), ("p", "u"))) == [
        "gpu-0-mig-1g10gb-19-0"
    ]


def test_without_the_gate_no_counter_consuming_device_is_allocated(api: RunningApiServer) -> None:
    """Gate off on the server: the fields were dropped, every device is independent (the full GPU
    and its MIG devices can all be handed out: why a publisher must see the drop). And an
    allocator without the gate skips a device that still consumes counters (isSelectable)."""
    server = store(api, nv.node_slices(NODE, range(1), "1.34.0"), "1.34.0", gate=False)
    assert devices_of(allocate(server, (0, "full", None))) == ["gpu-0"]
    assert devices_of(allocate(server, (0, "7g.80gb", None))) == ["gpu-0-mig-7g80gb-0-0"]
    on = FakeApiServer(partitionable_devices=True)
    for obj in nv.node_slices(NODE, range(1), "1.34.0"):
        on.put_slice(obj)  # stored as sent, the fields kept
    allocator = Allocator.from_state(on, NODE, CLASSES)
    allocator.counters = None  # a scheduler without the gate
    with pytest.raises(Unschedulable):
        allocator.allocate(claim((0, "full", None)), ("p", "u"))


def test_135_a_pool_consuming_an_undefined_counter_set_is_invalid(api: RunningApiServer) -> None:
    """1.35's buildPool: a device consuming a set the pool lacks ("counter set %s not found"), or
    a set defined twice ("duplicate counter set name"), makes the pool invalid, and nothing is
    allocated from it (the API server let the slices through)."""
    counter_slice, device_slice = nv.node_slices(NODE, [0], "1.35.0")
    device_slice["spec"]["devices"][3]["consumesCounters"][0]["counterSet"] = "gpu-9-counter-set"
    server = store(api, [counter_slice, device_slice], "1.35.0")
    with pytest.raises(
        Unschedulable, match=r"invalid resource pools.*counter set gpu-9-counter-set not found"
    ):
        allocate(server, (0, "full", None))
    twice = nv.node_slices(NODE, [0], "1.35.0")
    twice.append({**twice[0], "metadata": {"name": "again"}})
    assert gather(twice, "1.35.0").invalid == "duplicate counter set name gpu-0-counter-set"
    assert gather(twice[:2], "1.35.0").invalid == ""


def test_134_counters_are_per_slice() -> None:
    """1.34's checkAvailableCounters reads the device's own slice: a set of the same name in
    another slice is a different set (so each slice's GPU is accounted alone)."""
    one, two = nv.node_slices(NODE, range(2), "1.34.0")
    two["spec"]["sharedCounters"][0]["name"] = "gpu-0-counter-set"
    for d in two["spec"]["devices"]:
        d["consumesCounters"][0]["counterSet"] = "gpu-0-counter-set"
    counters = gather([one, two], "1.34.0")
    assert sorted(counters.sets) == [
        (one["metadata"]["name"], "gpu-0-counter-set"),
        (two["metadata"]["name"], "gpu-0-counter-set"),
    ]
    full0 = (one["metadata"]["name"], {"gpu-0-counter-set": {"memory-slice-0": 1.0}})
    full1 = (two["metadata"]["name"], {"gpu-0-counter-set": {"memory-slice-0": 1.0}})
    assert counters.fits([full1], [full0])
    assert not counters.fits([full0], [full0])
    assert gather([one, two], "1.35.0").invalid == "duplicate counter set name gpu-0-counter-set"
