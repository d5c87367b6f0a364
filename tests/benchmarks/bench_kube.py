"""The API-server layer: what it costs to load, and how fast the cluster side acts.

- Loading: the time and RSS an import adds to a fresh interpreter (median of several): gpuvisor's
  layer (supervisor.kube, and the cluster side's writer) alone, and on top of what `gpuvisor run`
  already imports at start (supervisor.main); for comparison the Kubernetes project's client
  (`kubernetes.client`) and lightkube, where this interpreter has them (they are not gpuvisor's
  dependencies: "n/a" otherwise).
- A label flip: the node label set on the fake API server (tests/kubeapi/) until the kubelet
  stand-in lists the new device count (pcie-l4, no sharing <-> 4 time-slicing replicas).
- A stop with the API server frozen: SIGTERM until the supervisor has exited, with the writer's
  call to the frozen server in flight.
"""

from __future__ import annotations

import math
import signal
import tempfile
import time
from pathlib import Path

from tests.benchmarks.common import Row, import_cost, p50
from tests.harness import SimNode
from tests.helpers import wait_until

LAYER = "import supervisor.kube.client, supervisor.kube.credentials, supervisor.kube.watch, supervisor.kube.recorder"
SIDE = LAYER + ", supervisor.cluster.writer"  # what the cluster side's start loads
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"


def label_flips(rounds: int) -> tuple[list[float], float]:
    """Label-to-listed times (ms) of `rounds` flips, and SIGTERM-to-exit (s) with the server frozen."""
    from tests.kubeapi import RunningApiServer

    flips: list[float] = []
    stop_s = math.nan
    with tempfile.TemporaryDirectory(prefix="gvbk") as tmp:
        base = Path(tmp)
        api = RunningApiServer(base)
        try:
            api.state.add_node("bench-node")
            srcdir = base / "configs"
            srcdir.mkdir()
            (srcdir / "ts1").write_text("version: v1\n")
            (srcdir / "ts4").write_text(TS4)
            args = ["--config-file-srcdir", str(srcdir), "--default-config", "ts1", "--node-health=true"]
            node = SimNode(
                "pcie-l4", args=args, env={"NODE_NAME": "bench-node", "KUBECONFIG": str(api.kubeconfig)}
            )
            with node:
                node.wait_listed(["nvidia.com/gpu"])
                wait_until(lambda: node.command("status")["cluster"].get("label", {}).get("value") == "", 30)
                for i in range(rounds):
                    name, want = ("ts4", 16) if i % 2 == 0 else ("ts1", 4)
                    t0 = time.perf_counter()
                    api.state.set_node_label("bench-node", "nvidia.com/device-plugin.config", name)
                    if node.kubelet.wait_for(lambda w=want: node.kubelet.capacity("nvidia.com/gpu") == w, 30):  # type: ignore[misc]
                        flips.append((time.perf_counter() - t0) * 1000)
                api.state.freeze()
                node.sim("xid", device=sorted(node.kubelet.devices("nvidia.com/gpu"))[0], xid=48)
                time.sleep(2)  # the writer's PATCH now hangs on the frozen server
                t0 = time.perf_counter()
                assert node.proc is not None
                node.proc.send_signal(signal.SIGTERM)
                node.proc.wait(60)
                stop_s = time.perf_counter() - t0
        finally:
            api.close()
    return flips, stop_s


def run(quick: bool) -> list[Row]:
    rounds = 3 if quick else 7
    layer = import_cost(LAYER, rounds=rounds)[:2]
    on_top = import_cost(SIDE, before="import supervisor.main", rounds=rounds)[:2]
    official = import_cost("import kubernetes.client", rounds=rounds)[:2]
    light = import_cost("import lightkube", rounds=rounds)[:2]
    flips, stop_s = label_flips(4 if quick else 10)
    note = f"median of {rounds} fresh interpreters"
    return [
        Row("gpuvisor's layer import", layer[0], "ms", "", f"+{layer[1]:.1f} MiB RSS; {note}"),
        Row("cluster side's start in gpuvisor run", on_top[0], "ms", "", f"+{on_top[1]:.1f} MiB RSS over supervisor.main (which loads no ssl: OpenSSL comes with this layer)"),
        Row("kubernetes.client import", official[0], "ms", "", f"+{official[1]:.1f} MiB RSS" if not math.isnan(official[1]) else "not installed"),
        Row("lightkube import", light[0], "ms", "", f"+{light[1]:.1f} MiB RSS" if not math.isnan(light[1]) else "not installed"),
        Row("label flip -> kubelet lists p50", p50(flips), "ms", "", f"{len(flips)} flips, pcie-l4, 1 <-> 4 replicas"),
        Row("SIGTERM, API server frozen -> exit", stop_s, "s", "< 5 s", "a PATCH to the frozen server in flight"),
    ]  # fmt: skip
