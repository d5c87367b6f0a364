"""A registration holds by design, not by order alone (issue: proven on the kubelet's own code).

Standalone workers (`python -m worker`, no supervisor) against the kubelet stand-in: the
stop-before-register order is pinned, and a registration the kubelet drops (no stream ever, or
the v1.32 `runClient` race disconnecting the newest client when an older stream's end is seen
late) is made again until a stream holds. Through a real supervisor, the worker says so in
`gpuvisor status` and the registration metric names the trigger.
"""

from __future__ import annotations

import os
import subprocess
import time

import grpc

from common.kubeletapi import pb
from common.procutil import unix_socket_listening
from supervisor.sim.kubelet import KubeletStandin
from tests.harness import GPU, Env, SimNode, listed_after, metrics_url, sample, settled, start_worker
from tests.helpers import wait_until


class OrderKubelet(KubeletStandin):
    """At each Register, notes whether the previous endpoint's server was still reachable."""

    def __init__(self, plugin_dir: str) -> None:
        super().__init__(plugin_dir, legacy_keying=True)
        self.previous_alive: list[bool] = []
        self._last = ""

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self._last:
            self.previous_alive.append(os.path.exists(self._last) or unix_socket_listening(self._last))
        self._last = os.path.join(self.plugin_dir, request.endpoint)
        return super().Register(request, context)


def test_the_old_server_is_gone_before_its_successor_registers(
    env: Env, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Three kubelet restarts and a deleted socket: at every new Register the previous server's
    socket is already gone (stopped, its streams ended), as kubernetes#121994 asks."""
    kubelet = OrderKubelet(env.dir)
    with kubelet:
        start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        for round_ in range(4):
            old = os.path.basename(kubelet.endpoint_socket(GPU))
            if round_ < 3:
                kubelet.restart()
            else:
                os.unlink(os.path.join(env.dir, old))

            def back(o: str = old) -> bool:
                return listed_after(kubelet, 0, o) and settled(env, kubelet)

            assert wait_until(back, 20), env.log()
        assert len(kubelet.previous_alive) >= 4 and not any(kubelet.previous_alive)


def test_a_registration_dropped_before_its_stream_is_made_again(
    env: Env, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The kubelet drops the first two freshly registered endpoints: no stream ever opens on
    them; the worker notices within its 2 s deadline, then within the doubled 4 s one (a kubelet
    that is only slow gets more time), and ends up connected."""
    with KubeletStandin(env.dir, drop_fresh=2) as kubelet:
        proc = start_worker(env, procs)
        assert wait_until(lambda: kubelet.connected(GPU) and settled(env, kubelet), 30), env.log()
        assert len([r for r in kubelet.registrations if not r.error]) == 3
        assert env.log().count("no ListAndWatch stream from the kubelet within 2s") == 1
        assert env.log().count("no ListAndWatch stream from the kubelet within 4s") == 1
        assert proc.poll() is None


def test_the_runclient_race_leaves_no_resource_disconnected(
    env: Env, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A kubelet that sees old streams end 300 ms late and then disconnects its newest client
    (v1.32 runClient): each re-registration is dropped in turn until the worker's backoff
    outlasts the delay; the resource ends connected and stays so."""
    with KubeletStandin(env.dir, legacy_keying=True, stream_end_delay=0.3) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        old = os.path.basename(kubelet.endpoint_socket(GPU))
        os.unlink(os.path.join(env.dir, old))  # a re-registration whose old stream ends "late"
        assert wait_until(lambda: listed_after(kubelet, 0, old) and settled(env, kubelet), 40), env.log()
        assert stays_connected(kubelet, 3.0, 60.0), env.log()
        assert "the kubelet dropped" in env.log()  # the backoff is what ended the ping-pong
        assert proc.poll() is None


def stays_connected(kubelet: KubeletStandin, seconds: float, within: float) -> bool:
    """Connected without a break for `seconds`, some time in the next `within` seconds."""
    since: list[float] = []

    def held() -> bool:
        if not kubelet.connected(GPU):
            since.clear()
            return False
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= seconds

    return wait_until(held, within)


def test_status_and_metrics_say_a_registration_was_made_again_for_want_of_a_stream() -> None:
    """Through a real supervisor: the dropped registration is made again, `gpuvisor status` counts
    it for the worker, and gpuvisor_registrations_total has it under trigger="no-stream"."""
    node = SimNode("pcie-l4", args=["--metrics-address", "127.0.0.1:0"])
    node.kubelet.drop_fresh = 1
    with node:
        node.wait_listed([GPU], 30)
        assert wait_until(lambda: node.command("status")["workers"][0]["no_stream_reregistrations"] == 1, 10)
        assert (
            sample(metrics_url(node), "gpuvisor_registrations_total", resource=GPU, trigger="no-stream")
            == 1.0
        )
