"""gpuvisor against the kubelet's own device manager (Kubernetes v1.32.10), one case per scenario.

`../shared/real-kubelet/run.sh` runs a Go test binary built from the kubelet's device manager
package (registration server, plugin client, ListAndWatch, capacity, GetPreferredAllocation and
Allocate, checkpoint) with scenarios that start the `gpuvisor` installed beside this Python. The
stand-in in `supervisor/sim/kubelet.py` is ours and can agree with our own mistakes; this is
theirs. A failure shows the scenario's line and the end of the device manager's log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO

HARNESS = os.environ.get("GPUVISOR_REAL_KUBELET") or os.path.join(
    os.path.dirname(REPO), "shared", "real-kubelet", "run.sh"
)
GPUVISOR = os.path.join(os.path.dirname(sys.executable), "gpuvisor")

SCENARIOS = [
    "1Register",
    "2Allocate",
    "3KubeletRestart",
    "4Health",
    "5MigMixed",
    "6Timeslicing",
    "7WorkerKill",
    "ExtraRestartStorm",
    "ExtraKillAllWorkers",
    "ExtraSocketDelete",
]


def _skip_reason() -> str | None:
    if not os.path.isfile(HARNESS):
        return f"the kubelet's device manager harness is not here ({HARNESS}; set GPUVISOR_REAL_KUBELET)"
    if shutil.which("xz") is None:
        return "xz is not installed (it unpacks the harness binary; .ci/run installs it)"
    if not os.access(GPUVISOR, os.X_OK):
        return f"gpuvisor is not installed beside this Python ({GPUVISOR})"
    return None


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_passes_with_the_kubelets_device_manager(scenario: str) -> None:
    """The kubelet's real device manager and gpuvisor: the scenario's checks all hold."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(
        ["bash", HARNESS, GPUVISOR, f"{scenario}$"], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed, 0 failed" in out, out[-8000:]
    print("\n" + "\n".join(line for line in out.splitlines() if line.startswith("SCENARIO")))
