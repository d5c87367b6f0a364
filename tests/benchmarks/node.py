"""The nodes that the start, memory and idle figures run on, as issue 30 compares them.

NVIDIA's figures were taken on NVIDIA's mock NVML with its h100 profile (8 GPUs). The like for
like here is `gpuvisor run` on the real nvidia-ml-py binding over the project's fake
libnvidia-ml serving that profile (or the simulator's dgx-h100 when NVIDIA's profiles are not
beside the checkout): what a node runs, the simulator and its YAML profiles not loaded. The MIG
node (five resources) is mig-a100 with the mixed strategy, over the same library. Where no C
compiler can build the library, the simulator's profiles stand in and the notes say so.

The library is built once per run (the first benchmark that asks) and removed when the runner
exits.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests import fakenvml
from tests.harness import SimNode

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
def _library() -> Path | None:
    if fakenvml.skip_reason() is not None:
        return None
    return _cleanup.enter_context(fakenvml.built())


def _real(name: str, what: str) -> tuple[dict[str, str], str] | None:
    """The environment of a supervisor on the real binding over the fake library serving `name`."""
    libdir = _library()
    if libdir is None:
        return None
    tmp = _cleanup.enter_context(tempfile.TemporaryDirectory(prefix="gvbench-node-"))
    fake = fakenvml.FakeNode(tmp, name)
    return fake.environ(libdir), f"{what}, real nvidia-ml-py over the fake libnvidia-ml"


@functools.cache
def one_resource() -> Kind:
    """NVIDIA's h100 over the real binding when it can be had, else the simulator's dgx-h100."""
    name = "h100" if "h100" in fakenvml.mock_profiles() else "dgx-h100"
    real = _real(name, ("NVIDIA's h100 profile" if name == "h100" else "dgx-h100") + ", 8 GPUs")
    if real is None:
        return Kind(
            "dgx-h100", {}, f"simulated dgx-h100, 8 GPUs (no fake libnvidia-ml: {fakenvml.skip_reason()})"
        )
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
            f"simulated mig-a100 --mig-strategy mixed (no fake libnvidia-ml: {fakenvml.skip_reason()})",
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
