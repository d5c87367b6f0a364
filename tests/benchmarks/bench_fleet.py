"""A fleet against one API server: what each node costs it at rest, in an XID storm, after a restart.

N real nodes (default 50; `--fleet-nodes N` on the runner, `GPUVISOR_BENCH_FLEET_NODES`; 3 with
`--quick`), each its own node name, temp dirs, kubelet stand-ins (device plugin with the
pod-resources API, and DRA) and its own bearer token, against ONE fake API server (tests/kubeapi/)
that counts every request by verb, resource and user (tally.py). Every cluster feature is on:

- `gpuvisor run --mode dra` on a simulated pcie-l4 (4 GPUs) with `--config-file-srcdir` (the
  config label's watch of its Node), `--node-health=true` (the GPUUnhealthy condition and Events)
  and the DRA driver (the pool's ResourceSlices and their watch, claims fetched at prepare: one
  claim per node is prepared and unprepared before the measurement starts);
- `gpuvisor labels` beside it, publishing its NodeFeature (GFD's default sleep interval, 60 s).

The phases, with the figures per node (mean and the worst node):

1. steady state: requests per minute beyond the open watches (the watch requests themselves are
   counted apart: a watch ends at its timeout, 5 to 10 minutes, and is opened again), the writes
   among them, and the watches open at the end of the window, per kind;
2. an XID storm on every node at once (an XID a second on each node, over its 4 GPUs, for the
   window): requests per minute, Events (create + patch) and Node status patches per minute;
3. an API server restart (stopped, compacted so every kept resourceVersion is gone, as after
   etcd's compaction, and started again on the same port): when each node's re-lists and
   re-watches arrive, as the spread from the first to the last and a histogram.

Each figure is extrapolated to 5,000 nodes (the per-node mean times 5,000). The API server here
runs in the benchmark's own process, so on a small machine it is the bottleneck of the herd: the
spreads measured are what the clients asked for, not what a real control plane would serve. The
load average at the end is printed with the figures.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.benchmarks.common import Row, percentile
from tests.dranode import DRIVER, DraNode
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer
from tests.labelsrun import labels_env, start_labels

NODES_ENV = "GPUVISOR_BENCH_FLEET_NODES"
DEFAULT_NODES = 50
QUICK_NODES = 3
WAVE = 10  # nodes started together
FLEET = 5000  # the cluster the figures are extrapolated to
NAMESPACE = "gpuvisor"
LABEL = "nvidia.com/device-plugin.config"
WRITES = ("create", "update", "patch", "delete", "deletecollection")
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
XIDS = (48, 79, 94, 95, 13, 31)  # fatal, reset-needed, contained, uncontained, app errors


def nodes_wanted(quick: bool) -> int:
    raw = os.environ.get(NODES_ENV, "")
    if raw:
        n = int(raw)
        if not 1 <= n <= 500:
            raise ValueError(f"{NODES_ENV}={raw}: a fleet of 1 to 500 nodes")
        return n
    return QUICK_NODES if quick else DEFAULT_NODES


class Member:
    """One node of the fleet: its supervisor (DraNode) and its labeller, with its own token."""

    def __init__(self, api: RunningApiServer, name: str, base: Path, configs: Path) -> None:
        self.name = name
        self.dir = base / name
        self.dir.mkdir()
        kubeconfig = api.kubeconfig_for(name, self.dir / "kubeconfig")
        api.state.add_node(name)
        self.pod = f"gpuvisor-{name}"
        api.state.add_daemonset_pod(NAMESPACE, self.pod)
        args = [
            "--mode", "dra", "--node-health=true",
            "--config-file-srcdir", str(configs), "--default-config", "ts1",
        ]  # fmt: skip
        self.node = DraNode(
            "pcie-l4",
            args=args,
            api=api,
            node_name=name,
            scan_interval=0.5,
            env={"KUBECONFIG": str(kubeconfig)},
        )
        self.labels_env = labels_env(
            KUBECONFIG=str(kubeconfig), NODE_NAME=name, NAMESPACE=NAMESPACE, POD_NAME=self.pod
        )
        self.labeller: subprocess.Popen[bytes] | None = None
        self.gpus: list[str] = []
        self.up = False

    def start(self) -> None:
        self.node.__enter__()
        self.labeller = start_labels(
            "--simulate",
            "pcie-l4",
            "--machine-type-file",
            "",
            log=self.dir / "labels.log",
            env=self.labels_env,
        )

    def close(self) -> None:
        if self.labeller is not None and self.labeller.poll() is None:
            self.labeller.terminate()
            try:
                self.labeller.wait(15)
            except subprocess.TimeoutExpired:
                self.labeller.kill()
                self.labeller.wait()
        self.node.close()

    def ready(self, api: RunningApiServer) -> bool:
        """Slices published, the label watch watching, the condition written, the NodeFeature there
        (once seen, kept)."""
        self.up = self.up or self._ready(api)
        return self.up

    def _ready(self, api: RunningApiServer) -> bool:
        if (NAMESPACE, f"nvidia-features-for-{self.name}") not in api.state.node_features:
            return False
        condition = api.state.condition(self.name, "GPUUnhealthy")
        if condition is None or condition.get("status") != "False":
            return False
        try:
            cluster = self.node.command("status")["cluster"]
        except Exception:
            return False
        return bool(
            cluster.get("label", {}).get("watch", {}).get("state") == "watching"
            and cluster.get("dra", {}).get("slices", {}).get("state") == "published"
        )

    def claim_once(self) -> None:
        """One claim prepared and unprepared: the claim fetch the DRA side makes."""
        devices = self.node.published()
        ref = self.node.claim(f"claim-{self.name}", sorted(devices)[:1])
        self.node.dra.prepare(DRIVER, [ref])
        self.node.dra.unprepare(DRIVER, [ref])
        self.gpus = sorted(
            d["attributes"]["uuid"]["string"] for s in self.node.slices() for d in s["spec"]["devices"]
        )


@contextlib.contextmanager
def fleet(n: int) -> Iterator[tuple[RunningApiServer, list[Member]]]:
    with tempfile.TemporaryDirectory(prefix="gvfleet") as tmp:
        base = Path(tmp)
        api = RunningApiServer(base)
        api.state.bookmark_s = 60.0  # about as often as kube-apiserver's watch cache sends them
        members: list[Member] = []
        try:
            configs = base / "configs"
            configs.mkdir()
            (configs / "ts1").write_text("version: v1\n")
            (configs / "ts4").write_text(TS4)
            for i in range(n):
                member = Member(api, f"fleet-{i:03d}", base, configs)
                members.append(member)
                member.start()
                if len(members) % WAVE == 0:  # a wave up before the next starts: the machine is small
                    wait_until(lambda: all(m.ready(api) for m in members[-WAVE:]), 180, 0.5)
            yield api, members
        finally:
            for member in members:
                member.close()
            api.close()


def _per_node(
    before: Counter[tuple[str, str, str]], after: Counter[tuple[str, str, str]], names: Sequence[str]
) -> dict[str, Counter[tuple[str, str]]]:
    """(verb, resource) counts of each node between two snapshots."""
    out: dict[str, Counter[tuple[str, str]]] = {name: Counter() for name in names}
    for (verb, resource, user), count in after.items():
        if user in out:
            delta = count - before.get((verb, resource, user), 0)
            if delta:
                out[user][(verb, resource)] += delta
    return out


def _rates(per_node: dict[str, Counter[tuple[str, str]]], minutes: float, pick: object) -> list[float]:
    assert callable(pick)
    return [sum(c for key, c in counts.items() if pick(key)) / minutes for counts in per_node.values()]


def _mix(per_node: dict[str, Counter[tuple[str, str]]], minutes: float) -> str:
    total: Counter[tuple[str, str]] = Counter()
    for counts in per_node.values():
        total.update(counts)
    n = max(len(per_node), 1)
    return (
        ", ".join(f"{verb} {res} {c / n / minutes:.2f}" for (verb, res), c in total.most_common()) or "none"
    )


def _storm(members: Sequence[Member], seconds: float, stop: threading.Event) -> None:
    """An XID a second on every node, over its GPUs, each node in its own thread."""

    def one(member: Member, offset: float) -> None:
        rng = random.Random(member.name)
        stop.wait(offset)
        i = 0
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            with contextlib.suppress(Exception):
                member.node.sim("xid", device=member.gpus[i % len(member.gpus)], xid=rng.choice(XIDS))
            i += 1
            stop.wait(1.0)

    threads = [
        threading.Thread(target=one, args=(m, i / max(len(members), 1)), daemon=True)
        for i, m in enumerate(members)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)


def _histogram(times: Sequence[float], width: float) -> str:
    if not times:
        return "none"
    start = min(times)
    bins = Counter(int((t - start) // width) for t in times)
    return " ".join(str(bins.get(i, 0)) for i in range(max(bins) + 1))


def run(quick: bool) -> list[Row]:
    n = nodes_wanted(quick)
    window = 20.0 if quick else 60.0
    storm_s = 15.0 if quick else 60.0
    outage_s = 3.0
    rows: list[Row] = []
    started_at = time.monotonic()
    with fleet(n) as (api, members):
        names = [m.name for m in members]
        ok = wait_until(lambda: all(m.ready(api) for m in members), 180, 0.5)
        if not ok:
            late = [m.name for m in members if not m.ready(api)]
            raise RuntimeError(
                f"{len(late)} of {n} nodes not up: {late[:5]}\n{members[0].node.log()[-3000:]}"
            )
        for m in members:
            m.claim_once()
        up_s = time.monotonic() - started_at
        time.sleep(5.0)  # what the start and the claims set off settles

        # 1. steady state
        before, _ = api.state.tally.snapshot()
        time.sleep(window)
        after, watches = api.state.tally.snapshot()
        minutes = window / 60.0
        steady = _per_node(before, after, names)
        calls = _rates(steady, minutes, lambda k: k[0] != "watch")
        writes = _rates(steady, minutes, lambda k: k[0] in WRITES)
        kinds: Counter[str] = Counter()
        worst_kind = 0
        for (resource, user), count in watches.items():
            if user in steady:
                kinds[resource] += count
                worst_kind = max(worst_kind, count)
        open_per_node = sum(kinds.values()) / n
        rows += [
            Row("steady: requests/min per node, mean", sum(calls) / n, "req/min", "no worse than NVIDIA's (docs/performance.md)",
                f"worst node {max(calls):.2f}; beyond the open watches; {window:.0f} s window; mix per node/min: {_mix(steady, minutes)}"),
            Row("steady: writes/min per node, worst", max(writes), "req/min", "0", f"mean {sum(writes) / n:.2f}"),
            Row("steady: open watches per node", open_per_node, "watches", "<= 1 per kind",
                f"by kind (fleet total): {dict(kinds)}; most of one kind on one node: {worst_kind}"),
            Row(f"steady at {FLEET} nodes: requests/s", sum(calls) / n * FLEET / 60.0, "req/s", "",
                f"and {open_per_node * FLEET:.0f} open watches"),
        ]  # fmt: skip

        # 2. an XID storm on every node at once
        before, _ = api.state.tally.snapshot()
        started = time.monotonic()
        _storm(members, storm_s, threading.Event())
        time.sleep(5.0)  # the writers drain what they will
        after, _ = api.state.tally.snapshot()
        minutes = (time.monotonic() - started) / 60.0
        storm = _per_node(before, after, names)
        all_calls = _rates(storm, minutes, lambda k: k[0] != "watch")
        events = _rates(storm, minutes, lambda k: k[1] == "events")
        status = _rates(storm, minutes, lambda k: k == ("patch", "nodes/status"))
        slices = _rates(storm, minutes, lambda k: k[1] == "resourceslices" and k[0] in WRITES)
        unhealthy = sum(
            1 for m in members if (api.state.condition(m.name, "GPUUnhealthy") or {}).get("status") == "True"
        )
        rows += [
            Row("storm: requests/min per node, mean", sum(all_calls) / n, "req/min", "",
                f"worst {max(all_calls):.2f}; an XID/s on each of {n} nodes for {storm_s:.0f} s; {unhealthy}/{n} "
                f"nodes show GPUUnhealthy; mix per node/min: {_mix(storm, minutes)}"),
            Row("storm: Events/min per node, worst", max(events), "req/min", "bounded", f"create + patch; mean {sum(events) / n:.2f}"),
            Row("storm: Node status patches/min per node, worst", max(status), "req/min", "bounded", f"mean {sum(status) / n:.2f}"),
            Row("storm: ResourceSlice writes/min per node, worst", max(slices), "req/min", "", f"mean {sum(slices) / n:.2f}"),
            Row(f"storm at {FLEET} nodes: requests/s", sum(all_calls) / n * FLEET / 60.0, "req/s", "", "every node in a storm at once"),
        ]  # fmt: skip

        # 3. the API server restarts
        watched = {key for key in api.state.tally.snapshot()[1] if key[1] in steady}  # (resource, node)
        api.stop()
        api.state.compact()  # the kept versions are gone: each watch must list again
        time.sleep(outage_s)
        api.start()
        back = time.monotonic()
        # The fake's old streams linger until they next write, so the open count says nothing here:
        # wait until every (kind, node) watched before has opened a watch again.
        wait_until(
            lambda: {(r, u) for _, verb, r, u in api.state.tally.since(back) if verb == "watch"} >= watched,
            120,
            0.5,
        )
        time.sleep(2.0)
        arrivals = [a for a in api.state.tally.since(back) if a[3] in steady]
        relists = [t - back for t, verb, _, _ in arrivals if verb == "list"]
        rewatches = [t - back for t, verb, _, _ in arrivals if verb == "watch"]
        rows += [
            Row("restart: re-lists, first to last", (max(relists) - min(relists)) if relists else math.nan, "s",
                ">= 10 s for 50 nodes" if n >= 50 else "", f"{len(relists)} lists by {n} nodes after a {outage_s:.0f} s outage; "
                f"p50 {percentile(relists, 50):.2f} s after the server was back; per second: {_histogram(relists, 1.0)}"),
            Row("restart: re-watches, first to last", (max(rewatches) - min(rewatches)) if rewatches else math.nan, "s", "",
                f"{len(rewatches)} watches; per second: {_histogram(rewatches, 1.0)}"),
            Row(f"restart at {FLEET} nodes: peak re-lists/s", (max(Counter(int(t) for t in relists).values()) if relists else 0) * FLEET / n,
                "req/s", "", "the busiest second of the herd, times 5,000 / N"),
            Row("fleet", float(n), "nodes", "", f"all up {up_s:.0f} s after the first start; load average {os.getloadavg()[0]:.2f} "
                f"on {os.cpu_count()} cores at the end"),
        ]  # fmt: skip
    return rows


if __name__ == "__main__":
    import argparse

    from tests.benchmarks.common import format_table

    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_fleet")
    parser.add_argument(
        "--nodes", type=int, default=0, help=f"fleet size (default {DEFAULT_NODES}, {QUICK_NODES} quick)"
    )
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    if options.nodes:
        os.environ[NODES_ENV] = str(options.nodes)
    print(format_table([("bench_fleet", r) for r in run(options.quick)]))
