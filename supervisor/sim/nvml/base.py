"""The simulator's plumbing: handles, per-GPU state, and the one decorator every NVML function wears.

`SimulatorBase` holds the node's state (GPUs, MIG layouts, event sets, injected failures) and the
lookups the NVML functions share (`_gpu`, `_full_gpu`, `_mig_of`, ...). The functions themselves
live in one module per area (`devices`, `migfuncs`, `events`) and fault injection in `faults`;
`core.Simulator` puts them together. Every NVML function is wrapped by `nvml_function`, which
takes the one lock, applies injected failures and checks that NVML is initialised, so the
modules share no other locking rule.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import pynvml

from supervisor.sim.nvml import mig
from supervisor.sim.nvml import state as statefile
from supervisor.sim.nvml.config import GpuSpec, MigSpec, NodeSpec

log = logging.getLogger("gpuvisor.sim")

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="SimulatorBase")

NO_INSTANCE = 0xFFFFFFFF  # what NVML puts in gpuInstanceId/computeInstanceId when none applies


def nvml_error(code: int) -> Exception:
    """The binding's exception for an NVML return code (NVMLError maps codes to subclasses)."""
    exc: Exception = pynvml.NVMLError(code)
    return exc


def nvml_function(
    requires_init: bool = True,
) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """Mark a method as a simulated NVML function: lock, injected failures, init check."""

    def deco(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        name = fn.__name__

        def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with self._cond:
                self._calls[name] += 1
                self._maybe_fail(name)
                if requires_init and self._init_count == 0:
                    raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
                return fn(self, *args, **kwargs)

        functools.update_wrapper(wrapper, fn)
        wrapper._sim_nvml = True  # type: ignore[attr-defined]
        return wrapper

    return deco


@dataclass(eq=False, frozen=True)
class SimDeviceHandle:
    """An opaque device handle (like `c_nvmlDevice_t`); one object per device, compared by identity."""

    gpu_index: int
    mig_uuid: str | None = None

    def __repr__(self) -> str:
        what = (
            f"gpu {self.gpu_index}" if self.mig_uuid is None else f"{self.mig_uuid} on gpu {self.gpu_index}"
        )
        return f"<sim device handle {what}>"


@dataclass(eq=False, frozen=True)
class SimGpuInstanceHandle:
    """An opaque GPU-instance handle (like `c_nvmlGpuInstance_t`): stale once its instance is
    destroyed, even if another one later gets the same id (`serial` tells them apart)."""

    gpu_index: int
    gi: int
    serial: int


@dataclass(eq=False, frozen=True)
class SimComputeInstanceHandle:
    """An opaque compute-instance handle (like `c_nvmlComputeInstance_t`): names its MIG device by
    UUID, which is new for every compute instance created, so a destroyed one's handle stays stale."""

    gpu_index: int
    gi: int
    ci: int
    mig_uuid: str


@dataclass(frozen=True)
class SimEventData:
    """Same attributes as `c_nvmlEventData_t`."""

    device: SimDeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass(frozen=True)
class SimGpuInstanceInfo:
    """Same attributes as `c_nvmlGpuInstanceInfo_t`."""

    device: SimDeviceHandle
    id: int
    profileId: int
    placement: Any  # pynvml.c_nvmlGpuInstancePlacement_t


@dataclass(frozen=True)
class SimComputeInstanceInfo:
    """Same attributes as `c_nvmlComputeInstanceInfo_t`."""

    device: SimDeviceHandle
    gpuInstance: SimGpuInstanceHandle
    id: int
    profileId: int
    placement: Any  # pynvml.c_nvmlComputeInstancePlacement_t


@dataclass
class GiRecord:
    """One GPU instance of a GPU: its profile (by name), first memory slice and creation serial."""

    profile: str
    start: int
    serial: int


@dataclass(eq=False)
class SimEventSet:
    """An event set (like `c_nvmlEventSet_t`): the events registered per GPU and a queue."""

    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    queue: deque[SimEventData] = field(default_factory=deque)
    freed: bool = False


@dataclass
class GpuState:
    """What can change about one simulated GPU at run time."""

    spec: GpuSpec
    lost: bool
    pending_retirement: bool
    remapped_rows_pending: bool
    mig_enabled: bool
    mig: list[MigSpec]
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    mig_generation: int = 0
    corrected_rows: int = 0
    uncorrected_rows: int = 0
    row_remap_failure: bool = False
    # MIG on demand (migcreate): the mode after the next reset, the GPU instances in creation order
    # (the MIG devices in `mig` are their compute instances, in the same order), the processes
    # running per GPU or MIG device UUID, and how many instances were created (for their UUIDs).
    mig_pending: bool = False
    gis: dict[int, GiRecord] = field(default_factory=dict)
    processes: Counter[str] = field(default_factory=Counter)
    created: int = 0


class SimulatorBase:
    """The simulated node's state and the lookups every NVML function shares."""

    def __init__(self, spec: NodeSpec) -> None:
        self._spec = spec
        self._cond = threading.Condition(threading.RLock())
        self._init_count = 0
        self._failures: dict[str, list[int | None]] = {}  # name -> [code, remaining or None]
        self._calls: Counter[str] = Counter()
        self._event_sets: list[SimEventSet] = []
        self._gpus = [
            GpuState(
                spec=g,
                lost=g.uuid in spec.lost,
                pending_retirement=g.uuid in spec.pending_retirement,
                remapped_rows_pending=g.uuid in spec.remapped_rows_pending,
                mig_enabled=g.mig_enabled,
                mig=list(g.mig),
            )
            for g in spec.gpus
        ]
        self._serial = 0  # GPU-instance serials, node-wide
        for state in self._gpus:
            state.mig_pending = state.mig_enabled
            self._index_gis(state)
        self._gpu_handles = [SimDeviceHandle(i) for i in range(len(spec.gpus))]
        self._mig_handles: dict[str, SimDeviceHandle] = {}
        self._state_file: Path | None = None  # where MIG changes are kept (`state`), if anywhere
        # NVLink wiring per GPU: link number -> remote bus id and whether the remote is a GPU.
        self._links: list[list[tuple[str, bool]]] = [[] for _ in spec.gpus]
        for (a, b), count in sorted(spec.nvlinks.items()):
            for _ in range(count):
                self._links[a].append((spec.gpus[b].pci_bus_id, True))
                self._links[b].append((spec.gpus[a].pci_bus_id, True))
        for g in spec.switch_gpus:
            for k in range(spec.switch_links):
                self._links[g].append((spec.switch_bus_ids[k % len(spec.switch_bus_ids)], False))

    # ---------------------------------------------------------------- the state file

    def keep_state(self, path: str | Path) -> None:
        """Keep the node's MIG layout in `path` (`state`): restored from it now if it exists (raises
        SimulatorConfigError if it is corrupt), written to it at every MIG change from now on."""
        where = Path(path)
        data = statefile.read(where)
        with self._cond:
            if data is not None:
                for r in statefile.check(str(where), data, self._gpus):
                    self._restore(r)
            self._state_file = where

    def _restore(self, r: statefile.Restored) -> None:
        gpu = self._gpus[r.index]
        for m in gpu.mig:
            self._mig_handles.pop(m.uuid, None)
        gpu.mig_enabled, gpu.mig_pending = r.mig_enabled, r.mig_pending
        gpu.created, gpu.mig_generation = r.created, r.generation
        gpu.mig = list(r.mig_devices)
        gpu.gis = {}
        for gi, (profile, start) in r.gpu_instances.items():
            self._serial += 1
            gpu.gis[gi] = GiRecord(profile, start, self._serial)

    def _save_state(self) -> None:
        """After a MIG change: write the layout to the state file, if there is one. A failed write
        is logged, not raised: the NVML call it follows did what it did."""
        if self._state_file is None:
            return
        try:
            statefile.write(self._state_file, statefile.snapshot(self._gpus))
        except OSError as exc:
            log.error("the simulator's MIG state could not be written to %s: %s", self._state_file, exc)

    # ---------------------------------------------------------------- plumbing

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined on the class: forward the binding's constants,
        # structures and error classes, but never its functions (they would call the real
        # library), so a function the simulator lacks fails loudly.
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(pynvml, name, None)
        if value is None or (callable(value) and not isinstance(value, type)):
            raise AttributeError(f"the NVML simulator does not implement {name!r}")
        return value

    @classmethod
    def nvml_functions(cls) -> list[str]:
        """The NVML functions this simulator implements."""
        # The functions live in mixins (devices, migfuncs, events): walk the whole MRO.
        found = {n for klass in cls.__mro__ for n, v in vars(klass).items() if getattr(v, "_sim_nvml", False)}
        return sorted(found)

    @property
    def spec(self) -> NodeSpec:
        return self._spec

    def call_count(self, function_name: str) -> int:
        """How many times an NVML function was called (including calls that raised)."""
        with self._cond:
            return self._calls[function_name]

    @property
    def initialized(self) -> bool:
        with self._cond:
            return self._init_count > 0

    def _maybe_fail(self, name: str) -> None:
        entry = self._failures.get(name)
        if entry is None:
            return
        code, remaining = entry
        if remaining is not None:
            if remaining <= 1:
                del self._failures[name]
            else:
                entry[1] = remaining - 1
        raise nvml_error(int(code or pynvml.NVML_ERROR_UNKNOWN))

    def _gpu(self, handle: object, allow_lost: bool = False) -> GpuState:
        """The GPU behind a handle (a MIG handle's parent), checking it is live."""
        if not isinstance(handle, SimDeviceHandle) or not 0 <= handle.gpu_index < len(self._gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpus[handle.gpu_index]
        if state.lost and not allow_lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.mig_uuid is not None:
            self._mig_of(state, handle)
        return state

    def _mig_of(self, state: GpuState, handle: SimDeviceHandle) -> MigSpec:
        for m in state.mig if state.mig_enabled else []:
            if m.uuid == handle.mig_uuid:
                return m
        # The instance was destroyed by a MIG reconfiguration: the handle is stale.
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def _full_gpu(self, handle: object) -> GpuState:
        """Like _gpu, for calls that NVML answers only for a physical GPU."""
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        if handle.mig_uuid is not None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state

    def _mig_handle(self, gpu_index: int, m: MigSpec) -> SimDeviceHandle:
        h = self._mig_handles.get(m.uuid)
        if h is None:
            h = self._mig_handles[m.uuid] = SimDeviceHandle(gpu_index, m.uuid)
        return h

    def _index_gis(self, state: GpuState) -> None:
        """Record the GPU instances behind a GPU's MIG devices (a layout's: one compute instance each)."""
        state.gis = {}
        for m in state.mig if state.mig_enabled else []:
            if m.gi not in state.gis:
                self._serial += 1
                state.gis[m.gi] = GiRecord(m.profile, m.placement, self._serial)

    def _activate_mig_mode(self, state: GpuState) -> None:
        """The pending MIG mode becomes current; every instance is gone (a reset or an unbind)."""
        state.mig_enabled = state.mig_pending
        for m in state.mig:
            self._mig_handles.pop(m.uuid, None)
        state.mig, state.gis = [], {}
        state.mig_generation += 1
        self._save_state()

    def _catalogue(self, state: GpuState) -> dict[str, mig.MigProfile]:
        cat = state.spec.catalogue
        if cat is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return cat
