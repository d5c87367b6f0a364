"""The DRA publisher (supervisor/dra/publish.py) against the fake API server (tests/kubeapi/):
the node's pool published as the Go controller publishes it, kept in step, republished after the
kubelet wipes it, tainted where the server keeps taints, withdrawn, and patient with failures.

Every slice the fake stores passed the resource.k8s.io/v1 schema (kubernetes-validate's, strict)
and the server's own rules; `state.errors` holds whatever it refused. No process is started.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from common.backoff import Backoff
from common.model import Node
from supervisor.dra import publish
from supervisor.dra.held import held_by_pods
from supervisor.dra.publish import SlicePublisher
from supervisor.dra.slices import PoolWant, build_slices
from supervisor.dra.sliceview import PATH
from supervisor.health.book import ConditionView, Recovery
from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.node.draplan import DRIVER
from supervisor.observe.allocations import Allocation, AllocationsView
from tests import nodes
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

NODE = "gpu-node-1"
NOW = 1_800_000_000.0


def xid(node: Node, index: int, number: int = 48) -> ConditionView:
    return ConditionView(
        node.gpus[index].uuid, None, None, f"xid:{number}", Recovery.UNTIL_RESET, f"XID {number}", NOW, NOW
    )


class Pub:
    """A publisher on a client of the fake, with the kubelet's allocations a test sets."""

    def __init__(self, api: RunningApiServer) -> None:
        self.api = api
        self.held: list[Allocation] = []
        self.counts: list[tuple[str, str]] = []
        self.client = KubeClient(load_credentials(str(api.kubeconfig), {}), component="test", version="test")
        self.publisher = SlicePublisher(
            self.client,
            node_name=NODE,
            allocations=lambda: AllocationsView(list(self.held), "pod-resources"),
            on_count=lambda what, result: self.counts.append((what, result)),
            retry=Backoff(0.05, 0.2),
        )

    def slices(self) -> list[dict[str, Any]]:
        return self.api.state.slices(NODE, DRIVER)

    def lists(self) -> int:
        """The lists of slices the server got (watches not counted)."""
        calls = self.api.state.calls("GET", PATH)
        return sum(1 for r in calls if r.path == PATH and r.query.get("watch") != "true")

    def devices(self) -> list[dict[str, Any]]:
        return [d for s in self.slices() for d in s["spec"]["devices"]]

    def generations(self) -> set[int]:
        return {s["spec"]["pool"]["generation"] for s in self.slices()}

    def published(self, node: Node, conditions: tuple[ConditionView, ...] = (), **kw: Any) -> bool:
        """The stored pool shows exactly what build_slices makes of this state."""
        want = [
            d
            for s in build_slices(node, conditions, node_name=NODE, taints=kw.get("taints", True),
                                  exclude=kw.get("exclude", ()))
            for d in s["spec"]["devices"]
        ]  # fmt: skip
        by_name = sorted(self.devices(), key=lambda d: str(d["name"]))
        return by_name == sorted(want, key=lambda d: str(d["name"])) and len(self.generations()) == 1


@pytest.fixture
def pub(api: RunningApiServer) -> Iterator[Pub]:
    api.state.add_node(NODE)
    p = Pub(api)
    p.publisher.start()
    yield p
    p.publisher.stop()
    p.client.close()


def test_the_pool_is_published_owned_by_the_node_and_valid(pub: Pub) -> None:
    """One pool named after the node: driver gpu.nvidia.com, spec.nodeName, generateName
    <node>-gpu.nvidia.com-, owned by the Node (its UID, controller true), generation 1, every device
    of the node; the fake found nothing to refuse."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    (obj,) = pub.slices()
    uid = pub.api.state.nodes[NODE]["metadata"]["uid"]
    assert obj["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-")
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}
    ]
    assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert (obj["spec"]["driver"], obj["spec"]["nodeName"]) == (DRIVER, NODE)
    assert [d["name"] for d in obj["spec"]["devices"]] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert pub.api.state.errors == []
    assert wait_until(lambda: pub.publisher.status()["state"] == "published")


def test_a_pool_in_step_is_not_written_again(pub: Pub) -> None:
    """Passes that find the pool as wanted (a resync, an equal want, a restarted publisher) list and
    write nothing: no create, update or delete reaches the server."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    writes = len([r for r in pub.api.state.requests if r.method != "GET"])
    passes = pub.publisher.passes
    pub.publisher.want(PoolWant(True, node, wait=""))  # equal: no pass at all
    pub.publisher.want(PoolWant(True, dataclasses.replace(node)))  # equal content: a pass, no write
    assert wait_until(lambda: pub.publisher.passes > passes)
    again = Pub(pub.api)  # gpuvisor restarted: the pool it finds is right
    again.publisher.start()
    try:
        again.publisher.want(PoolWant(True, node))
        assert wait_until(lambda: again.publisher.status()["state"] == "published")
        assert again.publisher.generation == 1
    finally:
        again.publisher.stop()
        again.client.close()
    assert len([r for r in pub.api.state.requests if r.method != "GET"]) == writes


def test_a_health_change_is_a_new_generation_with_the_devices_taint(pub: Pub) -> None:
    """XID 48 on GPU 2: the pool's next generation taints gpu-2 with gpu.nvidia.com/xid=48
    (NoSchedule); the server's answer to a dry-run create said it keeps taints, and the dry run
    stored nothing. The XID over: the next generation has no taint."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    pub.publisher.want(PoolWant(True, node, (xid(node, 2),)))
    assert wait_until(lambda: pub.generations() == {2})
    taints = {d["name"]: d.get("taints") for d in pub.devices()}
    assert taints["gpu-2"] == [
        {
            "key": "gpu.nvidia.com/xid",
            "value": "48",
            "effect": "NoSchedule",
            "timeAdded": "2027-01-15T08:00:00Z",
        }
    ]
    assert all(t is None for name, t in taints.items() if name != "gpu-2")
    assert any(r.query.get("dryRun") == "All" for r in pub.api.state.calls("POST"))
    assert len(pub.slices()) == 1 and pub.publisher.status()["taints"] == "kept"
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.generations() == {3} and pub.published(node))
    assert pub.api.state.errors == []


def test_a_health_storm_is_updates_without_a_list_per_generation(pub: Pub) -> None:
    """Generations this thread writes back to back are compared with what its last list and its
    own writes' answers left, as the Go controller reads its informer's cache (k8s.io/
    dynamic-resource-allocation resourceslice controller: no List in a sync): five health changes
    are five updates and no list; a slice edited by someone else meanwhile is listed again and
    repaired."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    lists = pub.lists()
    for i in range(5):
        conditions = tuple(xid(node, g) for g in range(i % 4 + 1))
        pub.publisher.want(PoolWant(True, node, conditions))
        assert wait_until(lambda c=conditions: pub.published(node, c))  # type: ignore[misc]
    assert pub.lists() == lists
    assert len(pub.api.state.calls("PUT", PATH)) == 5
    (obj,) = pub.slices()
    obj["spec"]["devices"] = obj["spec"]["devices"][:1]
    pub.api.state.put_slice(obj)
    assert wait_until(lambda: pub.published(node, conditions))
    assert pub.api.state.errors == []


def test_a_server_without_device_taints_gets_unhealthy_devices_left_out(pub: Pub) -> None:
    """An API server without the DRADeviceTaints gate drops the field: the dry-run probe shows it,
    the unhealthy device is left out of the pool instead (no failure, one probe), and it is back
    once healthy."""
    pub.api.state.device_taints = False
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node, (xid(node, 1, 79),)))
    assert wait_until(lambda: pub.published(node, (xid(node, 1, 79),), taints=False))
    assert [d["name"] for d in pub.devices()] == ["gpu-0", "gpu-2", "gpu-3"]
    status = pub.publisher.status()
    assert status["taints"] == "dropped" and status["failures"] == 0
    assert ("probe", "taints-dropped") in pub.counts
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    assert len([r for r in pub.api.state.calls("POST") if r.query.get("dryRun") == "All"]) == 1


def test_the_pool_log_line_names_the_unhealthy_devices_left_out_and_why(
    pub: Pub, caplog: pytest.LogCaptureFixture
) -> None:
    """Without device taints at the API server, the line that logs a pool generation names the
    unhealthy devices it left out, each with its conditions, beside the ones held by pods."""
    caplog.set_level(logging.INFO, logger=publish.log.name)
    pub.api.state.device_taints = False
    node = nodes.pcie_l4()
    pub.held = [Allocation("", "c", "nvidia.com/gpu", ("3",), "infer", "default")]
    conditions = (xid(node, 1, 79), xid(node, 1, 48), xid(node, 2, 94))
    pub.publisher.want(PoolWant(True, node, conditions))
    assert wait_until(lambda: pub.published(node, conditions, taints=False, exclude={"gpu-3"}))

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "pool generation" in r.getMessage()]

    assert wait_until(lines)  # logged just after the write the fake stored
    assert lines()[-1].endswith(
        "; left out, held by device-plugin containers: gpu-3 (default/infer)"
        "; left out, unhealthy (the API server drops device taints): gpu-1 (xid:48, xid:79), gpu-2 (xid:94)"
    )


def test_taints_dropped_on_a_real_write_are_noticed(pub: Pub) -> None:
    """A server that kept taints when probed but drops them on a write (a rollback of the API
    server): the answer shows it and the pool is written again without the unhealthy device."""
    node = nodes.pcie_l4()
    pub.publisher.taints = True  # as if probed before
    pub.api.state.device_taints = False
    pub.publisher.want(PoolWant(True, node, (xid(node, 0),)))
    assert wait_until(lambda: [d["name"] for d in pub.devices()] == ["gpu-1", "gpu-2", "gpu-3"])
    assert pub.publisher.taints is False and pub.generations() == {2}


def test_slices_wiped_by_the_kubelet_are_published_again(pub: Pub) -> None:
    """The kubelet deletes a node's slices when it starts: the publisher's watch sees deletions it
    did not make and publishes the pool again, at a new generation, at once."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    assert pub.api.state.delete_slices(NODE) == 1
    assert wait_until(lambda: pub.published(node) and pub.generations() == {2}, 10)
    assert wait_until(lambda: pub.publisher.status()["republished"] == 1)


def test_someone_elses_edit_is_repaired(pub: Pub) -> None:
    """A slice edited behind the publisher's back (a device removed by hand) is rewritten."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    state = pub.api.state
    with state.lock:
        (name,) = state.resource_slices
        edited = dict(state.resource_slices[name])
        edited["spec"] = {**edited["spec"], "devices": edited["spec"]["devices"][:1]}
        state.version += 1
        edited["metadata"] = {**edited["metadata"], "resourceVersion": str(state.version)}
        state.resource_slices[name] = edited
        state._record("resourceslices", "MODIFIED", edited)
    assert wait_until(lambda: pub.published(node) and pub.generations() == {2}, 10)


def test_a_pool_over_one_slice_gets_one_generation_and_stale_slices_go(pub: Pub) -> None:
    """140 MIG devices make two slices (128 at most each), both of the generation after the newest
    seen (8 -> 9) with the count 2; a slice of an older generation and one of another pool of this
    node and driver are deleted."""
    state = pub.api.state
    uid = state.nodes[NODE]["metadata"]["uid"]
    owner = [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]
    for name, pool, generation in (("other", "old-pool", 7), ("newest", NODE, 8), ("older", NODE, 3)):
        obj = build_slices(nodes.pcie_l4(), (), node_name=NODE)[0]
        obj["metadata"] = {"name": f"stale-{name}", "ownerReferences": owner}
        obj["spec"]["pool"].update(name=pool, generation=generation)
        state.put_slice(obj)
    node = nodes.mig_uniform(gpus=20, per_gpu=7)
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node), 15)
    slices = pub.slices()
    assert len(slices) == 2 and pub.generations() == {9}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
    assert sorted(len(s["spec"]["devices"]) for s in slices) == [12, 128]
    assert "stale-other" not in state.resource_slices and "stale-older" not in state.resource_slices
    assert state.errors == []


def test_withdrawing_deletes_the_pool(pub: Pub) -> None:
    """The node turns device plugin: every slice of this node and driver is deleted, with its UID and
    resourceVersion as preconditions; a slice of another driver stays."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))
    pub.publisher.want(PoolWant(False))
    assert wait_until(lambda: pub.slices() == [])
    deletes = pub.api.state.calls("DELETE")
    assert deletes and all(r.body["preconditions"]["uid"] for r in deletes)
    assert wait_until(lambda: pub.publisher.status()["state"] == "withdrawn")


def test_devices_held_by_device_plugin_containers_are_left_out_until_released(
    pub: Pub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a switch from device-plugin mode a container still holds GPU 1 (a replica of it, by
    UUID) and GPU 3 (by index): they are not offered; once the kubelet shows them released the
    pool offers them, without any other trigger."""
    monkeypatch.setattr(publish, "HELD_POLL_S", 0.2)
    node = nodes.pcie_l4()
    pub.held = [
        Allocation("", "c", "nvidia.com/gpu", (f"{node.gpus[1].uuid}::2",), "train", "default"),
        Allocation("", "c", "nvidia.com/gpu", ("3",), "infer", "default"),
    ]
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node, exclude={"gpu-1", "gpu-3"}))
    assert pub.publisher.status()["held_by_device_plugin"] == {
        "gpu-1": ["default/train"],
        "gpu-3": ["default/infer"],
    }
    pub.held = []
    assert wait_until(lambda: pub.published(node), 10)


def test_the_api_server_away_is_retried_and_the_pool_catches_up(pub: Pub) -> None:
    """Server stopped: each pass fails (counted, said once, status names it); back: published."""
    pub.api.stop()
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.publisher.failing.count >= 2)
    assert "no answer from the API server" in str(pub.publisher.status()["error"])
    pub.api.start()
    assert wait_until(lambda: pub.published(node), 15)
    assert wait_until(lambda: pub.publisher.status()["error"] is None)


@pytest.mark.parametrize(
    ("trouble", "words"),
    [
        ("no-node", "get Node gpu-node-1 (the owner of its ResourceSlices): 404 NotFound"),
        ("no-api", "does not serve resource.k8s.io/v1"),
        ("rbac", 'cannot create resource "resourceslices" in API group "resource.k8s.io"'),
    ],
)
def test_failures_say_what_is_wrong(pub: Pub, trouble: str, words: str) -> None:
    """A Node that is not there, an API server without resource.k8s.io/v1, a missing RBAC rule: the
    status says it in the server's words, and the publisher keeps trying."""
    state = pub.api.state
    if trouble == "no-node":
        del state.nodes[NODE]
    elif trouble == "no-api":
        state.dra = False
    else:
        state.allow = {("get", "nodes"), ("list", "resourceslices"), ("watch", "resourceslices")}
    pub.publisher.want(PoolWant(True, nodes.pcie_l4()))
    assert wait_until(lambda: words in str(pub.publisher.status()["error"]))
    failures = pub.publisher.failing.count
    assert wait_until(lambda: pub.publisher.failing.count > failures)


def test_a_pool_waits_while_device_plugin_workers_run(pub: Pub) -> None:
    """While the device plugin's workers are still stopping (a switch to DRA), nothing is written."""
    node = nodes.pcie_l4()
    pub.publisher.want(PoolWant(True, node, wait="the device plugin's workers are still stopping"))
    assert wait_until(lambda: pub.publisher.status()["state"] == "waiting")
    assert pub.slices() == []
    pub.publisher.want(PoolWant(True, node))
    assert wait_until(lambda: pub.published(node))


def test_held_device_ids_map_to_dra_device_names() -> None:
    """UUIDs (with replica suffixes), indexes of nvidia.com resources, MIG devices by UUID and
    index, and a full GPU with MIG mode on (every MIG device of it); other resources' IDs are not
    taken for indexes."""
    plain = nodes.pcie_l4()
    held = held_by_pods(
        plain,
        [
            Allocation("", "c", "nvidia.com/gpu.shared", (f"{plain.gpus[0].uuid}::1",), "a", "ns"),
            Allocation("", "c", "nvidia.com/gpu", ("2",), "b", "ns"),
            Allocation("", "c", "example.com/fpga", ("3",), "c", "ns"),
        ],
    )
    assert held == {"gpu-0": ("ns/a",), "gpu-2": ("ns/b",)}
    mig = nodes.mig_a100()
    migged = next(g for g in mig.gpus if g.mig_enabled and len(g.mig_devices) >= 2)
    first, second = sorted(migged.mig_devices, key=lambda m: m.index)[:2]
    held = held_by_pods(
        mig,
        [
            Allocation("uid-1", "c", "nvidia.com/mig-1g.10gb", (first.uuid,), "", ""),
            Allocation("", "c", "nvidia.com/mig-1g.10gb", (f"{migged.index}:{second.index}",), "d", "ns"),
        ],
    )
    assert len(held) == 2 and set(held.values()) == {("uid-1",), ("ns/d",)}
    whole = held_by_pods(mig, [Allocation("", "c", "nvidia.com/gpu", (migged.uuid,), "e", "ns")])
    assert len(whole) == len(migged.mig_devices)


# --- what the main loop tells the publisher (DraSide) --------------------------------------------


class Wants:
    """A stand-in publisher that records what it is told."""

    def __init__(self) -> None:
        self.told: list[PoolWant] = []

    def want(self, want: PoolWant) -> None:
        self.told.append(want)


class Reconciled:
    """The plans in force, as the reconciler holds them."""

    def __init__(self, config: Any) -> None:
        self.plans: dict[str, Any] = {}
        self.node: Node | None = None
        self.config = config


def side_with_recorder(reconciler: Any = None, workers: Any = None) -> tuple[Any, Wants]:
    from supervisor.dra.side import WAIT_FOR_DEVICE_PLUGIN, DraSide
    from supervisor.observe.metrics import Metrics
    from supervisor.scheduler import Scheduler
    from supervisor.workers.lifecycle import WorkerSet
    from tests.fakes import FakeClock, FakeSpawner

    side = DraSide(node_name=NODE, plugin_dir="/nowhere", pod_resources_socket="", metrics=Metrics("t"),
                   reply=lambda resource, reply: None, workers=workers or WorkerSet(spawner=FakeSpawner()),
                   reconciler=reconciler or Reconciled(None), connect=lambda: None,
                   timers=Scheduler(FakeClock()), post=lambda fn: None, rediscover=lambda why: None)  # fmt: skip
    wants = Wants()
    side.publisher = wants  # type: ignore[assignment]
    assert WAIT_FOR_DEVICE_PLUGIN
    return side, wants


def test_the_pool_is_wanted_from_the_plans_and_waits_for_the_device_plugin() -> None:
    """A DRA plan: publish the node with the book's conditions, but wait while a device-plugin
    worker still runs; a draining DRA plan (or none): withdraw. The same inputs again tell the
    publisher nothing; a condition's repeat (only last_event moves) is no new want."""
    from supervisor.config import config_from_data
    from supervisor.health.book import HealthBook
    from supervisor.health.policy import HealthPolicy
    from supervisor.node.draplan import dra_plan

    node = nodes.pcie_l4()
    config = config_from_data(
        {"version": "v1", "gpuvisor": {"mode": "dra"}}, flags={"node_name": NODE}, source="t"
    )
    plan = dra_plan(node, config)
    side, wants = side_with_recorder()
    assert not side.wanted
    book = HealthBook({DRIVER: plan}, HealthPolicy.from_config(config), NOW)
    side.refresh({DRIVER: plan}, node, book, True)
    assert side.wanted and wants.told[-1].publish and wants.told[-1].wait
    side.device_plugin_running(True)
    assert len(wants.told) == 1
    side.device_plugin_running(False)
    assert wants.told[-1] == PoolWant(True, node, (), "")
    book.apply_xid(node.gpus[0].uuid, 48, now=NOW)
    side.refresh({DRIVER: plan}, node, book, False)
    assert [c.name for c in wants.told[-1].conditions] == ["xid:48"]
    told = len(wants.told)
    book.apply_xid(node.gpus[0].uuid, 48, now=NOW + 5)  # a repeat: the slices would not change
    side.refresh({DRIVER: plan}, node, book, False)
    assert len(wants.told) == told
    assert plan.dra is not None
    draining = dataclasses.replace(plan, dra=dataclasses.replace(plan.dra, drain=True))
    side.refresh({DRIVER: draining}, node, book, False)
    assert wants.told[-1] == PoolWant(False)
    side.refresh({}, node, book, False)
    assert side.wanted  # this life published: it stays to withdraw and watch


def test_the_loops_calls_read_the_plans_in_force_and_whether_device_plugin_workers_run() -> None:
    """The loop names only the event: the DRA side reads the plans in force and the node from
    the reconciler, and asks the workers whether a device-plugin worker still runs. While one
    does the pool waits; the turn after it is gone, the pool goes out. New plans on a DRA node
    name the device-plugin resources the Node may still show."""
    from supervisor.config import config_from_data
    from supervisor.node.draplan import dra_plan
    from supervisor.workers.lifecycle import WorkerSet
    from tests.fakes import FakeSpawner

    config = config_from_data(
        {"version": "v1", "gpuvisor": {"mode": "dra"}}, flags={"node_name": NODE}, source="t"
    )
    node = nodes.pcie_l4()
    reconciler = Reconciled(config)
    reconciler.plans, reconciler.node = {DRIVER: dra_plan(node, config)}, node
    workers = WorkerSet(spawner=FakeSpawner())
    workers.want("nvidia.com/gpu", "/plans/gpu.json")
    workers.tick(0.0)
    side, wants = side_with_recorder(reconciler, workers)
    side.plans_applied(None)
    assert wants.told[-1].publish and wants.told[-1].wait
    assert side._device_plugin_names == {"nvidia.com/gpu"}
    workers.unwant("nvidia.com/gpu", 0.0)
    workers.tick(0.0)
    side.turn()
    assert wants.told[-1] == PoolWant(True, node, (), "")
