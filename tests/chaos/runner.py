"""Kill-and-recover chaos: random faults against a real supervisor on a simulated node.

Each fault is followed by a check of the invariants, polled until they hold or a deadline
passes:

1. every planned resource (from `gpuvisor status`) is registered with the kubelet stand-in with
   exactly one live stream, and the plugin dir holds exactly one gpuvisor socket per resource;
2. the health each resource reports to the kubelet equals the supervisor's health state;
3. no orphan process (every gpuvisor process is the supervisor or its descendant), no stale
   socket, no growth in the supervisor's file descriptors or threads (beyond a small slack);
4. Allocate and GetPreferredAllocation answer correctly for every resource with a free device;
5. no worker is FATAL, and stray entries planted in the kubelet dir are still there.

The "never lose a resource" kinds: `killstorm` SIGKILLs one worker again and again right after
each recovery; `stray` plants a directory, a regular file and a symlink named like a worker's
sockets (with its own tag) and then kills that worker; `reload-full` fills the run dir (a small
tmpfs the run mounts when it may; without one the kind is left out, and the report says so),
reloads a changed config, checks that it is pending while the running config serves, then frees
the space and the reload must apply by itself.

Everything is seeded: the same `--seed` and `--faults` replay the same run, and a failure
prints the command that does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import psutil

from supervisor.sim.kubelet import KubeletStandin
from tests.harness import SimNode
from tests.helpers import fill_filesystem, plant_stray, sockets_in, tmpfs_at, wait_until

# Relative weights: health faults are cheap and common, process kills less so.
WEIGHTS = {
    "worker-kill": 3,
    "worker-hang": 1,
    "supervisor-kill": 1,
    "kubelet-restart": 2,
    "kubelet-burst": 1,
    "xid": 4,
    "ecc": 2,
    "lose": 1,
    "restore": 2,
    "reset": 2,
    "reload-good": 1,
    "reload-bad": 1,
    "mig-change": 1,
    "killstorm": 1,
    "stray": 1,
    "reload-full": 1,
}
RUN_DIR_TMPFS = "1m"  # the run dir's size when the run may mount a tmpfs (reload-full)

CONFIG_A = """\
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
      - name: gpu
        devices: [4, 5]
        replicas: 2
gpuvisor:
  health:
    transientQuietSeconds: 2
    xids: {"94": transient}  # no XID is transient by default; the run should see that rule too
"""

CONFIG_B = CONFIG_A.replace("replicas: 2", "replicas: 3")
CONFIG_BAD = CONFIG_A.replace("replicas: 2", "replicas: 1")

MIG_LAYOUTS = (
    ["3g.40gb", "3g.40gb"],
    ["2g.20gb", "2g.20gb", "2g.20gb"],
    ["1g.10gb"] * 7,
    ["3g.40gb", "2g.20gb", "1g.10gb+me"],
)


class Violation(Exception):
    """An invariant did not hold within the deadline."""


@dataclass
class FaultRecord:
    index: int
    kind: str
    detail: str
    recovered: bool
    seconds: float
    error: str = ""


@dataclass
class ChaosReport:
    seed: int
    faults: list[FaultRecord] = field(default_factory=list)
    start: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    replay: str = ""
    fatal_left: int = 0  # workers FATAL at the end
    resources_lost: int = 0  # planned resources the kubelet has no live stream of at the end
    left_out: list[str] = field(default_factory=list)  # kinds this run could not do, and why
    log_tail: str = ""  # the supervisor's last log lines when an invariant broke

    def ok(self) -> bool:
        return not self.violations

    def summary_rows(self) -> list[dict[str, Any]]:
        by_kind: dict[str, list[FaultRecord]] = defaultdict(list)
        for f in self.faults:
            by_kind[f.kind].append(f)
        rows = []
        for kind in sorted(by_kind):
            records = by_kind[kind]
            times = sorted(r.seconds * 1000 for r in records if r.recovered)
            rows.append(
                {
                    "kind": kind,
                    "faults": len(records),
                    "survived": sum(1 for r in records if r.recovered),
                    "p50_ms": round(_pct(times, 50), 1) if times else None,
                    "p99_ms": round(_pct(times, 99), 1) if times else None,
                    "max_ms": round(times[-1], 1) if times else None,
                }
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "ok": self.ok(),
            "faults": len(self.faults),
            "by_kind": self.summary_rows(),
            "start": self.start,
            "end": self.end,
            "violations": self.violations,
            "replay": self.replay,
            "fatal_left": self.fatal_left,
            "resources_lost": self.resources_lost,
            "left_out": self.left_out,
            "records": [f.__dict__ for f in self.faults],
        }

    def table(self) -> str:
        lines = [f"{'fault':<16}{'count':>6}{'survived':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"]
        for r in self.summary_rows():
            lines.append(
                f"{r['kind']:<16}{r['faults']:>6}{r['survived']:>9}"
                + "".join(f"{'-' if r[k] is None else r[k]:>9}" for k in ("p50_ms", "p99_ms", "max_ms"))
            )
        lines.append("")
        for key in ("rss_mib", "fds", "threads"):
            lines.append(f"supervisor {key}: start {self.start.get(key, '-')}  end {self.end.get(key, '-')}")
        lines.append(f"FATAL workers left: {self.fatal_left}; resources lost: {self.resources_lost}")
        for note in self.left_out:
            lines.append(f"left out: {note}")
        lines.append(
            f"result: {'OK' if self.ok() else 'FAILED'} ({len(self.faults)} faults, seed {self.seed})"
        )
        return "\n".join(lines)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    k = (len(values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class Chaos:
    def __init__(self, seed: int, deadline: float = 20.0, log: Callable[[str], None] = print) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.deadline = deadline
        self.say = log
        self.node: SimNode | None = None
        self.config_path = ""
        self.baseline: dict[str, float] = {}
        self.lost: set[str] = set()
        self.strays: list[str] = []  # planted in the kubelet dir: must outlive every fault
        self.tmpfs = False  # the run dir is a tmpfs of our own (reload-full can fill it)
        self.cleanup = ExitStack()
        self.weights = dict(WEIGHTS)
        self.left_out: list[str] = []

    # ------------------------------------------------------------------ setup
    def __enter__(self) -> Chaos:
        self.node = SimNode(
            "mig-a100",
            args=["--mig-strategy", "mixed", "--heartbeat-timeout", "2", "--rediscovery-interval", "0"],
        )
        self.config_path = os.path.join(self.node.base, "config.yaml")
        with open(self.config_path, "w") as fh:
            fh.write(CONFIG_A)
        self.node.args += ["--config-file", self.config_path]
        self.tmpfs = self.cleanup.enter_context(tmpfs_at(self.node.run_dir, RUN_DIR_TMPFS))
        if not self.tmpfs:
            self.weights.pop("reload-full")
            self.left_out.append("reload-full (no tmpfs could be mounted for the run dir: needs root)")
        self.node.__enter__()
        self.check(time.monotonic() + 60)
        self.baseline = self.sample()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.node is not None:
                self.node.close()
        finally:
            self.cleanup.close()  # the run dir's tmpfs, after the node that used it

    @property
    def kubelet(self) -> KubeletStandin:
        assert self.node is not None
        return self.node.kubelet

    def status(self) -> dict[str, Any]:
        assert self.node is not None
        return self.node.command("status")

    def sample(self) -> dict[str, float]:
        assert self.node is not None and self.node.proc is not None
        p = psutil.Process(self.node.proc.pid)
        return {
            "rss_mib": round(p.memory_info().rss / 2**20, 1),
            "fds": p.num_fds(),
            "threads": p.num_threads(),
        }

    # ------------------------------------------------------------------ faults
    def random_fault(self) -> str:
        kinds = list(self.weights)
        return self.rng.choices(kinds, weights=[self.weights[k] for k in kinds])[0]

    def inject(self, kind: str) -> str:
        node = self.node
        assert node is not None and node.proc is not None
        status = self.status()
        workers = [w for w in status["workers"] if w.get("pid")]
        gpus = self._gpu_uuids(status)
        if kind in ("worker-kill", "worker-hang"):
            w = self.rng.choice(workers)
            os.kill(int(w["pid"]), signal.SIGKILL if kind == "worker-kill" else signal.SIGSTOP)
            self._await_replaced(str(w["resource"]), int(w["pid"]))
            return f"{w['resource']} pid {w['pid']}"
        if kind == "supervisor-kill":
            pids = [node.proc.pid] + [p.pid for p in node.workers()]
            node.proc.kill()
            node.proc.wait()
            self.lost.clear()  # the simulator lives in the supervisor: a new one starts from the profile
            node.start_supervisor()
            self._old_pids = pids
            return f"pid {pids[0]}"
        if kind == "kubelet-restart":
            self.kubelet.restart()
            return ""
        if kind == "kubelet-burst":
            n = self.rng.randint(3, 5)
            for _ in range(n):
                self.kubelet.restart()
            return f"{n} restarts"
        if kind == "xid":
            uuid = self.rng.choice(gpus)
            xid = self.rng.choice([13, 31, 43, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 999])
            self._sim("xid", device=uuid, xid=xid)
            return f"XID {xid} on {uuid}"
        if kind == "ecc":
            uuid = self.rng.choice(gpus)
            ecc_kind = self.rng.choice(["single", "double"])
            self._sim("ecc", device=uuid, kind=ecc_kind)
            return f"{ecc_kind} on {uuid}"
        if kind == "lose":
            uuid = self.rng.choice(gpus)
            self._sim("lose", device=uuid)
            self.lost.add(uuid)
            return uuid
        if kind == "restore":
            if not self.lost:
                return "nothing lost"
            uuid = self.rng.choice(sorted(self.lost))
            self._sim("restore", device=uuid)
            self.lost.discard(uuid)
            return uuid
        if kind == "reset":
            uuid = self.rng.choice(gpus)
            self._sim("reset", device=uuid)
            return uuid
        if kind in ("reload-good", "reload-bad"):
            text = CONFIG_BAD if kind == "reload-bad" else self.rng.choice([CONFIG_A, CONFIG_B])
            with open(self.config_path, "w") as fh:
                fh.write(text)
            os.kill(node.proc.pid, signal.SIGHUP)
            if kind == "reload-bad":
                # Put a good config back so the run goes on from a known state; the bad one must
                # have been refused in the meantime (checked by the invariants: nothing dropped).
                time.sleep(0.3)
                with open(self.config_path, "w") as fh:
                    fh.write(CONFIG_A)
                os.kill(node.proc.pid, signal.SIGHUP)  # taken now, not at the file watch's leisure
            return "bad config refused" if kind == "reload-bad" else "config swapped"
        if kind == "killstorm":
            w = self.rng.choice(workers)
            kills = self.rng.randint(3, 6)
            for i in range(kills):
                pid = self._worker_pid(str(w["resource"]))
                os.kill(pid, signal.SIGKILL)
                self._await_replaced(str(w["resource"]), pid)
                if i < kills - 1:
                    self.check(time.monotonic() + self.deadline)  # back, then killed again at once
            return f"{w['resource']}: {kills} kills, each right after its recovery"
        if kind == "stray":
            w = self.rng.choice(workers)
            self._plant_strays(str(w["resource"]), str(w.get("socket") or ""))
            os.kill(int(w["pid"]), signal.SIGKILL)
            self._await_replaced(str(w["resource"]), int(w["pid"]))
            return f"{w['resource']}: a dir, a file and a symlink named like its sockets, then SIGKILL"
        if kind == "reload-full":
            return self._reload_full()
        if kind == "mig-change":
            gpu = self.rng.randint(0, 3)
            layout = self.rng.choice(MIG_LAYOUTS)
            self._sim("mig", gpu=gpu, layout=layout)
            return f"GPU {gpu} -> {','.join(layout)}"
        raise ValueError(kind)

    def _await_replaced(self, resource: str, pid: int) -> None:
        """Until the supervisor no longer shows `pid` for `resource` (it noticed the fault): the
        invariants checked before that would only see the state from before the fault."""

        def replaced() -> bool:
            return not any(
                w["resource"] == resource and w.get("pid") == pid for w in self.status()["workers"]
            )

        if not wait_until(replaced, self.deadline, interval=0.01):
            raise Violation(f"{resource}: the supervisor still shows pid {pid} as its worker")

    def _worker_pid(self, resource: str) -> int:
        for w in self.status()["workers"]:
            if w["resource"] == resource and w.get("pid"):
                return int(w["pid"])
        raise LookupError(f"no worker for {resource}")

    def _plant_strays(self, resource: str, socket: str) -> None:
        assert self.node is not None
        base = os.path.basename(socket)  # gpuvisor-<name>-<tag><nn>.sock: the sweep's own kind
        stem = (
            base[: -len("00.sock")]
            if base.endswith(".sock")
            else f"gpuvisor-{resource.split('/')[-1]}-0badc0"
        )
        n = len(self.strays)
        target = os.path.join(self.node.base, "stray-target")
        if not os.path.exists(target):
            with open(target, "w") as fh:
                fh.write("a stray symlink points here")
        for kind in ("dir", "file", "link"):
            path = os.path.join(self.node.plugin_dir, f"{stem}{(0xF0 + n % 16):02x}.sock")
            n += 1
            if os.path.lexists(path):
                continue
            plant_stray(path, kind, target)
            self.strays.append(path)

    def _reload_full(self) -> str:
        node = self.node
        assert node is not None and node.proc is not None
        filler = fill_filesystem(node.run_dir)
        try:
            with open(self.config_path) as fh:
                current = fh.read()
            with open(self.config_path, "w") as fh:
                fh.write(CONFIG_B if current == CONFIG_A else CONFIG_A)
            os.kill(node.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + self.deadline  # one deadline for the whole fault
            if not wait_until(self._reload_pending, self.deadline):
                raise Violation("a reload into a full run dir did not become pending")
            self.check(deadline)  # the running config still serves every resource
        finally:
            os.unlink(filler)
        # Room again: it applies by itself.
        if not wait_until(lambda: not self._reload_pending(), max(0.0, deadline - time.monotonic())):
            raise Violation("a pending reload did not apply once the run dir had room again")
        return "reload pending while the run dir was full, then applied"

    def _reload_pending(self) -> bool:
        return bool((self.status().get("reconcile") or {}).get("pending"))

    def _sim(self, action: str, **args: Any) -> None:
        assert self.node is not None
        try:
            self.node.sim(action, **args)
        except Exception as exc:  # a lost GPU refuses some commands: that is not a violation
            self.say(f"    (sim {action} refused: {exc})")

    @staticmethod
    def _gpu_uuids(status: dict[str, Any]) -> list[str]:
        uuids = set()
        for devices in status["resources"].values():
            for d in devices:
                if d["id"].startswith("GPU-"):
                    uuids.add(d["id"].split("::")[0])
        return sorted(uuids) or ["GPU-unknown"]

    # ------------------------------------------------------------------ invariants
    def check(self, until: float) -> float:
        """Poll the invariants until they hold; returns when; raises Violation at `until`."""
        last = "not checked"
        while True:
            try:
                self._invariants()
                return time.monotonic()
            except (AssertionError, LookupError, OSError) as exc:
                last = str(exc)
            except Exception as exc:  # the control socket mid-restart, a gRPC error...
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > until:
                raise Violation(last)
            time.sleep(0.02)

    def _invariants(self) -> None:
        node = self.node
        assert node is not None and node.proc is not None
        assert node.proc.poll() is None, f"the supervisor exited with {node.proc.returncode}"
        status = self.status()
        planned = sorted(status["resources"])
        assert planned, "no planned resource"
        states = {w["resource"]: w["state"] for w in status["workers"]}
        # 1. one live registration per planned resource, one socket each
        for resource in planned:
            assert states.get(resource) == "RUNNING", f"{resource} is {states.get(resource)}"
            assert self.kubelet.connected(resource), f"{resource} not connected at the kubelet"
        for resource in self.kubelet.resource_names():
            if resource not in planned:
                assert self.kubelet.allocatable(resource) == 0, (
                    f"{resource} no longer planned but allocatable"
                )
        ours = [s for s in sockets_in(node.plugin_dir) if s.startswith("gpuvisor-")]
        assert len(ours) == len(planned), f"{len(ours)} gpuvisor sockets for {len(planned)} resources: {ours}"
        endpoints = sorted(os.path.basename(self.kubelet.endpoint_socket(r)) for r in planned)
        assert endpoints == sorted(ours), f"kubelet endpoints {endpoints} != sockets {sorted(ours)}"
        # 2. the kubelet's health equals the supervisor's
        for resource in planned:
            want = {d["id"]: d["health"] for d in status["resources"][resource]}
            seen = {d.id: d.health for d in self.kubelet.devices(resource).values()}
            assert want == seen, f"{resource}: kubelet sees {_diff(seen, want)}"
        # 3. no orphans
        tree = {node.proc.pid} | {p.pid for p in node.workers()}
        for pid in getattr(self, "_old_pids", []):
            if pid not in tree and psutil.pid_exists(pid):
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        raise AssertionError(f"orphan process {pid} of a killed supervisor")
                except psutil.NoSuchProcess:
                    pass
        worker_pids = {int(w["pid"]) for w in status["workers"] if w.get("pid")}
        assert worker_pids <= tree, f"worker pids {worker_pids - tree} are not the supervisor's descendants"
        # 5. never FATAL, strays untouched
        fatal = [w["resource"] for w in status["workers"] if w["state"] == "FATAL"]
        assert not fatal, f"FATAL: {fatal}"
        gone = [p for p in self.strays if not os.path.lexists(p)]
        assert not gone, f"stray entries removed: {gone}"
        # 4. allocation works where a device is free
        for resource in planned:
            healthy = [i for i, d in self.kubelet.devices(resource).items() if d.health == "Healthy"]
            if not healthy:
                continue
            ids, response = self.kubelet.allocate(resource, 1)
            try:
                backing = ids[0].split("::")[0]
                visible = response.envs.get("NVIDIA_VISIBLE_DEVICES", "")
                assert backing in visible.split(","), f"{resource}: Allocate({ids}) gave {visible!r}"
            finally:
                self.kubelet.release(resource, ids)

    # ------------------------------------------------------------------ run
    def run(self, faults: int, duration: float | None) -> ChaosReport:
        report = ChaosReport(seed=self.seed, start=self.baseline)
        started = time.monotonic()
        i = 0
        while (duration is None and i < faults) or (
            duration is not None and time.monotonic() - started < duration
        ):
            i += 1
            kind = self.random_fault()
            t0 = time.monotonic()
            detail = ""
            try:
                detail = self.inject(kind)
                t1 = self.check(t0 + self.deadline)
                record = FaultRecord(i, kind, detail, True, t1 - t0)
            except Violation as exc:
                record = FaultRecord(i, kind, detail, False, time.monotonic() - t0, str(exc))
                report.violations.append(f"fault {i} ({kind} {detail}): {exc}")
                if self.node is not None:
                    report.log_tail = self.node.log()[-8000:]
            report.faults.append(record)
            self.say(
                f"  {i:>4} {kind:<16} {record.seconds * 1000:8.1f} ms  {'ok' if record.recovered else 'VIOLATION'}  {detail}"
            )
            if not record.recovered:
                break
            if kind == "supervisor-kill":
                self.baseline = self.sample()  # a new supervisor: a new baseline for growth
        report.end = self.sample() if self.node and self.node.proc and self.node.proc.poll() is None else {}
        report.left_out = list(self.left_out)
        if report.end:
            status = self.status()
            report.fatal_left = sum(1 for w in status["workers"] if w["state"] == "FATAL")
            report.resources_lost = sum(1 for r in status["resources"] if not self.kubelet.connected(r))
        if report.end and report.start:
            # Growth is judged against the last supervisor's own start, with slack for lazily
            # created threads and sockets (gRPC channels per allocation check, etc.).
            base = self.baseline
            if report.end["fds"] > base["fds"] + 32:
                report.violations.append(f"file descriptors grew from {base['fds']} to {report.end['fds']}")
            if report.end["threads"] > base["threads"] + 16:
                report.violations.append(f"threads grew from {base['threads']} to {report.end['threads']}")
            if report.end["rss_mib"] > base["rss_mib"] * 1.5 + 16:
                report.violations.append(
                    f"RSS grew from {base['rss_mib']} MiB to {report.end['rss_mib']} MiB"
                )
        return report


def _diff(seen: dict[str, str], want: dict[str, str]) -> str:
    keys = sorted(set(seen) | set(want))
    parts = [
        f"{k}: {seen.get(k, 'absent')} (supervisor: {want.get(k, 'absent')})"
        for k in keys
        if seen.get(k) != want.get(k)
    ]
    return textwrap.shorten("; ".join(parts), 600)


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip()
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m tests.chaos", description="kill-and-recover chaos against a simulated node"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--duration", default=None, help="run for this long instead (e.g. 90s, 30m, 2h)")
    p.add_argument("--deadline", type=float, default=20.0, help="seconds each recovery may take")
    p.add_argument("--json", default="", help="also write the JSON report here")
    p.add_argument("--keep-log", default="", help="copy the supervisor's whole log here at the end")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    duration = parse_duration(args.duration) if args.duration else None
    replay = f"python -m tests.chaos --seed {seed} " + (
        f"--duration {args.duration}" if duration else f"--faults {args.faults}"
    )
    print(f"chaos: seed {seed}; replay with: {replay}", flush=True)
    try:
        with Chaos(seed, args.deadline, log=lambda s: print(s, flush=True)) as chaos:
            try:
                report = chaos.run(args.faults, duration)
            finally:
                if args.keep_log and chaos.node is not None:
                    with open(args.keep_log, "w") as fh:
                        fh.write(chaos.node.log())
    except Violation as exc:
        print(f"chaos: the node never became healthy at start: {exc}", file=sys.stderr)
        return 2
    report.replay = replay
    print()
    print(report.table())
    doc = report.to_json()
    print(json.dumps(doc, indent=None, sort_keys=True))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2, sort_keys=True)
    if not report.ok():
        print("\nINVARIANT VIOLATED:\n  " + "\n  ".join(report.violations), file=sys.stderr)
        print("\nthe supervisor's log, last lines:\n" + report.log_tail, file=sys.stderr)
        print(f"replay: {replay}", file=sys.stderr)
        return 1
    counts = Counter(f.kind for f in report.faults)
    print(f"survived {len(report.faults)} faults of {len(counts)} kinds")
    return 0
