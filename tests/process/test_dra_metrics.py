"""End to end: the DRA request metrics of a real supervisor and DRA worker on a simulated node, the
kubelet's calls made by the DRA kubelet stand-in (supervisor/sim/drakubelet.py: v1 DRAPlugin over
the service socket, one call per pod and driver, as the kubelet's DRA manager batches the claims in
kubernetes pkg/kubelet/cm/dra/manager.go `prepareResources` / `unprepareResources`), /metrics read
from the supervisor.

The families are NVIDIA's kubelet plugin's under gpuvisor's prefix (kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1, pkg/metrics/dra_requests.go: requests_total, request_duration_seconds, requests_inflight,
prepared_devices, node_prepare_errors_total, node_unprepare_errors_total); gpuvisor adds a `result`
label to the count and the histogram. An MPS claim (NVIDIA's demo gpu-test-mps, tests/draconfigs.py)
has its daemon started by the supervisor: tests/mpsfake.py's fake `nvidia-cuda-mps-control`.
"""

from __future__ import annotations

from pathlib import Path

from tests import draconfigs as dc
from tests import mpsfake
from tests.dranode import DRIVER, POOL, DraNode
from tests.harness import metrics_url, sample
from tests.helpers import short_tmpdir, wait_until


def test_prepare_and_unprepare_are_counted_at_metrics() -> None:
    """A plain claim and an MPS claim prepared, a claim on a device the first holds refused, then
    all three unprepared: /metrics counts 2 prepares ok and 1 error (`prepare_devices`), 3
    unprepares ok, the histogram's counts match, nothing is in flight after, and the prepared
    GPUs read 2 while the claims are prepared and 0 once they are not."""
    with short_tmpdir("gvdm") as base:
        fake = mpsfake.install(Path(base))
        args = (
            "--mode", "dra", "--metrics-address", "127.0.0.1:0",
            "--mps-root", f"{base}/mps", "--mps-control-binary", str(fake),
        )  # fmt: skip
        try:
            with DraNode("pcie-l4", args=args) as node:
                node.wait_registered()
                url = metrics_url(node)
                labels = {"driver": DRIVER}

                def reads(name: str, want: float, **more: str) -> bool:
                    return sample(url, name, **labels, **more) == want

                def wait(name: str, want: float, **more: str) -> None:
                    ok = wait_until(lambda: reads(name, want, **more), 20, interval=0.1)
                    assert ok, (
                        f"{name}{more} != {want}: {sample(url, name, **labels, **more)}\n{node.log()[-3000:]}"
                    )

                # Before any call: every series is there at 0 (NVIDIA's InitializeDRARequestMetrics).
                wait("gpuvisor_dra_requests_total", 0, operation="prepare", result="ok")
                assert reads("gpuvisor_dra_requests_inflight", 0, operation="prepare")

                plain = node.claim("plain", ["gpu-0"])
                taken = node.claim("taken", ["gpu-0"])  # gpu-0 is held by `plain`: refused
                mps = dc.gpu_test_mps("gpu-1")
                node.claims.put(mps.to_json(POOL))
                shared = (mps.namespace, mps.name, mps.uid)
                for ref, fails in ((plain, False), (taken, True), (shared, False)):
                    answer = node.dra.prepare(DRIVER, [ref], timeout=30).claims[ref[2]]
                    assert bool(answer.error) == fails, answer.error

                wait("gpuvisor_dra_requests_total", 2, operation="prepare", result="ok")
                assert reads("gpuvisor_dra_requests_total", 1, operation="prepare", result="error")
                assert reads("gpuvisor_dra_node_prepare_errors_total", 1, error_type="prepare_devices")
                assert reads(
                    "gpuvisor_dra_request_duration_seconds_count", 2, operation="prepare", result="ok"
                )
                assert reads(
                    "gpuvisor_dra_request_duration_seconds_count", 1, operation="prepare", result="error"
                )
                assert reads("gpuvisor_dra_requests_inflight", 0, operation="prepare")
                assert reads("gpuvisor_dra_prepared_devices", 2, node=POOL, device_type="gpu")
                assert reads("gpuvisor_dra_prepared_devices", 0, node=POOL, device_type="mig")

                for ref in (plain, taken, shared):
                    assert not node.dra.unprepare(DRIVER, [ref], timeout=30).claims[ref[2]].error
                wait("gpuvisor_dra_requests_total", 3, operation="unprepare", result="ok")
                assert reads("gpuvisor_dra_requests_total", 0, operation="unprepare", result="error")
                assert reads(
                    "gpuvisor_dra_request_duration_seconds_count", 3, operation="unprepare", result="ok"
                )
                assert reads("gpuvisor_dra_requests_inflight", 0, operation="unprepare")
                wait("gpuvisor_dra_prepared_devices", 0, node=POOL, device_type="gpu")
                assert sample(url, "gpuvisor_worker_dra_inflight_prepare", resource=DRIVER) is None
        finally:
            mpsfake.kill_daemons(Path(base))  # only the daemons this test's fake started
