"""`gpuvisor run --labels-output-file` (an extension): the supervisor keeps GFD's node labels
current itself, rewritten as soon as what it advertises changes, on a real supervisor."""

from __future__ import annotations

import os
from pathlib import Path

from tests.harness import SimNode, config_node, sighup_and_wait
from tests.helpers import wait_until

MIXED = ["--mig-strategy", "mixed"]


def read_labels(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return dict(line.split("=", 1) for line in fh.read().splitlines() if "=" in line)
    except FileNotFoundError:
        return {}


def test_labels_follow_a_mig_reconfiguration_at_once() -> None:
    """mig-a100 mixed: the MIG labels are there at start, and a `sim mig` change (a reconfiguration
    the supervisor picks up) rewrites them within seconds, not GFD's minute."""
    node = SimNode("mig-a100", args=MIXED)
    path = os.path.join(node.base, "features.d", "gfd")
    os.makedirs(os.path.dirname(path))
    node.args += ["--labels-output-file", path]
    with node:
        node.wait_listed(["nvidia.com/mig-3g.40gb"])
        assert wait_until(lambda: read_labels(path).get("nvidia.com/mig-3g.40gb.count") == "3", 15), (
            node.log()[-2000:]
        )
        labels = read_labels(path)
        assert labels["nvidia.com/mig.strategy"] == "mixed" and "nvidia.com/gfd.timestamp" not in labels
        # GPU 0 held 1g.10gb, 2g.20gb, 3g.40gb and 1g.10gb+me: now two 3g.40gb.
        node.sim("mig", gpu=0, layout=["3g.40gb", "3g.40gb"])
        assert wait_until(lambda: read_labels(path).get("nvidia.com/mig-3g.40gb.count") == "4", 15), (
            read_labels(path)
        )
        labels = read_labels(path)
        assert (labels["nvidia.com/mig-1g.10gb.count"], labels["nvidia.com/mig-2g.20gb.count"]) == ("7", "3")
        assert node.command("status")["labels"]["writes"] == 2


def test_labels_follow_a_reload_that_adds_replicas(tmp_path: Path) -> None:
    """A SIGHUP that shares the GPUs 4 ways rewrites gpu.replicas and the sharing strategy at once."""
    path = str(tmp_path / "gfd")
    node, config = config_node(tmp_path, "version: v1\n", args=["--labels-output-file", path])
    with node:
        node.wait_listed(["nvidia.com/gpu"])
        assert wait_until(lambda: read_labels(path).get("nvidia.com/gpu.replicas") == "1", 15)
        config.write_text(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4}\n"
        )
        sighup_and_wait(node)
        assert wait_until(lambda: read_labels(path).get("nvidia.com/gpu.replicas") == "4", 15), read_labels(
            path
        )
        assert read_labels(path)["nvidia.com/gpu.sharing-strategy"] == "time-slicing"


def test_a_label_file_that_cannot_be_written_is_retried_and_never_stops_serving() -> None:
    """No directory for the file: serving goes on, status says why, and the file appears once the
    directory does."""
    node = SimNode("pcie-l4")
    path = os.path.join(node.base, "later", "gfd")
    node.args += ["--labels-output-file", path]
    with node:
        node.wait_listed(["nvidia.com/gpu"])
        assert wait_until(lambda: node.command("status")["labels"]["error"], 15)
        assert node.kubelet.allocatable("nvidia.com/gpu") == 4
        os.makedirs(os.path.dirname(path))
        assert wait_until(lambda: read_labels(path).get("nvidia.com/gpu.count") == "4", 20), node.log()[
            -2000:
        ]
        assert node.command("status")["labels"]["error"] is None
