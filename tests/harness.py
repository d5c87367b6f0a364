"""A simulated node for integration tests: a kubelet stand-in plus a real supervisor process.

`profile` names the NVML simulator's node (`--simulate`); `profile=None` runs the supervisor on
real NVML instead, which the real-binding tier points at the project's fake libnvidia-ml through
`env` (see `tests.fakenvml.environ`).

Everything lives in a short temp dir (unix socket paths must stay under 108 bytes) that is
removed on exit, and only the processes started here are ever signalled, by PID.

Beside the node, what several test modules do with it: one-off `gpuvisor run` (expected to fail at
start; `run_to_exit` with its peak RSS) and `gpuvisor status` children in `child_env`'s environment, a config file and a SIGHUP
that is waited for (`config_node`, `sighup_and_wait`), a standalone worker with no supervisor
(`Env`, `start_worker`), reading /metrics (`metrics_url`, `sample`), and extra ListAndWatch streams.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from common.kubeletapi import pb
from common.kubeletapi.rpc import DevicePluginClient, unix_target
from supervisor.control.client import send_command
from supervisor.sim.kubelet import KubeletStandin
from tests.helpers import REPO, checkout_path, short_tmpdir, sockets_in, wait_until

# ---------------------------------------------------------------- gpuvisor as a one-off child


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a gpuvisor child process: this one's without GPUVISOR_* and DP_* (a test
    sees only what it sets), `extra` over it, and the checkout first on PYTHONPATH unless `extra`
    names its own path (an older pynvml before the checkout)."""
    extra = extra or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUVISOR_", "DP_"))}
    env.update(extra)
    env["PYTHONPATH"] = extra.get("PYTHONPATH", checkout_path())
    return env


def run_python(code: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` run to its end by a fresh interpreter of the checkout, in the checkout, with `env`
    (default: `child_env()`); its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env() if env is None else dict(env),
        timeout=60,
        check=False,
    )


def run_supervisor(
    tmp: str, args: Sequence[str], env: Mapping[str, str] | None = None, run_dir: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `gpuvisor run` in `tmp` to completion (it is expected to fail at start): the kubelet
    socket at `<tmp>/p/kubelet.sock`, the run dir at `run_dir` (default `<tmp>/r`), no metrics
    endpoint, `args` after those, `env` over the cleaned environment (`child_env`)."""
    os.makedirs(os.path.join(tmp, "p"), exist_ok=True)
    argv = [
        sys.executable, "-m", "supervisor", "run",
        "--kubelet-socket", os.path.join(tmp, "p", "kubelet.sock"),
        "--run-dir", run_dir or os.path.join(tmp, "r"),
        "--metrics-address", "",
        *args,
    ]  # fmt: skip
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=child_env(env), check=False
    )


def gpuvisor_status(node: SimNode, *extra: str) -> subprocess.CompletedProcess[str]:
    """`gpuvisor status *extra` on `node`'s run dir, in the node's environment, reading allocations
    from the checkpoint only (no pod-resources socket: this machine's kubelet, if any, is not the node's)."""
    argv = [
        sys.executable,
        "-m",
        "supervisor",
        "status",
        "--run-dir",
        node.run_dir,
        "--pod-resources-socket",
        "",
        *extra,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env=child_env(node.env), cwd=REPO, check=False
    )


class SimNode:
    def __init__(
        self,
        profile: str | None = "dgx-h100",
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        legacy_keying: bool = True,
        start_kubelet: bool = True,
    ) -> None:
        self.base = tempfile.mkdtemp(prefix="gv", dir="/tmp")
        self.plugin_dir = os.path.join(self.base, "p")
        self.run_dir = os.path.join(self.base, "r")
        self.log_path = os.path.join(self.base, "supervisor.log")
        os.makedirs(self.plugin_dir)
        self.kubelet = KubeletStandin(self.plugin_dir, legacy_keying=legacy_keying)
        self.profile = profile
        self.args = list(args)
        # Every simulated node keeps its MIG layout across supervisor restarts, as a real driver's
        # outlives the supervisor (supervisor.sim.nvml.state); a test's own env may say otherwise.
        self.sim_state_path = os.path.join(self.base, "sim-state.json")
        self.env = {"GPUVISOR_SIMULATE_STATE": self.sim_state_path, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_kubelet = start_kubelet
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self.pids_seen: set[int] = set()

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> SimNode:
        if self.start_kubelet:
            self.kubelet.start()
        self.start_supervisor()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def supervisor_argv(self) -> list[str]:
        return [
            sys.executable, "-m", "supervisor", "run",
            *(["--simulate", self.profile] if self.profile is not None else []),
            "--kubelet-socket", self.kubelet.socket_path,
            "--run-dir", self.run_dir,
            "--metrics-address", "",
            *self.args,
        ]  # fmt: skip

    def start_supervisor(self) -> subprocess.Popen[bytes]:
        self.proc = subprocess.Popen(
            self.supervisor_argv(),
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(self.env), cwd=REPO,
        )  # fmt: skip
        self.pids_seen.add(self.proc.pid)
        return self.proc

    def workers(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for k in kids:
            self.pids_seen.add(k.pid)
        return kids

    def worker_pid(self, resource: str) -> int:
        for proc in self.workers():
            try:
                cmd = proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "--resource" in cmd and cmd[cmd.index("--resource") + 1] == resource:
                return proc.pid
        return 0

    def stop_supervisor(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        self.workers()
        self.stop_supervisor()
        # Only processes this harness started (the supervisor and its children), by PID.
        for pid in sorted(self.pids_seen):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.kubelet.stop()
        self._log.close()
        shutil.rmtree(self.base, ignore_errors=True)

    # ---------------------------------------------------------------- queries
    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def wait_listed(self, resources: Sequence[str], timeout: float = 30.0) -> None:
        ok = self.kubelet.wait_listed(resources, timeout)
        assert ok, (
            f"{list(resources)} not registered and listed within {timeout}s\n--- log:\n{self.log()[-6000:]}"
        )

    def command(self, name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        return send_command(self.run_dir, name, args or {})

    def sim(self, action: str, **args: Any) -> None:
        self.command("sim", {"action": action, **args})

    def health(self, resource: str, device_id: str) -> str:
        dev = self.kubelet.devices(resource).get(device_id)
        return dev.health if dev else ""

    def wait_health(
        self, resource: str, device_ids: Sequence[str], health: str, timeout: float = 15.0
    ) -> None:
        ok = wait_until(lambda: all(self.health(resource, d) == health for d in device_ids), timeout)
        assert ok, (
            f"{resource} {list(device_ids)} not {health}: {self.kubelet.devices(resource)}\n{self.log()[-4000:]}"
        )

    def elapsed(self, since: float) -> float:
        return time.monotonic() - since


# ---------------------------------------------------------------- a config file and SIGHUP


def config_node(
    directory: Path, text: str, profile: str = "pcie-l4", args: Sequence[str] = ()
) -> tuple[SimNode, Path]:
    """A node (not started) on `profile` whose config file is `<directory>/config.yaml`, holding `text`."""
    path = directory / "config.yaml"
    path.write_text(text)
    return SimNode(profile, args=["--config-file", str(path), *args]), path


def reloads(node: SimNode) -> int:
    """How many reloads the supervisor has been through (`status`)."""
    return int(node.command("status")["reloads"])


def sighup_and_wait(node: SimNode) -> None:
    """SIGHUP, and wait until the supervisor has been through one reload."""
    assert node.proc is not None
    before = reloads(node)
    node.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: reloads(node) > before, 15), node.log()[-4000:]


# ---------------------------------------------------------------- a standalone worker
# `python -m worker` with no supervisor, against a kubelet stand-in: the `env` and `procs`
# fixtures (tests/conftest.py) give it a temp dir with dgx-h100's plan for GPU, and end what it started.

GPU = "nvidia.com/gpu"


@dataclass
class Env:
    """A standalone worker's temp dir: its plan, its log, and where the kubelet's socket goes."""

    dir: str
    plan_path: str
    log_path: str
    kubelet_socket: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()


def start_worker(env: Env, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """Start `python -m worker` for GPU on `env`'s plan, logging to `env.log_path`; noted in `procs`."""
    with open(env.log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--resource", GPU, "--plan", env.plan_path,
             "--kubelet-socket", env.kubelet_socket],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            env={**os.environ, "PYTHONPATH": checkout_path()},
        )  # fmt: skip
    procs.append(proc)
    return proc


def plugin_sockets(env: Env) -> list[str]:
    return [s for s in sockets_in(env.dir) if s != "kubelet.sock"]


def listed_after(kubelet: KubeletStandin, since: float, other_than: str = "") -> bool:
    """Registered after `since` (on a socket other than `other_than`), connected and listed."""
    res = kubelet.resource(GPU)
    ep = res.endpoint if res is not None else None
    return bool(
        ep is not None
        and ep.connected
        and ep.updates > 0
        and ep.registered_at >= since
        and os.path.basename(ep.socket_path) != other_than
    )


def settled(env: Env, kubelet: KubeletStandin) -> bool:
    """One live registration, served from the one plugin socket in the dir."""
    socks = plugin_sockets(env)
    return (
        kubelet.connected(GPU)
        and len(socks) == 1
        and os.path.basename(kubelet.endpoint_socket(GPU)) == socks[0]
    )


# ---------------------------------------------------------------- the metrics endpoint


def get(url: str) -> tuple[int, str]:
    """(HTTP status, body) of a GET; a 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metrics_url(node: SimNode) -> str:
    """The supervisor's metrics base URL, from `status` (waits for the control socket)."""
    assert wait_until(lambda: os.path.exists(os.path.join(node.run_dir, "control.sock")), 20), node.log()[
        -3000:
    ]
    url = node.command("status")["metrics_url"]
    assert isinstance(url, str) and url.startswith("http://127.0.0.1:")
    return url


def sample(url: str, name: str, **labels: str) -> float | None:
    """The value of one sample of /metrics (None when absent)."""
    _status, body = get(url + "/metrics")
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


# ---------------------------------------------------------------- streams beside the kubelet's


class ExtraStreams:
    """ListAndWatch streams opened on a worker's socket by someone other than the kubelet."""

    def __init__(self, socket_path: str, count: int) -> None:
        self.channels = [grpc.insecure_channel(unix_target(socket_path)) for _ in range(count)]
        self.calls = [DevicePluginClient(ch).ListAndWatch(pb.Empty()) for ch in self.channels]
        self.outcomes: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(c,), daemon=True) for c in self.calls]
        for t in self.threads:
            t.start()

    def _read(self, call: Any) -> None:
        try:
            for _ in call:
                pass
            self.outcomes.append("ended")
        except grpc.RpcError as exc:
            self.outcomes.append(exc.code().name)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for t in self.threads:
            t.join(10)


# ---------------------------------------------------------------- a start that is expected to fail

# Linux carries the peak RSS of the process that forks into the child across exec, so wait4 from
# a big pytest process reports pytest's size. A small launcher forks the supervisor instead and
# writes the child's own peak RSS (KiB) to the file named first.
LAUNCHER = """
import os, sys
out, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as fh:
    fh.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def time_slicing(replicas: int) -> str:
    return f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"


def run_to_exit(config: str) -> tuple[int, str, int, float]:
    """Run `gpuvisor run --simulate dgx-h100` with this config until it exits: (status, output, peak RSS KiB, seconds)."""
    with short_tmpdir("gvh") as base:
        path = os.path.join(base, "config.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(config)
        os.mkdir(os.path.join(base, "p"))
        argv = [
            sys.executable, "-m", "supervisor", "run", "--simulate", "dgx-h100", "--config-file", path,
            "--kubelet-socket", os.path.join(base, "p", "kubelet.sock"), "--run-dir", os.path.join(base, "r"),
            "--metrics-address", "",
        ]  # fmt: skip
        rss_file = os.path.join(base, "rss")
        start = time.monotonic()
        with open(os.path.join(base, "out"), "w+b") as out:
            proc = subprocess.run([sys.executable, "-c", LAUNCHER, rss_file, *argv], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=REPO, env=child_env(), timeout=120)  # fmt: skip
            elapsed = time.monotonic() - start
            out.seek(0)
            text = out.read().decode(errors="replace")
        with open(rss_file, encoding="utf-8") as fh:
            rss_kib = int(fh.read())
        return proc.returncode, text, rss_kib, elapsed
