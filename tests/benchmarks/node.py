"""The nodes that the start, memory and idle figures run on, as issue 30 compares them.

NVIDIA's figures were taken on NVIDIA's mock NVML with its h100 profile (8 GPUs). The like for
like here is `gpuvisor run` on the real nvidia-ml-py binding over the project's fake
libnvidia-ml serving that profile (or the simulator's dgx-h100 when NVIDIA's profiles are not
beside the checkout): what a node runs, the simulator and its YAML profiles not loaded. The MIG
node (five resources) is mig-a100 with the mixed strategy, over the same library. Where no C
compiler can build the library (none is there, or it refuses the sources), the simulator's
profiles stand in and the notes say why.

The library is built once per run (the first benchmark that asks) and removed when the runner
exits.

On a GPU node, `python -m tests.benchmarks --real-gpu` (which sets `REAL_GPU_ENV`) runs the
one-resource node on the node's own libnvidia-ml and GPUs instead, as a DaemonSet's pod would:
the start and memory figures issue 30 quotes from a real H100 are then the reference (it gives
no idle figure there, so idle CPU keeps the mock's). A start counts when every GPU NVML reports
is healthy at the stand-in, so the node's GPUs must all be healthy. The five-resource node stays
the fake mig-a100: the benchmark never changes a GPU's settings, so it makes no MIG layout.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests import fakenvml
from tests.harness import SimNode, run_python

REAL_GPU_ENV = "GPUVISOR_BENCH_REAL_GPU"  # "1": the one-resource node is this node's own GPUs

GPU = "nvidia.com/gpu"
MIG_RESOURCES = [
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/mig-1g.10gb.me",
    "nvidia.com/mig-2g.20gb",
    "nvidia.com/mig-3g.40gb",
]
MIG_ARGS = ["--mig-strategy", "mixed"]


@dataclass(frozen=True)
class Kind:
    """How to start the one-resource node: `profile` for --simulate (None: real NVML in `env`)."""

    profile: str | None
    env: dict[str, str]
    what: str
    gpus: int = 8

    def node(self, args: Sequence[str] = ()) -> SimNode:
        return SimNode(self.profile, args=args, env=dict(self.env))  # metrics off, as NVIDIA's


_cleanup = contextlib.ExitStack()
atexit.register(_cleanup.close)


@functools.cache
def _library() -> Path | str:
    """The folder of the fake library, built for this run; else why it cannot be had here (no
    compiler or header, or the compiler refused it: its error line)."""
    reason = fakenvml.skip_reason()
    if reason is not None:
        return reason
    try:
        return _cleanup.enter_context(fakenvml.built())
    except fakenvml.BuildError as exc:
        return "its build failed: " + build_error_line(str(exc))


def build_error_line(words: str) -> str:
    """The line of a compiler's output that says why: its first `error:` line (GCC's last line
    under -Werror says only that warnings were errors), else its first non-empty line."""
    lines = [line.strip() for line in words.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[0] if lines else "no output")


def library_missing() -> str | None:
    """Why the fake library is not used in this run, or None when it is."""
    found = _library()
    return found if isinstance(found, str) else None


def _real(name: str, what: str) -> tuple[dict[str, str], str] | None:
    """The environment of a supervisor on the real binding over the fake library serving `name`."""
    libdir = _library()
    if isinstance(libdir, str):
        return None
    tmp = _cleanup.enter_context(tempfile.TemporaryDirectory(prefix="gvbench-node-"))
    fake = fakenvml.FakeNode(tmp, name)
    return fake.environ(libdir), f"{what}, real nvidia-ml-py over the fake libnvidia-ml"


def real_gpu() -> bool:
    """Was the run asked to use this node's own GPUs (`--real-gpu`)?"""
    return os.environ.get(REAL_GPU_ENV) == "1"


# What the probe prints: how many GPUs NVML counts, the first one's name, the driver's version.
_PROBE = """
import json, pynvml
from supervisor.node.nvml import text
pynvml.nvmlInit()
n = pynvml.nvmlDeviceGetCount()
name = text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))) if n else ""
print(json.dumps({"count": n, "name": name, "driver": text(pynvml.nvmlSystemGetDriverVersion())}))
"""


def node_gpus(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(count, description) of this node's GPUs, as NVML reports them, read in a fresh
    interpreter (with `env`, default `child_env()`) so that the runner itself holds no NVML.
    Raises RuntimeError with NVML's reason when there is no driver or no GPU."""
    proc = run_python(_PROBE, env)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"--real-gpu: this node's NVML could not be read: {reason}")
    found = json.loads(proc.stdout)
    if found["count"] < 1:
        raise RuntimeError("--real-gpu: NVML reports no GPU on this node")
    return found["count"], f"{found['count']} x {found['name']} (driver {found['driver']})"


@functools.cache
def one_resource() -> Kind:
    """This node's GPUs under `--real-gpu`; else NVIDIA's h100 over the real binding when it can
    be had, else the simulator's dgx-h100."""
    if real_gpu():
        count, what = node_gpus()
        return Kind(None, {}, f"this node's {what}, its own libnvidia-ml", gpus=count)
    name = "h100" if "h100" in fakenvml.mock_profiles() else "dgx-h100"
    real = _real(name, ("NVIDIA's h100 profile" if name == "h100" else "dgx-h100") + ", 8 GPUs")
    if real is None:
        return Kind("dgx-h100", {}, f"simulated dgx-h100, 8 GPUs (no fake libnvidia-ml: {library_missing()})")
    return Kind(None, real[0], real[1])


@functools.cache
def five_resources() -> Kind:
    """mig-a100 with the mixed strategy (five resources, five workers), over the real binding
    when it can be had, else on the simulator."""
    real = _real("mig-a100", "mig-a100 --mig-strategy mixed")
    if real is None:
        return Kind(
            "mig-a100",
            {},
            f"simulated mig-a100 --mig-strategy mixed (no fake libnvidia-ml: {library_missing()})",
        )
    return Kind(None, real[0], real[1])


def mig_node(args: Sequence[str] = ()) -> SimNode:
    """The five-resource node (`five_resources()`), not started."""
    return five_resources().node([*MIG_ARGS, *args])


def listed(sim: SimNode, resource: str) -> bool:
    """Is `resource` registered at the stand-in, connected, with its device list sent?"""
    res = sim.kubelet.resource(resource)
    ep = res.endpoint if res is not None else None
    return ep is not None and ep.connected and ep.updates > 0
