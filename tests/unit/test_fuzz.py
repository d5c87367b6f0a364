"""Fuzzing with hypothesis: bad input gets a correct answer or a clear error, never a crash or a hang.

Allocate and GetPreferredAllocation are fuzzed through a real gRPC server on a unix socket (the
worker's servicer), the simulator's node-description loader through its YAML parser. (The
config loader and the ZeroMQ decoder have their own fuzz properties in test_config.py and
test_messages.py.)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.kubeletapi import pb
from common.kubeletapi.rpc import DevicePluginClient, unix_target
from common.model import ResourcePlan
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from supervisor.sim.nvml.config import SimulatorConfigError, parse_spec
from tests import nodes
from worker.devicebook import DeviceBook
from worker.server import PluginServer
from worker.service import PluginService

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _plans() -> dict[str, ResourcePlan]:
    config = config_from_data(
        {
            "version": "v1",
            "sharing": {"timeSlicing": {"resources": [{"name": "gpu", "devices": [4, 5], "replicas": 4}]}},
        },
        flags={"mig_strategy": "mixed"},
    )
    return plan_resources(nodes.mig_a100(), config)


PLANS = _plans()


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[str, DevicePluginClient]]:
    """One real gRPC server per resource of the mig-a100 plan, on unix sockets in a temp dir."""
    base = tempfile.mkdtemp(prefix="gvf", dir="/tmp")
    servers, channels, out = [], [], {}
    for resource, plan in PLANS.items():
        server = PluginServer(PluginService(DeviceBook(plan)), base)
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(unix_target(server.path))
        channels.append(channel)
        out[resource] = DevicePluginClient(channel)
    yield out
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(0)
    os.rmdir(base)


def _ids_strategy(resource: str) -> st.SearchStrategy[list[str]]:
    valid = [d.id for d in PLANS[resource].devices]
    other = [d.id for r, p in PLANS.items() if r != resource for d in p.devices][:20]
    junk = st.text(min_size=0, max_size=80)
    huge = st.just("G" * 10_000)
    return st.lists(st.one_of(st.sampled_from(valid), st.sampled_from(other), junk, huge), max_size=40)


@pytest.mark.parametrize("resource", sorted(PLANS))
def test_allocate_fuzz_answers_or_invalid_argument(
    clients: dict[str, DevicePluginClient], resource: str
) -> None:
    """Random, duplicated, foreign, huge and empty ID lists give a valid response or INVALID_ARGUMENT, never another error."""
    valid = {d.id for d in PLANS[resource].devices}
    shared = PLANS[resource].fail_requests_greater_than_one

    @FUZZ
    @given(ids=_ids_strategy(resource))
    def check(ids: list[str]) -> None:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        try:
            response = clients[resource].Allocate(request, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            assert any(i not in valid for i in ids) or shared
            return
        assert all(i in valid for i in ids)
        assert len(response.container_responses) == 1

    check()


@pytest.mark.parametrize("resource", sorted(PLANS))
def test_preferred_allocation_fuzz_never_errors(
    clients: dict[str, DevicePluginClient], resource: str
) -> None:
    """GetPreferredAllocation answers every request (NVIDIA #2038: an error would fail the pod), within the sizes asked."""

    @FUZZ
    @given(available=_ids_strategy(resource), must=_ids_strategy(resource), size=st.integers(-5, 100))
    def check(available: list[str], must: list[str], size: int) -> None:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must[:5], allocation_size=size
                )
            ]
        )
        response = clients[resource].GetPreferredAllocation(request, timeout=10)
        ids = list(response.container_responses[0].deviceIDs)
        assert len(ids) <= max(size, 0)
        assert len(ids) == len(set(ids))

    check()


_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
_gpu_keys = st.sampled_from(
    ["name", "uuid", "minor", "pci_bus_id", "memory_mib", "numa_node", "compute_capability", "mig"]
)


@settings(max_examples=300, deadline=None)
@given(
    doc=st.dictionaries(
        st.sampled_from(["name", "driver_version", "gpus", "topology", "faults", "other"]),
        st.one_of(_yaml_values, st.lists(st.dictionaries(_gpu_keys, _yaml_values, max_size=8), max_size=3)),
        max_size=5,
    )
)
def test_node_description_loader_fuzz(doc: dict[str, object]) -> None:
    """Any YAML node description gives a spec or a SimulatorConfigError naming file and key, never another exception."""
    text = yaml.safe_dump(doc)
    try:
        parse_spec(text, "fuzz.yaml")
    except SimulatorConfigError as exc:
        assert exc.file == "fuzz.yaml"
        assert str(exc).startswith("fuzz.yaml: ")


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_node_description_loader_fuzz_raw_text(text: str) -> None:
    """Arbitrary text (not even YAML) gives a SimulatorConfigError or a spec, never another exception."""
    with contextlib.suppress(SimulatorConfigError):
        parse_spec(text, "raw.yaml")
