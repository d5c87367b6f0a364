"""A short kill-and-recover chaos run is part of the suite: about 50 seeded faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, checkout_path


@pytest.mark.slow
def test_short_chaos_run_survives_every_fault(tmp_path: object) -> None:
    """50 seeded random faults (kills, hangs, kubelet restarts, XIDs, reloads, MIG changes) all recover with every invariant held."""
    out = os.path.join(str(tmp_path), "chaos.json")
    env = dict(os.environ, PYTHONPATH=checkout_path())
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos", "--seed", "20261122", "--faults", "50", "--json", out],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    with open(out) as fh:
        doc = json.load(fh)
    assert doc["ok"] and doc["faults"] == 50
    assert len(doc["by_kind"]) >= 8, "the run should exercise most fault kinds"
