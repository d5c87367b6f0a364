"""The cluster side (supervisor/cluster): GPU health on the Node, and when the side starts.

The condition and Event texts are pure functions of the health book, tested on a book with a
fake clock; the writer runs its thread against the fake API server (tests/kubeapi/), as does
ClusterSide once started. None of this starts a process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from common.backoff import Backoff
from common.messages import Json
from supervisor.cluster import writer as writer_module
from supervisor.cluster.health import (
    CONDITION_TYPE,
    NodeCondition,
    NodeEvent,
    condition_patch,
    health_event,
    node_condition,
)
from supervisor.cluster.side import ClusterSide
from supervisor.cluster.writer import NodeHealthWriter
from supervisor.config import config_from_data
from supervisor.health.findings import Lost, Xid
from supervisor.health.hub import HealthHub
from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.node.planning import plan_resources
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Scheduler
from tests import nodes
from tests.fakes import FakeClock, hub_with_book, sim_config
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

NODE = "gpu-node-1"
T0, T1 = "2026-11-20T10:00:00Z", "2026-11-20T10:05:00Z"


def batches(hub: HealthHub) -> list[tuple[Any, str]]:
    seen: list[tuple[Any, str]] = []
    hub.listeners.append(lambda batch, line: seen.append((batch, line)))
    return seen


def condition_of(hub: HealthHub) -> NodeCondition:
    assert hub.book is not None and hub.node is not None
    unhealthy = {}
    total = 0
    for resource in hub.book.resources:
        _, devices = hub.book.snapshot(resource)
        total += len(devices)
        unhealthy[resource] = [d.device_id for d in devices if not d.healthy]
    return node_condition(unhealthy, total, hub.book.conditions(), {g.uuid: g.index for g in hub.node.gpus})


# --- the condition and the Events ----------------------------------------------------------------


def test_all_healthy_is_false() -> None:
    """No device out: status False, reason GpusHealthy, the device count in the message."""
    hub, _, _ = hub_with_book()
    assert condition_of(hub) == NodeCondition("False", "GpusHealthy", "all 4 GPU devices are healthy")


def test_an_unhealthy_device_names_the_gravest_reason_and_every_cause() -> None:
    """An XID on one GPU and a lost other: True, reason GpuLost (the gravest), and the message names
    the devices, each GPU by index and UUID, and what happened to it."""
    hub, _, _ = hub_with_book()
    gpus = nodes.pcie_l4().gpus
    hub.apply(Xid(gpus[1].uuid, 48))
    hub.apply(Lost(gpus[2].uuid, "fell off the bus"))
    cond = condition_of(hub)
    assert (cond.status, cond.reason) == ("True", "GpuLost")
    assert cond.message.startswith(
        f"2 of 4 GPU devices Unhealthy (nvidia.com/gpu: {gpus[1].uuid}, {gpus[2].uuid})."
    )
    assert f"GPU 2 ({gpus[2].uuid}): GPU lost: fell off the bus" in cond.message
    assert f"GPU 1 ({gpus[1].uuid}): XID 48" in cond.message
    assert cond.message.index("GPU 2") < cond.message.index("GPU 1")  # gravest first


def test_the_message_is_bounded() -> None:
    """However many devices and causes, the message stays within 1024 characters."""
    many = {"nvidia.com/gpu": [f"GPU-{i:040d}::{r}" for i in range(64) for r in range(8)]}
    cond = node_condition(many, 512, [], {})
    assert len(cond.message) <= 1024 and "and 504 more" in cond.message


def test_the_patch_touches_only_our_condition_and_keeps_the_transition_time() -> None:
    """Same status, new message: lastTransitionTime stays; a status change moves it; equal: no patch."""
    wanted = NodeCondition("True", "XidCriticalError", "1 of 8 ...")
    current = {
        "type": CONDITION_TYPE,
        "status": "True",
        "reason": "GpuLost",
        "message": "x",
        "lastTransitionTime": T0,
    }
    patch = condition_patch(current, wanted, T1)
    assert patch is not None
    (sent,) = patch["status"]["conditions"]
    assert (sent["type"], sent["lastTransitionTime"], sent["lastHeartbeatTime"]) == (CONDITION_TYPE, T0, T1)
    assert list(patch) == ["status"] and list(patch["status"]) == ["conditions"]
    flipped = condition_patch({**current, "status": "False"}, wanted, T1)
    assert flipped is not None and flipped["status"]["conditions"][0]["lastTransitionTime"] == T1
    same = {"status": "True", "reason": "XidCriticalError", "message": "1 of 8 ..."}
    assert condition_patch(same, wanted, T1) is None
    assert condition_patch(None, wanted, T1) is not None


def test_events_tell_of_decisions_in_the_health_logs_words() -> None:
    """A batch that takes devices out is a Warning with its condition's reason; one that brings them
    back a Normal GpuRecovered; the message is the health log's line; new plans are no Event."""
    hub, _clock, _ = hub_with_book()
    seen = batches(hub)
    gpu = nodes.pcie_l4().gpus[0].uuid
    hub.apply(Xid(gpu, 79))
    hub.gpu_reset(gpu)
    plans = plan_resources(nodes.pcie_l4(), config_from_data({"version": "v1", "sharing": {"timeSlicing": {
        "resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}))  # fmt: skip
    hub.set_plans(plans)  # new devices appear: a change batch, but no decision
    out, back = (health_event(b, line) for b, line in seen)
    assert (out.type, out.reason) == ("Warning", "XidCriticalError")
    assert out.message.startswith(f"XID 79 on {gpu}: Unhealthy until the GPU is reset -> 1 device(s)")
    assert (back.type, back.reason) == ("Normal", "GpuRecovered")
    assert len(seen) == 2


# --- the writer ----------------------------------------------------------------------------------


@pytest.fixture
def node_api(api: RunningApiServer) -> RunningApiServer:
    api.state.add_node(NODE)
    return api


QUICK_INTERVAL_S = 0.3


@pytest.fixture
def quick_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's pause after a pass that wrote (5 s) made short, for a test of several writes
    in turn that would otherwise sleep it out each time (the writer reads it at every pass)."""
    monkeypatch.setattr(writer_module, "MIN_INTERVAL_S", QUICK_INTERVAL_S)


@pytest.fixture
def writer(node_api: RunningApiServer) -> Iterator[NodeHealthWriter]:
    client = KubeClient(load_credentials(str(node_api.kubeconfig), {}), component="test", version="test")
    w = NodeHealthWriter(client, node=NODE, retry=Backoff(0.05, 0.2))
    w.start()
    yield w
    w.stop()


BAD = NodeCondition("True", "XidCriticalError", "1 of 8 GPU devices Unhealthy")
GOOD = NodeCondition("False", "GpusHealthy", "all 8 GPU devices are healthy")


def test_the_writer_sets_the_condition_and_leaves_the_kubelets(
    node_api: RunningApiServer, writer: NodeHealthWriter
) -> None:
    """The condition appears on the Node by a status PATCH; Ready and MemoryPressure are untouched."""
    writer.want(BAD)
    assert wait_until(lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("status") == "True")
    types = [c["type"] for c in node_api.state.nodes[NODE]["status"]["conditions"]]
    assert types == ["MemoryPressure", "Ready", CONDITION_TYPE]
    assert node_api.state.condition(NODE, "Ready")["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # type: ignore[index]
    assert all(r.path.endswith("/status") for r in node_api.state.calls("PATCH"))
    assert node_api.state.errors == []


def test_a_storm_of_changes_is_a_few_writes_of_the_newest(
    node_api: RunningApiServer, writer: NodeHealthWriter
) -> None:
    """200 wanted conditions in a burst: the Node ends with the last, written a handful of times."""
    for i in range(200):
        writer.want(NodeCondition("True", "XidCriticalError", f"change {i}"))
    assert wait_until(
        lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("message") == "change 199"
    )
    assert len(node_api.state.calls("PATCH")) <= 3


def test_after_the_first_write_a_change_is_one_patch_without_a_read(
    node_api: RunningApiServer, quick_pacing: None, writer: NodeHealthWriter
) -> None:
    """The Node is read once, before the first write; after it, the answer to each PATCH says what
    the Node holds: a change is one PATCH and no GET, and lastTransitionTime still moves only when
    the status does."""
    node_path = f"/api/v1/nodes/{NODE}"

    def condition() -> dict[str, Any]:
        return node_api.state.condition(NODE, CONDITION_TYPE) or {}

    writer.want(BAD)
    assert wait_until(lambda: writer.status()["written"] is True)
    first = condition()["lastTransitionTime"]
    reads = len(node_api.state.calls("GET", node_path))
    assert reads == 1
    worse = NodeCondition("True", "XidCriticalError", "2 of 8 GPU devices Unhealthy")
    writer.want(worse)
    assert wait_until(lambda: condition().get("message") == worse.message)
    assert condition()["lastTransitionTime"] == first  # the same status: no transition
    writer.want(GOOD)
    assert wait_until(lambda: condition().get("status") == "False")
    assert len(node_api.state.calls("PATCH")) == 3
    assert len(node_api.state.calls("GET", node_path)) == reads


def test_after_a_failed_call_the_node_is_read_again_before_the_next_write(
    node_api: RunningApiServer, quick_pacing: None, writer: NodeHealthWriter
) -> None:
    """Any failed call (here an Event, with the condition in step) means the Node may have changed
    meanwhile: the next condition write reads it first, so lastTransitionTime is kept from the
    Node as it is, not from the writer's older view."""
    node_path = f"/api/v1/nodes/{NODE}"
    writer.want(BAD)
    assert wait_until(lambda: writer.status()["written"] is True)
    reads = len(node_api.state.calls("GET", node_path))
    node_api.stop()
    writer.event(NodeEvent("Warning", "XidCriticalError", "XID 48 on GPU-1"))
    assert wait_until(lambda: writer.failing.count >= 1)
    node_api.start()
    assert wait_until(lambda: writer.status()["error"] is None and writer.status()["events_queued"] == 0, 15)
    writer.want(NodeCondition("True", "XidCriticalError", "2 of 8 GPU devices Unhealthy"))
    assert wait_until(
        lambda: (
            (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("message")
            == "2 of 8 GPU devices Unhealthy"
        )
    )
    assert len(node_api.state.calls("GET", node_path)) == reads + 1


def test_a_resync_reads_the_node_again_and_repairs_it(
    node_api: RunningApiServer, monkeypatch: pytest.MonkeyPatch, quick_pacing: None
) -> None:
    """Every RESYNC_S the writer reads the Node again, so a condition someone else changed is put
    back although the writer's own last PATCH said otherwise."""
    monkeypatch.setattr(writer_module, "RESYNC_S", 0.3)
    client = KubeClient(load_credentials(str(node_api.kubeconfig), {}), component="test", version="test")
    w = NodeHealthWriter(client, node=NODE, retry=Backoff(0.05, 0.2))
    w.start()
    try:
        w.want(BAD)
        assert wait_until(
            lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("status") == "True"
        )
        with node_api.state.lock:  # someone else's edit
            for cond in node_api.state.nodes[NODE]["status"]["conditions"]:
                if cond["type"] == CONDITION_TYPE:
                    cond["status"] = "False"
        assert wait_until(
            lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("status") == "True"
        )
    finally:
        w.stop()


def test_a_restarted_writer_changes_nothing_that_is_right(
    node_api: RunningApiServer, writer: NodeHealthWriter
) -> None:
    """A new writer (gpuvisor restarted) wanting what the Node shows reads it and writes nothing."""
    writer.want(BAD)
    assert wait_until(lambda: writer.status()["written"] is True)
    writer.stop()
    again = NodeHealthWriter(
        KubeClient(load_credentials(str(node_api.kubeconfig), {}), component="t", version="test"), node=NODE
    )
    patches = len(node_api.state.calls("PATCH"))
    again.start()
    try:
        again.want(BAD)
        assert wait_until(lambda: again.status()["written"] is True)
        assert len(node_api.state.calls("PATCH")) == patches
    finally:
        again.stop()


def test_after_an_outage_the_node_catches_up(
    node_api: RunningApiServer, quick_pacing: None, writer: NodeHealthWriter
) -> None:
    """Server away: the wanted condition and the Events wait (failures counted); back: both are written."""
    writer.want(GOOD)
    assert wait_until(lambda: writer.status()["written"] is True)
    node_api.stop()
    writer.want(BAD)
    writer.event(NodeEvent("Warning", "XidCriticalError", "XID 48 on GPU-1"))
    assert wait_until(lambda: writer.failing.count >= 2)
    assert writer.status()["error"] is not None
    node_api.start()
    assert wait_until(
        lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("status") == "True", 15
    )
    assert wait_until(lambda: len(node_api.state.node_events(NODE)) == 1)
    assert wait_until(lambda: writer.status()["error"] is None)


def test_events_wait_in_a_bounded_queue(node_api: RunningApiServer) -> None:
    """While nothing can be sent, at most MAX_QUEUED Events wait; the oldest are dropped and counted."""
    from supervisor.cluster.writer import MAX_QUEUED

    client = KubeClient(load_credentials(str(node_api.kubeconfig), {}), component="t", version="test")
    w = NodeHealthWriter(client, node=NODE)  # not started: nothing leaves the queue
    for i in range(MAX_QUEUED + 5):
        w.event(NodeEvent("Warning", "R", f"m{i}"))
    assert w.status()["events_queued"] == MAX_QUEUED and w.dropped == 5
    client.close()


# --- the side: when it starts, what it forwards --------------------------------------------------


class RecordingPart:
    """A higher layer's part (as the DRA side): says whether it is wanted, records what it got."""

    def __init__(self, wanted: bool = False) -> None:
        self.wanted = wanted
        self.clients: list[KubeClient] = []
        self.stops = 0

    def start(self, client: KubeClient) -> None:
        self.clients.append(client)

    def stop(self) -> None:
        self.stops += 1

    def status(self) -> dict[str, Json]:
        return {"started": len(self.clients)}


class Side:
    def __init__(self, api: RunningApiServer | None, part: RecordingPart | None = None, **env: str) -> None:
        self.clock = FakeClock()
        self.timers = Scheduler(self.clock)
        self.metrics = Metrics(version="test")
        self.hub, _, _ = hub_with_book()
        self.posted: list[Any] = []
        self.labels: list[str] = []
        kube = {"KUBECONFIG": str(api.kubeconfig)} if api is not None else {}
        self.config = sim_config(NODE_NAME=NODE, **kube, **env)
        self.side = ClusterSide(
            config=self.config,
            environ={},
            hub=self.hub,
            metrics=self.metrics,
            timers=self.timers,
            post=self.posted.append,
            on_label=self.labels.append,
            parts={"dra": part} if part is not None else None,
        )
        self.hub.listeners.append(self.side.health_changed)

    def run_posted(self) -> None:
        while self.posted:
            self.posted.pop(0)()


def test_off_unless_a_feature_needs_it() -> None:
    """Without --config-file-srcdir or --node-health the side never starts, whatever happens."""
    s = Side(None)
    s.side.start_when(registered=True, nothing_to_register=True, awaiting_label=True)
    assert not s.side.started and s.side.status() == {"enabled": False}


def test_it_waits_for_the_kubelet_path(node_api: RunningApiServer) -> None:
    """Node health on: nothing is called before a worker registered; then it starts and says why."""
    s = Side(node_api, GPUVISOR_NODE_HEALTH="true")
    s.side.start_when(registered=False, nothing_to_register=False, awaiting_label=False)
    assert not s.side.started and node_api.state.requests == []
    s.side.start_when(registered=True, nothing_to_register=False, awaiting_label=False)
    try:
        assert s.side.started_because == "a worker registered with the kubelet"
        assert wait_until(lambda: node_api.state.condition(NODE, CONDITION_TYPE) is not None)
    finally:
        s.side.stop()


def test_a_part_alone_makes_the_side_start_and_gets_the_client(node_api: RunningApiServer) -> None:
    """A part that wants the API server (a node in mode dra) is enough for the side to start after
    the first registration; the part gets the side's client, shows in status, and is stopped with
    it."""
    part = RecordingPart(wanted=True)
    s = Side(node_api, part)
    assert s.side.wanted
    s.side.start_when(registered=True, nothing_to_register=False, awaiting_label=False)
    try:
        assert s.side.started and part.clients == [s.side.client]
        assert s.side.status()["dra"] == {"started": 1}
    finally:
        s.side.stop()
    assert part.stops == 1


def test_a_part_that_becomes_wanted_later_starts_then(node_api: RunningApiServer) -> None:
    """The side runs for node health; a part not wanted then (mode device-plugin) is not started;
    once it is (a switch to mode dra) the next loop turn starts it with the same client, once."""
    part = RecordingPart(wanted=False)
    s = Side(node_api, part, GPUVISOR_NODE_HEALTH="true")
    s.side.start_when(registered=True, nothing_to_register=False, awaiting_label=False)
    try:
        assert s.side.started and part.clients == [] and s.side.status()["dra"] is None
        part.wanted = True
        s.side.start_when(registered=True, nothing_to_register=False, awaiting_label=False)
        s.side.start_when(registered=True, nothing_to_register=False, awaiting_label=False)
        assert part.clients == [s.side.client]
    finally:
        s.side.stop()


def test_health_before_the_start_is_sent_once_it_starts(node_api: RunningApiServer) -> None:
    """An XID before the start (the first probe found a bad GPU): its Event and the condition reach
    the Node when the side starts."""
    s = Side(node_api, GPUVISOR_NODE_HEALTH="true")
    s.hub.apply(Xid(nodes.pcie_l4().gpus[0].uuid, 48))
    s.side.start("test")
    try:
        assert wait_until(
            lambda: (node_api.state.condition(NODE, CONDITION_TYPE) or {}).get("status") == "True"
        )
        assert wait_until(
            lambda: [e["reason"] for e in node_api.state.node_events(NODE)] == ["XidCriticalError"]
        )
    finally:
        s.side.stop()


def test_a_start_that_fails_is_retried_and_shown(tmp_path: Any) -> None:
    """No credentials yet (not in a pod, no kubeconfig): status says why, a retry is armed."""
    s = Side(None, GPUVISOR_NODE_HEALTH="true")
    s.side.start("test")
    assert not s.side.started and "KUBERNETES_SERVICE_HOST" in str(s.side.status()["error"])
    assert s.timers.when("cluster-start") is not None


def test_label_values_are_posted_once_per_change(node_api: RunningApiServer, tmp_path: Any) -> None:
    """The watch's Node objects become label values on the main loop: the first, then each change;
    the same value again is nothing; a deleted Node is the empty label (config-manager's handlers)."""
    (tmp_path / "c").mkdir()
    s = Side(node_api, CONFIG_FILE_SRCDIR=str(tmp_path / "c"))
    key = "nvidia.com/device-plugin.config"
    objects: list[dict[str, Any] | None] = [
        {"metadata": {"labels": {}}},
        {"metadata": {"labels": {key: "a"}}},
        {"metadata": {"labels": {key: "a", "x": "y"}}},
        None,
    ]
    for obj in objects:
        s.side._on_node(obj)
        s.run_posted()
    assert s.labels == ["", "a", ""]


def test_gpuvisor_status_says_which_config_runs_and_how_the_cluster_side_is() -> None:
    """The status table names the config and its source, the label, the condition, and failures."""
    from supervisor.cli import format_status

    data: dict[str, Any] = {
        "pid": 1,
        "workers": [],
        "resources": {},
        "config": {"name": "ts4", "file": "/etc/gpuvisor/ts4", "source": "label",
                   "node_label": {"key": "nvidia.com/device-plugin.config", "value": "ts4"}},
        "cluster": {"enabled": True, "node": NODE, "started": True, "started_because": "a worker registered",
                    "label": {"watch": {"error": "no answer", "failing_since": 1.0}},
                    "node_health": {"condition": {"status": "True", "reason": "GpuLost"}, "written": False,
                                    "error": "403 Forbidden"}},
    }  # fmt: skip
    data["cluster"]["dra"] = {
        "slices": {"state": "published", "pool": NODE, "generation": 3, "slices": 1, "devices": 3,
                   "taints": "dropped", "held_by_device_plugin": {"gpu-1": ["default/train"]},
                   "error": None},
        "claims": {"fetched": 4, "failed": 1, "error": "403 Forbidden: resourceclaims"},
    }  # fmt: skip
    text = format_status(data)
    assert f"DRA pool {NODE}: generation 3, 1 ResourceSlice(s), 3 device(s), device taints dropped" in text
    assert "left out, held by device-plugin containers: gpu-1 (default/train)" in text
    assert "DRA claims fetched: 4, failed: 1" in text and "DRA claims failing: 403 Forbidden" in text
    assert "config: ts4 (source: label); node label nvidia.com/device-plugin.config='ts4'" in text
    assert f"cluster side for Node {NODE}: started (a worker registered)" in text
    assert "node label watch failing since 1.0: no answer" in text
    assert "Node condition GPUUnhealthy=True (GpuLost), not written yet" in text
    assert "health on the Node failing: 403 Forbidden" in text
    waiting = format_status(
        {"pid": 1, "workers": [], "resources": {}, "config": {"awaiting_label": "no config"}}
    )
    assert "config: none chosen yet, waiting for the node label: no config" in waiting
