"""End to end: a real supervisor with the `cdi-cri` device list strategy keeps its CDI spec file.

A simulated MIG node (mixed strategy) with `--cdi-spec-dir` and `--mig-minors-path` in a temp
dir: the spec is written before the workers hand out names, names exactly what Allocate answers,
is replaced when a MIG change alters the devices, and stays after the supervisor stops.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from supervisor.cdi.spec import CDI_CLASS, CDI_VENDOR
from tests.harness import SimNode
from tests.helpers import short_tmpdir, wait_until, write_mig_minors

GPU = "nvidia.com/gpu"
MIG_3G = "nvidia.com/mig-3g.40gb"
SPEC_NAME = f"{CDI_VENDOR}-{CDI_CLASS}.json"


def spec_names(spec_dir: Path) -> set[str]:
    spec = json.loads((spec_dir / SPEC_NAME).read_text())
    assert spec["kind"] == f"{CDI_VENDOR}/{CDI_CLASS}"
    return {d["name"] for d in spec["devices"]}


def test_cdi_spec_follows_the_devices_and_outlives_the_supervisor() -> None:
    """Spec written at start naming Allocate's cdi_devices; replaced after a MIG change; kept after SIGTERM."""
    with short_tmpdir("gvc") as base:
        spec_dir, minors = Path(base) / "cdi", Path(base) / "mig-minors"
        write_mig_minors(minors)
        args = [
            "--mig-strategy", "mixed",
            "--device-list-strategy", "cdi-cri",
            "--cdi-spec-dir", str(spec_dir),
            "--mig-minors-path", str(minors),
        ]  # fmt: skip
        with SimNode("mig-a100", args=args) as node:
            node.wait_listed([GPU, MIG_3G])
            names = spec_names(spec_dir)
            devices = set(node.kubelet.devices(GPU)) | set(node.kubelet.devices(MIG_3G))
            assert devices <= names
            for resource in (GPU, MIG_3G):
                ids, response = node.kubelet.allocate(resource, 1)
                assert [c.name for c in response.cdi_devices] == [
                    f"{CDI_VENDOR}/{CDI_CLASS}={i}" for i in ids
                ]
                assert not response.envs.get("NVIDIA_VISIBLE_DEVICES")
                assert {c.name.split("=", 1)[1] for c in response.cdi_devices} <= names
            status = node.command("status")
            assert status["cdi"] == {"spec_dir": str(spec_dir), "source": "gpuvisor", "error": None}
            assert wait_until(lambda: node.command("status")["ready"], 20), node.command("status")[
                "ready_detail"
            ]

            # GPU 4 (a full GPU) is split into two 3g.40gb MIG devices: the spec is replaced.
            full_before = set(node.kubelet.devices(GPU))
            mig_before = set(node.kubelet.devices(MIG_3G))
            inode = os.stat(spec_dir / SPEC_NAME).st_ino
            node.sim("mig", gpu=4, layout=["3g.40gb", "3g.40gb"])
            assert wait_until(lambda: len(node.kubelet.devices(MIG_3G)) == len(mig_before) + 2, 20), (
                node.log()[-3000:]
            )
            assert wait_until(lambda: len(node.kubelet.devices(GPU)) == len(full_before) - 1, 20)
            gone = full_before - set(node.kubelet.devices(GPU))
            added = set(node.kubelet.devices(MIG_3G)) - mig_before
            after = spec_names(spec_dir)
            assert added <= after and not (gone & after)
            assert os.stat(spec_dir / SPEC_NAME).st_ino != inode  # replaced by rename, never edited
            response = node.kubelet.allocate_ids(MIG_3G, sorted(added)[:1])
            assert {c.name.split("=", 1)[1] for c in response.cdi_devices} <= after

            assert node.stop_supervisor(signal.SIGTERM) == 0
            assert spec_names(spec_dir) == after  # left for containers that restart meanwhile
            assert [p for p in os.listdir(spec_dir) if p.startswith(".")] == []  # no temp files left


def test_cdi_spec_failure_is_not_ready() -> None:
    """A spec that cannot be built (MIG minors unreadable) shows in status and keeps the node not ready."""
    with short_tmpdir("gvc") as base:
        args = [
            "--mig-strategy", "mixed",
            "--device-list-strategy", "cdi-cri",
            "--cdi-spec-dir", os.path.join(base, "cdi"),
            "--mig-minors-path", os.path.join(base, "missing"),
        ]  # fmt: skip
        with SimNode("mig-a100", args=args) as node:
            node.wait_listed([GPU, MIG_3G])
            assert wait_until(lambda: "CDI spec" in node.command("status")["ready_detail"], 20)
            status = node.command("status")
            assert status["ready"] is False
            assert "cannot be read" in status["cdi"]["error"] and "missing" in status["cdi"]["error"]
            assert not os.path.exists(os.path.join(base, "cdi", SPEC_NAME))
