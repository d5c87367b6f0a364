"""`gpuvisor labels` choosing its config by the Node's label, as NVIDIA's chart has config-manager do
for GFD: a real `gpuvisor labels` process, the fake API server (tests/kubeapi/) holding the Node."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer
from tests.labelsrun import labels_env, start_labels

NODE = "gpu-node-1"
LABEL = "nvidia.com/device-plugin.config"
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"


def replicas(out: Path) -> str:
    lines = out.read_text().splitlines() if out.exists() else []
    return next((line.split("=", 1)[1] for line in lines if line.startswith("nvidia.com/gpu.replicas=")), "")


@contextmanager
def labeller(api: RunningApiServer, tmp_path: Path) -> Iterator[tuple[Popen[bytes], Path, Path]]:
    """`gpuvisor labels` writing a features.d file, relabelling only once an hour (so a change seen
    within the test came from the label), configs ts1 and ts4, ts1 the default."""
    srcdir = tmp_path / "configs"
    srcdir.mkdir()
    (srcdir / "ts1").write_text("version: v1\n")
    (srcdir / "ts4").write_text(TS4)
    out, log = tmp_path / "gfd", tmp_path / "labels.log"
    env = labels_env(
        KUBECONFIG=str(api.kubeconfig), NODE_NAME=NODE, CONFIG_FILE_SRCDIR=str(srcdir), DEFAULT_CONFIG="ts1"
    )
    args = ("--simulate", "pcie-l4", "--use-node-feature-api=false", "--sleep-interval", "1h")
    proc = start_labels(*args, "--machine-type-file", "", "--output-file", str(out), log=log, env=env)
    try:
        yield proc, out, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_the_labels_follow_the_nodes_config_label(api: RunningApiServer, tmp_path: Path) -> None:
    """No label: the default config's labels; the label set to ts4: its labels at once (not at the
    next interval); a label naming no config: refused, the running config's labels stay; the
    label removed: the default again. A stop exits 0."""
    api.state.add_node(NODE)
    with labeller(api, tmp_path) as (proc, out, log):
        assert wait_until(lambda: replicas(out) == "1", 30), log.read_text()
        api.state.set_node_label(NODE, LABEL, "ts4")
        assert wait_until(lambda: replicas(out) == "4", 30), log.read_text()
        assert "config applied: config 'ts4', named by the node label" in log.read_text()
        api.state.set_node_label(NODE, LABEL, "no-such-config")
        assert wait_until(lambda: "specified config no-such-config does not exist" in log.read_text(), 30)
        assert replicas(out) == "4"
        api.state.set_node_label(NODE, LABEL, None)
        assert wait_until(lambda: replicas(out) == "1", 30), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert api.state.errors == []


def test_a_labelled_node_is_labelled_with_its_config_from_the_first_labelling(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """A node labelled before the labeller starts: the first file written already has the labelled
    config's labels (the labeller waits for the Node instead of labelling the default first)."""
    api.state.add_node(NODE, {LABEL: "ts4"})
    with labeller(api, tmp_path) as (_, out, log):
        assert wait_until(out.exists, 30), log.read_text()
        assert replicas(out) == "4"
        assert log.read_text().count("labels written") == 1  # one labelling, not the default's first
