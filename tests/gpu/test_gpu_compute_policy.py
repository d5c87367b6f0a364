"""The nvidia-smi command lines a time-sliced DRA claim runs (worker.dra.sharing.TimeSlicer), checked
against the real tool, read-only: nothing here changes a GPU's compute mode or timeslice.

Run where an NVIDIA driver and GPU are present (`pytest -m gpu`); elsewhere each test skips with
the reason (tests/gpu/conftest.py `driver`). The fake that stands in for nvidia-smi in the other
tiers (tests/smifake.py) takes the same command lines; this is where they meet the real one.
"""

from __future__ import annotations

import shutil
import subprocess

from tests.gpu.conftest import DriverGpu
from worker.dra.sharing import find_nvidia_smi


def smi(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("nvidia-smi")
    assert binary is not None
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_worker_finds_the_nvidia_smi_on_path(driver: list[DriverGpu]) -> None:
    """find_nvidia_smi picks the nvidia-smi the shell would run (PATH first, as NVIDIA's plugin
    runs the one from its driver root)."""
    assert find_nvidia_smi() == shutil.which("nvidia-smi")


def test_the_real_tool_takes_the_options_the_worker_runs(driver: list[DriverGpu]) -> None:
    """`compute-policy ... --set-timeslice` and `-c` (the compute mode) are options of this driver's
    nvidia-smi, as NVIDIA's nvlib.go runs them; only the help is read."""
    policy = smi("compute-policy", "-h")
    assert "--set-timeslice" in policy.stdout + policy.stderr, policy.stdout[-2000:]
    main = smi("-h")
    assert "--compute-mode" in main.stdout and "-c" in main.stdout


def test_each_gpus_compute_mode_reads_and_is_one_the_fake_knows(driver: list[DriverGpu]) -> None:
    """The compute mode of every GPU reads back (what a time-sliced claim sets to Default first);
    the values are those nvidia-smi's `-c` takes, which the fake accepts."""
    out = smi("--query-gpu=uuid,compute_mode", "--format=csv,noheader")
    assert out.returncode == 0, out.stderr
    modes = dict(line.split(", ", 1) for line in out.stdout.strip().splitlines())
    assert set(modes) == {g.uuid for g in driver}
    assert set(modes.values()) <= {"Default", "Exclusive_Process", "Prohibited"}
