"""End to end: a real supervisor's /metrics, /healthz, /readyz, systemd notifications and `status`.

Each test runs a simulated node (tests.harness.SimNode: a kubelet stand-in plus the real
supervisor and workers) in a temp dir. The metrics endpoint listens on 127.0.0.1:0 and the test
learns the bound port from `status` (`metrics_url`). Worker figures reach /metrics through
heartbeats (one a second), so every check polls with a generous deadline.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.kubeletapi import api_pb2 as pb
from tests.harness import SimNode, get, gpuvisor_status, metrics_url, sample
from tests.helpers import short_tmpdir, wait_until

GPU = "nvidia.com/gpu"
METRICS_ARGS = ["--metrics-address", "127.0.0.1:0"]


def wait_sample(
    node: SimNode, url: str, name: str, at_least: float, timeout: float = 20.0, **labels: str
) -> None:
    ok = wait_until(lambda: (sample(url, name, **labels) or 0.0) >= at_least, timeout, interval=0.2)
    assert ok, f"{name}{labels} never reached {at_least}: {sample(url, name, **labels)}\n{node.log()[-3000:]}"


def test_probes_and_metrics_follow_the_node() -> None:
    """/healthz 200; /readyz 503 until registered, then 200; device, XID, RPC, restart and registration series move."""
    with SimNode("pcie-l4", args=METRICS_ARGS, start_kubelet=False) as node:
        url = metrics_url(node)
        assert get(url + "/healthz") == (200, "ok\n")
        status, body = get(url + "/readyz")
        assert status == 503 and "not ready" in body, body
        assert sample(url, "gpuvisor_ready") == 0.0

        node.kubelet.start()
        node.wait_listed([GPU])
        assert wait_until(lambda: get(url + "/readyz")[0] == 200, 20, interval=0.2), node.log()[-3000:]
        assert sample(url, "gpuvisor_ready") == 1.0
        assert sample(url, "gpuvisor_devices", resource=GPU, health="healthy") == 4.0
        assert sample(url, "gpuvisor_devices", resource=GPU, health="unhealthy") == 0.0
        wait_sample(node, url, "gpuvisor_registrations_total", 1, resource=GPU, trigger="start")

        # An XID that takes a GPU out until reset: the counter and the device gauges move.
        victim = sorted(node.kubelet.devices(GPU))[0]
        node.sim("xid", device=victim, xid=48)
        wait_sample(node, url, "gpuvisor_xid_events_total", 1, xid="48")
        wait_sample(node, url, "gpuvisor_devices", 1, resource=GPU, health="unhealthy")
        assert sample(url, "gpuvisor_devices", resource=GPU, health="healthy") == 3.0
        wait_sample(node, url, "gpuvisor_health_transitions_total", 1, resource=GPU, to="unhealthy")

        # An allocation: the worker's Allocate histogram reaches /metrics with its next heartbeat.
        node.kubelet.allocate(GPU, 1)
        wait_sample(node, url, "gpuvisor_rpc_duration_seconds_count", 1, resource=GPU, method="Allocate")

        # A worker killed: one restart counted, by its cause.
        node.kubelet.wait_listed([GPU])
        pid = node.worker_pid(GPU)
        os.kill(pid, signal.SIGKILL)
        wait_sample(node, url, "gpuvisor_worker_restarts_total", 1, resource=GPU)
        node.wait_listed([GPU])
        # The histogram is cumulative over worker lives: the dead worker's Allocate stays counted.
        assert (sample(url, "gpuvisor_rpc_duration_seconds_count", resource=GPU, method="Allocate") or 0) >= 1

        # A kubelet restart: the registration that follows is counted as such.
        assert wait_until(lambda: node.worker_pid(GPU) not in (0, pid), 20)
        wait_sample(node, url, "gpuvisor_registrations_total", 2, resource=GPU, trigger="start")
        node.kubelet.restart()
        wait_sample(node, url, "gpuvisor_registrations_total", 1, resource=GPU, trigger="kubelet-restart")
        assert wait_until(lambda: get(url + "/readyz")[0] == 200, 20, interval=0.2)
        assert get(url + "/nope")[0] == 404


class NotifySocket:
    """A stand-in for systemd's NOTIFY_SOCKET: collects the datagrams' KEY=VALUE lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.lines: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return self.lines
            self.lines.extend(data.decode().splitlines())

    def wait_for(self, predicate: object, timeout: float = 20.0) -> bool:
        assert callable(predicate)
        return wait_until(lambda: predicate(self.drain()), timeout, interval=0.05)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    with short_tmpdir("gvn") as tmp:
        sock = NotifySocket(os.path.join(tmp, "notify"))
        try:
            yield sock
        finally:
            sock.close()


def test_systemd_notifications(notify: NotifySocket) -> None:
    """STATUS lines while not ready, READY=1 once every resource is registered, WATCHDOG=1 pings, STOPPING=1 on SIGTERM."""
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "2000000"}
    with SimNode("pcie-l4", env=env, start_kubelet=False) as node:
        assert notify.wait_for(lambda ls: any(line.startswith("STATUS=not ready") for line in ls)), (
            notify.lines
        )
        # Pings every second (half of WatchdogSec) from the main loop, ready or not.
        assert notify.wait_for(lambda ls: ls.count("WATCHDOG=1") >= 2), notify.lines
        assert "READY=1" not in notify.drain()  # no kubelet yet: nothing is registered

        node.kubelet.start()
        assert notify.wait_for(lambda ls: "READY=1" in ls), f"{notify.lines}\n{node.log()[-3000:]}"
        assert node.kubelet.connected(GPU)  # ready means registered (and streaming)
        ready_at = notify.lines.index("READY=1")
        assert any(line.startswith("STATUS=ready") for line in notify.lines), notify.lines
        assert "STOPPING=1" not in notify.lines

        assert node.stop_supervisor(signal.SIGTERM) == 0
        notify.drain()
        assert "STOPPING=1" in notify.lines[ready_at:]
        assert notify.lines.count("READY=1") == 1


def _checkpoint(entries: list[dict[str, object]]) -> str:
    return json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1})


def test_status_shows_allocations_from_the_checkpoint() -> None:
    """`gpuvisor status` (JSON and table) lists the checkpoint's allocations of our resources, readiness and
    conditions; with the checkpoint gone it warns of nothing (no checkpoint: nothing allocated yet)."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        ids, response = node.kubelet.allocate(GPU, 2)
        resp = base64.b64encode(response.SerializeToString()).decode()
        entries: list[dict[str, object]] = [
            {
                "PodUID": "pod-uid-1",
                "ContainerName": "train",
                "ResourceName": GPU,
                "DeviceIDs": {"0": ids},
                "AllocResp": resp,
            },
            {
                "PodUID": "pod-uid-2",
                "ContainerName": "other",
                "ResourceName": "example.com/fpga",
                "DeviceIDs": ["x"],
            },
        ]
        with open(os.path.join(node.plugin_dir, "kubelet_internal_checkpoint"), "w", encoding="utf-8") as fh:
            fh.write(_checkpoint(entries))
        assert pb.ContainerAllocateResponse.FromString(base64.b64decode(resp)).envs  # a real response

        node.sim("xid", device=ids[0], xid=48)
        assert wait_until(lambda: node.command("status")["conditions"], 15)

        done = gpuvisor_status(node, "--json")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert data["allocations_source"] == "checkpoint"
        assert data["allocations"] == [
            {
                "pod": "pod-uid-1",
                "pod_uid": "pod-uid-1",
                "namespace": "",
                "container": "train",
                "resource": GPU,
                "devices": ids,
            }
        ]
        assert data["plugin_dir"] == node.plugin_dir
        assert [(c["gpu"], c["name"], c["recovery"]) for c in data["conditions"]] == [
            (ids[0], "xid:48", "until-reset")
        ]
        assert isinstance(data["ready"], bool) and data["ready_detail"]

        table = gpuvisor_status(node)
        assert table.returncode == 0, table.stderr
        assert "allocations (from checkpoint):" in table.stdout
        assert "pod-uid-1" in table.stdout and "train" in table.stdout and "pod-uid-2" not in table.stdout
        assert "xid:48" in table.stdout and "ready:" in table.stdout

        os.unlink(os.path.join(node.plugin_dir, "kubelet_internal_checkpoint"))
        missing = gpuvisor_status(node)  # nothing allocated yet is normal: no warning
        assert missing.returncode == 0 and missing.stderr == ""


def ignored_xids(node: SimNode) -> list[str]:
    """The XIDs the running health policy ignores, from `status`."""
    policy = str(node.command("status")["health_policy"])
    return policy.split("ignored XIDs: ")[1].split(";")[0].split(",")


def test_reloaded_health_section_applies_live(tmp_path: Path) -> None:
    """A SIGHUP reload that maps XID 94 from transient to ignore applies to the next XID 94, without a restart."""
    config = tmp_path / "config.yaml"
    config.write_text(
        'version: v1\ngpuvisor:\n  health:\n    transientQuietSeconds: 600\n    xids: {"94": transient}\n'
    )
    with SimNode("pcie-l4", args=["--config-file", str(config)]) as node:
        node.wait_listed([GPU])
        first, second, third = sorted(node.kubelet.devices(GPU))[:3]
        node.sim("xid", device=first, xid=94)  # transient by the config: takes the GPU out
        node.wait_health(GPU, [first], "Unhealthy")
        pid = node.proc.pid if node.proc else 0

        config.write_text(
            'version: v1\ngpuvisor:\n  health:\n    transientQuietSeconds: 600\n    xids: {"94": ignore}\n'
        )
        os.kill(pid, signal.SIGHUP)
        assert wait_until(lambda: "94" in ignored_xids(node), 20), node.command("status")["health_policy"]

        node.sim("xid", device=second, xid=94)  # now ignored
        node.sim("xid", device=third, xid=48)  # a marker: events are handled in order
        node.wait_health(GPU, [third], "Unhealthy")
        assert node.health(GPU, second) == "Healthy"
        conditions = {(c["gpu"], c["name"]) for c in node.command("status")["conditions"]}
        assert conditions == {(first, "xid:94"), (third, "xid:48")}  # the earlier fault keeps its own rule
        assert node.worker_pid(GPU) and node.proc is not None and node.proc.pid == pid
        assert "setting health changed; it takes effect at the next restart" not in node.log()
