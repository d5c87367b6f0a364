"""The one way into NVML: discovery, event watching and health probes over a `pynvml`-like module.

`Nvml` takes the module as a parameter: the real `pynvml` (nvidia-ml-py) on a node, or a
`common.simulator.Simulator` in tests and demos, so the code that runs on a GPU node is the
code the tests run. Nothing NVML-shaped leaks out: discovery returns `common.model.Node`, events
and probes come back as small frozen dataclasses, and NVML failures a caller must act on are
raised as `NvmlCallError` carrying the function name, the NVML return code and the original
`NVMLError`.

Choices worth knowing:
- A MIG device's profile name ("1g.10gb", "1g.10gb+me") is read the way NVML documents it: the
  device's GPU instance id -> `nvmlDeviceGetGpuInstanceById` -> `nvmlGpuInstanceGetInfo`
  (profile id) -> the parent's `nvmlDeviceGetGpuInstanceProfileInfo` entry with that id, whose
  v2 struct carries the name. If that path is refused (old driver, permissions) the name is
  rebuilt from the device attributes (slices, memory as a fraction of the GPU's).
- NVLink counts come from each link's state and remote PCI address: a remote that is a peer
  GPU is a direct link; any other remote (an NVSwitch, as on DGX/HGX boards) is a switch link,
  and two GPUs both on switches count min(switch links of each) between them, as
  `nvidia-smi topo -m` shows NV12/NV18 there.
- NUMA comes from `nvmlDeviceGetNumaNodeId`; where the driver or binding lacks it, from
  `/sys/bus/pci/devices/<bus id>/numa_node`.
- A GPU that is lost at discovery is left out of the `Node` (with a warning): it cannot be
  described, and the health pipeline learns of it through probes and XID 79.
- `node_facts()` is GPU Feature Discovery's reading of the node (for the node labels), with
  GFD's failure rules: any GPU it cannot describe fails the call. The PCI class comes from sysfs
  as GFD reads it; `sysfs_root=None` says the GPUs have no sysfs here (a simulated node), and
  then it comes from `nvmlDeviceGetPciInfoExt`.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from common import nodefacts
from common.model import TOPOLOGY_SYSTEM, Gpu, Link, MigDevice, Node

log = logging.getLogger(__name__)

# NVML return codes (nvmlReturn_t): part of NVML's C ABI, identical in every binding version.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_NO_INSTANCE = 0xFFFFFFFF
_MIB = 1024 * 1024
_NVLINK_DEVICE_TYPE_GPU = 0
_GI_PROFILE_1_SLICE_REV1 = 0x7  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: the "+me" profile
_UNAVAILABLE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)

EventKind = Literal["xid", "single-bit-ecc", "double-bit-ecc", "other"]
ProbeStatus = Literal["ok", "lost", "pending-retirement", "remapped-rows-pending", "row-remap-failure", "not-found", "error"]


class NvmlCallError(Exception):
    """An NVML call failed. `code` is the NVML return code, `error` the binding's NVMLError."""

    def __init__(self, function: str, code: int, error: BaseException | None = None) -> None:
        super().__init__(f"{function} failed: {error if error is not None else 'not available'} (NVML code {code})")
        self.function = function
        self.code = code
        self.error = error

    @property
    def gpu_lost(self) -> bool:
        return self.code == NVML_ERROR_GPU_IS_LOST


@dataclass(frozen=True)
class NvmlEvent:
    """One event from the event set. `gpu_uuid` is None when NVML named a device we cannot tell."""

    gpu_uuid: str | None
    event_type: int  # nvmlEventType* bit
    kind: EventKind
    data: int  # eventData: the XID number for XID events
    gi_id: int | None  # GPU instance on a MIG GPU, None when the event names none
    ci_id: int | None

    @property
    def xid(self) -> int | None:
        return self.data if self.kind == "xid" else None


@dataclass(frozen=True)
class ProbeResult:
    """What a cheap health probe of one GPU or MIG device found."""

    uuid: str
    status: ProbeStatus
    code: int | None = None  # the NVML return code behind "lost" / "not-found" / "error"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle: the pointer value for real ctypes handles."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" as sysfs names it: "0000:18:00.0"."""
    domain, rest = bus_id.strip().split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def mig_profile_name(slices: int, memory_mib: int, gpu_memory_mib: int, media_extensions: bool = False) -> str:
    """A MIG profile name rebuilt from sizes: memory is named by its share of the GPU, in eighths."""
    total_gb = math.ceil(gpu_memory_mib / 1024)
    eighths = math.ceil(memory_mib * 8 / gpu_memory_mib) if gpu_memory_mib else 0
    gb = round(eighths * total_gb / 8)
    return f"{slices}g.{gb}gb" + ("+me" if media_extensions else "")


class EventWatch:
    """An NVML event set with XID and ECC events registered on every GPU that supports them."""

    def __init__(self, nvml: Nvml, event_set: Any, uuids: dict[Any, str], registered: dict[str, int], skipped: dict[str, str]) -> None:
        self._nvml = nvml
        self._set = event_set
        self._uuids = uuids
        self.registered = registered  # GPU UUID -> registered event mask
        self.skipped = skipped  # GPU UUID (or "index N") -> why nothing is registered for it
        self._closed = False

    def wait(self, timeout_ms: int) -> NvmlEvent | None:
        """The next event, or None when `timeout_ms` passes. Other NVML errors raise NvmlCallError."""
        m = self._nvml.module
        try:
            data = m.nvmlEventSetWait_v2(self._set, timeout_ms)
        except m.NVMLError as exc:
            code = int(getattr(exc, "value", NVML_ERROR_UNKNOWN))
            if code == NVML_ERROR_TIMEOUT:
                return None
            raise NvmlCallError("nvmlEventSetWait_v2", code, exc) from exc
        uuid = self._event_uuid(data.device)
        event_type = int(data.eventType)
        kind: EventKind = "other"
        if event_type & m.nvmlEventTypeXidCriticalError:
            kind = "xid"
        elif event_type & m.nvmlEventTypeDoubleBitEccError:
            kind = "double-bit-ecc"
        elif event_type & m.nvmlEventTypeSingleBitEccError:
            kind = "single-bit-ecc"
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return NvmlEvent(
            gpu_uuid=uuid,
            event_type=event_type,
            kind=kind,
            data=int(data.eventData),
            gi_id=None if gi == _NO_INSTANCE else gi,
            ci_id=None if ci == _NO_INSTANCE else ci,
        )

    def _event_uuid(self, device: Any) -> str | None:
        """The physical GPU an event names: looked up among the registered handles first, since a
        lost GPU's handle can no longer tell its own UUID."""
        uuid = self._uuids.get(_handle_key(device))
        if uuid is not None:
            return uuid
        m = self._nvml.module
        try:
            # Not a handle we registered: if it is a MIG device, report its parent GPU.
            is_mig = m.nvmlDeviceIsMigDeviceHandle(device)
            if bool(getattr(is_mig, "value", is_mig)):
                device = m.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
                uuid = self._uuids.get(_handle_key(device))
            return uuid if uuid is not None else _text(m.nvmlDeviceGetUUID(device))
        except m.NVMLError:
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        m = self._nvml.module
        try:
            m.nvmlEventSetFree(self._set)
        except m.NVMLError as exc:
            # After nvmlShutdown the set is gone with the library state; nothing to free.
            log.debug("nvmlEventSetFree failed: %s", exc)

    def __enter__(self) -> EventWatch:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Nvml:
    """NVML access for gpuvisor over `module`: the real `pynvml` or a simulator."""

    def __init__(self, module: Any, sysfs_root: str | Path | None = "/sys") -> None:
        self.module = module
        self._sysfs = None if sysfs_root is None else Path(sysfs_root)
        self._initialized = False
        self._lost: set[int] = set()  # GPU indexes discovery already reported lost (said once)

    # ------------------------------------------------------------ calls

    def _call(self, function: str, *args: Any) -> Any:
        fn = getattr(self.module, function, None)
        if fn is None:
            raise NvmlCallError(function, NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return fn(*args)
        except self.module.NVMLError as exc:
            raise NvmlCallError(function, int(getattr(exc, "value", NVML_ERROR_UNKNOWN)), exc) from exc

    def _try(self, function: str, *args: Any, tolerate: tuple[int, ...] = _UNAVAILABLE) -> Any:
        """Like _call, but None when NVML answers with one of the `tolerate` codes."""
        try:
            return self._call(function, *args)
        except NvmlCallError as exc:
            if exc.code in tolerate:
                return None
            raise

    def init(self) -> None:
        """nvmlInit; raises NvmlCallError (e.g. code 12, library not found, on a node without a driver)."""
        self._call("nvmlInit")
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            self._call("nvmlShutdown")

    def __enter__(self) -> Nvml:
        self.init()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()

    # ------------------------------------------------------------ discovery

    def discover(self) -> Node:
        """Describe the node: GPUs, their MIG devices and the topology between every pair."""
        count = int(self._call("nvmlDeviceGetCount"))
        driver = _text(self._call("nvmlSystemGetDriverVersion"))
        cuda = self._try("nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._try("nvmlSystemGetCudaDriverVersion")
        gpus: list[Gpu] = []
        handles: list[Any] = []
        for i in range(count):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", i)
                gpus.append(self._describe_gpu(i, handle))
                handles.append(handle)
            except NvmlCallError as exc:
                if not exc.gpu_lost:
                    raise
                level = logging.DEBUG if i in self._lost else logging.WARNING  # once, not every rediscovery
                log.log(level, "GPU %d is lost; leaving it out of discovery", i, extra={"device": str(i)})
                self._lost.add(i)
                continue
            self._lost.discard(i)
        return Node(
            gpus=tuple(gpus),
            links=self._links(gpus, handles),
            driver_version=driver,
            cuda_driver_version=int(cuda or 0),
        )

    def _describe_gpu(self, index: int, h: Any) -> Gpu:
        uuid = _text(self._call("nvmlDeviceGetUUID", h))
        memory_mib = int(self._call("nvmlDeviceGetMemoryInfo", h).total) // _MIB
        bus_id = _text(self._call("nvmlDeviceGetPciInfo", h).busId)
        major, minor_cc = self._call("nvmlDeviceGetCudaComputeCapability", h)
        _capable, mig_enabled = self._mig_mode(h)
        return Gpu(
            index=index,
            uuid=uuid,
            minor=int(self._call("nvmlDeviceGetMinorNumber", h)),
            name=_text(self._call("nvmlDeviceGetName", h)),
            memory_mib=memory_mib,
            pci_bus_id=bus_id,
            numa_node=self._numa(h, bus_id),
            compute_capability=(int(major), int(minor_cc)),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(index, uuid, h, memory_mib) if mig_enabled else (),
        )

    def _numa(self, h: Any, bus_id: str) -> int | None:
        node = self._try("nvmlDeviceGetNumaNodeId", h)
        if node is not None:
            return int(node) if int(node) >= 0 else None
        if self._sysfs is None:
            return None
        try:
            text = (self._sysfs / "bus/pci/devices" / sysfs_bus_id(bus_id) / "numa_node").read_text()
            value = int(text.strip())
        except (OSError, ValueError):
            return None
        return value if value >= 0 else None

    def _mig_mode(self, h: Any) -> tuple[bool, bool]:
        """(MIG-capable, MIG enabled): NotSupported or no symbol is not capable (as go-nvlib says)."""
        mode = self._try("nvmlDeviceGetMigMode", h)
        return mode is not None, mode is not None and int(mode[0]) == int(getattr(self.module, "NVML_DEVICE_MIG_ENABLE", 1))

    def _each_mig(self, h: Any, gpu_memory_mib: int) -> Iterator[tuple[int, Any, int, Any, str]]:
        """The MIG devices of the GPU `h`: (index, handle, GPU instance id, attributes, profile)."""
        profiles = self._gi_profiles(h)
        for j in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h))):
            mh = self._try("nvmlDeviceGetMigDeviceHandleByIndex", h, j, tolerate=(NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT))
            if mh is None:
                continue
            gi = int(self._call("nvmlDeviceGetGpuInstanceId", mh))
            attrs = self._call("nvmlDeviceGetAttributes", mh)
            yield j, mh, gi, attrs, self._mig_profile(h, gi, attrs, profiles, gpu_memory_mib)

    def _mig_devices(self, parent_index: int, parent_uuid: str, h: Any, gpu_memory_mib: int) -> tuple[MigDevice, ...]:
        return tuple(
            MigDevice(
                uuid=_text(self._call("nvmlDeviceGetUUID", mh)),
                parent_uuid=parent_uuid,
                parent_index=parent_index,
                index=j,
                gi_id=gi,
                ci_id=int(self._call("nvmlDeviceGetComputeInstanceId", mh)),
                profile=profile,
                memory_mib=int(attrs.memorySizeMB),
            )
            for j, mh, gi, attrs, profile in self._each_mig(h, gpu_memory_mib)
        )

    def _gi_profiles(self, h: Any) -> dict[int, tuple[int, Any]]:
        """The parent's GPU-instance profiles: profile id -> (NVML profile enum, profile info)."""
        table: dict[int, tuple[int, Any]] = {}
        count = int(getattr(self.module, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))
        refused = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NO_PERMISSION, NVML_ERROR_FUNCTION_NOT_FOUND)
        for enum in range(count):
            info = self._try("nvmlDeviceGetGpuInstanceProfileInfo", h, enum, tolerate=refused)
            if info is not None:
                table[int(info.id)] = (enum, info)
        return table

    def _mig_profile(self, h: Any, gi: int, attrs: Any, profiles: dict[int, tuple[int, Any]], gpu_memory_mib: int) -> str:
        gi_slices = int(attrs.gpuInstanceSliceCount)
        ci_slices = int(attrs.computeInstanceSliceCount)
        name = ""
        try:
            info = self._call("nvmlGpuInstanceGetInfo", self._call("nvmlDeviceGetGpuInstanceById", h, gi))
            enum, prof = profiles.get(int(info.profileId), (-1, None))
            if prof is not None:
                name = _text(getattr(prof, "name", "")).removeprefix("MIG ").strip()
                if not name:
                    name = mig_profile_name(int(prof.sliceCount), int(prof.memorySizeMB), gpu_memory_mib, enum == _GI_PROFILE_1_SLICE_REV1)
        except NvmlCallError as exc:
            if exc.gpu_lost:
                raise
            log.debug("GPU instance lookup failed (%s); naming the MIG profile from its attributes", exc)
        if not name:
            name = mig_profile_name(gi_slices, int(attrs.memorySizeMB), gpu_memory_mib)
        # A compute instance smaller than its GPU instance is named like nvidia-smi does: "1c.3g.40gb".
        if ci_slices and ci_slices != gi_slices:
            name = f"{ci_slices}c.{name}"
        return name

    def _links(self, gpus: list[Gpu], handles: list[Any]) -> tuple[Link, ...]:
        by_bus = {sysfs_bus_id(g.pci_bus_id): k for k, g in enumerate(gpus)}
        direct: dict[tuple[int, int], int] = {}
        switch = [0] * len(gpus)
        max_links = int(getattr(self.module, "NVML_NVLINK_MAX_LINKS", 18))
        active = int(getattr(self.module, "NVML_FEATURE_ENABLED", 1))
        skip = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_FUNCTION_NOT_FOUND)
        for k, h in enumerate(handles):
            for link in range(max_links):
                if self._try("nvmlDeviceGetNvLinkState", h, link, tolerate=skip) != active:
                    continue
                remote = self._try("nvmlDeviceGetNvLinkRemotePciInfo", h, link, tolerate=skip)
                if remote is None:
                    continue
                peer = by_bus.get(sysfs_bus_id(_text(remote.busId)))
                if peer is not None and peer != k:
                    direct[(k, peer)] = direct.get((k, peer), 0) + 1
                    continue
                kind = self._try("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, tolerate=skip)
                if kind is None or int(kind) != _NVLINK_DEVICE_TYPE_GPU:
                    switch[k] += 1
        links: list[Link] = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                level = self._try("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
                count = max(direct.get((a, b), 0), direct.get((b, a), 0)) + min(switch[a], switch[b])
                links.append(
                    Link(
                        a=gpus[a].index,
                        b=gpus[b].index,
                        ancestor=TOPOLOGY_SYSTEM if level is None else int(level),
                        nvlinks=count,
                    )
                )
        return tuple(links)

    # ------------------------------------------------------------ events

    def watch_events(self) -> EventWatch:
        """An event set with XID and single/double-bit ECC events on every GPU that supports them.

        A GPU that supports none of them, or only some, is registered for what it supports; one
        that is lost, or that fails any other per-GPU call, is skipped with the reason, so one bad
        GPU never costs the others their events. Both are listed in `EventWatch.skipped` /
        `.registered`. What fails the whole set raises NvmlCallError: the set itself or the device
        count, or every GPU failing with an error other than "GPU lost" (then NVML is broken
        rather than one GPU, and the caller's wait-failure handling applies).
        """
        m = self.module
        wanted = int(m.nvmlEventTypeXidCriticalError | m.nvmlEventTypeSingleBitEccError | m.nvmlEventTypeDoubleBitEccError)
        event_set = self._call("nvmlEventSetCreate")
        uuids: dict[Any, str] = {}
        registered: dict[str, int] = {}
        skipped: dict[str, str] = {}
        errors: list[NvmlCallError] = []
        try:
            count = int(self._call("nvmlDeviceGetCount"))
            for i in range(count):
                uuid = ""
                try:
                    h = self._call("nvmlDeviceGetHandleByIndex", i)
                    uuid = _text(self._call("nvmlDeviceGetUUID", h))
                    supported = self._try("nvmlDeviceGetSupportedEventTypes", h)
                    mask = wanted & (int(supported) if supported is not None else wanted)
                    done = self._register(h, uuid, mask, event_set)
                except NvmlCallError as exc:
                    key = uuid or f"index {i}"
                    if exc.gpu_lost:
                        skipped[key] = "GPU is lost"
                    else:
                        skipped[key] = f"cannot register its events: {exc}"
                        errors.append(exc)
                    continue
                if done:
                    registered[uuid] = done
                    uuids[_handle_key(h)] = uuid
                else:
                    skipped[uuid] = "no XID/ECC event type supported"
            if errors and not registered:
                raise errors[0]
        except NvmlCallError:
            EventWatch(self, event_set, {}, {}, {}).close()
            raise
        return EventWatch(self, event_set, uuids, registered, skipped)

    def _register(self, h: Any, uuid: str, mask: int, event_set: Any) -> int:
        """Register `mask` (type by type if NVML refuses it whole); returns what was registered."""
        if not mask:
            return 0
        try:
            self._call("nvmlDeviceRegisterEvents", h, mask, event_set)
            return mask
        except NvmlCallError as exc:
            if exc.gpu_lost:
                return 0
            if exc.code != NVML_ERROR_NOT_SUPPORTED:
                raise
        done = 0
        for bit in (1 << n for n in range(mask.bit_length()) if mask & (1 << n)):
            try:
                self._call("nvmlDeviceRegisterEvents", h, bit, event_set)
                done |= bit
            except NvmlCallError as exc:
                if exc.code != NVML_ERROR_NOT_SUPPORTED and not exc.gpu_lost:
                    raise
        log.info("GPU %s accepts only event mask 0x%x of 0x%x", uuid, done, mask, extra={"device": uuid})
        return done

    # ------------------------------------------------------------ probes

    def probe(self, uuid: str) -> ProbeResult:
        """A few cheap queries: is the device reachable, and is a reset pending for its memory?"""
        try:
            h = self._call("nvmlDeviceGetHandleByUUID", uuid)
            is_mig = self._call("nvmlDeviceIsMigDeviceHandle", h)
            if bool(getattr(is_mig, "value", is_mig)):
                h = self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", h)
            self._call("nvmlDeviceGetMemoryInfo", h)  # reaches the GPU: a lost one fails here
            pending = self._try("nvmlDeviceGetRetiredPagesPendingStatus", h)
            rows = self._try("nvmlDeviceGetRemappedRows", h)
        except NvmlCallError as exc:
            if exc.gpu_lost:
                return ProbeResult(uuid, "lost", exc.code, str(exc))
            if exc.code == NVML_ERROR_NOT_FOUND:
                return ProbeResult(uuid, "not-found", exc.code, str(exc))
            return ProbeResult(uuid, "error", exc.code, str(exc))
        if rows is not None and int(rows[3]):
            return ProbeResult(uuid, "row-remap-failure", None, "row remapping failed")
        if pending is not None and int(pending):
            return ProbeResult(uuid, "pending-retirement", None, "retired pages pending a reset")
        if rows is not None and int(rows[2]):
            return ProbeResult(uuid, "remapped-rows-pending", None, "remapped rows pending a reset")
        return ProbeResult(uuid, "ok")

    # ------------------------------------------------------------ GPU Feature Discovery's facts

    def node_facts(self) -> nodefacts.NodeFacts:
        """What GFD v0.20.0 (internal/lm, internal/resource) reads for the labels. Raises NvmlCallError
        where GFD fails; only the memory size (0) and the PCI class (None) may be missing."""
        count = int(self._call("nvmlDeviceGetCount"))
        gpus = tuple(self._gpu_facts(i, self._call("nvmlDeviceGetHandleByIndex", i)) for i in range(count))
        if not gpus:  # GFD asks for the versions only when there are devices
            return nodefacts.NodeFacts()
        driver = _text(self._call("nvmlSystemGetDriverVersion"))
        return nodefacts.NodeFacts(driver, int(self._call("nvmlSystemGetCudaDriverVersion")), gpus)

    def _gpu_facts(self, index: int, h: Any) -> nodefacts.GpuFacts:
        name = _text(self._call("nvmlDeviceGetName", h))
        try:
            memory_mib = int(self._call("nvmlDeviceGetMemoryInfo", h).total) // _MIB
        except NvmlCallError as exc:
            log.warning("GPU %d: no memory size (%s); its memory label is left out, as GFD does", index, exc)
            memory_mib = 0
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", h)
        capable, enabled = self._mig_mode(h)
        return nodefacts.GpuFacts(
            index=index,
            name=name,
            memory_mib=memory_mib,
            compute_capability=(int(major), int(minor)),
            mig_capable=capable,
            mig_enabled=enabled,
            migs=self._mig_facts(h, memory_mib) if enabled else (),
            pci_class=self._pci_class(h),
            fabric=self._fabric_clique(h),
        )

    def _mig_facts(self, h: Any, gpu_memory_mib: int) -> tuple[nodefacts.MigFacts, ...]:
        return tuple(
            nodefacts.MigFacts(
                profile=profile,
                memory_mib=int(attrs.memorySizeMB),
                multiprocessors=int(attrs.multiprocessorCount),
                gi_slices=int(attrs.gpuInstanceSliceCount),
                ci_slices=int(attrs.computeInstanceSliceCount),
                copy_engines=int(attrs.sharedCopyEngineCount),
                decoders=int(attrs.sharedDecoderCount),
                encoders=int(attrs.sharedEncoderCount),
                jpegs=int(attrs.sharedJpegCount),
                ofas=int(attrs.sharedOfaCount),
            )
            for _j, _mh, _gi, attrs, profile in self._each_mig(h, gpu_memory_mib)
        )

    def _pci_class(self, h: Any) -> int | None:
        """The GPU's PCI class from sysfs, as GFD reads it; None when unknown (gpu.mode "unknown")."""
        try:
            if self._sysfs is not None:
                return nodefacts.read_pci_class(self._sysfs, _text(self._call("nvmlDeviceGetPciInfo", h).busId))
            info = self.module.nvmlPciInfoExt_v1_t()  # no sysfs for these GPUs: ask NVML
            info.version = self.module.nvmlPciInfoExt_v1
            self._call("nvmlDeviceGetPciInfoExt", h, ctypes.byref(info))
        except (NvmlCallError, AttributeError):  # AttributeError: a binding without the call
            return None
        return nodefacts.pci_gpu_class(int(info.baseClass) << 16 | int(info.subClass) << 8)

    def _fabric_clique(self, h: Any) -> nodefacts.FabricClique | None:
        """go-nvlib IsFabricAttached + GetFabricIDs: the v1 call if the library has it, else the V one."""
        for function, struct in (("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"), ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t")):
            cls = getattr(self.module, struct, None)
            if cls is None:  # an nvidia-ml-py older than the call
                continue
            info = cls()
            try:
                self._call(function, h, ctypes.byref(info))
            except NvmlCallError as exc:
                if exc.code == NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                if exc.code == NVML_ERROR_NOT_SUPPORTED:
                    return None
                raise
            return nodefacts.fabric_clique(bytes(info.clusterUuid), int(info.cliqueId), int(info.state), int(info.status))
        return None
