"""`gpuvisor labels` as a process publishing a NodeFeature through a fake Kubernetes API server."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer
from tests.labelsrun import labels_env, run_labels, start_labels

NS, NODE, POD = "gpuvisor", "gpu-node-1", "gpuvisor-labels-x7k2p"
NAME = "nvidia-features-for-gpu-node-1"  # output.go:115, 130


def test_gpuvisor_labels_publishes_through_the_api_by_default(api: RunningApiServer) -> None:
    """`gpuvisor labels --oneshot` with GFD's pod env (NODE_NAME, NAMESPACE, POD_NAME) and KUBECONFIG creates the
    object with the labels it computed (the NodeFeature API is GFD's default, main.go:102)."""
    api.state.add_daemonset_pod(NS, POD)
    env = labels_env(KUBECONFIG=str(api.kubeconfig), NODE_NAME=NODE, NAMESPACE=NS, POD_NAME=POD)
    args = ("--simulate", "dgx-h100", "--oneshot")
    proc = run_labels(*args, "--machine-type-file", "", env=env)
    assert proc.returncode == 0, proc.stderr
    labels = api.state.node_features[(NS, NAME)]["spec"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.clique"] == "5b3ce1a2-7d0e-4c4f-9a51-2f1d8e6c0b47.1"
    assert int(labels["nvidia.com/gfd.timestamp"]) > 0
    assert api.state.errors == []
    proc = run_labels(*args, "--machine-type-file", "", "--node-name", "", env={**env, "NODE_NAME": ""})
    assert proc.returncode == 78 and "needs the node name" in proc.stderr


def test_sigterm_ends_the_labeller_at_once_against_a_frozen_api_server(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """A real kube-apiserver that froze held the old client ~60 s per pass and a SIGTERM 56.6 s:
    now the call in flight is aborted and the process exits 0 at once."""
    api.state.add_daemonset_pod(NS, POD)
    env = labels_env(KUBECONFIG=str(api.kubeconfig), NODE_NAME=NODE, NAMESPACE=NS, POD_NAME=POD)
    args = ("--simulate", "dgx-h100", "--sleep-interval", "1s", "--machine-type-file", "")
    proc = start_labels(*args, log=tmp_path / "labels.log", env=env)
    try:
        assert wait_until(lambda: (NS, NAME) in api.state.node_features, 30), (
            tmp_path / "labels.log"
        ).read_text()
        api.state.freeze()
        calls = len(api.state.calls())
        assert wait_until(lambda: len(api.state.calls()) > calls, 10)  # the next pass hangs on the server
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 5.0
        assert "labelling failed" not in (tmp_path / "labels.log").read_text()  # a stop is no failure
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
