"""`gpuvisor labels` as a process publishing a NodeFeature through a fake Kubernetes API server."""

from __future__ import annotations

from tests.kubeapi import RunningApiServer
from tests.labelsrun import labels_env, run_labels

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
