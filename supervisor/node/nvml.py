"""The one way into NVML: calls, discovery and health probes over a `pynvml`-like module.

`Nvml` takes the module as a parameter: the real `pynvml` (nvidia-ml-py) on a node, or a
`supervisor.sim.nvml.Simulator` in tests and demos, so the code that runs on a GPU node is the
code the tests run. Every NVML call goes through `Nvml.call` (or `try_call`, for what a GPU may
not support). Nothing NVML-shaped leaks out: discovery returns `common.model.Node`, probes come
back as small frozen dataclasses, and NVML failures a caller must act on are raised as
`NvmlCallError` carrying the function name, the NVML return code and the original `NVMLError`.
The event set is `supervisor.node.events`, GPU Feature Discovery's reading of the node
`supervisor.node.facts.facts_from_nvml`; both go through this adapter.

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
- `Nvml(..., mig_options=True)` also fills each MIG-capable GPU's `mig_options` (every profile at
  every placement, `supervisor.node.migplace`), whether MIG mode is on or not; off by default.
- A GPU that is lost at discovery is left out of the `Node` (with a warning): it cannot be
  described, and the health pipeline learns of it through probes and XID 79.
- `sysfs_root=None` says the GPUs have no sysfs here (a simulated node without a simulated PCIe
  tree): the NUMA node and the PCI class (for the labels) then come from NVML alone, and the
  PCIe root and sysfs NUMA node that NVIDIA's DRA driver publishes are unknown
  (`supervisor.node.pcie` reads them where there is a sysfs).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple

from common.model import TOPOLOGY_SYSTEM, Gpu, GpuPair, MigDevice, MigOption, Node
from supervisor.node import migplace
from supervisor.node.migplace import mig_profile_name as mig_profile_name
from supervisor.node.pcie import nvlib_bus_id, pci_numa_node, pcie_root

log = logging.getLogger("gpuvisor.nvml")

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

NO_INSTANCE = 0xFFFFFFFF  # NVML's "no GPU/compute instance"
MIB = 1024 * 1024
_NVLINK_DEVICE_TYPE_GPU = 0
_GI_PROFILE_1_SLICE_REV1 = 0x7  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: the "+me" profile
UNAVAILABLE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)

ProbeStatus = Literal[
    "ok", "lost", "pending-retirement", "remapped-rows-pending", "row-remap-failure", "not-found", "error"
]


class NvmlCallError(Exception):
    """An NVML call failed. `code` is the NVML return code, `error` the binding's NVMLError."""

    def __init__(self, function: str, code: int, error: BaseException | None = None) -> None:
        super().__init__(
            f"{function} failed: {error if error is not None else 'not available'} (NVML code {code})"
        )
        self.function = function
        self.code = code
        self.error = error

    @property
    def gpu_lost(self) -> bool:
        return self.code == NVML_ERROR_GPU_IS_LOST


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


class MigView(NamedTuple):
    """One MIG device as `Nvml.each_mig` reads it: NVML's own structs, for discovery and GFD's facts."""

    position: int  # among the parent's MIG devices: the `j` of the `i:j` index
    handle: Any
    gi: int  # GPU instance id
    attrs: Any  # nvmlDeviceGetAttributes
    profile: str  # "1g.10gb", "1g.10gb+me", "1c.3g.40gb"
    gi_info: Any  # nvmlGpuInstanceGetInfo (profile id, placement), or None
    gi_profile: Any  # the parent's nvmlDeviceGetGpuInstanceProfileInfo for that profile, or None


# nvmlBrandType_t and nvmlDeviceArchitecture_t (NVML's ABI), named as go-nvlib's
# GetBrandAsString / GetArchitectureAsString name them: what NVIDIA's DRA driver publishes.
BRANDS = {
    0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
    7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
    12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}  # fmt: skip
ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada Lovelace",
    9: "Hopper", 10: "Blackwell", 13: "Rubin", 0xFFFFFFFF: "Unknown",
}  # fmt: skip


# nvmlDeviceAddressingModeType_t, named as go-nvlib's GetAddressingModeAsString names it.
ADDRESSING_MODES = {0: "None", 1: "HMM", 2: "ATS"}


def architecture_of(compute_capability: tuple[int, int]) -> str:
    """The architecture a compute capability belongs to, for an NVML without the architecture call
    (the NVML simulator, old drivers): CUDA's table of compute capabilities."""
    major, minor = compute_capability
    if major == 7:
        return "Turing" if minor >= 5 else "Volta"
    if major == 8:
        return "Ada Lovelace" if minor == 9 else "Ampere"
    return {
        3: "Kepler",
        5: "Maxwell",
        6: "Pascal",
        9: "Hopper",
        10: "Blackwell",
        11: "Blackwell",
        12: "Blackwell",
    }.get(major, "")


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle: the pointer value for real ctypes handles."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" as sysfs names it: "0000:18:00.0"."""
    domain, rest = bus_id.strip().split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


class Nvml:
    """NVML access for gpuvisor over `module`: the real `pynvml` or a simulator."""

    def __init__(
        self, module: Any, sysfs_root: str | Path | None = "/sys", mig_options: bool = False
    ) -> None:
        self.module = module
        self.with_mig_options = mig_options  # discovery fills Gpu.mig_options (MIG on demand)
        self.sysfs = None if sysfs_root is None else Path(sysfs_root)
        self._initialized = False
        self._lost: set[int] = set()  # GPU indexes discovery already reported lost (said once)

    # ------------------------------------------------------------ calls

    def call(self, function: str, *args: Any) -> Any:
        fn = getattr(self.module, function, None)
        if fn is None:
            raise NvmlCallError(function, NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return fn(*args)
        except self.module.NVMLError as exc:
            raise NvmlCallError(function, int(getattr(exc, "value", NVML_ERROR_UNKNOWN)), exc) from exc

    def try_call(self, function: str, *args: Any, tolerate: tuple[int, ...] = UNAVAILABLE) -> Any:
        """Like call, but None when NVML answers with one of the `tolerate` codes."""
        try:
            return self.call(function, *args)
        except NvmlCallError as exc:
            if exc.code in tolerate:
                return None
            raise

    def init(self) -> None:
        """nvmlInit; raises NvmlCallError (e.g. code 12, library not found, on a node without a driver)."""
        self.call("nvmlInit")
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            self.call("nvmlShutdown")

    def __enter__(self) -> Nvml:
        self.init()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    # ------------------------------------------------------------ discovery

    def discover(self) -> Node:
        """Describe the node: GPUs, their MIG devices and the topology between every pair."""
        count = int(self.call("nvmlDeviceGetCount"))
        driver = text(self.call("nvmlSystemGetDriverVersion"))
        cuda = self.try_call("nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self.try_call("nvmlSystemGetCudaDriverVersion")
        gpus: list[Gpu] = []
        handles: list[Any] = []
        for i in range(count):
            try:
                handle = self.call("nvmlDeviceGetHandleByIndex", i)
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
        uuid = text(self.call("nvmlDeviceGetUUID", h))
        memory_mib = int(self.call("nvmlDeviceGetMemoryInfo", h).total) // MIB
        bus_id = text(self.call("nvmlDeviceGetPciInfo", h).busId)
        major, minor_cc = self.call("nvmlDeviceGetCudaComputeCapability", h)
        capable, mig_enabled = self.mig_mode(h)
        brand = self.try_call("nvmlDeviceGetBrand", h)
        arch = self.try_call("nvmlDeviceGetArchitecture", h)
        nvlib_bus = nvlib_bus_id(bus_id)
        return Gpu(
            index=index,
            uuid=uuid,
            minor=int(self.call("nvmlDeviceGetMinorNumber", h)),
            name=text(self.call("nvmlDeviceGetName", h)),
            memory_mib=memory_mib,
            pci_bus_id=bus_id,
            numa_node=self._numa(h, bus_id),
            compute_capability=(int(major), int(minor_cc)),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(index, uuid, h, memory_mib) if mig_enabled else (),
            brand=BRANDS.get(int(brand), "") if brand is not None else "",
            architecture=ARCHITECTURES.get(int(arch), "")
            if arch is not None
            else architecture_of((int(major), int(minor_cc))),
            pcie_root=(pcie_root(self.sysfs, nvlib_bus) or "") if self.sysfs is not None else "",
            pci_numa_node=pci_numa_node(self.sysfs, nvlib_bus) if self.sysfs is not None else None,
            addressing_mode=self._addressing_mode(index, h),
            mig_options=self._mig_options(index, h) if capable and self.with_mig_options else (),
        )

    def _mig_options(self, index: int, h: Any) -> tuple[MigOption, ...]:
        """Every placement of every profile (`migplace`). A lost GPU fails its discovery (and is left
        out, as always); any other failure leaves it without options, with a warning."""
        try:
            return migplace.mig_options(self.module, h)
        except self.module.NVMLError as exc:
            code = int(getattr(exc, "value", NVML_ERROR_UNKNOWN))
            if code == NVML_ERROR_GPU_IS_LOST:
                raise NvmlCallError("nvmlDeviceGetGpuInstanceProfileInfo", code, exc) from exc
            log.warning(
                "GPU %d: reading its MIG profiles and placements failed (%s, NVML code %d); it offers"
                " no MIG device on demand", index, exc, code, extra={"device": str(index)},
            )  # fmt: skip
            return ()

    def _addressing_mode(self, index: int, h: Any) -> str:
        """NVML's addressing mode as go-nvlib's GetAddressingModeAsString names it ("ATS", "HMM",
        "None"); "" where NVML lacks the call or the platform does not support it (NotSupported).
        NVIDIA's driver fails discovery on any other answer; gpuvisor leaves the attribute out
        with a warning instead (a lost GPU still fails discovery of that GPU)."""
        try:
            mode = self.try_call("nvmlDeviceGetAddressingMode", h)
        except NvmlCallError as exc:
            if exc.gpu_lost:
                raise
            log.warning("GPU %d: %s; publishing no addressing mode", index, exc, extra={"device": str(index)})
            return ""
        if mode is None:
            return ""
        name = ADDRESSING_MODES.get(int(getattr(mode, "value", mode)), "")
        if not name:
            log.warning("GPU %d: unknown NVML addressing mode %s", index, mode, extra={"device": str(index)})
        return name

    def _numa(self, h: Any, bus_id: str) -> int | None:
        node = self.try_call("nvmlDeviceGetNumaNodeId", h)
        if node is not None:
            return int(node) if int(node) >= 0 else None
        if self.sysfs is None:
            return None
        try:
            text = (self.sysfs / "bus/pci/devices" / sysfs_bus_id(bus_id) / "numa_node").read_text()
            value = int(text.strip())
        except (OSError, ValueError):
            return None
        return value if value >= 0 else None

    def mig_mode(self, h: Any) -> tuple[bool, bool]:
        """(MIG-capable, MIG enabled): NotSupported or no symbol is not capable (as go-nvlib says)."""
        mode = self.try_call("nvmlDeviceGetMigMode", h)
        return mode is not None, mode is not None and int(mode[0]) == int(
            getattr(self.module, "NVML_DEVICE_MIG_ENABLE", 1)
        )

    def each_mig(self, h: Any, gpu_memory_mib: int) -> Iterator[MigView]:
        """The MIG devices of the GPU `h`, each with its GPU instance and that instance's profile."""
        profiles = self._gi_profiles(h)
        for j in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", h))):
            mh = self.try_call(
                "nvmlDeviceGetMigDeviceHandleByIndex",
                h,
                j,
                tolerate=(NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT),
            )
            if mh is None:
                continue
            gi = int(self.call("nvmlDeviceGetGpuInstanceId", mh))
            attrs = self.call("nvmlDeviceGetAttributes", mh)
            info = self._gi_info(h, gi)
            enum, prof = profiles.get(int(info.profileId), (-1, None)) if info is not None else (-1, None)
            profile = self._mig_profile(attrs, enum, prof, gpu_memory_mib)
            yield MigView(j, mh, gi, attrs, profile, info, prof)

    def _mig_devices(
        self, parent_index: int, parent_uuid: str, h: Any, gpu_memory_mib: int
    ) -> tuple[MigDevice, ...]:
        return tuple(
            MigDevice(
                uuid=text(self.call("nvmlDeviceGetUUID", m.handle)),
                parent_uuid=parent_uuid,
                parent_index=parent_index,
                index=m.position,
                gi_id=m.gi,
                ci_id=int(self.call("nvmlDeviceGetComputeInstanceId", m.handle)),
                profile=m.profile,
                memory_mib=int(m.attrs.memorySizeMB),
                gi_profile_id=int(m.gi_info.profileId) if m.gi_info is not None else -1,
                placement_start=int(m.gi_info.placement.start) if m.gi_info is not None else -1,
                placement_size=int(m.gi_info.placement.size) if m.gi_info is not None else 0,
                # The GPU instance profile's engines, as NVIDIA's DRA driver publishes them.
                multiprocessors=int(m.gi_profile.multiprocessorCount) if m.gi_profile is not None else 0,
                copy_engines=int(m.gi_profile.copyEngineCount) if m.gi_profile is not None else 0,
                decoders=int(m.gi_profile.decoderCount) if m.gi_profile is not None else 0,
                encoders=int(m.gi_profile.encoderCount) if m.gi_profile is not None else 0,
                jpeg_engines=int(m.gi_profile.jpegCount) if m.gi_profile is not None else 0,
                ofa_engines=int(m.gi_profile.ofaCount) if m.gi_profile is not None else 0,
            )
            for m in self.each_mig(h, gpu_memory_mib)
        )

    def _gi_profiles(self, h: Any) -> dict[int, tuple[int, Any]]:
        """The parent's GPU-instance profiles: profile id -> (NVML profile enum, profile info)."""
        table: dict[int, tuple[int, Any]] = {}
        count = int(getattr(self.module, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))
        refused = (
            NVML_ERROR_NOT_SUPPORTED,
            NVML_ERROR_INVALID_ARGUMENT,
            NVML_ERROR_NO_PERMISSION,
            NVML_ERROR_FUNCTION_NOT_FOUND,
        )
        for enum in range(count):
            info = self.try_call("nvmlDeviceGetGpuInstanceProfileInfo", h, enum, tolerate=refused)
            if info is not None:
                table[int(info.id)] = (enum, info)
        return table

    def _gi_info(self, h: Any, gi: int) -> Any:
        """The GPU instance's info (profile id, placement), or None where NVML refuses it."""
        try:
            return self.call("nvmlGpuInstanceGetInfo", self.call("nvmlDeviceGetGpuInstanceById", h, gi))
        except NvmlCallError as exc:
            if exc.gpu_lost:
                raise
            log.debug("GPU instance lookup failed (%s); naming the MIG profile from its attributes", exc)
            return None

    @staticmethod
    def _mig_profile(attrs: Any, enum: int, prof: Any, gpu_memory_mib: int) -> str:
        gi_slices = int(attrs.gpuInstanceSliceCount)
        ci_slices = int(attrs.computeInstanceSliceCount)
        name = ""
        if prof is not None:
            name = text(getattr(prof, "name", "")).removeprefix("MIG ").strip()
            if not name:
                name = mig_profile_name(
                    int(prof.sliceCount),
                    int(prof.memorySizeMB),
                    gpu_memory_mib,
                    enum == _GI_PROFILE_1_SLICE_REV1,
                )
        if not name:
            name = mig_profile_name(gi_slices, int(attrs.memorySizeMB), gpu_memory_mib)
        # A compute instance smaller than its GPU instance is named like nvidia-smi does: "1c.3g.40gb".
        if ci_slices and ci_slices != gi_slices:
            name = f"{ci_slices}c.{name}"
        return name

    def _links(self, gpus: list[Gpu], handles: list[Any]) -> tuple[GpuPair, ...]:
        by_bus = {sysfs_bus_id(g.pci_bus_id): k for k, g in enumerate(gpus)}
        direct: dict[tuple[int, int], int] = {}
        switch = [0] * len(gpus)
        max_links = int(getattr(self.module, "NVML_NVLINK_MAX_LINKS", 18))
        active = int(getattr(self.module, "NVML_FEATURE_ENABLED", 1))
        skip = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_FUNCTION_NOT_FOUND)
        for k, h in enumerate(handles):
            for link in range(max_links):
                if self.try_call("nvmlDeviceGetNvLinkState", h, link, tolerate=skip) != active:
                    continue
                remote = self.try_call("nvmlDeviceGetNvLinkRemotePciInfo", h, link, tolerate=skip)
                if remote is None:
                    continue
                peer = by_bus.get(sysfs_bus_id(text(remote.busId)))
                if peer is not None and peer != k:
                    direct[(k, peer)] = direct.get((k, peer), 0) + 1
                    continue
                kind = self.try_call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, tolerate=skip)
                if kind is None or int(kind) != _NVLINK_DEVICE_TYPE_GPU:
                    switch[k] += 1
        links: list[GpuPair] = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                level = self.try_call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
                count = max(direct.get((a, b), 0), direct.get((b, a), 0)) + min(switch[a], switch[b])
                links.append(
                    GpuPair(
                        a=gpus[a].index,
                        b=gpus[b].index,
                        ancestor=TOPOLOGY_SYSTEM if level is None else int(level),
                        nvlinks=count,
                    )
                )
        return tuple(links)

    # ------------------------------------------------------------ probes

    def probe(self, uuid: str) -> ProbeResult:
        """A few cheap queries: is the device reachable, and is a reset pending for its memory?"""
        try:
            h = self.call("nvmlDeviceGetHandleByUUID", uuid)
            is_mig = self.call("nvmlDeviceIsMigDeviceHandle", h)
            if bool(getattr(is_mig, "value", is_mig)):
                h = self.call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", h)
            self.call("nvmlDeviceGetMemoryInfo", h)  # reaches the GPU: a lost one fails here
            pending = self.try_call("nvmlDeviceGetRetiredPagesPendingStatus", h)
            rows = self.try_call("nvmlDeviceGetRemappedRows", h)
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
