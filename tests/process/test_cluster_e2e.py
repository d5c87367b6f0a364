"""The cluster side end to end: a real supervisor and workers, the kubelet stand-in, and the fake
API server (tests/kubeapi/, in this process: it is the one part that cannot be real here).

- a label flip under Allocate load switches time-slicing 1 -> 4 -> 1 in place, with no drop of
  nvidia.com/gpu's allocatable and no failed Allocate of a device that is listed;
- the API server gone for a minute (GPUVISOR_TEST_API_OUTAGE_S, default 60), then back: the kubelet
  path runs on (Allocate, an XID marked Unhealthy at once), a label changed meanwhile applies, and
  the Node catches up on the condition and the Event;
- an XID storm: one condition on the Node, a bounded number of Events and Node writes;
- a stop with the API server frozen ends at once; nothing calls the API server before the first
  registration; an exec credential plugin's token is used.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from supervisor.control.commands import CommandError
from tests.harness import SimNode
from tests.helpers import wait_until
from tests.kubeapi import TOKEN, RunningApiServer

GPU = "nvidia.com/gpu"
NODE = "gpu-node-1"
LABEL = "nvidia.com/device-plugin.config"
CONDITION = "GPUUnhealthy"
OUTAGE_S = float(os.environ.get("GPUVISOR_TEST_API_OUTAGE_S", "60"))
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"


def configs(tmp_path: Path) -> Path:
    """The named configs, as a ConfigMap mounts them: `ts1` (no sharing) and `ts4` (4 replicas)."""
    srcdir = tmp_path / "configs"
    srcdir.mkdir()
    (srcdir / "ts1").write_text("version: v1\n")
    (srcdir / "ts4").write_text(TS4)
    return srcdir


def cluster_node(
    api: RunningApiServer,
    tmp_path: Path,
    *,
    health: bool = True,
    labels_file: Path | None = None,
    **kw: object,
) -> SimNode:
    args = ["--config-file-srcdir", str(configs(tmp_path)), "--default-config", "ts1"]
    if health:
        args.append("--node-health=true")
    if labels_file is not None:
        args += ["--labels-output-file", str(labels_file)]
    env = {"NODE_NAME": NODE, "KUBECONFIG": str(api.kubeconfig)}
    return SimNode("pcie-l4", args=args, env=env, **kw)  # type: ignore[arg-type]


def status(node: SimNode) -> dict[str, Any]:
    """`gpuvisor status` as JSON, or {} while the supervisor's control socket is not up yet."""
    try:
        return node.command("status")
    except CommandError:
        return {}


def condition(api: RunningApiServer) -> dict[str, str]:
    return api.state.condition(NODE, CONDITION) or {}


class Load:
    """Allocate calls in a loop, as pods being admitted: counts, errors, the lowest allocatable."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.ok = 0
        self.errors: list[str] = []
        self.lowest = node.kubelet.allocatable(GPU)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        kubelet = self.node.kubelet
        while not self._stop.is_set():
            self.lowest = min(self.lowest, kubelet.allocatable(GPU))
            try:
                chosen, _ = kubelet.allocate(GPU, 1)
            except grpc.RpcError as exc:
                text = str(exc.details()) if hasattr(exc, "details") else str(exc)
                # An ID picked from the list just before the list changed is unknown to the new
                # plan: the kubelet would not offer it any more. Anything else is a failure.
                listed = set(kubelet.devices(GPU))
                if not ("unknown device" in text and not any(i in text for i in listed)):
                    self.errors.append(text)
                continue
            except LookupError:
                continue
            kubelet.release(GPU, chosen)
            self.ok += 1

    @contextmanager
    def running(self) -> Iterator[Load]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)


def test_a_label_flip_under_load_switches_time_slicing_in_place(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """ts1 -> ts4 -> ts1 by the node label while Allocate runs: 4 -> 16 -> 4 devices in the same
    worker, allocatable never under 4, every Allocate of a listed device answered, the config's
    name and source in status and the metric, and the node labels the daemon writes follow."""
    api.state.add_node(NODE)
    labels = tmp_path / "gfd"

    def replicas() -> str:
        lines = labels.read_text().splitlines() if labels.exists() else []
        return next(
            (line.split("=", 1)[1] for line in lines if line.startswith("nvidia.com/gpu.replicas=")), ""
        )

    with cluster_node(api, tmp_path, health=False, labels_file=labels) as node:
        node.wait_listed([GPU])
        pid = node.worker_pid(GPU)
        assert node.kubelet.capacity(GPU) == 4
        assert wait_until(lambda: node.command("status")["cluster"]["label"]["value"] == "", 20), node.log()[
            -3000:
        ]
        with Load(node).running() as load:
            assert wait_until(lambda: replicas() == "1", 20)
            api.state.set_node_label(NODE, LABEL, "ts4")
            assert wait_until(lambda: node.kubelet.allocatable(GPU) == 16, 20), node.log()[-3000:]
            config = node.command("status")["config"]
            assert (config["name"], config["source"]) == ("ts4", "label")
            assert wait_until(lambda: replicas() == "4", 20), labels.read_text()
            api.state.set_node_label(NODE, LABEL, "ts1")
            assert wait_until(lambda: node.kubelet.allocatable(GPU) == 4, 20), node.log()[-3000:]
            assert wait_until(lambda: replicas() == "1", 20), labels.read_text()
            after = load.ok
            assert wait_until(lambda: load.ok >= after + 10, 20)  # Allocate goes on after the flip back
            assert wait_until(lambda: load.ok > 20, 20)  # a count, not a rate: a loaded machine is slow
        assert load.errors == [] and load.ok > 20, (load.errors[:5], load.ok)
        assert load.lowest >= 4
        assert node.worker_pid(GPU) == pid  # in place: the same worker
        assert all("::" not in d for d in node.kubelet.devices(GPU))
        log = node.log()
        assert "config applied: config 'ts4', named by the node label" in log
        assert "config applied: config 'ts1', named by the node label" in log


def test_the_api_server_away_then_back(api: RunningApiServer, tmp_path: Path) -> None:
    """A real outage of OUTAGE_S seconds: Allocate and health at the kubelet go on; status shows the
    failure; the label changed meanwhile applies after; the Node catches up on condition and Event."""
    api.state.add_node(NODE)
    with cluster_node(api, tmp_path) as node:
        node.wait_listed([GPU])
        assert wait_until(lambda: condition(api).get("status") == "False", 20), node.log()[-3000:]
        api.stop()
        api.state.set_node_label(NODE, LABEL, "ts4")  # an operator's change the node cannot see yet
        gpu = sorted(node.kubelet.devices(GPU))[0]
        started = time.monotonic()
        node.sim("xid", device=gpu, xid=48)
        node.wait_health(GPU, [gpu], "Unhealthy", timeout=5)
        assert time.monotonic() - started < 5
        with Load(node).running() as load:
            deadline = time.monotonic() + OUTAGE_S
            while time.monotonic() < deadline:
                time.sleep(1)
                assert node.proc is not None and node.proc.poll() is None
        assert load.errors == [] and load.ok > 0
        status = node.command("status")["cluster"]
        assert status["node_health"]["error"] and status["label"]["watch"]["failures"] >= 1, status
        assert node.kubelet.capacity(GPU) == 4  # the running config stayed
        api.start()
        assert wait_until(lambda: node.kubelet.capacity(GPU) == 16, 60), node.log()[-3000:]
        assert wait_until(lambda: condition(api).get("status") == "True", 60), node.log()[-3000:]
        assert (
            condition(api)["reason"] == "XidCriticalError" and gpu.split("::")[0] in condition(api)["message"]
        )
        assert wait_until(
            lambda: any(e["reason"] == "XidCriticalError" for e in api.state.node_events(NODE)), 60
        )
        assert wait_until(lambda: node.command("status")["cluster"]["node_health"]["error"] is None, 60)
        assert api.state.errors == []


def test_an_xid_storm_is_one_condition_and_few_events(api: RunningApiServer, tmp_path: Path) -> None:
    """400 XIDs on 4 GPUs in a burst: one GPUUnhealthy condition on the Node, at most client-go's
    spam burst of Events (repeats counted, not new objects), and few Node writes."""
    api.state.add_node(NODE)
    with cluster_node(api, tmp_path) as node:
        node.wait_listed([GPU])
        assert wait_until(lambda: condition(api).get("status") == "False", 20), node.log()[-3000:]
        gpus = sorted(node.kubelet.devices(GPU))
        for i in range(400):
            node.sim("xid", device=gpus[i % len(gpus)], xid=(48, 95)[i % 2])
        node.wait_health(GPU, gpus, "Unhealthy")
        assert wait_until(lambda: condition(api).get("status") == "True", 20)
        time.sleep(3)  # let the writer drain what it will
        conditions = api.state.nodes[NODE]["status"]["conditions"]
        assert [c["type"] for c in conditions].count(CONDITION) == 1
        events = api.state.node_events(NODE)
        assert 1 <= len(events) <= 25, [e["message"] for e in events]
        assert len(api.state.calls("PATCH", f"/api/v1/nodes/{NODE}/status")) <= 10
        assert api.state.errors == []


def test_a_stop_with_the_api_server_frozen_ends_at_once(api: RunningApiServer, tmp_path: Path) -> None:
    """The API server accepts and never answers (its calls in flight): SIGTERM still ends the
    supervisor within its grace period, exit 0."""
    api.state.add_node(NODE)
    with cluster_node(api, tmp_path) as node:
        node.wait_listed([GPU])
        assert wait_until(lambda: condition(api).get("status") == "False", 20)
        api.state.freeze()
        node.sim("xid", device=sorted(node.kubelet.devices(GPU))[0], xid=48)
        assert wait_until(lambda: len(api.state.calls()) > 0 and api.state.frozen.is_set(), 5)
        time.sleep(1.5)  # the writer's call is now hanging on the frozen server
        started = time.monotonic()
        assert node.stop_supervisor(signal.SIGTERM, timeout=30) == 0
        assert time.monotonic() - started < 6.0, node.log()[-3000:]


def test_nothing_calls_the_api_server_before_the_first_registration(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """With no kubelet to register with, the supervisor makes no API call; once the kubelet is up
    and a worker registered, the cluster side starts and says why."""
    api.state.add_node(NODE)
    with cluster_node(api, tmp_path, start_kubelet=False) as node:
        assert wait_until(lambda: status(node).get("nvml", {}).get("up"), 20)
        time.sleep(2)
        assert node.command("status")["cluster"]["started"] is False
        assert api.state.requests == []
        node.kubelet.start()
        node.wait_listed([GPU])
        assert wait_until(lambda: node.command("status")["cluster"]["started"], 20)
        assert node.command("status")["cluster"]["started_because"] == "a worker registered with the kubelet"
        assert wait_until(lambda: len(api.state.requests) > 0, 20)


def test_an_exec_credential_plugin_gives_the_token(api: RunningApiServer, tmp_path: Path) -> None:
    """A kubeconfig whose user runs an exec plugin (client.authentication.k8s.io/v1): its token is
    the bearer token, and KUBERNETES_EXEC_INFO reaches it."""
    plugin = tmp_path / "plugin.py"
    seen = tmp_path / "exec-info"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": TOKEN},
    }
    plugin.write_text(
        "import json, os, sys\n"
        f"open({str(seen)!r}, 'w').write(os.environ.get('KUBERNETES_EXEC_INFO', ''))\n"
        f"print(json.dumps({credential!r}))\n"
    )
    kubeconfig = tmp_path / "exec-kubeconfig"
    text = api.kubeconfig.read_text().replace(
        f"token: {TOKEN}",
        f"exec: {{apiVersion: client.authentication.k8s.io/v1, command: {sys.executable}, args: [{plugin}]}}",
    )
    kubeconfig.write_text(text)
    from supervisor.kube.client import KubeClient
    from supervisor.kube.credentials import load_credentials

    api.state.add_node(NODE)
    client = KubeClient(load_credentials(str(kubeconfig), dict(os.environ)), component="test", version="test")
    assert client.get(f"/api/v1/nodes/{NODE}", what="get")["metadata"]["name"] == NODE
    assert json.loads(seen.read_text())["kind"] == "ExecCredential"


@pytest.mark.parametrize("missing", ["patch nodes/status"])
def test_a_missing_rbac_rule_is_shown_and_the_kubelet_path_runs_on(
    api: RunningApiServer, tmp_path: Path, missing: str
) -> None:
    """RBAC without `patch nodes/status`: the 403 is in status in the server's words, counted, and
    the node's GPUs stay advertised and healthy."""
    api.state.add_node(NODE)
    api.state.allow = {
        ("get", "nodes"),
        ("list", "nodes"),
        ("watch", "nodes"),
        ("create", "events"),
        ("patch", "events"),
    }
    with cluster_node(api, tmp_path) as node:
        node.wait_listed([GPU])
        assert wait_until(lambda: node.command("status")["cluster"].get("node_health", {}).get("error"), 20)
        error = node.command("status")["cluster"]["node_health"]["error"]
        assert f'cannot {missing.split()[0]} resource "{missing.split()[1]}"' in error
        assert node.kubelet.allocatable(GPU) == 4


def test_a_restart_in_the_same_run_dir_starts_with_the_labels_config(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """The label's config is kept in the run dir: a supervisor killed and started again (a container
    restart in the same pod) lists the labelled config's devices from its first ListAndWatch, even
    with the API server away, as NVIDIA's plugin finds the file its config-manager last linked."""
    api.state.add_node(NODE, {LABEL: "ts4"})
    with cluster_node(api, tmp_path, health=False) as node:
        assert wait_until(lambda: node.kubelet.capacity(GPU) == 16, 30), node.log()[-3000:]
        assert node.stop_supervisor(signal.SIGKILL) == -signal.SIGKILL
        assert wait_until(lambda: not node.workers(), 15)
        listed: list[int] = []
        node.kubelet.listeners.append(
            lambda resource, devices: listed.append(len(devices)) if resource == GPU else None
        )
        api.stop()  # only the kept label can say ts4 now
        node.start_supervisor()
        assert wait_until(lambda: listed and node.kubelet.connected(GPU), 30), node.log()[-3000:]
        assert set(listed) == {16}, listed
        assert "as an earlier run read it: starting with its config" in node.log()
