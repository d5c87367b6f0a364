"""A fake `nvidia-smi` for the two settings a time-sliced claim changes: the compute mode and the
compute-policy timeslice (tests/unit/test_dra_sharing.py, tests/process/test_dra_config.py).

It takes the command lines NVIDIA's DRA driver runs (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1,
cmd/gpu-kubelet-plugin/nvlib.go `setComputeMode`, `setTimeSlice`): `-i <uuid> -c <mode>` and
`compute-policy -i <uuid> --set-timeslice <n>`, and, to read them back, `compute-policy -l`. The
state of each GPU it was installed with is kept in `nvidia-smi-state.json` beside it (what the
driver would hold), every command line in `nvidia-smi.log`; a GPU it does not know fails as the
real tool does ("No devices were found", exit status 6), and a `nvidia-smi-fail` file beside it
holding a UUID makes every command on that GPU fail (a GPU that refuses the setting).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FAKE_SMI = r"""
import fcntl, json, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
STATE = os.path.join(HERE, "nvidia-smi-state.json")


def main(argv):
    with open(os.path.join(HERE, "nvidia-smi.log"), "a") as log:
        log.write(" ".join(argv) + "\n")
    with open(STATE, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        state = json.load(handle)
        code = apply(argv, state)
        handle.seek(0)
        handle.truncate()
        json.dump(state, handle)
    return code


def failing():
    try:
        with open(os.path.join(HERE, "nvidia-smi-fail")) as handle:
            return set(handle.read().split())
    except OSError:
        return set()


def apply(argv, state):
    policy = argv[:1] == ["compute-policy"]
    args = argv[1:] if policy else argv
    if policy and args == ["-l"]:
        for uuid, gpu in sorted(state.items()):
            print("%s timeslice %d" % (uuid, gpu["timeslice"]))
        return 0
    if len(args) != 4 or args[0] != "-i":
        print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
        return 2
    uuid = args[1]
    if uuid not in state:
        print("No devices were found")
        return 6
    if uuid in failing():
        print("Unable to set the setting for GPU %s: Not Supported" % uuid)
        return 3
    if policy and args[2] == "--set-timeslice" and args[3] in ("0", "1", "2", "3"):
        state[uuid]["timeslice"] = int(args[3])
        print("Set timeslice to %s for GPU %s" % (args[3], uuid))
        return 0
    if not policy and args[2] == "-c" and args[3] in ("DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED", "0", "2", "3"):
        state[uuid]["computeMode"] = args[3]
        print("Compute mode set to %s for GPU %s." % (args[3], uuid))
        return 0
    print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    return 2


sys.exit(main(sys.argv[1:]))
"""


def install(directory: Path, gpu_uuids: Sequence[str]) -> Path:
    """The fake as `<directory>/nvidia-smi`, every GPU at compute mode DEFAULT and timeslice 0."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n{FAKE_SMI}", encoding="utf-8")
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
