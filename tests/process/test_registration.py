"""Registration that never gives up, on real processes: a standalone worker against the stand-in.

Each test runs `python -m worker` (standalone: no supervisor tells it anything, so it has to
notice kubelet restarts and lost sockets by itself) against a `KubeletStandin` with legacy keying
(kubernetes#121994): a worker that let an old stream outlive its new registration would end up
disconnected, so "connected at the end" also proves the close-before-register ordering.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import grpc

from common.kubeletapi import pb
from common.kubeletapi.rpc import DevicePluginClient, unix_target
from supervisor.sim.kubelet import KubeletStandin
from tests.harness import GPU, Env, listed_after, plugin_sockets, settled, start_worker
from tests.helpers import sockets_in, wait_until


def state_lines(log: str, state: str) -> list[str]:
    return [line for line in log.splitlines() if f"state={state}]" in line]


class ProbingKubelet(KubeletStandin):
    """Before handling Register, checks the plugin already serves: socket there, options answered twice."""

    def __init__(self, plugin_dir: str) -> None:
        super().__init__(plugin_dir, legacy_keying=True)
        self.probes: list[tuple[bool, int]] = []  # (socket existed, options answers) per Register

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        path = os.path.join(self.plugin_dir, request.endpoint)
        existed = os.path.exists(path)
        answers = 0
        channel = grpc.insecure_channel(unix_target(path))
        try:
            client = DevicePluginClient(channel)
            for _ in range(2):  # our Register stays in flight until both were answered
                options = client.GetDevicePluginOptions(pb.Empty(), timeout=5)
                answers += int(options.get_preferred_allocation_available)
        except grpc.RpcError:
            pass
        finally:
            channel.close()
        self.probes.append((existed, answers))
        return super().Register(request, context)


def test_serves_before_registering(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """The worker's socket exists and answers GetDevicePluginOptions before its first Register arrives."""
    with ProbingKubelet(env.dir) as kubelet:
        start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        assert isinstance(kubelet, ProbingKubelet)
        assert kubelet.probes[0] == (True, 2)
        assert kubelet.registrations[0].error == ""


def test_options_answered_while_register_in_flight(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """A Register held open by the kubelet does not block GetDevicePluginOptions on the plugin's socket."""
    with ProbingKubelet(env.dir) as kubelet:
        start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        assert isinstance(kubelet, ProbingKubelet)
        # Every Register of this run was held until two extra options calls had been answered.
        assert kubelet.probes and all(p == (True, 2) for p in kubelet.probes)
        assert len(kubelet.registrations) == len(kubelet.probes)


def test_kubelet_restart_reregisters_on_a_new_socket(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """After a kubelet restart the standalone worker registers again, in-process, on a fresh socket name."""
    with KubeletStandin(env.dir, legacy_keying=True) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        old = os.path.basename(kubelet.endpoint_socket(GPU))
        before = time.monotonic()
        kubelet.restart()
        assert wait_until(lambda: listed_after(kubelet, before, old) and settled(env, kubelet), 15), env.log()
        assert proc.poll() is None  # no process restart
        assert old not in plugin_sockets(env)


def test_own_socket_deleted_reregisters(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """Deleting the worker's socket makes it serve on a new socket name and register again, still connected."""
    with KubeletStandin(env.dir, legacy_keying=True) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        old = os.path.basename(kubelet.endpoint_socket(GPU))
        os.unlink(os.path.join(env.dir, old))
        assert wait_until(lambda: listed_after(kubelet, 0, old) and settled(env, kubelet), 15), env.log()
        assert len([r for r in kubelet.registrations if not r.error]) == 2
        assert proc.poll() is None


def test_stream_cancelled_by_kubelet_reregisters(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """A ListAndWatch stream the kubelet cancels (it never reopens one) makes the worker register again."""
    with KubeletStandin(env.dir, legacy_keying=True) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        res = kubelet.resource(GPU)
        assert res is not None and res.endpoint is not None and res.endpoint.stream is not None
        old = os.path.basename(res.endpoint.socket_path)
        res.endpoint.stream.cancel()
        assert wait_until(lambda: listed_after(kubelet, 0, old) and settled(env, kubelet), 15), env.log()
        assert proc.poll() is None
        assert "registering (the kubelet ended our ListAndWatch stream)" in env.log()


def test_kubelet_absent_at_start_then_appears(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """With no kubelet for 3 s the worker waits (one log line, not one per try) and registers once it appears."""
    kubelet = KubeletStandin(env.dir, legacy_keying=True)
    appeared: list[float] = []

    def appear() -> None:
        kubelet.start()
        appeared.append(time.monotonic())

    start_worker(env, procs)
    timer = threading.Timer(3.0, appear)  # the scenario: the kubelet comes up 3 s after the plugin
    timer.start()
    try:
        assert wait_until(lambda: state_lines(env.log(), "waiting"), 15), env.log()
        assert wait_until(lambda: len(plugin_sockets(env)) == 1, 15)  # serving while waiting
        assert kubelet.wait_listed([GPU], 30), env.log()
        assert appeared and kubelet.registrations[0].at >= appeared[0]
        assert kubelet.registrations[0].at - appeared[0] < 5.0
        assert wait_until(lambda: state_lines(env.log(), "registered"), 10), env.log()
        log = env.log()
        assert len(state_lines(log, "waiting")) == 1, log
        assert len(state_lines(log, "registered")) == 1, log
        assert state_lines(log, "retrying") == [], log
    finally:
        timer.cancel()
        timer.join()
        kubelet.stop()


class RefusingKubelet(KubeletStandin):
    """Refuses the first `refusals` Register calls, as a kubelet that is not ready would."""

    def __init__(self, plugin_dir: str, refusals: int) -> None:
        super().__init__(plugin_dir, legacy_keying=True)
        self.refusals = refusals
        self.calls = 0

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.calls += 1
        if self.calls <= self.refusals:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"not ready yet ({self.calls})")
        return super().Register(request, context)


def test_failed_register_backs_off_and_logs_once(env: Env, procs: list[subprocess.Popen[bytes]]) -> None:
    """Refused Registers are retried with backoff until one succeeds; the log says "retrying" once, not per try."""
    with RefusingKubelet(env.dir, refusals=4) as kubelet:
        start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 30), env.log()
        assert isinstance(kubelet, RefusingKubelet) and kubelet.calls == 5
        assert wait_until(lambda: state_lines(env.log(), "registered"), 10), env.log()
        log = env.log()
        assert len(state_lines(log, "retrying")) == 1, log
        assert len(state_lines(log, "registered")) == 1, log
        assert "not ready yet (1)" in log


def test_five_quick_kubelet_restarts_end_with_one_registration(
    env: Env, procs: list[subprocess.Popen[bytes]]
) -> None:
    """5 kubelet restarts in quick succession end with exactly one live registration and one plugin socket."""
    with KubeletStandin(env.dir, legacy_keying=True) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        before = 0.0
        for _ in range(5):
            before = time.monotonic()
            kubelet.restart()
        assert wait_until(lambda: listed_after(kubelet, before) and settled(env, kubelet), 20), env.log()
        assert proc.poll() is None
        # The last registration is the live one: nothing older disconnected it (legacy keying).
        ok = [r for r in kubelet.registrations if not r.error]
        assert ok[-1].endpoint == plugin_sockets(env)[0]


def test_sigterm_ends_streams_and_removes_only_own_socket(
    env: Env, procs: list[subprocess.Popen[bytes]]
) -> None:
    """SIGTERM: the kubelet sees the stream end, the worker exits 0 and removes its socket and no other."""
    planted = os.path.join(env.dir, "gpuvisor-other-1234abcd.sock")
    keeper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    keeper.bind(planted)
    keeper.close()  # the file stays: a socket of someone else
    with KubeletStandin(env.dir, legacy_keying=True) as kubelet:
        proc = start_worker(env, procs)
        assert kubelet.wait_listed([GPU], 20), env.log()
        own = os.path.basename(kubelet.endpoint_socket(GPU))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, env.log()
        assert kubelet.wait_for(lambda: not kubelet.connected(GPU), 10)
        assert kubelet.allocatable(GPU) == 0
        assert own not in sockets_in(env.dir)
        assert os.path.exists(planted)
        assert "stopped (worker stopping)" in env.log()
