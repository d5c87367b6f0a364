"""A fake `nvidia-smi` for the two settings a time-sliced claim changes: the compute mode and the
compute-policy timeslice (tests/unit/test_dra_sharing.py, tests/process/test_dra_config.py).

It takes the command lines NVIDIA's DRA driver runs (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1,
cmd/gpu-kubelet-plugin/nvlib.go `setComputeMode`, `setTimeSlice`): `-i <uuid> -c <mode>` and
`compute-policy -i <uuid> --set-timeslice <n>`, and, to read them back, `compute-policy -l`. The
state of each GPU it was installed with is kept in `nvidia-smi-state.json` beside it (what the
driver would hold), every command line in `nvidia-smi.log`; a GPU it does not know fails as the
real tool does ("No devices were found", exit status 6), and a `nvidia-smi-fail` file beside it
holding a UUID makes every command on that GPU fail (a GPU that refuses the setting). The
process tier runs it as a program; unit tests, which start no process, run the same code in
their own process through `runner`.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.helpers import REPO


def apply(argv: Sequence[str], state: dict[str, Any], failing: set[str]) -> tuple[int, str]:
    """One command line on the GPUs' `state` (changed in place): (exit status, output)."""
    policy = list(argv[:1]) == ["compute-policy"]
    args = list(argv[1:] if policy else argv)
    if policy and args == ["-l"]:
        return 0, "".join(f"{u} timeslice {g['timeslice']}\n" for u, g in sorted(state.items()))
    usage = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
    if len(args) != 4 or args[0] != "-i":
        return 2, usage
    uuid = args[1]
    if uuid not in state:
        return 6, "No devices were found\n"
    if uuid in failing:
        return 3, f"Unable to set the setting for GPU {uuid}: Not Supported\n"
    if policy and args[2] == "--set-timeslice" and args[3] in ("0", "1", "2", "3"):
        state[uuid]["timeslice"] = int(args[3])
        return 0, f"Set timeslice to {args[3]} for GPU {uuid}\n"
    if (
        not policy
        and args[2] == "-c"
        and args[3] in ("DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED", "0", "2", "3")
    ):
        state[uuid]["computeMode"] = args[3]
        return 0, f"Compute mode set to {args[3]} for GPU {uuid}.\n"
    return 2, usage


def run(directory: Path, argv: Sequence[str]) -> tuple[int, str]:
    """The fake in `directory` runs one command line (argv without the program): logged, then
    applied to the state file under its lock."""
    import fcntl

    with open(directory / "nvidia-smi.log", "a", encoding="utf-8") as log:
        log.write(" ".join(argv) + "\n")
    try:
        failing = set((directory / "nvidia-smi-fail").read_text(encoding="utf-8").split())
    except OSError:
        failing = set()
    with open(directory / "nvidia-smi-state.json", "r+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        gpus = json.load(handle)
        result = apply(argv, gpus, failing)
        handle.seek(0)
        handle.truncate()
        json.dump(gpus, handle)
    return result


def runner(directory: Path) -> Any:
    """A TimeSlicer runner that runs the fake in this process (unit tests start no process)."""

    def run_in_process(argv: Sequence[str], timeout: float) -> tuple[int, str]:
        assert Path(argv[0]) == directory / "nvidia-smi", argv
        return run(directory, argv[1:])

    return run_in_process


SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.smifake import run
code, output = run(Path(os.path.dirname(os.path.abspath(__file__))), sys.argv[1:])
sys.stdout.write(output)
sys.exit(code)
"""


def install(directory: Path, gpu_uuids: Sequence[str]) -> Path:
    """The fake as `<directory>/nvidia-smi`, every GPU at compute mode DEFAULT and timeslice 0."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n{SCRIPT.format(repo=REPO)}", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    state = {uuid: {"computeMode": "DEFAULT", "timeslice": 0} for uuid in gpu_uuids}
    (directory / "nvidia-smi-state.json").write_text(json.dumps(state), encoding="utf-8")
    return path


def state(directory: Path) -> dict[str, Any]:
    """Each GPU's {"computeMode", "timeslice"}, as the fake holds them now."""
    with open(directory / "nvidia-smi-state.json", encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def timeslices(directory: Path) -> dict[str, int]:
    return {uuid: gpu["timeslice"] for uuid, gpu in state(directory).items()}


def commands(directory: Path) -> list[str]:
    try:
        with open(directory / "nvidia-smi.log", encoding="utf-8") as fh:
            return fh.read().splitlines()
    except FileNotFoundError:
        return []


def fail_on(directory: Path, uuid: str) -> None:
    (directory / "nvidia-smi-fail").write_text(uuid, encoding="utf-8")


def path_with(directory: Path) -> str:
    """$PATH with the fake's directory first."""
    return os.pathsep.join([str(directory), os.environ.get("PATH", os.defpath)])
