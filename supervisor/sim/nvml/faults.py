"""Fault injection into a simulated node: XIDs, ECC events, lost GPUs, resets, MIG changes, failures."""

from __future__ import annotations

import dataclasses

import pynvml

from supervisor.node.migmaker import MigMaker
from supervisor.sim.nvml import mig
from supervisor.sim.nvml.base import NO_INSTANCE, GpuState, SimEventData, SimulatorBase
from supervisor.sim.nvml.config import MigSpec, derived_mig_uuid

_XID_GPU_LOST = 79  # "GPU has fallen off the bus"


class FaultInjection(SimulatorBase):
    """What tests and `gpuvisor sim` do to a simulated node; every method takes the lock."""

    # ---------------------------------------------------------------- fault injection

    def _find(self, uuid: str) -> tuple[GpuState, MigSpec | None]:
        for state in self._gpus:
            if state.spec.uuid == uuid:
                return state, None
            for m in state.mig if state.mig_enabled else []:
                if m.uuid == uuid:
                    return state, m
        raise ValueError(f"no GPU or MIG device with UUID {uuid!r} in simulated node {self._spec.name!r}")

    def _find_gpu(self, uuid: str, what: str) -> GpuState:
        state, m = self._find(uuid)
        if m is not None:
            raise ValueError(f"{what} needs a GPU UUID, {uuid} is a MIG device")
        return state

    def _deliver(self, state: GpuState, event_type: int, data: int, gi: int, ci: int) -> None:
        event = SimEventData(self._gpu_handles[state.spec.index], int(event_type), data, gi, ci)
        for es in self._event_sets:
            if es.registered.get(state.spec.index, 0) & event_type:
                es.queue.append(event)
        self._cond.notify_all()

    def _instance_ids(
        self, m: MigSpec | None, gpu_instance: int | None, compute_instance: int | None
    ) -> tuple[int, int]:
        if m is not None:
            return m.gi, m.ci
        gi = NO_INSTANCE if gpu_instance is None else gpu_instance
        ci = NO_INSTANCE if compute_instance is None else compute_instance
        return gi, ci

    def inject_xid(
        self, uuid: str, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None
    ) -> None:
        """Deliver an XID critical-error event for a GPU or (by its UUID) a MIG device."""
        with self._cond:
            state, m = self._find(uuid)
            gi, ci = self._instance_ids(m, gpu_instance, compute_instance)
            self._deliver(state, pynvml.nvmlEventTypeXidCriticalError, int(xid), gi, ci)

    def inject_ecc(
        self,
        uuid: str,
        kind: str = "double",
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
    ) -> None:
        """Deliver a single- or double-bit ECC event (`kind` is "single" or "double")."""
        types = {
            "single": pynvml.nvmlEventTypeSingleBitEccError,
            "double": pynvml.nvmlEventTypeDoubleBitEccError,
        }
        if kind not in types:
            raise ValueError(f"ECC kind must be 'single' or 'double', got {kind!r}")
        with self._cond:
            state, m = self._find(uuid)
            gi, ci = self._instance_ids(m, gpu_instance, compute_instance)
            self._deliver(state, types[kind], 0, gi, ci)

    def lose(self, uuid: str) -> None:
        """The GPU falls off the bus: its calls raise GpuIsLost and an XID 79 event is sent."""
        with self._cond:
            state = self._find_gpu(uuid, "lose")
            state.lost = True
            self._deliver(
                state, pynvml.nvmlEventTypeXidCriticalError, _XID_GPU_LOST, NO_INSTANCE, NO_INSTANCE
            )

    def restore(self, uuid: str) -> None:
        """The lost GPU is reachable and healthy again (same handles, same MIG layout)."""
        with self._cond:
            self._find_gpu(uuid, "restore").lost = False
            self._cond.notify_all()

    def reset(self, uuid: str) -> None:
        """A GPU reset: reachable again, pending page retirement and row remapping applied, and a
        pending MIG mode made current (its instances gone). Refused (ValueError) while processes
        run on the GPU or its MIG devices, as `nvidia-smi --gpu-reset` refuses a GPU in use. A reset
        that leaves MIG mode as it was keeps the instances (a real one drops them; a description's
        layout stands for what a MIG manager would make again)."""
        with self._cond:
            state = self._find_gpu(uuid, "reset")
            live = [state.spec.uuid, *(m.uuid for m in state.mig)]
            busy = {u: state.processes[u] for u in live if state.processes[u] > 0}
            if busy:
                raise ValueError(f"GPU {uuid} is in use (processes: {busy}): a reset is refused")
            state.lost = False
            state.pending_retirement = False
            state.remapped_rows_pending = False
            if state.mig_pending != state.mig_enabled:
                self._activate_mig_mode(state)
            self._cond.notify_all()

    def set_processes(self, uuid: str, count: int) -> None:
        """How many processes run on a GPU or a MIG device (by UUID): while any do, destroying its
        compute instance, a MIG mode change's activation and a reset answer "in use" (migcreate)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"a process count is an int >= 0, got {count!r}")
        with self._cond:
            state, _ = self._find(uuid)
            state.processes[uuid] = count

    def set_pending_retirement(self, uuid: str, pending: bool = True) -> None:
        """Set whether the GPU has retired pages waiting for a reset."""
        with self._cond:
            self._find_gpu(uuid, "set_pending_retirement").pending_retirement = pending

    def set_remapped_rows_pending(self, uuid: str, pending: bool = True) -> None:
        """Set whether the GPU has row remappings waiting for a reset."""
        with self._cond:
            state = self._find_gpu(uuid, "set_remapped_rows_pending")
            if pending and not state.remapped_rows_pending:
                state.uncorrected_rows += 1
            state.remapped_rows_pending = pending

    def set_row_remap_failure(self, uuid: str, failed: bool = True) -> None:
        """Set whether a row remapping failed on the GPU (nvmlDeviceGetRemappedRows' failure flag; a
        reset does not clear it: the GPU needs service)."""
        with self._cond:
            self._find_gpu(uuid, "set_row_remap_failure").row_remap_failure = failed

    def set_mig_layout(self, gpu_index: int, profiles: list[str] | None) -> list[str]:
        """Reconfigure MIG on one GPU; None disables MIG. Returns the new MIG UUIDs in order.

        New UUIDs derive from the GPU UUID, the number of layout changes so far, and each
        instance's GI/CI ids, so the same sequence of changes always gives the same UUIDs.
        """
        with self._cond:
            if not 0 <= gpu_index < len(self._gpus):
                raise ValueError(f"no GPU with index {gpu_index} (the node has {len(self._gpus)})")
            state = self._gpus[gpu_index]
            cat = state.spec.catalogue
            if cat is None:
                raise ValueError(f"GPU {gpu_index} ({state.spec.name}) is not MIG-capable")
            new: list[MigSpec] = []
            if profiles is None:
                state.mig_enabled = state.mig_pending = False
            else:
                unknown = [p for p in profiles if p not in cat]
                if unknown:
                    raise ValueError(
                        f"unknown MIG profile(s) {unknown} for {state.spec.name} (known: {sorted(cat)})"
                    )
                chosen = [cat[p] for p in profiles]
                starts = mig.place(chosen)
                if starts is None:
                    raise ValueError(f"MIG layout {profiles} does not fit on {state.spec.name}")
                generation = state.mig_generation + 1
                for prof, start in zip(chosen, starts, strict=True):
                    gi = mig.gi_id_for(prof, start)
                    uuid = derived_mig_uuid(state.spec.uuid, generation, gi, 0, prof.name)
                    new.append(MigSpec(profile=prof.name, placement=start, gi=gi, ci=0, uuid=uuid))
                state.mig_enabled = state.mig_pending = True
            state.mig_generation += 1
            state.mig = new
            self._index_gis(state)
            self._save_state()
            return [m.uuid for m in new]

    def create_instance(
        self, gpu_uuid: str, gi_profile_id: int, placement_start: int
    ) -> dict[str, str | int]:
        """A MIG device made by hand (as an operator's `nvidia-smi mig` makes one, not gpuvisor): the
        GPU instance of a profile (by id) at a placement and the compute instance spanning it,
        through this node's own NVML functions (`supervisor.node.migmaker`, which turns MIG mode
        on first where the GPU allows it without a reset). Raises MigError saying why not."""
        made = MigMaker(self).create(gpu_uuid, gi_profile_id, placement_start)
        return dataclasses.asdict(made)

    def mig_instances(self, gpu_uuid: str) -> list[dict[str, str | int]]:
        """The GPU's GPU instances and their compute instances (`MigMaker.instances`), by placement."""
        return [dataclasses.asdict(m) for m in MigMaker(self).instances(gpu_uuid)]

    def fail(self, function_name: str, error_code: int, count: int | None = None) -> None:
        """Make an NVML function raise `NVMLError(error_code)` `count` times (None: until cleared)."""
        if function_name not in self.nvml_functions():
            raise ValueError(f"the simulator has no NVML function {function_name!r}")
        if (
            isinstance(error_code, bool)
            or not isinstance(error_code, int)
            or error_code == pynvml.NVML_SUCCESS
        ):
            raise ValueError(f"error_code must be a non-zero NVML return code, got {error_code!r}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        with self._cond:
            self._failures[function_name] = [error_code, count]
            self._cond.notify_all()  # a blocked wait should notice

    def clear_failures(self, function_name: str | None = None) -> None:
        """Stop injected failures of one function, or of all."""
        with self._cond:
            if function_name is None:
                self._failures.clear()
            else:
                self._failures.pop(function_name, None)

    def gpu_uuids(self) -> list[str]:
        return [g.spec.uuid for g in self._gpus]

    def mig_uuids(self, gpu_index: int) -> list[str]:
        with self._cond:
            state = self._gpus[gpu_index]
            return [m.uuid for m in state.mig] if state.mig_enabled else []
