"""A real worker process refuses a plan whose required IMEX channel is missing (worker/main.py): exit 78, one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import nodes
from tests.helpers import REPO, checkout_path

CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"


BARE_CHANNEL0_EXISTS = os.path.exists(CHANNEL0)


@pytest.mark.skipif(BARE_CHANNEL0_EXISTS, reason="this host has an IMEX channel 0")
def test_worker_with_missing_required_channel_exits_with_config_error(tmp_path: Path) -> None:
    """A real worker process whose plan requires a missing channel exits 78 (config error) with one clear line."""
    plan = nodes.imex_plan(str(tmp_path), required=True)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--resource", plan.resource, "--plan", str(plan_path),
         "--kubelet-socket", str(tmp_path / "kubelet.sock")],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": checkout_path()},
    )  # fmt: skip
    assert done.returncode == 78, done.stderr
    assert "cannot serve nvidia.com/gpu: requested IMEX channel channel0 does not exist" in done.stderr
    assert "Traceback" not in done.stderr
