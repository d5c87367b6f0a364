"""GetPreferredAllocation: how long the policy takes to choose (target under 5 ms per call).

In-process timing of `PreferredPolicy.select` (what the worker runs for each call) on two plans
built by the real planner from hand-made nodes:
- 8 GPUs (dgx-h100-like, NVLink mesh, 2 NUMA nodes): the topology search, sizes 1..8, with all
  GPUs available and with random subsets available (some already taken);
- 16 GPUs x 64 replicas (time-slicing, 1024 device IDs): the greedy spread over GPUs, sizes
  1..16, with a random part of the replicas already allocated.
Then the same 8-GPU call once through gRPC on a unix socket (a PluginServer in this process), for
reference: the policy's share of a real call.
"""

from __future__ import annotations

import random

import grpc

from common.kubeletapi import pb
from common.kubeletapi.rpc import DevicePluginClient, unix_target
from common.model import Node, ResourcePlan
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.benchmarks.common import Row, Timer, p50
from tests.helpers import short_tmpdir
from worker.devicebook import DeviceBook
from worker.preferred import PreferredPolicy
from worker.server import PluginServer
from worker.service import PluginService

GPU = "nvidia.com/gpu"
TARGET = "< 5 ms"


def plan_8_gpus() -> ResourcePlan:
    return plan_resources(nodes.dgx_h100(), config_from_data(None))[GPU]


def plan_16x64() -> ResourcePlan:
    gpus = tuple(nodes.make_gpu(0x16, i, nodes.H100_80GB, 81559, numa_node=i // 8) for i in range(16))
    node = Node(gpus=gpus, driver_version="550.54.15", cuda_driver_version=12040)
    config = config_from_data(
        {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": GPU, "replicas": 64}]}}}
    )
    return plan_resources(node, config)[GPU]


def _cases(
    ids: list[str], sizes: list[int], rounds: int, rng: random.Random, free_share: float
) -> list[tuple[list[str], int]]:
    """(available, size) requests: each size with everything free, then with random subsets free."""
    cases: list[tuple[list[str], int]] = []
    for _ in range(rounds):
        for size in sizes:
            cases.append((list(ids), size))
            free = [i for i in ids if rng.random() < free_share]
            if len(free) < size:
                free = rng.sample(ids, size)
            cases.append((free, size))
    return cases


def _time_policy(plan: ResourcePlan, sizes: list[int], rounds: int, free_share: float) -> Timer:
    policy = PreferredPolicy(plan)
    ids = [d.id for d in plan.devices]
    cases = _cases(ids, sizes, rounds, random.Random(1), free_share)
    for available, size in cases[:10]:  # warm-up: first-call costs are not what we measure
        policy.select(available, [], size)
    timer = Timer()
    for available, size in cases:
        with timer:
            answer = policy.select(available, [], size)
        assert len(answer) == size, f"asked {size}, got {len(answer)}"
    return timer


def _time_grpc(plan: ResourcePlan, rounds: int) -> Timer:
    timer = Timer()
    with short_tmpdir("gvb") as d:
        server = PluginServer(PluginService(DeviceBook(plan)), d)
        server.start()
        channel = grpc.insecure_channel(unix_target(server.path))
        try:
            client = DevicePluginClient(channel)
            ids = [dev.id for dev in plan.devices]
            for i in range(rounds + 20):
                request = pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=ids, allocation_size=1 + i % 8
                        )
                    ]
                )
                if i < 20:  # warm-up: connection and first-call costs
                    client.GetPreferredAllocation(request, timeout=10)
                    continue
                with timer:
                    client.GetPreferredAllocation(request, timeout=10)
        finally:
            channel.close()
            server.stop()
    return timer


def run(quick: bool) -> list[Row]:
    rounds = 8 if quick else 60
    eight = _time_policy(plan_8_gpus(), list(range(1, 9)), rounds, 0.7)
    big_plan = plan_16x64()
    big = _time_policy(big_plan, [1, 2, 4, 8, 16], max(2, rounds // 4), 0.6)
    via_grpc = _time_grpc(plan_8_gpus(), 50 if quick else 400)
    n8, n16 = len(eight.samples), len(big.samples)
    return [
        Row("policy 8 GPUs p50", p50(eight.ms()), "ms", TARGET, f"{n8} calls, sizes 1-8, all or some free"),
        Row("policy 8 GPUs max", max(eight.ms()), "ms", TARGET),
        Row(
            "policy 16x64 p50",
            p50(big.ms()),
            "ms",
            TARGET,
            f"{n16} calls, {len(big_plan.devices)} IDs, sizes 1-16",
        ),
        Row("policy 16x64 max", max(big.ms()), "ms", TARGET),
        Row("gRPC 8 GPUs p50", p50(via_grpc.ms()), "ms", "", f"{len(via_grpc.samples)} calls, for reference"),
    ]
