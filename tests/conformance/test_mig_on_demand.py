"""MIG on demand, one scenario at a time, through both NVML doubles: the Python simulator in this
process and the real `nvidia-ml-py` binding over the project's C libnvidia-ml in a child.

Each scenario is a list of steps written once: binding calls as expressions (the driver's scope,
tests/fakenvml/driver.py: `pynvml`, `gpu(i)`, `dev(uuid)`, `placement`, `gpu_instances`, ... ; over
the simulator the same names, with the simulator as `pynvml`) and control commands (`set_processes`,
`reset`, `fail`: the simulator's fault injection and the library's control file). Every step's
answer (a value or an NVML return code) is checked against what NVML's rules say, on both
backends; and the two backends' whole transcripts must be equal, step for step. The rules and
their sources are in supervisor/sim/nvml/migcreate.py (nvml.h, NVIDIA's DRA driver v0.4.1).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from supervisor.sim.nvml import Simulator
from supervisor.sim.nvml.base import SimComputeInstanceHandle, SimDeviceHandle, SimGpuInstanceHandle
from supervisor.sim.nvml.config import NodeSpec, parse_spec
from supervisor.sim.nvml.mig import created_mig_uuid
from tests.fakenvml import Driver, FakeNode, NvmlFailure, driver
from tests.helpers import REPO

OK = pynvml.NVML_SUCCESS
INVALID = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
IN_USE = pynvml.NVML_ERROR_IN_USE
NO_ROOM = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
RESET_REQUIRED = pynvml.NVML_ERROR_RESET_REQUIRED

A100_ON, A100_OFF, H100, L4 = 0, 1, 2, 3
UUIDS = [
    "GPU-6e0c1f2a-4b3d-4c5e-8f70-9a1b2c3d4e01",
    "GPU-6e0c1f2a-4b3d-4c5e-8f70-9a1b2c3d4e02",
    "GPU-6e0c1f2a-4b3d-4c5e-8f70-9a1b2c3d4e03",
    "GPU-6e0c1f2a-4b3d-4c5e-8f70-9a1b2c3d4e04",
]
LAYOUT_UUID = "MIG-6e0c1f2a-0000-4c5e-8f70-9a1b2c3d4e01"
NODE = f"""
name: mig-on-demand
driver_version: "550.54.15"
gpus:
  - {{name: NVIDIA A100-SXM4-80GB, uuid: {UUIDS[0]}, minor: 0, pci_bus_id: "00000000:07:00.0",
      memory_mib: 81920, numa_node: 0, compute_capability: [8, 0],
      mig: {{enabled: true, devices: [{{profile: 3g.40gb, placement: 0, uuid: {LAYOUT_UUID}}}]}}}}
  - {{name: NVIDIA A100-SXM4-80GB, uuid: {UUIDS[1]}, minor: 1, pci_bus_id: "00000000:0F:00.0",
      memory_mib: 81920, numa_node: 0, compute_capability: [8, 0]}}
  - {{name: NVIDIA H100 80GB HBM3, uuid: {UUIDS[2]}, minor: 2, pci_bus_id: "00000000:47:00.0",
      memory_mib: 81559, numa_node: 1, compute_capability: [9, 0]}}
  - {{name: NVIDIA L4, uuid: {UUIDS[3]}, minor: 3, pci_bus_id: "00000000:4E:00.0",
      memory_mib: 23034, numa_node: 1, compute_capability: [8, 9]}}
topology: {{default_ancestor: SYSTEM}}
"""


def node_spec() -> NodeSpec:
    """An A100 with MIG on (one 3g.40gb at slices 0-3), an A100 and an H100 with MIG off, an L4."""
    return parse_spec(NODE, "mig-on-demand (test)")


def created(gpu: int, n: int, gi: int, profile: str) -> str:
    return created_mig_uuid(UUIDS[gpu], n, gi, 0, profile)


# ------------------------------------------------------------------ the two backends


def _sim_plain(value: Any) -> Any:
    """The simulator's answers in the driver's JSON form: handles as "<handle>", info objects as
    the dicts of the binding's structures with the same fields."""
    if isinstance(value, (SimDeviceHandle, SimGpuInstanceHandle, SimComputeInstanceHandle)):
        return "<handle>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _sim_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_sim_plain(v) for v in value]
    return driver.plain(value)


class SimBackend:
    """The simulator, called with the driver's expressions (the same scope names)."""

    def __init__(self, spec: NodeSpec) -> None:
        self.sim = sim = Simulator(spec)
        self.control: Any = sim

        def listed(call: Callable[..., Any], owner: Any, profile: int) -> list[Any]:
            out: list[Any] = []
            call(owner, profile, out, ctypes.byref(ctypes.c_uint(8)))
            return out

        self.scope: dict[str, Any] = {
            "pynvml": sim,
            "ctypes": ctypes,
            "gpu": sim.nvmlDeviceGetHandleByIndex,
            "dev": sim.nvmlDeviceGetHandleByUUID,
            "placement": driver.placement,
            "placements": functools.partial(driver.placements, nvml=sim),
            "mig_uuids": functools.partial(driver.mig_uuids, nvml=sim),
            "gpu_instances": functools.partial(listed, sim.nvmlDeviceGetGpuInstances),
            "compute_instances": functools.partial(listed, sim.nvmlGpuInstanceGetComputeInstances),
        }

    def eval(self, expression: str) -> Any:
        try:
            return _sim_plain(eval(expression, self.scope))  # the test's own expressions
        except pynvml.NVMLError as exc:
            raise NvmlFailure(expression, int(exc.value)) from None


class LibBackend:
    """The real binding over the C library in a child process."""

    def __init__(self, node: FakeNode, d: Driver) -> None:
        self.control: Any = node.control
        self.d = d

    def eval(self, expression: str) -> Any:
        return self.d.eval(expression)


class Steps:
    """Runs a scenario's steps on one backend, checking each answer and keeping a transcript."""

    def __init__(self, backend: SimBackend | LibBackend) -> None:
        self.backend = backend
        self.transcript: list[tuple[str, Any]] = []

    def answer(self, expression: str) -> tuple[int, Any]:
        try:
            value = self.backend.eval(expression)
        except NvmlFailure as exc:
            self.transcript.append((expression, ("nvml", exc.code)))
            return exc.code, None
        self.transcript.append((expression, value))
        return OK, value

    def ok(self, expression: str, expected: Any = ...) -> Any:
        """The expression succeeds (with `expected` as its value, when given)."""
        code, value = self.answer(expression)
        assert code == OK, f"{expression} -> NVML error {code}"
        if expected is not ...:
            assert value == expected, expression
        return value

    def fails(self, expression: str, code: int) -> None:
        """The expression answers NVML return code `code`."""
        got, value = self.answer(expression)
        assert got == code, f"{expression} -> {got} ({value!r}), expected {code}"

    def control(self, name: str, *args: Any) -> None:
        getattr(self.backend.control, name)(*args)
        self.transcript.append((f"control {name}{args}", None))


# ------------------------------------------------------------------ the scenarios


def placements_and_capacity(s: Steps) -> None:
    """Placements are every start of a profile, whether MIG is on or not; capacity counts what
    still fits beside the instances; a GPU without MIG answers NOT_SUPPORTED; an unknown profile
    id is INVALID_ARGUMENT."""
    s.ok(f"placements(gpu({A100_ON}), 19)", [[k, 1] for k in range(7)])
    s.ok(f"placements(gpu({A100_ON}), 9)", [[0, 4], [4, 4]])
    s.ok(f"placements(gpu({A100_OFF}), 0)", [[0, 8]])
    s.fails(f"placements(gpu({A100_ON}), 99)", INVALID)
    s.fails(f"placements(gpu({L4}), 19)", NOT_SUPPORTED)
    s.ok(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu({A100_ON}), 19)", 3)  # starts 4, 5, 6
    s.ok(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu({A100_ON}), 9)", 1)
    s.ok(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu({A100_ON}), 5)", 0)  # 4g starts at 0 only
    s.fails(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu({A100_OFF}), 19)", NOT_SUPPORTED)
    s.fails(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu({A100_ON}), 99)", INVALID)


def create_at_placement_and_overlap(s: Steps) -> None:
    """A GPU instance is made at a free placement; one overlapping an instance, or beyond the
    profile's count, is INSUFFICIENT_RESOURCES; a placement the profile does not have is
    INVALID_ARGUMENT; MIG off or no MIG is NOT_SUPPORTED; an injected failure fails one call."""
    g = f"gpu({A100_ON})"
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(0, 4))", NO_ROOM)
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 19, placement(2, 1))", NO_ROOM)
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 19, placement(7, 1))", INVALID)
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 2))", INVALID)
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 99, placement(4, 4))", INVALID)
    s.fails(
        f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu({A100_OFF}), 9, placement(4, 4))", NOT_SUPPORTED
    )
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu({L4}), 9, placement(4, 4))", NOT_SUPPORTED)
    s.control("fail", "nvmlDeviceCreateGpuInstanceWithPlacement", pynvml.NVML_ERROR_UNKNOWN, 1)
    s.fails(
        f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 4))", pynvml.NVML_ERROR_UNKNOWN
    )
    s.ok(f"(gi := pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 4)))", "<handle>")
    s.ok(
        "pynvml.nvmlGpuInstanceGetInfo(gi)",
        {"device": "<handle>", "id": 2, "profileId": 9, "placement": {"start": 4, "size": 4}},
    )
    s.ok(f"pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById({g}, 2)).id", 2)
    s.ok(f"sorted(pynvml.nvmlGpuInstanceGetInfo(h).id for h in gpu_instances({g}, 9))", [1, 2])
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 4))", NO_ROOM)
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstance({g}, 19)", NO_ROOM)  # no slice is free
    s.ok(f"pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity({g}, 19)", 0)
    # Without a compute instance it is no MIG device yet.
    s.ok(f"mig_uuids({g})", [LAYOUT_UUID])


def compute_instance_makes_a_mig_device(s: Steps) -> None:
    """The compute instance spanning a GPU instance is the one creatable (another profile is
    NOT_SUPPORTED, a second one INSUFFICIENT_RESOURCES); it is a MIG device everywhere: by
    index, by UUID, its memory, name, attributes and GI/CI ids."""
    g = f"gpu({A100_ON})"
    s.ok(f"(gi := pynvml.nvmlDeviceCreateGpuInstance({g}, 9))", "<handle>")  # the free placement: 4
    s.ok("pynvml.nvmlGpuInstanceGetInfo(gi).placement", {"start": 4, "size": 4})
    s.ok("pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0).sliceCount", 3)
    s.ok("pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 2)", 1)
    s.fails("pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)", NOT_SUPPORTED)
    s.fails("pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 99)", INVALID)
    s.ok("(ci := pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 2))", "<handle>")
    s.fails("pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)", NO_ROOM)
    s.ok("pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 2)", 0)
    uuid = created(A100_ON, 1, 2, "3g.40gb")
    s.ok(f"mig_uuids({g})", [LAYOUT_UUID, uuid])
    info = s.ok("pynvml.nvmlComputeInstanceGetInfo(ci)")
    assert (info["id"], info["profileId"], info["placement"]) == (0, 2, {"start": 0, "size": 3})
    s.ok("pynvml.nvmlDeviceGetUUID(pynvml.nvmlComputeInstanceGetInfo(ci).device)", uuid)
    s.ok("len(compute_instances(gi, 2))", 1)
    s.ok("pynvml.nvmlComputeInstanceGetInfo(pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)).id", 0)
    s.fails("pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, 1)", NOT_FOUND)
    s.ok(f"pynvml.nvmlDeviceGetMemoryInfo(dev('{uuid}')).total", 40192 * 1024 * 1024)
    s.ok(f"pynvml.nvmlDeviceGetName(dev('{uuid}'))", "NVIDIA A100-SXM4-80GB MIG 3g.40gb")
    s.ok(f"pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetMigDeviceHandleByIndex({g}, 1))", 2)
    s.ok(f"pynvml.nvmlDeviceGetComputeInstanceId(dev('{uuid}'))", 0)
    s.ok(f"pynvml.nvmlDeviceGetAttributes(dev('{uuid}')).multiprocessorCount", 42)
    s.ok(
        f"pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(dev('{uuid}')))",
        UUIDS[A100_ON],
    )


def destroy_order_and_in_use(s: Steps) -> None:
    """A GPU instance holding a compute instance, and a compute instance with processes, are
    IN_USE; destroyed in order they go, their handles go stale (INVALID_ARGUMENT), their MIG device
    is NOT_FOUND, and an instance made again at the same place gets a new UUID."""
    g = f"gpu({A100_ON})"
    s.ok(f"(gi := pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 4)))", "<handle>")
    s.ok("(ci := pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 2))", "<handle>")
    first = created(A100_ON, 1, 2, "3g.40gb")
    s.ok(f"(mig := dev('{first}'))", "<handle>")
    s.fails("pynvml.nvmlGpuInstanceDestroy(gi)", IN_USE)
    s.control("set_processes", first, 1)
    s.fails("pynvml.nvmlComputeInstanceDestroy(ci)", IN_USE)
    s.control("set_processes", first, 0)
    s.ok("pynvml.nvmlComputeInstanceDestroy(ci)", OK)
    s.fails("pynvml.nvmlComputeInstanceGetInfo(ci)", INVALID)
    s.fails("pynvml.nvmlComputeInstanceDestroy(ci)", INVALID)
    s.fails("pynvml.nvmlDeviceGetUUID(mig)", NOT_FOUND)
    s.fails(f"dev('{first}')", NOT_FOUND)
    s.ok(f"mig_uuids({g})", [LAYOUT_UUID])
    s.ok("pynvml.nvmlGpuInstanceDestroy(gi)", OK)
    s.fails("pynvml.nvmlGpuInstanceGetInfo(gi)", INVALID)
    s.fails(f"pynvml.nvmlDeviceGetGpuInstanceById({g}, 2)", NOT_FOUND)
    s.ok(f"(again := pynvml.nvmlDeviceCreateGpuInstanceWithPlacement({g}, 9, placement(4, 4)))", "<handle>")
    s.fails("pynvml.nvmlGpuInstanceGetInfo(gi)", INVALID)  # the old handle names the old instance
    s.ok("pynvml.nvmlGpuInstanceCreateComputeInstance(again, 2)", "<handle>")
    s.ok(f"mig_uuids({g})", [LAYOUT_UUID, created(A100_ON, 2, 2, "3g.40gb")])
    # The layout's own instance is destroyed the same way.
    s.ok(f"(lgi := pynvml.nvmlDeviceGetGpuInstanceById({g}, 1))", "<handle>")
    s.ok("pynvml.nvmlComputeInstanceDestroy(pynvml.nvmlGpuInstanceGetComputeInstanceById(lgi, 0))", OK)
    s.ok("pynvml.nvmlGpuInstanceDestroy(lgi)", OK)
    s.ok(f"mig_uuids({g})", [created(A100_ON, 2, 2, "3g.40gb")])


def mig_mode_pending_until_reset(s: Steps) -> None:
    """On an A100 a MIG mode change is pending until a reset (activationStatus RESET_REQUIRED, or
    IN_USE while processes run); disabling while GPU instances exist is IN_USE and changes
    nothing; a bad mode is INVALID_ARGUMENT; a GPU without MIG is NOT_SUPPORTED."""
    g = f"gpu({A100_OFF})"
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [0, 0])
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_ENABLE)", RESET_REQUIRED)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [0, 1])
    s.fails(f"pynvml.nvmlDeviceCreateGpuInstance({g}, 19)", NOT_SUPPORTED)
    s.control("reset", UUIDS[A100_OFF])
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 1])
    s.ok(f"(gi := pynvml.nvmlDeviceCreateGpuInstance({g}, 19))", "<handle>")
    s.fails(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_DISABLE)", IN_USE)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 1])
    s.ok("pynvml.nvmlGpuInstanceDestroy(gi)", OK)
    s.control("set_processes", UUIDS[A100_OFF], 2)
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_DISABLE)", IN_USE)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 0])
    s.control("set_processes", UUIDS[A100_OFF], 0)
    s.control("reset", UUIDS[A100_OFF])
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [0, 0])
    s.fails(f"pynvml.nvmlDeviceSetMigMode({g}, 2)", INVALID)
    s.fails(f"pynvml.nvmlDeviceSetMigMode(gpu({L4}), pynvml.NVML_DEVICE_MIG_ENABLE)", NOT_SUPPORTED)
    s.fails(f"pynvml.nvmlDeviceGetMigMode(gpu({L4}))", NOT_SUPPORTED)


def hopper_toggles_at_once_when_idle(s: Steps) -> None:
    """On an H100 an idle GPU's MIG mode changes at once; with processes running the change stays
    pending (activationStatus IN_USE), and asking for the current mode again clears it."""
    g = f"gpu({H100})"
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_ENABLE)", OK)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 1])
    s.ok(
        f"pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceCreateGpuInstance({g}, 19)).placement",
        {"start": 0, "size": 1},
    )
    s.ok(f"pynvml.nvmlGpuInstanceDestroy(pynvml.nvmlDeviceGetGpuInstanceById({g}, 7))", OK)
    s.control("set_processes", UUIDS[H100], 1)
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_DISABLE)", IN_USE)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 0])
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_ENABLE)", OK)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [1, 1])
    s.control("set_processes", UUIDS[H100], 0)
    s.ok(f"pynvml.nvmlDeviceSetMigMode({g}, pynvml.NVML_DEVICE_MIG_DISABLE)", OK)
    s.ok(f"pynvml.nvmlDeviceGetMigMode({g})", [0, 0])


SCENARIOS = [
    placements_and_capacity,
    create_at_placement_and_overlap,
    compute_instance_makes_a_mig_device,
    destroy_order_and_in_use,
    mig_mode_pending_until_reset,
    hopper_toggles_at_once_when_idle,
]


# ------------------------------------------------------------------ running them


def _run_sim(scenario: Callable[[Steps], None]) -> list[tuple[str, Any]]:
    backend = SimBackend(node_spec())
    backend.eval("pynvml.nvmlInit()")
    steps = Steps(backend)
    scenario(steps)
    return steps.transcript


@pytest.fixture
def lib_steps(
    fake_nvml_libdir: Path, tmp_path: Path
) -> Iterator[Callable[[Callable[[Steps], None]], list[tuple[str, Any]]]]:
    drivers: list[Driver] = []

    def run(scenario: Callable[[Steps], None]) -> list[tuple[str, Any]]:
        where = tmp_path / f"node{len(drivers)}"
        where.mkdir()
        node = FakeNode(where, node_spec())
        d = Driver(node.environ(fake_nvml_libdir))
        drivers.append(d)
        d.eval("pynvml.nvmlInit()")
        steps = Steps(LibBackend(node, d))
        scenario(steps)
        return steps.transcript

    yield run
    for d in drivers:
        d.close()
        assert "fakenvml:" not in d.stderr, d.stderr  # no control line was refused


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario_over_the_simulator(scenario: Callable[[Steps], None]) -> None:
    """The scenario's rules hold on the Python simulator."""
    _run_sim(scenario)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario_over_the_real_binding_and_c_library(
    scenario: Callable[[Steps], None],
    lib_steps: Callable[[Callable[[Steps], None]], list[tuple[str, Any]]],
) -> None:
    """The scenario's rules hold through nvidia-ml-py over the C library, and every answer of the
    scenario, checked or not, is the simulator's."""
    assert lib_steps(scenario) == _run_sim(scenario)


GPU_TIER_RUN = """
import pynvml
from tests.gpu import test_gpu_mig as t
from tests.gpu.conftest import DriverGpu
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
gpus = [DriverGpu(0, pynvml.nvmlDeviceGetUUID(h), "", 0, True, (8, 0), "")]
before = t.mig_uuids(h)
t.test_one_smallest_instance_is_created_seen_and_destroyed(gpus, None)
print(sorted(before) == sorted(t.mig_uuids(h)), pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19))
"""


def test_the_gpu_tiers_mig_test_runs_through_the_real_binding_over_the_c_library(
    fake_nvml_libdir: Path, tmp_path: Path
) -> None:
    """tests/gpu/test_gpu_mig.py's test, run in a child over the C library on an A100 with MIG on
    and room to spare, creates, sees and destroys its instance without skipping (so the test a
    real GPU runs is itself checked where there is none), and leaves the GPU as it found it."""
    node = FakeNode(tmp_path, node_spec())
    proc = subprocess.run(
        [sys.executable, "-c", GPU_TIER_RUN], env=node.environ(fake_nvml_libdir), cwd=REPO,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "3"]
