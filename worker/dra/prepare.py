"""Preparing and unpreparing claims: the DRA worker's policy, apart from the gRPC plumbing.

`Preparer.prepare(claims)` answers every claim the kubelet named, each with its devices or its
error, and never raises: a claim that cannot be prepared is that claim's error, and the kubelet
asks again for it. For each claim:

1. already in the checkpoint (same UID): the recorded answer, at once (idempotent, and the API
   server is not needed when a restarted kubelet re-prepares running pods' claims);
2. else fetched from the `ClaimSource` (outside the lock: a slow source does not hold up other
   calls) and checked (`worker.dra.claims.allocated_devices`: allocated, the UID asked for, this
   driver's results naming this node's pool and devices this node has);
3. then, under the lock: a device another prepared claim holds for itself is refused (the
   scheduler never allocates one device twice; two claims on one device would mean a stale
   allocation or a mode switch race); a claim with admin access (monitoring beside the user) or
   a share ID (a shared device) neither holds a device nor is refused one; a device the
   supervisor holds unhealthy is refused with the reason (admin access excepted: that is how a
   sick device is inspected); the claims are recorded in the checkpoint, and only then answered.

A draining plan (the node switched to device-plugin mode while claims were prepared) answers
claims of the checkpoint as before and refuses every other with why; the drain is checked again
under the lock before a claim is recorded, so once `set_plan` has taken a draining plan no new
claim can be recorded: the supervisor then reads the checkpoint as final.

Each device is answered with its CDI device ID in the claim's own CDI spec
(`k8s.gpu.nvidia.com/claim=<claim UID>-<device>`, worker.dra.claimspec), written before the claim
is recorded; without a spec dir (a plan made without one), with its ID in the spec the supervisor
writes for the plan (`<vendor>/<class>=<uuid>`, or `=<i>` / `=<i:j>` under the index strategy), as
claims recorded before per-claim specs keep being answered. `unprepare(claims)` forgets them and
removes their specs; a claim it never prepared is a success.

Claim configuration (worker.dra.config: NVIDIA's `GpuConfig` and `MigDeviceConfig`) is resolved
right after the fetch, outside the lock; a bad one is that claim's error. A claim whose devices
are shared by it (TimeSlicing, MPS) is reserved under the lock (its devices count as held), its
sharing applied outside it (`worker.dra.sharing.SharingSteps`: nvidia-smi runs, an MPS daemon
start; one claim's steps at a time, under a lock of their own), its spec written with the
container edits the sharing returns (an MPS claim's pipe dir and limits), then recorded; a step,
a spec or a record that fails undoes what was applied. A claim without sharing never waits for
that. Each device's sharing is in the checkpoint, so an unprepare after a restart undoes it: the
claim's MPS daemon is stopped and a GPU no other prepared claim time-slices is set back to
Default before the claim is forgotten (when that fails the claim stays, and the kubelet's retry
tries again). The edits are kept in the checkpoint too (`PreparedClaim.container_edits`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.dracheckpoint import (
    MEMORY_SHARE,
    MPS,
    Checkpoint,
    CheckpointError,
    DeviceSharing,
    PreparedClaim,
    PreparedDevice,
)
from common.model import AllocatableDevice, ResourcePlan
from worker.dra.claims import (
    AllocatedDevice,
    ClaimError,
    ClaimRef,
    ClaimSource,
    allocated_devices,
    check_ref,
)
from worker.dra.claimspec import ClaimSpecError, ClaimSpecs, claim_device_id
from worker.dra.config import Result, resolve
from worker.dra.edits import ClaimMps, ContainerEdits, SharingError
from worker.dra.figures import prepared_devices
from worker.dra.migdemand import SupervisorMig, made_record
from worker.dra.sharing import SharingSteps, TimeSlicer, edits_from_json
from worker.healthboard import Health

log = logging.getLogger("gpuvisor.worker")

MAX_CLAIMS_PER_CALL = 256  # a pod's claims for one driver; more is no kubelet's request
NO_SOURCE = "no claim source: neither the supervisor nor --dra-claims-dir can give this worker ResourceClaims"
DRAINING = (
    "this node serves its GPUs through the device plugin now (gpuvisor mode device-plugin): the DRA "
    "driver only finishes the claims it prepared before the switch"
)
BUSY = "is being prepared by another call (its sharing is being applied): the kubelet asks again"


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    edits: ContainerEdits = field(default_factory=ContainerEdits)  # the claim's sharing's, for its CDI spec


@dataclass(frozen=True)
class Fetched:
    """A claim fetched and checked: its devices and the sharing its configuration gives each."""

    ref: ClaimRef
    allocated: list[AllocatedDevice]
    sharing: list[DeviceSharing | None]


def cdi_device_id(plan: ResourcePlan, device: AllocatableDevice) -> str:
    """The device's qualified name in the supervisor's CDI spec (supervisor/cdi/spec.py names it so)."""
    settings = plan.allocate
    name = device.index if settings.device_id_strategy == "index" else device.uuid
    return f"{settings.cdi_vendor}/{settings.cdi_class}={name}"


def _answer(claim: PreparedClaim) -> PrepareResult:
    return PrepareResult(claim.devices, edits=edits_from_json(claim.container_edits))


class Preparer:
    """Prepares and unprepares claims for one DRA plan; thread-safe, answers are data."""

    def __init__(
        self,
        plan: ResourcePlan,
        source: ClaimSource | None,
        checkpoint: Checkpoint,
        health: Callable[[str], Health | None] = lambda device: None,
        clock: Callable[[], float] = time.time,
        count: Callable[[str], None] = lambda name: None,
        on_change: Callable[[], None] = lambda: None,
        mps: ClaimMps | None = None,
        timeslicer: TimeSlicer | None = None,
        specs: ClaimSpecs | None = None,
        mig: SupervisorMig | None = None,
    ) -> None:
        if plan.dra is None:
            raise ValueError(f"plan {plan.resource} is no DRA plan")
        self._plan = plan
        self._source = source
        self._checkpoint = checkpoint
        self._health = health
        self._clock = clock
        self._count = count
        self._on_change = on_change  # the checkpoint changed (from the gRPC threads)
        self._steps = SharingSteps(timeslicer, mps)
        self._specs = specs  # each claim's own CDI spec; None: the node-wide spec's IDs
        self._mig = mig  # MIG devices made on demand, through the supervisor (worker.dra.migdemand)
        self._lock = threading.Lock()
        # Taken before `_lock`, never under it: one claim's sharing steps at a time.
        self._sharing_lock = threading.Lock()
        self._pending: dict[str, PreparedClaim] = {}  # reserved while their sharing is applied
        self.changes = 0  # checkpoint writes that added or dropped a claim, in this process

    def set_plan(self, plan: ResourcePlan) -> None:
        """A new device list (rediscovery, a reload), or the drain of a switch to device-plugin
        mode: prepared claims keep what they were answered. Under the lock, so once this returns
        no claim fetched under the old plan is recorded under it any more."""
        with self._lock:
            self._plan = plan
            if self._specs is not None:
                self._specs.set_plan(plan)

    @property
    def draining(self) -> bool:
        return self._plan.dra is not None and self._plan.dra.drain

    def prepared(self) -> int:
        with self._lock:
            return len(self._checkpoint)

    def prepared_devices(self) -> dict[str, int]:
        """The prepared claims' devices by type (worker.dra.figures)."""
        with self._lock:
            return prepared_devices(self._checkpoint.claims(), {d.id: d for d in self._plan.devices})

    # ------------------------------------------------------------------ prepare
    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        if len(refs) > MAX_CLAIMS_PER_CALL:
            text = f"{len(refs)} claims in one request, at most {MAX_CLAIMS_PER_CALL} are prepared at a time"
            return {ref.uid: PrepareResult(error=text) for ref in refs}
        wanted: list[ClaimRef] = []
        with self._lock:
            for ref in refs:
                if ref.uid in results or any(w.uid == ref.uid for w in wanted):
                    continue
                done = self._checkpoint.get(ref.uid)
                if done is not None:
                    results[ref.uid] = _answer(done)
                elif ref.uid in self._pending:
                    results[ref.uid] = PrepareResult(error=f"claim {ref} {BUSY}")
                else:
                    wanted.append(ref)
        fetched: list[Fetched] = []
        for ref in wanted:  # the slow part, outside the lock
            try:
                fetched.append(self._fetch(ref))
            except ClaimError as exc:
                results[ref.uid] = PrepareResult(error=str(exc))
        if fetched:
            results.update(self._record(fetched))
        for uid, result in results.items():
            self._count("prepare_errors" if result.error else "prepared_claims")
            if result.error:
                log.warning("claim %s not prepared: %s", uid, result.error)
        return results

    def _fetch(self, ref: ClaimRef) -> Fetched:
        check_ref(ref)
        if self.draining:
            raise ClaimError(f"claim {ref}: {DRAINING}")
        if self._source is None:
            raise ClaimError(f"claim {ref}: {NO_SOURCE}")
        claim = self._source.get(ref.namespace, ref.name)
        plan = self._plan
        assert plan.dra is not None
        by_id = {d.id: d for d in plan.devices}
        allocated = allocated_devices(claim, ref, driver=plan.dra.driver, pool=plan.dra.pool, devices=by_id)
        results = [Result(a.result_request or a.request, by_id[a.device], a.admin_access) for a in allocated]
        sharing = resolve(claim, ref, plan.dra.driver, results, skipped=log.info)
        if any(a.consumed_memory is not None for a in allocated):  # a GPU shared by memory
            from worker.dra.memshare import memory_sharing

            sharing = memory_sharing(ref, allocated, [r.device for r in results], sharing)
        return Fetched(ref, allocated, sharing)

    def _record(self, fetched: list[Fetched]) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        new: list[PreparedClaim] = []
        shared: list[PreparedClaim] = []
        with self._lock:
            plan = self._plan
            by_id = {d.id: d for d in plan.devices}
            for item in fetched:
                ref = item.ref
                done = self._checkpoint.get(ref.uid)  # another call prepared it meanwhile
                if done is not None:
                    results[ref.uid] = _answer(done)
                    continue
                if ref.uid in self._pending:
                    results[ref.uid] = PrepareResult(error=f"claim {ref} {BUSY}")
                    continue
                if self.draining:  # the switch came while this claim was being fetched
                    results[ref.uid] = PrepareResult(error=f"claim {ref}: {DRAINING}")
                    continue
                try:
                    devices = tuple(
                        self._device(ref, a, s, by_id, new)
                        for a, s in zip(item.allocated, item.sharing, strict=True)
                    )
                    staged = any(d.sharing for d in devices) or any(
                        by_id[d.device].partitionable for d in devices
                    )
                    if not staged:  # a staged claim's spec waits for its edits and its MIG devices
                        devices = self._write_spec(ref, devices, by_id, ContainerEdits())
                except ClaimError as exc:
                    results[ref.uid] = PrepareResult(error=str(exc))
                    continue
                except ClaimSpecError as exc:
                    results[ref.uid] = PrepareResult(error=f"claim {ref}: {exc}")
                    continue
                claim = PreparedClaim(ref.uid, ref.namespace, ref.name, devices, self._clock())
                if staged:
                    self._pending[claim.uid] = claim  # its devices are held while it is staged
                    shared.append(claim)
                else:
                    new.append(claim)
            try:
                self._checkpoint.put(new)
            except CheckpointError as exc:
                for claim in new:
                    self._remove_spec(claim.uid)
                    results[claim.uid] = PrepareResult(error=f"claim {claim.namespace}/{claim.name}: {exc}")
                new = []
            if new:
                self.changes += 1
        if new:
            self._on_change()
        for claim in new:
            results[claim.uid] = PrepareResult(claim.devices)
            self._log_prepared(claim)
        for claim in shared:
            results[claim.uid] = self._share(claim)
        return results

    def _share(self, claim: PreparedClaim) -> PrepareResult:
        """Make a reserved claim's MIG devices and apply its sharing, then record it; on any
        failure nothing stays made or applied."""
        what = f"claim {claim.namespace}/{claim.name}"
        with self._sharing_lock:
            try:
                claim = self._make(claim)
            except SharingError as exc:
                with self._lock:
                    self._pending.pop(claim.uid, None)
                return PrepareResult(error=f"{what}: {exc}")
            try:
                with self._lock:
                    others = self._checkpoint.claims()
                edits = self._steps.apply(claim, others)
            except SharingError as exc:
                self._unmake(claim, undo=True)
                with self._lock:
                    self._pending.pop(claim.uid, None)
                return PrepareResult(error=f"{what}: {exc}")
            devices, error = self._shared_spec(claim, edits)
            claim = dataclasses.replace(claim, devices=devices, container_edits=edits.to_json())
            with self._lock:
                self._pending.pop(claim.uid, None)
                if not error and self.draining:
                    error = DRAINING
                elif not error:
                    try:
                        self._checkpoint.put([claim])
                        self.changes += 1
                    except CheckpointError as exc:
                        error = str(exc)
                others = self._checkpoint.claims()
            if error:
                self._remove_spec(claim.uid)
                try:
                    self._steps.teardown(claim, others)
                except SharingError as exc:
                    log.error("%s: undoing its sharing after a failed record failed too: %s", what, exc)
                self._unmake(claim, undo=True)
                return PrepareResult(error=f"{what}: {error}")
        self._on_change()
        self._log_prepared(claim)
        return PrepareResult(claim.devices, edits=edits)

    def _shared_spec(
        self, claim: PreparedClaim, edits: ContainerEdits
    ) -> tuple[tuple[PreparedDevice, ...], str]:
        """A shared claim's spec, with its sharing's edits: its devices as answered, and the error."""
        by_id = {d.id: d for d in self._plan.devices}
        gone = [d.device for d in claim.devices if d.device not in by_id]
        if gone:  # the plan changed (a MIG change) while the sharing was applied
            return claim.devices, f"device {gone[0]} is not on this node any more"
        for d in claim.devices:  # a MIG device made for the claim: the spec names the instance
            if d.made is not None:
                by_id[d.device] = made_record(by_id[d.device], d.made)
        ref = ClaimRef(claim.namespace, claim.name, claim.uid)
        try:
            return self._write_spec(ref, claim.devices, by_id, edits), ""
        except ClaimSpecError as exc:
            return claim.devices, str(exc)

    def _make(self, claim: PreparedClaim) -> PreparedClaim:
        """Make the claim's MIG devices of partitionable GPUs, and give it their full GPUs (MIG mode
        off); raises SharingError with what was made destroyed again."""
        by_id = {d.id: d for d in self._plan.devices}
        records = [by_id.get(d.device) for d in claim.devices]
        if not any(r is not None and r.partitionable for r in records):
            return claim
        if self._mig is None or self._specs is None:
            raise SharingError(
                "its devices are MIG placements made on demand (gpuvisor.dra.migOnDemand), which need the "
                "supervisor and a CDI spec per claim; this DRA worker has "
                + ("no supervisor" if self._mig is None else "no CDI spec dir")
            )
        devices: list[PreparedDevice] = []
        try:
            for d, record in zip(claim.devices, records, strict=True):
                if record is None or not record.partitionable:
                    devices.append(d)
                elif record.on_demand:
                    if d.sharing is not None:
                        raise SharingError(
                            f"device {d.device} is made on demand and cannot be shared ({d.sharing.strategy})"
                        )
                    devices.append(dataclasses.replace(d, made=self._mig.create(claim.uid, record)))
                else:
                    self._mig.full(claim.uid, record.gpu_uuid)
                    devices.append(d)
        except SharingError:
            self._unmake(dataclasses.replace(claim, devices=tuple(devices)), undo=True)
            raise
        return dataclasses.replace(claim, devices=tuple(devices))

    def _unmake(self, claim: PreparedClaim, *, undo: bool = False) -> None:
        """Destroy the MIG devices made for the claim; raises SharingError (unless `undo`: a failed
        prepare's, logged, and the supervisor's clean-up destroys what no claim holds)."""
        for d in claim.devices:
            if d.made is None:
                continue
            if self._mig is None:
                raise SharingError(
                    f"MIG device {d.made.uuid} was made for it, and this worker has no supervisor to destroy it"
                )
            try:
                self._mig.destroy(claim.uid, d.made)
            except SharingError as exc:
                if not undo:
                    raise
                log.error("claim %s/%s: destroying MIG device %s after a failed prepare failed: %s",
                          claim.namespace, claim.name, d.made.uuid, exc)  # fmt: skip

    @staticmethod
    def _log_prepared(claim: PreparedClaim) -> None:
        log.info(
            "prepared claim %s/%s (%s): %s",
            claim.namespace,
            claim.name,
            claim.uid,
            ", ".join(d.device + (f" ({d.sharing.strategy})" if d.sharing else "") for d in claim.devices),
        )

    def _device(
        self,
        ref: ClaimRef,
        allocated: AllocatedDevice,
        sharing: DeviceSharing | None,
        by_id: dict[str, AllocatableDevice],
        pending: list[PreparedClaim],
    ) -> PreparedDevice:
        """One allocated device, checked against the other claims and its health (under the lock)."""
        name = allocated.device
        if name not in by_id:  # the plan changed (a MIG change) while the claim was fetched
            raise ClaimError(f"claim {ref}: device {name} is not on this node any more")
        if not (allocated.admin_access or allocated.share_id):
            holders = self._checkpoint.holders(name) + [
                c
                for c in (*pending, *self._pending.values())
                if any(d.device == name and d.exclusive for d in c.devices)
            ]
            for holder in holders:
                raise ClaimError(
                    f"claim {ref}: device {name} is in use by claim {holder.namespace}/{holder.name} "
                    f"(UID {holder.uid}) until the kubelet unprepares it"
                )
            health = self._health(name)
            if health is not None and not health.healthy:
                raise ClaimError(
                    f"claim {ref}: device {name} is unhealthy: {health.reason or 'no reason given'}"
                )
        return PreparedDevice(
            requests=(allocated.request,),
            pool=allocated.pool,
            device=name,
            cdi_device_ids=(cdi_device_id(self._plan, by_id[name]),),
            share_id=allocated.share_id,
            admin_access=allocated.admin_access,
            sharing=sharing,
        )

    def _write_spec(
        self,
        ref: ClaimRef,
        devices: tuple[PreparedDevice, ...],
        by_id: dict[str, AllocatableDevice],
        edits: ContainerEdits,
    ) -> tuple[PreparedDevice, ...]:
        """Write the claim's CDI spec; the devices answered with the spec's IDs. The sharing's
        edits (the MPS daemon's) go on the claim's MPS devices only: NVIDIA gives each config
        group's devices that group's edits (device_state.go `prepareDevices`), so a time-sliced
        or plain device of the same claim does not join the daemon."""
        if self._specs is None:
            return devices
        none = ContainerEdits()
        self._specs.write(
            ref.uid,
            [
                (by_id[d.device], edits if d.sharing and d.sharing.strategy in (MPS, MEMORY_SHARE) else none)
                for d in devices
            ],
        )
        return tuple(
            dataclasses.replace(d, cdi_device_ids=(claim_device_id(ref.uid, d.device),)) for d in devices
        )

    def _remove_spec(self, uid: str) -> None:
        if self._specs is not None:
            self._specs.remove(uid)

    # ------------------------------------------------------------------ unprepare
    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """The error per claim UID ("" when unprepared); a claim never prepared is unprepared."""
        uids = [ref.uid for ref in refs]
        errors = dict.fromkeys(uids, "")
        with self._lock:
            known = [c for uid in uids if (c := self._checkpoint.get(uid)) is not None]
            shared = [c for c in known if c.shared]
            plain = [c for c in known if not c.shared]
            keep = {c.uid for c in shared}
            try:
                self._checkpoint.drop(uid for uid in uids if uid not in keep)
            except CheckpointError as exc:
                self._count("unprepare_errors")
                return {uid: f"claim {uid}: {exc}" for uid in uids}
            if plain:
                self.changes += 1
        for uid in uids:  # a spec left by a prepare that never reached the checkpoint goes too
            if uid not in keep:
                self._remove_spec(uid)
        if plain:
            self._on_change()
        for claim in plain:
            self._unprepared(claim)
        for claim in shared:
            errors[claim.uid] = self._unshare(claim)
            if errors[claim.uid]:
                self._count("unprepare_errors")
                log.warning("claim %s not unprepared: %s", claim.uid, errors[claim.uid])
        return errors

    def _unshare(self, claim: PreparedClaim) -> str:
        """Undo a claim's sharing, then forget it; the error ("" when done). A failed undo keeps it."""
        what = f"claim {claim.namespace}/{claim.name}"
        with self._sharing_lock:
            with self._lock:
                current = self._checkpoint.get(claim.uid)
                others = [c for c in self._checkpoint.claims() if c.uid != claim.uid]
            if current is None:
                return ""  # another call unprepared it meanwhile
            try:
                self._steps.teardown(current, others)
                self._unmake(current)
            except SharingError as exc:
                return f"{what}: {exc}"
            with self._lock:
                try:
                    self._checkpoint.drop([claim.uid])
                except CheckpointError as exc:
                    return f"{what}: {exc}"
                self.changes += 1
        self._remove_spec(claim.uid)
        self._on_change()
        self._unprepared(claim)
        return ""

    def _unprepared(self, claim: PreparedClaim) -> None:
        self._count("unprepared_claims")
        log.info("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
