"""DRA through the API server, end to end: a supervisor in `--mode dra` on a simulated node, its DRA
worker, the DRA and device-plugin kubelet stand-ins, and the fake API server (tests/kubeapi/, in
this process: the one part that cannot be real here). Claims come from the API server (the
supervisor fetches them for its worker) and the node's ResourceSlices go to it.

Each test pins one behaviour: the pool published and valid, a claim prepared from the API server;
a kubelet restart that wipes the slices, published again; an XID that taints a device in the slices
and reaches the kubelet's health stream; a switch from DRA to the device plugin and back under load
(prepare calls and Allocate calls running) with no device handed out twice and no claim lost.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.model import ResourcePlan
from supervisor.node.draplan import dra_devices
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import load_simulator
from tests.dranode import DRIVER, POOL, DraNode
from tests.harness import sighup_and_wait
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

GPU = "nvidia.com/gpu"
ALL = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]


def plan_of(node: DraNode) -> ResourcePlan:
    with open(f"{node.run_dir}/plans/{DRIVER}.json", encoding="utf-8") as fh:
        return ResourcePlan.from_json(fh.read())


def test_the_pool_is_published_and_a_claim_prepares_from_the_api_server(api: RunningApiServer) -> None:
    """After the DRA worker registers, the node's pool is at the API server (every device, owned by
    the Node, valid against resource.k8s.io/v1, each GPU with the PCIe root and NUMA node of the
    simulated sysfs given by --sysfs-root); a claim allocated there prepares through the worker,
    which asked the supervisor for it (one GET by gpuvisor's supervisor), and unprepares."""
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30), node.log()[-4000:]
        (obj,) = node.slices()
        where = {
            d["name"]: (
                d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
                d["attributes"]["resource.kubernetes.io/numaNode"]["int"],
            )
            for d in obj["spec"]["devices"]
        }
        assert where == {
            "gpu-0": ("pci0000:10", 0),
            "gpu-1": ("pci0000:10", 0),
            "gpu-2": ("pci0000:b0", 1),
            "gpu-3": ("pci0000:b0", 1),
        }
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "Node",
            POOL,
            api.state.nodes[POOL]["metadata"]["uid"],
            True,
        )
        assert api.state.errors == []
        ref = node.claim("c1", ["gpu-1", "gpu-2"])
        prepared = node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
        assert prepared.error == "" and [d.device_name for d in prepared.devices] == ["gpu-1", "gpu-2"]
        claim_path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c1"
        # The prepare's fetch, then (in the background, after the answer) the claim status
        # writer's read before its PUT of status: two GETs once the status is in, both the
        # supervisor's (the worker holds no credentials).
        assert wait_until(lambda: api.state.calls("PUT", claim_path + "/status"), 30)
        gets = api.state.calls("GET", claim_path)
        assert len(gets) == 2 and all(g.user_agent.endswith(" supervisor") for g in gets)
        missing = node.dra.prepare(DRIVER, [("default", "nope", "u-1")]).claims["u-1"].error
        assert "claim default/nope not found" in missing
        assert node.dra.unprepare(DRIVER, [ref]).claims[ref[2]].error == ""
        status = node.command("status")["cluster"]["dra"]
        assert status["slices"]["state"] == "published" and status["claims"]["fetched"] == 1


def test_a_kubelet_restart_that_wipes_the_slices_gets_them_published_again(api: RunningApiServer) -> None:
    """The kubelet deletes the node's ResourceSlices when it starts: the supervisor sees it and
    publishes the pool again (a new generation); the DRA worker is registered again."""
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30)
        before, registrations = node.generation(), node.registrations()
        node.dra.restart()
        assert node.dra.wipes == 1
        assert wait_until(lambda: sorted(node.published()) == ALL and node.generation() > before, 15)
        node.wait_registered(more_than=registrations)
        assert wait_until(lambda: "published again" in node.log(), 10)


def test_an_xid_taints_the_device_in_the_slices_and_reaches_the_health_stream(api: RunningApiServer) -> None:
    """XID 48 on the GPU behind gpu-2: the pool's next generation taints gpu-2 with
    gpu.nvidia.com/xid=48 and the kubelet's health stream says UNHEALTHY; after a reset both clear."""
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30)
        uuid = next(d.gpu_uuid for d in plan_of(node).devices if d.id == "gpu-2")
        node.sim("xid", device=uuid, xid=48)
        assert wait_until(
            lambda: (
                [(t["key"], t.get("value")) for t in node.published().get("gpu-2", [])]
                == [("gpu.nvidia.com/xid", "48")]
            ),
            15,
        ), node.log()[-4000:]
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-2") == "UNHEALTHY", 15)
        assert node.published()["gpu-1"] == []
        node.sim("reset", device=uuid)
        assert wait_until(lambda: node.published().get("gpu-2") == [], 15)
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-2") == "HEALTHY", 15)


def test_with_the_api_server_away_the_kubelet_path_runs_on_and_the_pool_catches_up(
    api: RunningApiServer,
) -> None:
    """The API server goes away: a claim prepared before prepares again from the checkpoint and
    unprepares, a new one fails with the reason (the kubelet retries it), an XID still reaches the
    kubelet's health stream at once. Back: the new claim prepares and the pool shows the taint."""
    with DraNode("pcie-l4", api=api) as node:
        node.wait_registered()
        assert wait_until(lambda: sorted(node.published()) == ALL, 30)
        before = node.claim("before", ["gpu-0"])
        first = node.dra.prepare(DRIVER, [before]).claims[before[2]]
        assert first.error == ""
        new = node.claim("new", ["gpu-1"])
        api.stop()
        assert node.dra.prepare(DRIVER, [before]).claims[before[2]] == first
        refused = node.dra.prepare(DRIVER, [new]).claims[new[2]].error
        assert "no answer from the API server" in refused, refused
        uuid = next(d.gpu_uuid for d in plan_of(node).devices if d.id == "gpu-3")
        node.sim("xid", device=uuid, xid=79)
        assert node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, "gpu-3") == "UNHEALTHY", 15)
        assert node.dra.unprepare(DRIVER, [before]).claims[before[2]].error == ""
        assert wait_until(lambda: node.command("status")["cluster"]["dra"]["slices"]["error"] is not None, 15)
        api.start()
        assert wait_until(lambda: node.dra.prepare(DRIVER, [new]).claims[new[2]].error == "", 30)
        assert wait_until(
            lambda: [t["key"] for t in node.published().get("gpu-3", [])] == ["gpu.nvidia.com/xid"], 60
        )


class Traffic:
    """Pods arriving while the node switches: Allocate calls through the device-plugin kubelet and,
    as a scheduler would, claims on devices the pool offers, prepared through the DRA kubelet, and
    while `churn` is on the oldest unprepared whenever no device is free (a pod ending: prepare and
    unprepare calls run all the time). It records every device either path handed out and each
    claim prepared and not yet unprepared."""

    def __init__(self, node: DraNode) -> None:
        self.node = node
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.prepared: dict[str, tuple[tuple[str, str, str], list[str]]] = {}  # uid -> ref, devices
        self.refused: list[str] = []
        self.twice: list[str] = []  # a GPU handed out through one path while the other held it
        self.allocations = 0
        self.count = 0
        self.churn = True
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._allocate, self._claim)]

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _allocate(self) -> None:
        while not self.stop.wait(0.02):
            if len(self.node.kubelet.held(GPU)) >= len(ALL) - 1:
                # Pods leave one GPU free: on a slow machine the Allocate traffic could otherwise
                # take every GPU before the switch stops the device plugin, and an empty pool
                # would prove nothing about what the pool leaves out.
                continue
            try:
                chosen, _ = self.node.kubelet.allocate(GPU, 1)
            except (LookupError, grpc.RpcError):
                continue  # nothing free, or the device plugin is not registered: the pod waits
            self.allocations += 1
            both = set(chosen) & self.claimed_uuids()
            if both:
                self.twice.append(f"Allocate gave {both}, held by a prepared claim")

    def _claim(self) -> None:
        while not self.stop.wait(0.02):
            offered = self.node.published()
            with self.lock:
                taken = {d for _, devices in self.prepared.values() for d in devices}
            free = [d for d in offered if d not in taken]
            if not free:
                if self.churn and taken:
                    self._unprepare_oldest()
                continue
            self.count += 1
            ref = self.node.claim(f"pod-{self.count}", [free[0]])
            try:
                answer = self.node.dra.prepare(DRIVER, [ref]).claims[ref[2]]
            except (LookupError, grpc.RpcError):
                continue  # the DRA worker is not registered (any more): the kubelet retries later
            if answer.error:
                self.refused.append(answer.error)
                continue
            names = [d.device_name for d in answer.devices]
            with self.lock:
                self.prepared[ref[2]] = (ref, names)
            both = {gpu_of()[n] for n in names} & self.node.kubelet.held(GPU)
            if both:
                self.twice.append(f"claim {ref[1]} prepared {names}, held by a device-plugin container")

    def _unprepare_oldest(self) -> None:
        with self.lock:
            uid, (ref, _) = next(iter(self.prepared.items()))
        try:
            error = self.node.dra.unprepare(DRIVER, [ref]).claims[uid].error
        except (LookupError, grpc.RpcError):
            return  # not registered at the moment: the kubelet retries later
        if error:
            self.refused.append(error)
            return
        with self.lock:
            del self.prepared[uid]

    def claimed_uuids(self) -> set[str]:
        uuids = gpu_of()
        with self.lock:
            return {uuids[d] for _, devices in self.prepared.values() for d in devices}

    def unprepare_all(self) -> None:
        for uid, (ref, _) in list(self.prepared.items()):
            assert self.node.dra.unprepare(DRIVER, [ref]).claims[uid].error == ""
            del self.prepared[uid]


@functools.cache
def gpu_of() -> dict[str, str]:
    """DRA device name -> the UUID of its GPU on the simulated pcie-l4 node (fixed by the node)."""
    nvml = Nvml(load_simulator("pcie-l4"), sysfs_root=None)
    nvml.init()
    return {name: gpu.uuid for gpu, _mig, name in dra_devices(nvml.discover())}


@pytest.fixture
def switching(api: RunningApiServer, tmp_path: Path) -> Iterator[tuple[DraNode, Path]]:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    with DraNode("pcie-l4", args=("--config-file", str(config)), api=api) as node:
        yield node, config


def test_a_switch_under_load_hands_no_device_out_twice_and_loses_no_claim(
    switching: tuple[DraNode, Path], api: RunningApiServer
) -> None:
    """Device plugin -> DRA -> device plugin with Allocate calls and claim prepares running the
    whole time. To DRA: the GPU a container holds (the kubelet's pod-resources API lists it) stays
    out of the pool until released, and nvidia.com/gpu goes to 0 allocatable. Back: the devices of
    prepared claims stay out of nvidia.com/gpu, new claims are refused with why, every claim that
    was answered is in the checkpoint and unprepares; then the device plugin has every GPU again.
    At no time does a GPU serve a container through both paths, and the draining plan goes into the
    DRA worker with the health snapshot that came with it."""
    node, config = switching
    node.wait_listed([GPU])
    held, _ = node.kubelet.allocate(GPU, 1)  # a running pod's GPU, through the device plugin

    config.write_text("version: v1\ngpuvisor: {mode: dra}\n")
    with Traffic(node) as traffic:
        sighup_and_wait(node)
        node.wait_registered()
        assert wait_until(lambda: node.kubelet.allocatable(GPU) == 0, 15)

        # The device plugin is gone: what its containers hold (the first pod's GPU, and any the
        # Allocate traffic got before the switch) stays theirs, out of the pool.
        def free() -> set[str]:
            return {name for name, uuid in gpu_of().items() if uuid not in node.kubelet.held(GPU)}

        assert wait_until(lambda: node.published() and set(node.published()) == free(), 30), node.log()[
            -4000:
        ]
        in_use = node.kubelet.held(GPU)
        assert held[0] in in_use
        assert wait_until(lambda: traffic.count >= 5, 30), traffic.refused[-3:]
        node.kubelet.release(GPU, in_use)  # the pods end: their GPUs join the pool
        assert wait_until(lambda: sorted(node.published()) == ALL, 30)
        assert not (traffic.claimed_uuids() & node.kubelet.held(GPU))

        traffic.churn = False  # the claims prepared now stay across the switch back
        assert wait_until(lambda: len(traffic.prepared) >= 2, 15)
        config.write_text("version: v1\ngpuvisor: {mode: device-plugin}\n")
        sighup_and_wait(node)
        node.wait_listed([GPU])
        assert wait_until(lambda: node.slices() == [], 15), "the pool was not withdrawn"
        # The DRA worker took the draining plan in place, with the health the supervisor sent
        # along: no round trip to ask for a snapshot first.
        assert wait_until(lambda: "draining (the node runs as a device plugin)" in node.log(), 15)
        assert "waiting for their health snapshot" not in node.log()
        assert wait_until(lambda: node.kubelet.allocatable(GPU) == 4 - len(traffic.claimed_uuids()), 15)
        assert not traffic.claimed_uuids() & set(node.kubelet.devices(GPU))
    # Every claim answered is still prepared (the checkpoint), none on a device-plugin device.
    assert set(traffic.prepared) == node.prepared_uids()
    assert not traffic.claimed_uuids() & node.kubelet.held(GPU)
    assert traffic.allocations > 0 and traffic.count >= 5
    assert traffic.twice == []
    late = node.claim("late", ["gpu-0"])
    assert (
        "serves its GPUs through the device plugin now"
        in node.dra.prepare(DRIVER, [late]).claims[late[2]].error
    )

    traffic.unprepare_all()
    assert node.prepared_uids() == set()
    assert wait_until(lambda: node.kubelet.allocatable(GPU) == 4, 15)
    assert node.dra.wait_for(lambda: not node.dra.registered(DRIVER), 15)
    assert api.state.errors == []
