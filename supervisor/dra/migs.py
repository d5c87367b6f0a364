"""MIG devices made on demand (gpuvisor.dra.migOnDemand): the supervisor's half, `MigRequests`.

The DRA worker prepares a claim for a MIG placement by asking here (`MigClaimRequest`,
common/migmessages.py), because the supervisor owns NVML; it answers the kubelet once the MIG
device exists and its claim is in the checkpoint, and asks here again to destroy it at the
claim's unprepare. The rules, as NVIDIA's DRA driver keeps them with DynamicMIG
(kubernetes-sigs/dra-driver-nvidia-gpu at 9593204, cmd/gpu-kubelet-plugin/nvlib.go
`createMigDevice`, `deleteMigDevice`; device_state.go `DestroyUnknownMIGDevices`), with
gpuvisor's guards:

- create: MIG mode is turned on first where it is off, and only while no prepared claim holds
  any device of that GPU (its full GPU above all); then the GPU instance at the placement and its
  compute instance (supervisor.node.migmaker). A placement another instance overlaps is refused
  with the instance named.
- full: a claim for the whole GPU turns MIG mode off where it is on, only while the GPU has no
  instance (refused, naming them, where it has) and no prepared claim holds a device of it.
- destroy: the compute instance, then the GPU instance; one gone already is destroyed.
- what no claim holds is destroyed (`reconcile`): each time the DRA worker process changes (the
  supervisor's start, a crash, a restart) and every `CLEAN_S` (supervisor.dra.side), every
  instance on a partitionable GPU that no checkpointed claim holds goes: what a crash between an
  instance's creation and its record left, or an instance made by hand. Kept: those a
  checkpointed claim holds (by its record, or by its device's name), and those made here for a
  DRA worker that still lives, for `GRACE_S` (it records them or undoes them itself). A
  checkpoint that cannot be read destroys nothing. A destroy names the instance's UUID: GPU
  instance IDs are reused, and another claim's instance at the same IDs is never destroyed; a
  create asked again for the same claim and placement is answered with the instance made for it.

A request that fails is answered with why (the worker's prepare fails with it, and the kubelet
asks again); nothing here ends the thread. After each change the node is discovered again
(`rediscover`, on the main loop, once for a burst of changes), so the plans, the health book and
the slices' taints know the instance.

Threads: one of its own ("gpuvisor-mig"), fed by a queue, so NVML's MIG calls (hundreds of
milliseconds on a real GPU) never hold up the main loop, and two requests never race on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from common.dracheckpoint import CheckpointError, read_claims
from common.messages import Json, Message
from common.migmessages import CREATE, DESTROY, FULL, MigClaimReply, MigClaimRequest
from common.model import Node
from supervisor.node.draplan import gpu_device_name, static_migs

log = logging.getLogger("gpuvisor.dra")

MAX_QUEUE = 1024  # requests waiting; a DRA worker asks one claim's devices at a time
# An instance made for a DRA worker that still lives, and not in the checkpoint this long after,
# is not going to be: its prepare failed or gave up (the kubelet's call lasts 45 s at most).
GRACE_S = 120.0


class Made(Protocol):
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gi_id(self) -> int: ...
    @property
    def ci_id(self) -> int: ...
    @property
    def uuid(self) -> str: ...


class Mode(Protocol):
    @property
    def current(self) -> bool: ...


class Maker(Protocol):
    """What this needs of NVML (supervisor.node.migmaker.MigMaker)."""

    def create(self, gpu_uuid: str, gi_profile_id: int, placement_start: int) -> Made: ...
    def destroy(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None: ...
    def instances(self, gpu_uuid: str) -> Iterable[Made]: ...
    def mig_mode(self, gpu_uuid: str) -> Mode: ...
    def set_mig_mode(self, gpu_uuid: str, on: bool) -> Mode: ...


@dataclass(frozen=True)
class _Made:
    worker_pid: int
    made_at: float  # monotonic
    claim_uid: str
    uuid: str
    at: tuple[int, int]  # (GI profile id, placement start)


@dataclass(frozen=True)
class _Reconcile:
    gpus: frozenset[str]  # the partitionable GPUs' UUIDs
    live: frozenset[int]  # the DRA worker pids alive when it was asked for
    asked_at: float  # monotonic: what was made after it is a live worker's
    reason: str


class MigRequests:
    def __init__(
        self,
        *,
        maker: Callable[[], Maker | None],
        checkpoint_path: str,
        node: Callable[[], Node | None],
        answer: Callable[[str, Message], None],
        rediscover: Callable[[str], object],
        on_count: Callable[[str, str], None] = lambda action, result: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._maker = maker  # NVML's MIG calls; None while NVML is not up
        self.checkpoint_path = checkpoint_path
        self._node = node  # the node as last discovered (which GPU a UUID is, its device names)
        self._answer = answer  # (resource, reply): posted to the main loop, which owns the socket
        self._rediscover = rediscover  # (trigger): thread-safe, it posts to the main loop
        self._on_count = on_count
        self._clock = clock
        self._queue: queue.Queue[MigClaimRequest | _Reconcile | None] = queue.Queue(MAX_QUEUE)
        self._thread: threading.Thread | None = None
        # What was made here and not yet destroyed here: (GPU, GI, CI) -> who asked, when, for what.
        self._made_for: dict[tuple[str, int, int], _Made] = {}
        self.counts: dict[str, int] = {"created": 0, "destroyed": 0, "failed": 0, "cleaned": 0}
        self.last_error = ""

    # ------------------------------------------------------------------ from the main loop
    def request(self, request: MigClaimRequest) -> None:
        self._start()
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self._reply(request, error=f"{MAX_QUEUE} MIG requests are waiting already: asked again later")

    def reconcile(self, gpus: frozenset[str], live: frozenset[int], reason: str) -> None:
        """Destroy, on these GPUs, the instances that no claim holds (see the module docstring)."""
        if not gpus:
            return
        self._start()
        try:
            self._queue.put_nowait(_Reconcile(gpus, live, self._clock(), reason))
        except queue.Full:
            log.warning("MIG clean-up (%s) not queued: the queue is full; it runs at the next change", reason)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(2.0)
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuvisor-mig", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, _Reconcile):
                    self._clean(item)
                else:
                    self._serve(item)
            except Exception as exc:  # a bug must not end the thread: say it, answer, go on
                log.exception("a MIG request failed unexpectedly")
                self.last_error = f"{type(exc).__name__}: {exc}"
                if isinstance(item, MigClaimRequest):
                    self._reply(item, error=f"the supervisor failed on the request: {self.last_error}")

    def _serve(self, req: MigClaimRequest) -> None:
        maker = self._maker()
        if maker is None:
            self._reply(req, error="NVML is not up on this node: no MIG device can be made or destroyed now")
            return
        changed = False
        try:
            if req.action == CREATE:
                changed = self._create(maker, req)
            elif req.action == DESTROY:
                changed = self._destroy(maker, req)
            elif req.action == FULL:
                changed = self._full(maker, req)
            else:
                self._reply(req, error=f"unknown MIG action {req.action!r:.40}")
        except Exception as exc:  # NVML's refusal (MigError, NVMLError): the claim's error
            self.last_error = str(exc)
            self._reply(req, error=str(exc) or type(exc).__name__)
        if changed:
            self._rediscover("mig")

    def _destroy(self, maker: Maker, req: MigClaimRequest) -> bool:
        """Destroy the claim's MIG device, if it is still the one there: GPU instance IDs are reused,
        so an instance at (GI, CI) with another UUID is another claim's, and the claim's own is gone."""
        key = (req.gpu_uuid, req.gi_id, req.ci_id)
        there = next(
            (m for m in maker.instances(req.gpu_uuid) if (m.gi_id, m.ci_id) == (req.gi_id, req.ci_id)), None
        )
        if there is None or (req.mig_uuid and there.uuid != req.mig_uuid):
            if there is not None:
                log.info("MIG device %s of claim %s is gone already (GPU instance %d is %s's now): not destroyed",
                         req.mig_uuid, req.claim_uid, req.gi_id, there.uuid)  # fmt: skip
            self._reply(req)
            return False
        maker.destroy(req.gpu_uuid, req.gi_id, req.ci_id)
        self._made_for.pop(key, None)
        self._count(DESTROY, "ok")
        self._reply(req)
        return True

    def _create(self, maker: Maker, req: MigClaimRequest) -> bool:
        """Make the claim's MIG device; whether NVML changed. A claim asking again for the device
        made for it at that placement (its first answer came too late) gets that one."""
        at = (req.gi_profile_id, req.placement_start)
        live = {m.uuid for m in maker.instances(req.gpu_uuid)}
        for (gpu, gi, ci), was in self._made_for.items():
            if gpu == req.gpu_uuid and (was.claim_uid, was.at) == (req.claim_uid, at) and was.uuid in live:
                self._made_for[(gpu, gi, ci)] = dataclasses.replace(
                    was, worker_pid=req.worker_pid, made_at=self._clock()
                )
                self._answer(req.resource, MigClaimReply(req.request_id, uuid=was.uuid, gi_id=gi, ci_id=ci))
                return False
        toggled = False
        if not maker.mig_mode(req.gpu_uuid).current:
            holder = self._holder(req.gpu_uuid, req.claim_uid)
            if holder:
                self._reply(
                    req, error=f"MIG mode is off on GPU {req.gpu_uuid} and {holder}: it is not turned on"
                )
                return False
            maker.set_mig_mode(req.gpu_uuid, True)
            toggled = True
            log.info("MIG mode turned on on GPU %s (a claim's MIG device is made on demand)", req.gpu_uuid)
        try:
            made = maker.create(req.gpu_uuid, req.gi_profile_id, req.placement_start)
        except Exception:
            if toggled:
                self._rediscover("mig")
            raise
        self._made_for[(made.gpu_uuid, made.gi_id, made.ci_id)] = _Made(
            req.worker_pid, self._clock(), req.claim_uid, made.uuid, at
        )
        self._count(CREATE, "ok")
        log.info(
            "MIG device %s made on GPU %s (GPU instance %d, compute instance %d) for claim %s",
            made.uuid, req.gpu_uuid, made.gi_id, made.ci_id, req.claim_uid,
        )  # fmt: skip
        self._answer(
            req.resource, MigClaimReply(req.request_id, uuid=made.uuid, gi_id=made.gi_id, ci_id=made.ci_id)
        )
        self._rediscover("mig-create")
        return False  # rediscovered already

    def _full(self, maker: Maker, req: MigClaimRequest) -> bool:
        """Clear the way for a claim of the whole GPU; whether NVML changed."""
        if not maker.mig_mode(req.gpu_uuid).current:
            self._reply(req)
            return False
        there = list(maker.instances(req.gpu_uuid))
        if there:
            names = ", ".join(f"{m.uuid} (GPU instance {m.gi_id})" for m in there[:4])
            self._reply(req, error=f"GPU {req.gpu_uuid} has MIG devices ({names}): it cannot be given whole")
            return False
        holder = self._holder(req.gpu_uuid, req.claim_uid)
        if holder:
            self._reply(req, error=f"MIG mode is on on GPU {req.gpu_uuid} and {holder}: it is not turned off")
            return False
        maker.set_mig_mode(req.gpu_uuid, False)
        log.info("MIG mode turned off on GPU %s (a claim gets it whole)", req.gpu_uuid)
        self._count(FULL, "ok")
        self._reply(req)
        return True

    def _holder(self, gpu_uuid: str, asking: str) -> str:
        """Which prepared claim (other than `asking`) holds a device of the GPU, said; "" none.
        A checkpoint that cannot be read holds everything: MIG mode is never toggled blind."""
        node = self._node()
        gpu = node.gpu_by_uuid(gpu_uuid) if node is not None else None
        if gpu is None:
            return "the GPU is not on this node as last discovered"
        whole = gpu_device_name(gpu)
        try:
            claims = read_claims(self.checkpoint_path)
        except CheckpointError as exc:
            return f"the DRA checkpoint cannot be read ({exc})"
        for claim in claims.values():
            for d in claim.devices:
                if claim.uid != asking and (d.device == whole or d.device.startswith(f"{whole}-mig-")):
                    return f"claim {claim.namespace}/{claim.name} holds its device {d.device}"
        return ""

    def _held(self) -> set[tuple[str, int, int]]:
        """The instances prepared claims hold: made for them, or named by their devices (a claim
        prepared before the node's GPUs were partitionable holds a static MIG device by its name).
        Raises CheckpointError."""
        claims = read_claims(self.checkpoint_path).values()
        held = {(d.made.gpu_uuid, d.made.gi_id, d.made.ci_id) for c in claims for d in c.devices if d.made}
        names = {d.device for c in claims for d in c.devices}
        node = self._node()
        for gpu in node.gpus if node is not None else ():
            for mig, name in static_migs(gpu):
                if name in names:  # a placement's name is its instance's
                    held.add((gpu.uuid, mig.gi_id, mig.ci_id))
        return held

    def _still_coming(self, was: _Made, item: _Reconcile) -> bool:
        """May the record of an instance made here still come? Its worker lives and made it less
        than GRACE_S ago, or it was made after this clean-up was asked for (by a worker the caller
        did not know yet)."""
        if was.made_at >= item.asked_at:
            return True
        return bool(was.worker_pid) and was.worker_pid in item.live and self._clock() - was.made_at < GRACE_S

    def _clean(self, item: _Reconcile) -> None:
        maker = self._maker()
        if maker is None:
            return
        try:
            held = self._held()
        except CheckpointError as exc:
            log.warning("MIG clean-up (%s) skipped: the DRA checkpoint cannot be read (%s)", item.reason, exc)
            return
        destroyed = 0
        for gpu in sorted(item.gpus):
            try:
                found = list(maker.instances(gpu))
            except Exception as exc:
                log.warning(
                    "MIG clean-up (%s): the instances of GPU %s cannot be listed: %s", item.reason, gpu, exc
                )
                continue
            for m in found:
                key = (m.gpu_uuid, m.gi_id, m.ci_id)
                was = self._made_for.get(key)
                if key in held or (was is not None and self._still_coming(was, item)):
                    continue
                try:
                    maker.destroy(m.gpu_uuid, m.gi_id, m.ci_id)
                except Exception as exc:
                    log.warning(
                        "MIG device %s on GPU %s, which no claim holds, cannot be destroyed: %s",
                        m.uuid,
                        gpu,
                        exc,
                    )
                    continue
                self._made_for.pop(key, None)
                destroyed += 1
                log.warning(
                    "MIG device %s on GPU %s (GPU instance %d) destroyed (%s): no prepared claim holds it "
                    "(left by a crash between its creation and its record, or made by hand)",
                    m.uuid, gpu, m.gi_id, item.reason,
                )  # fmt: skip
        self.counts["cleaned"] += destroyed
        if destroyed:
            self._rediscover("mig")

    # ------------------------------------------------------------------ answers and status
    def _reply(self, req: MigClaimRequest, *, error: str = "") -> None:
        if error:
            self.counts["failed"] += 1
            self._on_count(f"mig:{req.action}", "refused")
            log.warning(
                "MIG %s for claim %s on GPU %s refused: %s", req.action, req.claim_uid, req.gpu_uuid, error
            )
        self._answer(req.resource, MigClaimReply(req.request_id, error=error))

    def _count(self, action: str, result: str) -> None:
        if result == "ok":
            key = {CREATE: "created", DESTROY: "destroyed"}.get(action)
            if key:
                self.counts[key] += 1
        self._on_count(f"mig:{action}", result)

    def status(self) -> dict[str, Json]:
        out: dict[str, Any] = dict(self.counts)
        out["waiting"] = self._queue.qsize()
        out["last_error"] = self.last_error
        return out
