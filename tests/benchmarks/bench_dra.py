"""Benchmark: gpuvisor as a DRA driver, on a simulated pcie-l4 node in `--mode dra`.

A real supervisor and DRA worker, the DRA kubelet stand-in (v1 client) and claims in a claims dir:
- claim prepare latency: NodePrepareResources of one new claim of one GPU, as the kubelet times
  it (the worker reads and checks the claim, writes and fsyncs its checkpoint, then answers);
  then unprepare of it (checkpoint rewritten); and a repeated prepare of a prepared claim (an
  answer from the checkpoint: what a restarted kubelet gets for running pods);
- prepare latency of an MPS claim (NVIDIA's demo gpu-test-mps: 50 % of the threads, 10Gi pinned):
  the worker asks the supervisor for the claim's MPS control daemon, which starts it with its
  limits and answers once it is up; here the daemon is tests/mpsfake.py's fake
  `nvidia-cuda-mps-control` (a Python process forking its daemon), so the figure is gpuvisor's
  path around a daemon start, not a real daemon's own start time; then its unprepare (the daemon
  stopped);
- prepare and unprepare latency of a MIG device made on demand (gpuvisor.dra.migOnDemand): the
  supervisor creates the GPU and compute instance at the claim's placement in the simulator, the
  claim's spec names it, and the unprepare destroys it;
- prepare latency of a memory share (gpuvisor.dra.memorySharing: a result with a shareID and
  consumedCapacity.memory): the first share of a GPU starts the GPU's one MPS daemon (the
  fake's, as above), a second share of it joins the running daemon; each claim's spec carries
  its own pinned limit; the last unprepare stops the daemon;
- XID -> UNHEALTHY in the kubelet's health stream: `sim xid 48` on a GPU until the stand-in holds
  the device UNHEALTHY (its receive time), then `sim reset` until HEALTHY again;
- ResourceSlice content after a health change: `build_slices` for the node with the book's
  conditions (mig-a100: 21 devices).

Then the same node with the fake API server (tests/kubeapi/, in this process, TLS on loopback,
connections kept alive as kube-apiserver keeps them):
- claim prepare latency with the claim fetched from the API server: the DRA worker asks the
  supervisor over the control channel, the supervisor GETs it with the node's one client on a
  kept-alive connection; then the same claim prepared again and unprepared, and the API requests
  the node made per claim (the fetch, and the claim status written and cleared in the background);
- what a TLS connection costs: a claim GET on a kept-alive connection of the kube layer's client
  against one that opens its own (the TCP connect and TLS handshake), as a worker holding a client
  made in a process of its own would see them;
- the slice publication after a health change: `sim xid 48` on a GPU until the pool's new
  generation with gpu.nvidia.com/xid=48 on the device is stored at the API server, and
  `sim reset` until the generation without it is; a kubelet wipe (DeleteCollection by
  spec.nodeName) until the pool is complete again;
- the claim-source choice (docs/dra.md): what loading that client costs a fresh interpreter that
  has the DRA worker's modules loaded already (time, RSS and PSS, medians of 7), against the round
  trip through the supervisor above.

The reference for a new claim is NVIDIA's kubelet plugin v0.4.1 beside gpuvisor on one real
kube-apiserver (issue 40: 8.9 ms p50 for a new claim, 4.8 ms for one prepared again). The API
server here is the fake, in this very process, so its own time (Python, not Go) is in each figure.
Every claim makes several requests (`requests/claim`), so the supervisor here runs with
`--kube-api-qps 50 --kube-api-burst 100`: at client-go's 5/10 a loop of claims 0.3 s apart
measures the limiter's waits instead of the prepare (what the limiter does is in the kube tests);
the health changes are spaced (`EVENT_SPACING_S`) as one XID on a real node is.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.dra.slices import build_slices
from supervisor.health.book import ConditionView, Recovery
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import load_simulator
from tests import draconfigs, mpsfake
from tests.benchmarks.common import Row, Timer, import_cost, p50, p99
from tests.dranode import DRIVER, POOL, DraNode
from tests.helpers import short_tmpdir

if TYPE_CHECKING:
    from tests.kubeapi import RunningApiServer

CLAIMS, CLAIMS_QUICK = 500, 60
MPS_CLAIMS, MPS_CLAIMS_QUICK = 200, 30  # each starts and stops a daemon process
SPACING_S = 0.3  # between two claims
NVIDIA_NEW_CLAIM_MS = 8.9  # NVIDIA's kubelet plugin v0.4.1, a new claim's prepare p50 (issue 40)
NVIDIA_AGAIN_MS = 4.8  # ... a prepared claim prepared again
API_ARGS = ("--mode", "dra", "--log-level", "warning", "--kube-api-qps", "50", "--kube-api-burst", "100")
EVENT_SPACING_S = 1.0  # between two health changes (each is a list and a write, twice)
EVENTS, EVENTS_QUICK = 100, 20
WAIT_S = 10.0


def run(quick: bool) -> list[Row]:
    claims = CLAIMS_QUICK if quick else CLAIMS
    events = EVENTS_QUICK if quick else EVENTS
    mps_claims = MPS_CLAIMS_QUICK if quick else MPS_CLAIMS
    with short_tmpdir("gvbm") as mps_base:
        fake = mpsfake.install(Path(mps_base))
        mps_args = ("--mps-root", f"{mps_base}/mps", "--mps-control-binary", str(fake))
        try:
            with DraNode("pcie-l4", args=("--mode", "dra", "--log-level", "warning", *mps_args)) as node:
                node.wait_registered()
                prepare, unprepare, again = _claims(node, claims)
                mps_prepare, mps_unprepare = _mps_claims(node, mps_claims)
                first_share, joined = _memory_shares(node, mps_claims)
                unhealthy, healthy = _health(node, events)
        finally:
            mpsfake.kill_daemons(Path(mps_base))  # only the daemons this benchmark's fake started
    made, destroyed = _mig_on_demand(30 if quick else 200)
    slices = _slices(200 if quick else 2000)
    api_rows = _with_api_server(20 if quick else 60, 5 if quick else 20)
    note = f"{claims} claims, one GPU each, v1"
    return [
        *api_rows,
        Row("prepare p50", p50(prepare.ms()), "ms", "", note),
        Row("prepare p99", p99(prepare.ms()), "ms", "", "claim read + checks + checkpoint fsync + answer"),
        Row("unprepare p50", p50(unprepare.ms()), "ms", "", "checkpoint rewritten and fsync'd"),
        Row("unprepare p99", p99(unprepare.ms()), "ms"),
        Row("re-prepare p50", p50(again.ms()), "ms", "", "a prepared claim again: from the checkpoint"),
        Row(
            "prepare p50 with an MPS claim",
            p50(mps_prepare.ms()),
            "ms",
            "",
            f"{mps_claims} claims (gpu-test-mps): the supervisor starts the claim's daemon (the fake's)",
        ),
        Row("prepare p99 with an MPS claim", p99(mps_prepare.ms()), "ms"),
        Row(
            "unprepare p50 with an MPS claim", p50(mps_unprepare.ms()), "ms", "", "the claim's daemon stopped"
        ),
        Row(
            "prepare p50 with a memory share, daemon started",
            p50(first_share.ms()),
            "ms",
            "",
            f"{mps_claims} rounds: a GPU's first share (its MPS daemon started, the fake's)",
        ),
        Row("prepare p99 with a memory share, daemon started", p99(first_share.ms()), "ms"),
        Row(
            "prepare p50 with a memory share, daemon running",
            p50(joined.ms()),
            "ms",
            "",
            "a second share of the GPU: a client of its running daemon",
        ),
        Row("prepare p99 with a memory share, daemon running", p99(joined.ms()), "ms"),
        Row(
            "prepare p50 with a MIG device made on demand",
            p50(made.ms()),
            "ms",
            "",
            f"{len(made.samples)} claims (gpuvisor.dra.migOnDemand, dgx-h100 simulator): the supervisor creates the "
            "GPU and compute instance, the spec names it",
        ),
        Row("prepare p99 with a MIG device made on demand", p99(made.ms()), "ms"),
        Row(
            "unprepare p50 with a MIG device made on demand",
            p50(destroyed.ms()),
            "ms",
            "",
            "its instances destroyed",
        ),
        Row("xid->UNHEALTHY p50", p50(unhealthy), "ms", "", f"{events} events, at the health stream"),
        Row("xid->UNHEALTHY p99", p99(unhealthy), "ms"),
        Row("reset->HEALTHY p50", p50(healthy), "ms"),
        Row(
            "slices rebuilt p50", p50(slices.ms()), "ms", "", "build_slices, mig-a100, after a health change"
        ),
    ]


def _claims(
    node: DraNode,
    count: int,
    spacing: float = 0.0,
    settle: Callable[[DraNode, str, bool], None] = lambda node, name, prepared: None,
) -> tuple[Timer, Timer, Timer]:
    """`settle` waits for what a call leaves in the background (the claim status the supervisor
    writes) before the next call is timed: the fake API server's checks of it run in this process
    and would be counted in the kubelet stand-in's next call otherwise."""
    prepare, unprepare, again = Timer(), Timer(), Timer()
    for i in range(count + 10):
        time.sleep(spacing)
        ref = node.claim(f"c{i}", [f"gpu-{i % 4}"], namespace="bench")
        warm = i < 10
        with prepare:
            result = node.dra.prepare(DRIVER, [ref], timeout=WAIT_S)
        if result.claims[ref[2]].error:
            raise RuntimeError(f"prepare failed: {result.claims[ref[2]].error}")
        settle(node, f"c{i}", True)
        with again:
            node.dra.prepare(DRIVER, [ref], timeout=WAIT_S)
        with unprepare:
            node.dra.unprepare(DRIVER, [ref], timeout=WAIT_S)
        settle(node, f"c{i}", False)
        if warm:
            for timer in (prepare, again, unprepare):
                timer.samples.pop()
        if node.api is not None:
            node.api.state.delete_claim("bench", f"c{i}")
        else:
            node.claims.delete("bench", f"c{i}")
    return prepare, unprepare, again


def _mps_claims(node: DraNode, count: int) -> tuple[Timer, Timer]:
    """Prepare and unprepare of NVIDIA's MPS demo claim, one GPU each in turn, 10 warm-up rounds."""
    prepare, unprepare = Timer(), Timer()
    for i in range(count + 10):
        claim = dataclasses.replace(draconfigs.gpu_test_mps(f"gpu-{i % 4}"), namespace="bench", name=f"m{i}")
        node.claims.put(claim.to_json(POOL))
        ref = (claim.namespace, claim.name, claim.uid)
        with prepare:
            result = node.dra.prepare(DRIVER, [ref], timeout=WAIT_S * 3)
        if result.claims[claim.uid].error:
            raise RuntimeError(f"MPS claim prepare failed: {result.claims[claim.uid].error}")
        with unprepare:
            result = node.dra.unprepare(DRIVER, [ref], timeout=WAIT_S * 3)
        if result.claims[claim.uid].error:
            raise RuntimeError(f"MPS claim unprepare failed: {result.claims[claim.uid].error}")
        if i < 10:
            prepare.samples.pop()
            unprepare.samples.pop()
        node.claims.delete("bench", f"m{i}")
    return prepare, unprepare


def _memory_shares(node: DraNode, count: int) -> tuple[Timer, Timer]:
    """Two memory shares of one GPU in turn: the first starts its daemon, the second joins it;
    both unprepared (the daemon stopped with the second). 10 warm-up rounds."""
    first, joined = Timer(), Timer()
    for i in range(count + 10):
        refs = []
        for j, timer in enumerate((first, joined)):
            obj = draconfigs.memory_share("bench", f"s{i}-{j}", f"gpu-{i % 4}", "4Gi", POOL)
            node.claims.put(obj)
            ref = ("bench", f"s{i}-{j}", obj["metadata"]["uid"])
            with timer:
                result = node.dra.prepare(DRIVER, [ref], timeout=WAIT_S * 3)
            if result.claims[ref[2]].error:
                raise RuntimeError(f"memory share prepare failed: {result.claims[ref[2]].error}")
            refs.append(ref)
        for ref in refs:
            result = node.dra.unprepare(DRIVER, [ref], timeout=WAIT_S * 3)
            if result.claims[ref[2]].error:
                raise RuntimeError(f"memory share unprepare failed: {result.claims[ref[2]].error}")
            node.claims.delete("bench", ref[1])
        if i < 10:
            first.samples.pop()
            joined.samples.pop()
    return first, joined


def _mig_on_demand(count: int) -> tuple[Timer, Timer]:
    """Claims of 1g.10gb placements of a dgx-h100's GPUs in turn, each prepared (its instance
    made) and unprepared (destroyed); 10 warm-up rounds (the first turns MIG mode on)."""
    from tests.helpers import write_mig_minors

    made, destroyed = Timer(), Timer()
    with short_tmpdir("gvbg") as base:
        minors = Path(base) / "mig-minors"
        write_mig_minors(minors)
        args = (
            "--mode",
            "dra",
            "--log-level",
            "warning",
            "--dra-mig-on-demand",
            "--mig-minors-path",
            str(minors),
        )
        with DraNode("dgx-h100", args=args) as node:
            node.wait_registered()
            for i in range(count + 10):
                device = f"gpu-{i % 8}-mig-1g10gb-19-{i % 7}"
                ref = node.claim(f"m{i}", [device])
                with made:
                    result = node.dra.prepare(DRIVER, [ref], timeout=WAIT_S * 3)
                if result.claims[ref[2]].error:
                    raise RuntimeError(f"MIG on demand prepare failed: {result.claims[ref[2]].error}")
                with destroyed:
                    result = node.dra.unprepare(DRIVER, [ref], timeout=WAIT_S * 3)
                if result.claims[ref[2]].error:
                    raise RuntimeError(f"MIG on demand unprepare failed: {result.claims[ref[2]].error}")
                if i < 10:
                    made.samples.pop()
                    destroyed.samples.pop()
    return made, destroyed


def _gpu_uuids(node: DraNode) -> list[str]:
    from common.model import ResourcePlan

    with open(f"{node.run_dir}/plans/{DRIVER}.json", encoding="utf-8") as fh:
        plan = ResourcePlan.from_json(fh.read())
    return [d.gpu_uuid for d in plan.devices]


def _until(node: DraNode, device: str, health: str) -> float:
    """The stand-in's receive time (monotonic) of the first message showing `device` as `health`."""
    if not node.dra.wait_for(lambda: node.dra.device_health(DRIVER, POOL, device) == health, WAIT_S):
        raise RuntimeError(f"{device} not {health} in the health stream within {WAIT_S:g}s")
    return node.dra.health_seen(DRIVER)[(POOL, device)].at


def _health(node: DraNode, events: int) -> tuple[list[float], list[float]]:
    uuids = _gpu_uuids(node)
    _until(node, "gpu-0", "HEALTHY")
    down: list[float] = []
    up: list[float] = []
    for i in range(events):
        k = i % len(uuids)
        start = time.monotonic()
        node.sim("xid", device=uuids[k], xid=48)
        down.append((_until(node, f"gpu-{k}", "UNHEALTHY") - start) * 1000.0)
        start = time.monotonic()
        node.sim("reset", device=uuids[k])
        up.append((_until(node, f"gpu-{k}", "HEALTHY") - start) * 1000.0)
    return down, up


def _slices(rounds: int) -> Timer:
    nvml = Nvml(load_simulator("mig-a100"), sysfs_root=None)
    nvml.init()
    node = nvml.discover()
    timer = Timer()
    for i in range(rounds):
        gpu = node.gpus[i % len(node.gpus)]
        conditions = [ConditionView(gpu.uuid, None, None, "xid:48", Recovery.UNTIL_RESET, "r", 1e9, 1e9)]
        with timer:
            build_slices(node, conditions, node_name=POOL, generation=i + 1)
    return timer


# ---------------------------------------------------------------------------------- with the API server

# What a DRA worker holding its own client would load: the client and the credentials (kubeconfig or
# service account), and with them Python's ssl, which a worker leaves out (worker.process.leave_out_ssl);
# on top of the modules the DRA worker has loaded already, as it has them.
WORKER = "from worker.process import leave_out_ssl\nleave_out_ssl()\nimport worker.dra.main, zmq, grpc"
CLIENT = (
    "import sys\nsys.modules.pop('ssl', None)\nimport supervisor.kube.client, supervisor.kube.credentials"
)


def _wait_at_api(node: DraNode, predicate: Callable[[], bool]) -> float:
    """The monotonic time the fake API server first held `predicate` (woken by each change)."""
    assert node.api is not None
    state = node.api.state
    with state.changed:
        if not state.changed.wait_for(predicate, WAIT_S):
            raise RuntimeError(f"the API server did not get there within {WAIT_S:g}s")
        return time.monotonic()


def _shows(node: DraNode, device: str, taints: list[str]) -> Callable[[], bool]:
    """Does the pool's newest generation have `device` with these taint values?"""

    def check() -> bool:
        published = node.published()
        return device in published and [str(t.get("value", "")) for t in published[device]] == taints

    return check


def _complete_after(node: DraNode, generation: int) -> Callable[[], bool]:
    return lambda: len(node.published()) == 4 and node.generation() > generation


def _with_api_server(claims: int, events: int) -> list[Row]:
    from tests.kubeapi import RunningApiServer

    with tempfile.TemporaryDirectory(prefix="gvbd") as tmp:
        api = RunningApiServer(Path(tmp))
        try:
            with DraNode("pcie-l4", args=API_ARGS, api=api) as node:
                node.wait_registered()
                if not node.dra.wait_for(lambda: len(node.published()) == 4, 30):
                    raise RuntimeError("the pool was not published")
                before = len(api.state.requests)
                prepare, unprepare, again = _claims(node, claims, SPACING_S, settle=_status_settled)
                per_claim = _node_requests(api, before) / (claims + 10)
                kept, fresh = _claim_gets(api, claims)
                tainted, cleared = _publication(node, events)
                wipes = _wipes(node, max(3, events // 2))
        finally:
            api.close()
    load_ms, load_rss, load_pss = import_cost(CLIENT, before=WORKER)
    note = f"{claims} claims, {SPACING_S:g} s apart; the worker asks the supervisor, which GETs it (kept-alive TLS)"
    tls = p50(fresh.ms()) - p50(kept.ms())
    return [
        Row("prepare (API server) p50", p50(prepare.ms()), "ms", f"<= {NVIDIA_NEW_CLAIM_MS:g} (NVIDIA's)", note),
        Row("prepare (API server) p99", p99(prepare.ms()), "ms"),
        Row("re-prepare (API server) p50", p50(again.ms()), "ms", f"<= {NVIDIA_AGAIN_MS:g} (NVIDIA's)", "a prepared claim again: from the checkpoint, no API call"),
        Row("unprepare (API server) p50", p50(unprepare.ms()), "ms", "", "checkpoint rewritten and fsync'd"),
        Row("unprepare (API server) p99", p99(unprepare.ms()), "ms"),
        Row("API requests/claim", per_claim, "", "", "the node's requests per claim: its GET, the claim status written and cleared"),
        Row("claim GET, kept connection p50", p50(kept.ms()), "ms", "", "the kube layer's client, a connection kept alive"),
        Row("claim GET, kept connection p99", p99(kept.ms()), "ms"),
        Row("claim GET, new connection p50", p50(fresh.ms()), "ms", "", "a client of its own each time: TCP connect + TLS handshake + GET"),
        Row("TLS connection cost p50", tls, "ms", "", "new connection minus kept, p50s: what each claim paid before connections were kept"),
        Row("kube client load time", load_ms, "ms", "", "into a fresh process with the DRA worker's modules (ssl left out, as a worker has it)"),
        Row("kube client load RSS", load_rss, "MiB", "", "the same, RSS added"),
        Row("kube client load PSS", load_pss, "MiB", "", "the same, PSS added"),
        Row("xid->slice taint p50", p50(tainted), "ms", "", f"{events} events: the new generation stored at the API server"),
        Row("xid->slice taint p99", p99(tainted), "ms"),
        Row("reset->taint gone p50", p50(cleared), "ms"),
        Row("wipe->republished p50", p50(wipes), "ms", "", "the kubelet's DeleteCollection until the pool is complete"),
    ]  # fmt: skip


def _status_settled(node: DraNode, name: str, prepared: bool) -> None:
    """The claim's status shows this driver's devices (prepared) or none of them (unprepared)."""
    assert node.api is not None
    claims = node.api.state.resource_claims

    def settled() -> bool:
        claim = claims.get(("bench", name))
        devices = ((claim or {}).get("status") or {}).get("devices") or []
        return any(d.get("driver") == DRIVER for d in devices) == prepared

    _wait_at_api(node, settled)


def _node_requests(api: RunningApiServer, since: int) -> int:
    """The supervisor's requests since `since` (the kubelet stand-in's own are not the node's)."""
    with api.state.lock:
        return sum(1 for r in api.state.requests[since:] if " supervisor" in r.user_agent)


def _claim_gets(api: RunningApiServer, count: int) -> tuple[Timer, Timer]:
    """A claim GET with the kube layer's client: on a kept connection, and on a new one each time."""
    from supervisor.kube.client import KubeClient
    from supervisor.kube.credentials import load_credentials

    credentials = load_credentials(str(api.kubeconfig), {})
    api.state.add_claim("bench", "direct", POOL, ["gpu-0"])
    path = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/direct"
    kept, fresh = Timer(), Timer()
    client = KubeClient(credentials, component="bench", version="test", qps=-1)
    try:
        for i in range(count + 10):
            time.sleep(SPACING_S / 3)
            with kept:
                client.get(path, what="get a claim")
            own = KubeClient(credentials, component="bench", version="test", qps=-1)
            try:
                with fresh:
                    own.get(path, what="get a claim")
            finally:
                own.close()
            if i < 10:
                kept.samples.pop()
                fresh.samples.pop()
    finally:
        client.close()
    return kept, fresh


def _publication(node: DraNode, events: int) -> tuple[list[float], list[float]]:
    uuids = _gpu_uuids(node)
    tainted: list[float] = []
    cleared: list[float] = []
    for i in range(events):
        k = i % len(uuids)
        device = f"gpu-{k}"
        time.sleep(EVENT_SPACING_S)
        start = time.monotonic()
        node.sim("xid", device=uuids[k], xid=48)
        tainted.append((_wait_at_api(node, _shows(node, device, ["48"])) - start) * 1000.0)
        time.sleep(EVENT_SPACING_S)
        start = time.monotonic()
        node.sim("reset", device=uuids[k])
        cleared.append((_wait_at_api(node, _shows(node, device, [])) - start) * 1000.0)
    return tainted, cleared


def _wipes(node: DraNode, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        time.sleep(EVENT_SPACING_S)
        before = node.generation()
        start = time.monotonic()
        node.dra.wipe_slices()
        done = _wait_at_api(node, _complete_after(node, before))
        times.append((done - start) * 1000.0)
    return times
