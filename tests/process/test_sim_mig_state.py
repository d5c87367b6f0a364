"""A MIG device made by hand on a running simulated node (`gpuvisor sim create-instance`) outlives a
killed supervisor: the simulator keeps its MIG layout in the node's state file
(GPUVISOR_SIMULATE_STATE, which tests/harness.py SimNode sets for every node), as a real driver's
MIG layout outlives the device plugin, and the next supervisor finds the same MIG device."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.harness import SimNode
from tests.helpers import REPO, checkout_path, gone, wait_until

MIXED = ["--mig-strategy", "mixed"]
MIG_3G = "nvidia.com/mig-3g.40gb"


def gpuvisor_sim(node: SimNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "sim", *args, "--run-dir", node.run_dir],
        capture_output=True, text=True, timeout=30, cwd=REPO, env={**os.environ, "PYTHONPATH": checkout_path()},
        check=False,
    )  # fmt: skip


def test_a_hand_made_instance_is_advertised_and_outlives_a_killed_supervisor() -> None:
    """create-instance makes 3g.40gb at placement 4 on an H100 (MIG turned on: Hopper needs no
    reset) and prints it; the supervisor advertises it (mixed strategy); `instances` lists it; after
    SIGKILL and a new start the same MIG device is advertised again."""
    with SimNode("dgx-h100", args=MIXED) as node:
        node.wait_listed(["nvidia.com/gpu"])
        gpu = json.loads(gpuvisor_sim(node, "instances", "--device", "GPU-0").stdout or "null")
        assert gpu is None  # an unknown GPU is refused (and prints nothing on stdout)
        uuid = next(iter(node.kubelet.devices("nvidia.com/gpu")))
        made = gpuvisor_sim(
            node, "create-instance", "--device", uuid, "--gi-profile", "9", "--placement", "4"
        )
        assert made.returncode == 0, made.stderr
        instance = json.loads(made.stdout)
        assert (instance["gpu_uuid"], instance["profile"], instance["placement_start"]) == (
            uuid,
            "3g.40gb",
            4,
        )
        node.wait_listed([MIG_3G])
        assert list(node.kubelet.devices(MIG_3G)) == [instance["uuid"]]
        listed = gpuvisor_sim(node, "instances", "--device", uuid)
        assert listed.returncode == 0 and json.loads(listed.stdout) == [instance]
        again = gpuvisor_sim(
            node, "create-instance", "--device", uuid, "--gi-profile", "9", "--placement", "4"
        )
        assert again.returncode == 1 and "is taken" in again.stderr and instance["uuid"] in again.stderr

        old, before = [p.pid for p in node.workers()], len(node.kubelet.registrations)
        node.stop_supervisor(signal.SIGKILL)
        assert wait_until(lambda: gone(old), 15), "the workers outlived their supervisor"
        node.start_supervisor()
        # The new supervisor's own registration of the MIG resource, and the device it lists.
        assert node.kubelet.wait_for(
            lambda: any(r.resource == MIG_3G and not r.error for r in node.kubelet.registrations[before:]), 30
        ), node.log()[-4000:]
        assert node.kubelet.wait_for(lambda: list(node.kubelet.devices(MIG_3G)) == [instance["uuid"]], 15)
        assert json.loads(gpuvisor_sim(node, "instances", "--device", uuid).stdout) == [instance]
