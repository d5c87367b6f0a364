"""Health end to end on real processes: fault injection through `gpuvisor sim`, the supervisor's
NVML thread and health book, ZeroMQ fan-out, the worker, and what the kubelet stand-in sees.

Most tests share one pcie-l4 node (module fixture) with every GPU in 4 time-slicing replicas, a
1 s transient quiet period and probes every 0.3 s; each test works on its own GPU and leaves it
Healthy again, so the order of the tests does not matter.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from common.messages import DeviceHealth, HealthSnapshot, SnapshotReply, encode
from supervisor.__main__ import main as gpuvisor
from supervisor.config import load_config
from supervisor.control.client import send_command
from supervisor.control.commands import CommandError
from supervisor.node.nvml import Nvml
from supervisor.node.planning import plan_resources
from supervisor.sim.nvml import load_simulator
from tests.harness import SimNode, metrics_url, sample
from tests.helpers import gone, short_tmpdir, wait_until

GPU = "nvidia.com/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
REPLICAS = 4
L4_GPUS = load_simulator("pcie-l4").gpu_uuids()

L4_CONFIG = {
    "version": "v1",
    "sharing": {"timeSlicing": {"resources": [{"name": GPU, "replicas": REPLICAS}]}},
    "gpuvisor": {"health": {"transientQuietSeconds": 1, "xids": {"94": "transient"}}},
}


def replicas(gpu: str) -> list[str]:
    return [f"{gpu}::{n}" for n in range(REPLICAS)]


def unhealthy_at_standin(node: SimNode, resources: list[str]) -> set[tuple[str, str]]:
    return {
        (resource, dev.id)
        for resource in resources
        for dev in node.kubelet.devices(resource).values()
        if dev.health != HEALTHY
    }


@pytest.fixture(scope="module")
def l4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    path = tmp_path_factory.mktemp("health") / "config.yaml"
    path.write_text(yaml.safe_dump(L4_CONFIG), encoding="utf-8")
    with SimNode(
        "pcie-l4", args=["--config-file", str(path)], env={"GPUVISOR_PROBE_INTERVAL": "0.3"}
    ) as node:
        node.wait_listed([GPU])
        yield node


def test_xid_marks_every_replica_and_logs_one_line(l4: SimNode) -> None:
    """XID 48 on a time-sliced GPU: all 4 replicas Unhealthy, no other device, and one log line
    naming the GPU, the resource, the XID and the action; `sim reset` brings them back."""
    gpu = L4_GPUS[0]
    log_start = len(l4.log())
    l4.sim("xid", device=gpu, xid=48)
    l4.wait_health(GPU, replicas(gpu), UNHEALTHY)
    assert unhealthy_at_standin(l4, [GPU]) == {(GPU, d) for d in replicas(gpu)}
    lines = [line for line in l4.log()[log_start:].splitlines() if "supervisor: health" in line]
    assert len(lines) == 1, lines
    assert all(part in lines[0] for part in (gpu, GPU, "XID 48", "until-reset", "Unhealthy")), lines[0]
    l4.sim("reset", device=gpu)
    l4.wait_health(GPU, replicas(gpu), HEALTHY)


def test_xid_94_keeps_the_gpu_allocatable_by_default_while_xid_48_takes_it_out() -> None:
    """Default policy: XID 94 (a contained ECC error, NVIDIA's catalog: restart the application)
    leaves the kubelet stand-in's allocatable and the GPU's health as they were, with a log line
    advising a reset when convenient; XID 48 after it, on another GPU, takes that one GPU out."""
    with SimNode("pcie-l4") as node:
        node.wait_listed([GPU])
        contained, uncorrectable = sorted(node.kubelet.devices(GPU))[:2]
        before = node.kubelet.allocatable(GPU)
        node.sim("xid", device=contained, xid=94)
        node.sim("xid", device=uncorrectable, xid=48)  # handled after the 94: events keep their order
        node.wait_health(GPU, [uncorrectable], UNHEALTHY)
        assert node.kubelet.allocatable(GPU) == before - 1
        assert node.health(GPU, contained) == HEALTHY
        assert [c["gpu"] for c in node.command("status")["conditions"]] == [uncorrectable]
        advice = f"health event: XID 94 on {contained}: ignored, the GPU stays in service"
        assert wait_until(lambda: advice in node.log(), 10), node.log()[-3000:]
        assert "reset the GPU when convenient" in node.log()


def test_transient_xid_recovers_and_until_reset_waits_for_a_reset(l4: SimNode) -> None:
    """XID 94 (transient by this node's config) recovers on its own after the quiet period and a probe; XID 48
    (until-reset) injected at the same time is still Unhealthy then, until `sim reset`."""
    transient, until_reset = L4_GPUS[1], L4_GPUS[2]
    l4.sim("xid", device=until_reset, xid=48)
    l4.sim("xid", device=transient, xid=94)
    l4.wait_health(GPU, replicas(until_reset) + replicas(transient), UNHEALTHY)
    l4.wait_health(GPU, replicas(transient), HEALTHY, timeout=20)
    assert all(l4.health(GPU, d) == UNHEALTHY for d in replicas(until_reset))
    l4.sim("reset", device=until_reset)
    l4.wait_health(GPU, replicas(until_reset), HEALTHY)


def test_double_bit_ecc_from_the_cli_is_unhealthy_with_reason_and_since_in_status(
    l4: SimNode, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuvisor sim ecc --kind double` marks the GPU's replicas Unhealthy until a reset, and
    `gpuvisor status` keeps the reason and since of each device."""
    gpu = L4_GPUS[1]
    before = time.time()
    assert gpuvisor(["sim", "ecc", "--device", gpu, "--kind", "double", "--run-dir", l4.run_dir]) == 0
    assert capsys.readouterr().out.startswith("injected: ecc")
    l4.wait_health(GPU, replicas(gpu), UNHEALTHY)
    status = {d["id"]: d for d in l4.command("status")["resources"][GPU]}
    for device in replicas(gpu):
        assert status[device]["health"] == UNHEALTHY
        assert "double-bit ECC error" in status[device]["reason"]
        assert before - 1 <= status[device]["since"] <= time.time() + 1
    assert gpuvisor(["sim", "reset", "--device", gpu, "--run-dir", l4.run_dir]) == 0
    l4.wait_health(GPU, replicas(gpu), HEALTHY)


def test_lost_gpu_is_unhealthy_and_recovers_when_restored(l4: SimNode) -> None:
    """A lost GPU makes exactly its replicas Unhealthy; once NVML sees it again they recover."""
    gpu = L4_GPUS[3]
    l4.sim("lose", device=gpu)
    l4.wait_health(GPU, replicas(gpu), UNHEALTHY)
    assert unhealthy_at_standin(l4, [GPU]) == {(GPU, d) for d in replicas(gpu)}
    assert wait_until(lambda: f"GPU {gpu} lost" in l4.log(), 15)
    l4.sim("restore", device=gpu)
    l4.wait_health(GPU, replicas(gpu), HEALTHY)


def test_restarted_workers_first_list_already_shows_unhealthy(l4: SimNode) -> None:
    """XID, then SIGKILL of the worker: the new worker's FIRST ListAndWatch message already
    shows the device Unhealthy (snapshot before serving)."""
    gpu = L4_GPUS[0]
    l4.sim("xid", device=gpu, xid=48)
    l4.wait_health(GPU, replicas(gpu), UNHEALTHY)
    old_pid, old_socket = l4.worker_pid(GPU), l4.kubelet.endpoint_socket(GPU)
    seen: list[tuple[str, dict[str, str]]] = []

    def listener(resource: str, devices: list[Any]) -> None:
        if resource == GPU:
            seen.append((l4.kubelet.endpoint_socket(GPU), {d.id: d.health for d in devices}))

    l4.kubelet.listeners.append(listener)
    try:
        os.kill(old_pid, signal.SIGKILL)
        assert wait_until(lambda: gone([old_pid]), 10)
        assert wait_until(lambda: any(sock != old_socket for sock, _ in seen), 30), l4.log()[-3000:]
    finally:
        l4.kubelet.listeners.remove(listener)
    first = next(health for sock, health in seen if sock != old_socket)
    assert [first[d] for d in replicas(gpu)] == [UNHEALTHY] * REPLICAS
    assert sum(1 for h in first.values() if h == UNHEALTHY) == REPLICAS
    l4.sim("reset", device=gpu)
    l4.wait_health(GPU, replicas(gpu), HEALTHY)


def test_malformed_control_messages_are_logged_and_dropped(l4: SimNode) -> None:
    """Garbage on the supervisor's control socket is logged and dropped; it keeps answering."""
    before = l4.log().count("dropped a malformed control message")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{os.path.join(l4.run_dir, 'control.sock')}")
        sock.send_multipart([b"junk"])
        sock.send_multipart([b"control", b"{not json"])
        sock.send_multipart([b"control", b'{"v":1,"seq":1,"time":0,"kind":"no-such-kind","payload":{}}'])
        assert wait_until(lambda: l4.log().count("dropped a malformed control message") >= before + 3, 15)
    finally:
        sock.close(0)
    assert l4.proc is not None and l4.command("status")["pid"] == l4.proc.pid


def test_sim_on_an_unknown_device_is_refused_with_a_clear_error(l4: SimNode) -> None:
    """`gpuvisor sim xid` on a UUID the simulated node lacks gets an error naming it."""
    with pytest.raises(CommandError, match="no GPU or MIG device with UUID 'GPU-nope'"):
        l4.sim("xid", device="GPU-nope", xid=48)


def test_xid_on_a_mig_instance_marks_only_it_and_a_gpu_xid_marks_all_instances(tmp_path: Path) -> None:
    """mig-a100, mixed: an XID naming a GPU/compute instance marks only that MIG device (both
    its replicas); an XID naming none marks every MIG device of the GPU across mig-* resources."""
    path = tmp_path / "config.yaml"
    config = {
        "version": "v1",
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    sim = load_simulator("mig-a100")
    nvml = Nvml(sim)
    nvml.init()
    plans = plan_resources(
        nvml.discover(), load_config({"mig_strategy": "mixed", "config_file": str(path)}, {})
    )
    nvml.shutdown()
    gpu0 = sim.gpu_uuids()[0]
    on_gpu0 = {(r, d.id) for r, p in plans.items() for d in p.devices if d.gpu_uuid == gpu0}
    on_gi9 = {(r, d.id) for r, p in plans.items() for d in p.devices if d.gpu_uuid == gpu0 and d.mig_gi == 9}
    assert len(on_gi9) == 2 and len({r for r, _ in on_gpu0}) == 3
    resources = sorted(plans)
    with SimNode("mig-a100", args=["--mig-strategy", "mixed", "--config-file", str(path)]) as node:
        node.wait_listed(resources)
        node.sim("xid", device=gpu0, xid=48, gpu_instance=9, compute_instance=0)
        assert wait_until(lambda: unhealthy_at_standin(node, resources) == on_gi9, 15), node.log()[-3000:]
        node.sim("reset", device=gpu0)
        assert wait_until(lambda: not unhealthy_at_standin(node, resources), 15)
        node.sim("xid", device=gpu0, xid=48)
        assert wait_until(lambda: unhealthy_at_standin(node, resources) == on_gpu0, 15), node.log()[-3000:]


# --------------------------------------------------------------------------- without a node


def test_worker_drops_a_malformed_message_and_keeps_applying(tmp_path: Path) -> None:
    """The worker's receive path logs and drops a malformed message, then applies a good one."""
    from common.workerargs import parse_args
    from worker.main import Worker

    plan = plan_resources(_discover("pcie-l4"), load_config({}, {}))[GPU]
    args = parse_args(
        ["--resource", GPU, "--plan", "unused", "--kubelet-socket", str(tmp_path / "kubelet.sock")]
    )
    worker = Worker(args, plan)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind("inproc://health-e2e-worker-decode")
        rx.connect("inproc://health-e2e-worker-decode")
        bad = plan.devices[1].id
        tx.send_multipart([b"health", b"\xff\xfe"])
        tx.send_multipart([b"health", b'{"v":1,"seq":1}'])
        snapshot = HealthSnapshot(
            seq=7,
            resource=GPU,
            devices=(DeviceHealth(device_id=bad, healthy=False, reason="test", since=1.0),),
            epoch="e",
        )
        good = encode(SnapshotReply(snapshot), seq=3)
        tx.send_multipart(good)

        def drained() -> bool:
            worker.link.drain(rx)
            return worker.applier.seq is not None

        assert wait_until(drained, 10)
        assert worker.stats.snapshot()["count:malformed_messages"] == 2
        assert worker.applier.seq == 7
        assert worker.book.unhealthy_ids() == {bad}
    finally:
        tx.close(0)
        rx.close(0)
        worker.mailbox.close()


def test_plan_update_lists_new_devices_only_with_their_snapshot_health(tmp_path: Path) -> None:
    """An in-place PlanUpdate without a snapshot (the supervisor had no health book) keeps the old
    list until the requested snapshot; the first list with the new IDs already shows a new ID the
    snapshot marks unhealthy as Unhealthy."""
    from common.messages import PlanUpdate, SnapshotRequest, decode
    from common.workerargs import parse_args
    from worker.main import Worker

    full = plan_resources(_discover("pcie-l4"), load_config({}, {}))[GPU]
    old = dataclasses.replace(full, devices=full.devices[:2])
    old_ids = [d.id for d in old.devices]
    bad = full.devices[3].id
    args = parse_args(
        ["--resource", GPU, "--plan", "unused", "--kubelet-socket", str(tmp_path / "kubelet.sock")]
    )
    worker = Worker(args, old)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    supervisor, dealer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind("inproc://health-e2e-plan-update")
        rx.connect("inproc://health-e2e-plan-update")
        supervisor.bind("inproc://health-e2e-plan-update-control")
        dealer.connect("inproc://health-e2e-plan-update-control")
        worker.link.dealer = dealer

        def reply(seq: int, *devices: DeviceHealth) -> None:
            tx.send_multipart(
                encode(
                    SnapshotReply(HealthSnapshot(seq=seq, resource=GPU, devices=devices, epoch="e")), seq=seq
                )
            )

            def applied() -> bool:
                worker.link.drain(rx)
                return worker.applier.seq == seq

            assert wait_until(applied, 10)

        reply(1)
        tx.send_multipart(encode(PlanUpdate(full.to_json()), seq=2))

        def asked() -> bool:
            worker.link.drain(rx)
            return supervisor.poll(0) != 0

        assert wait_until(asked, 10)
        assert isinstance(decode(supervisor.recv_multipart()).message, SnapshotRequest)
        version, listing = worker.book.current()
        assert [d.ID for d in listing.devices] == old_ids  # not the new IDs as Healthy by default
        assert worker.book.plan == old

        reply(3, DeviceHealth(device_id=bad, healthy=False, reason="XID 48", since=1.0))
        new_version, listing = worker.book.current()
        assert new_version == version + 1  # one swap: no list in between
        expected = {d.id: (UNHEALTHY if d.id == bad else HEALTHY) for d in full.devices}
        assert {d.ID: d.health for d in listing.devices} == expected
        assert worker.book.plan == full and worker.plan == full
    finally:
        for sock in (tx, rx, supervisor, dealer):
            sock.close(0)
        worker.mailbox.close()


def test_plan_update_with_its_snapshot_swaps_in_one_step_without_asking(tmp_path: Path) -> None:
    """A PlanUpdate carrying the new devices' health (what the supervisor sends): the worker lists
    the new IDs with that health in one swap and sends no SnapshotRequest."""
    from common.messages import PlanUpdate
    from common.workerargs import parse_args
    from worker.main import Worker

    full = plan_resources(_discover("pcie-l4"), load_config({}, {}))[GPU]
    old = dataclasses.replace(full, devices=full.devices[:2])
    bad = full.devices[3].id
    args = parse_args(
        ["--resource", GPU, "--plan", "unused", "--kubelet-socket", str(tmp_path / "kubelet.sock")]
    )
    worker = Worker(args, old)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    supervisor, dealer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind("inproc://health-e2e-plan-snapshot")
        rx.connect("inproc://health-e2e-plan-snapshot")
        supervisor.bind("inproc://health-e2e-plan-snapshot-control")
        dealer.connect("inproc://health-e2e-plan-snapshot-control")
        worker.link.dealer = dealer
        tx.send_multipart(
            encode(SnapshotReply(HealthSnapshot(seq=1, resource=GPU, devices=(), epoch="e")), seq=1)
        )

        def drained(check: Callable[[], bool]) -> Callable[[], bool]:
            def step() -> bool:
                worker.link.drain(rx)
                return check()

            return step

        assert wait_until(drained(lambda: worker.applier.seq == 1), 10)
        version, _ = worker.book.current()
        devices = tuple(
            DeviceHealth(
                device_id=d.id, healthy=d.id != bad, reason="XID 48" if d.id == bad else "", since=1.0
            )
            for d in full.devices
        )
        update = PlanUpdate(full.to_json(), HealthSnapshot(seq=3, resource=GPU, devices=devices, epoch="e"))
        tx.send_multipart(encode(update, seq=2))
        assert wait_until(drained(lambda: worker.plan == full), 10)
        new_version, listing = worker.book.current()
        assert new_version == version + 1
        assert {d.ID: d.health for d in listing.devices} == {
            d.id: (UNHEALTHY if d.id == bad else HEALTHY) for d in full.devices
        }
        assert worker.applier.seq == 3 and supervisor.poll(200) == 0  # nothing asked
    finally:
        for sock in (tx, rx, supervisor, dealer):
            sock.close(0)
        worker.mailbox.close()


def test_sim_cli_refuses_when_no_supervisor_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuvisor sim xid` with no supervisor at the run dir exits 1 with a clear message."""
    rc = gpuvisor(["sim", "xid", "--device", "GPU-x", "--xid", "48", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "gpuvisor sim xid: no supervisor control socket at" in err and str(tmp_path) in err
    assert "Traceback" not in err


def test_sim_command_refuses_a_stale_control_socket_with_a_clear_error() -> None:
    """A control socket nobody answers on: the client gives up with a clear error, no hang."""
    with short_tmpdir() as run_dir:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(os.path.join(run_dir, "control.sock"))
        stale.close()  # the file stays, nobody listens: a supervisor that died
        start = time.monotonic()
        with pytest.raises(CommandError, match="did not answer within"):
            send_command(run_dir, "sim", {"action": "xid", "device": "GPU-x", "xid": 48}, timeout=0.3)
        assert time.monotonic() - start < 5


def _discover(profile: str) -> Any:
    nvml = Nvml(load_simulator(profile))
    nvml.init()
    try:
        return nvml.discover()
    finally:
        nvml.shutdown()


def test_a_burst_of_xids_is_counted_summarised_and_never_stalls_health() -> None:
    """1,000 XID 31 events on one GPU (NVIDIA #1553): every one is counted, the log gets one line
    for them per 10 s window (one window when the burst is quick), `gpuvisor status` says how many were held, and an XID 48 right after still
    takes its GPU out at once, with its own line."""
    with SimNode("pcie-l4", args=["--metrics-address", "127.0.0.1:0"]) as node:
        node.wait_listed([GPU])
        url = metrics_url(node)
        gpu = sorted(node.kubelet.devices(GPU))[0]
        started = time.monotonic()
        for _ in range(1000):
            node.sim("xid", device=gpu, xid=31)
        windows = 1 + int((time.monotonic() - started) // 10)  # a slow machine may span more
        assert wait_until(lambda: sample(url, "gpuvisor_xid_events_total", xid="31") == 1000.0, 30)
        node.sim("xid", device=gpu, xid=48)
        node.wait_health(GPU, [gpu], UNHEALTHY)
        log = node.log()
        lines = log.count(f"health event: XID 31 on {gpu}: ignored as an application error")
        assert 1 <= lines <= windows, log[-3000:]
        figures = node.command("status")["health_events"]
        assert figures["held"] >= 1000 - windows, figures
        assert f"health event: XID 48 on {gpu}: Unhealthy until the GPU is reset -> 1 device(s)" in log
