"""The Allocate response builder: plain data in, plain data out, no gRPC and no protobuf.

Given a resource plan and the device IDs the kubelet picked for one container, build exactly
what NVIDIA's k8s-device-plugin v0.20.0 would answer (the server converts it to protobuf). The
order of the steps follows NVIDIA's `getAllocateResponse`:

1. validate: every ID known (first), then the shared-resource request size (second), the same
   order as NVIDIA's `ValidateRequest`, so the same bad request gets the same error text;
2. CDI (`cdi-annotations` / `cdi-cri`): one fully qualified CDI name per device, then one per
   IMEX channel, then `gdrcopy=all`, `gds=all`, `mofed=all` when those flags are on;
3. MPS: `CUDA_MPS_PIPE_DIRECTORY` and the pipe and `/dev/shm` mounts;
4. `NVIDIA_GDRCOPY` / `NVIDIA_GDS` / `NVIDIA_MOFED` = `enabled` (set whatever the strategy);
5. stop here when every list strategy is a CDI one: NVIDIA then sets no `NVIDIA_VISIBLE_DEVICES`
   at all (no "void" either: that value appears nowhere in NVIDIA's Allocate path), so the
   runtime injects only the CDI devices;
6. `envvar`: `NVIDIA_VISIBLE_DEVICES=<ids>` and `NVIDIA_IMEX_CHANNELS=<channel ids>`;
   `volume-mounts`: `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` (it overwrites
   the envvar value when both are listed, as NVIDIA does: volume-mounts is applied second) and
   one `/dev/null` mount per device and per IMEX channel, all read-write (`read_only` false, the
   protobuf default NVIDIA leaves in place);
7. `pass_device_specs`: `rw` device nodes.

IMEX channels are those of the plan whose device node exists (common.imex, as NVIDIA's
GetChannels): a missing one is left out with a warning, or, when `imex.required` is set, the
Allocator cannot be built (the worker's start fails; after a plan update, Allocate is refused).

Two deliberate differences. Where NVIDIA's output is not deterministic (index-strategy IDs and
device nodes come out of a Go map, so their order is random there, and replicas of one GPU
repeat its node) this module uses request order, first occurrence kept, one node per path.
And the optional control nodes are looked for under the dev root (NVIDIA stats the bare path
inside its own container); with the default dev root "/" the two are the same.

Allocate is the hot path: everything that depends only on the plan is computed once in
`Allocator.__init__`. What can change under a running worker is looked at per call: the four
control device nodes (`nvidia-uvm` appears only once the module is loaded) and, until it has been
read once, the MIG capability minors file.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from common.devnodes import CONTROL_DEVICES, host_path, read_mig_minors
from common.imex import IMEX_CLASS, ImexChannelMissing, char_device_problem, select_channels
from common.model import AllocatableDevice, ResourcePlan
from common.uuidtext import uuid4_text

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
MPS_CONTAINER_ROOT = "/mps"
MIG_CAPS_DIR = "/dev/nvidia-caps"
CDI_ANNOTATION_PLUGIN = "nvidia-device-plugin"
# Control nodes NVIDIA passes only when they exist, in this order, before the GPU nodes.
CDI_STRATEGIES = frozenset({"cdi-annotations", "cdi-cri"})


class AllocationError(Exception):
    """An Allocate request that cannot be answered; the message is the text the kubelet shows."""


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerResponse:
    """One ContainerAllocateResponse as plain data (the server turns it into protobuf)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceSpec, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Entry:
    """What the hot path needs about one allocatable device ID."""

    device: AllocatableDevice
    list_id: str  # the name put in NVIDIA_VISIBLE_DEVICES / mounts / CDI names


class Allocator:
    """Builds Allocate responses for one resource plan."""

    def __init__(
        self,
        plan: ResourcePlan,
        uuid_factory: Callable[[], str] = uuid4_text,
        exists: Callable[[str], bool] = os.path.exists,
        imex_problem: Callable[[str], str | None] = char_device_problem,
        strict_imex: bool = True,
    ) -> None:
        """`strict_imex`: a missing required IMEX channel raises ImexChannelMissing (a worker's
        start); without it (a plan update in a running worker) every Allocate is refused instead."""
        settings = plan.allocate
        self._plan = plan
        self._resource = plan.resource
        self._uuid_factory = uuid_factory
        self._exists = exists
        self._dev_root = settings.dev_root
        self._by_index = settings.device_id_strategy == "index"
        self._entries: dict[str, _Entry] = {
            d.id: _Entry(d, d.index if self._by_index else d.uuid) for d in plan.devices
        }
        # NVIDIA's ValidateRequest (internal/rm/rm.go:95-104) applies failRequestsGreaterThanOne
        # to MPS as to time-slicing; only its default differs (true for MPS, api/config/v1/config.go:73).
        self._max_one = plan.fail_requests_greater_than_one

        strategies = settings.device_list_strategies
        self._cdi_annotations = "cdi-annotations" in strategies
        self._cdi_cri = "cdi-cri" in strategies
        # NVIDIA's AllCDIEnabled is true for an empty list too (api/config/v1/strategy.go:62-69):
        # `deviceListStrategy: []` gives no NVIDIA_VISIBLE_DEVICES and no device specs.
        self._all_cdi = all(s in CDI_STRATEGIES for s in strategies)
        self._envvar = "envvar" in strategies
        self._volume_mounts = "volume-mounts" in strategies
        self._pass_specs = settings.pass_device_specs
        self._annotation_key_prefix = f"{settings.cdi_annotation_prefix}{CDI_ANNOTATION_PLUGIN}_"
        self._cdi_gpu_prefix = f"{settings.cdi_vendor}/{settings.cdi_class}="

        self._imex_error = ""
        try:
            selected = select_channels(
                settings.imex_channel_ids, settings.dev_root, settings.imex_required, imex_problem
            )
        except ImexChannelMissing as exc:
            if strict_imex:
                raise
            self._imex_error = str(exc)
            selected = ()
        channels = tuple(c.id for c in selected)
        self._imex_env = ",".join(channels)
        extra_cdi = [f"{settings.cdi_vendor}/{IMEX_CLASS}={c}" for c in channels]
        # NVIDIA's CDI handler adds its optional modes in this order: gdrcopy, gds, mofed.
        for enabled, mode in (
            (settings.gdrcopy_enabled, "gdrcopy"),
            (settings.gds_enabled, "gds"),
            (settings.mofed_enabled, "mofed"),
        ):
            if enabled:
                extra_cdi.append(f"{settings.cdi_vendor}/{mode}=all")
        self._extra_cdi = tuple(extra_cdi)

        fixed_envs: dict[str, str] = {}
        mps_mounts: tuple[Mount, ...] = ()
        if plan.sharing == "mps":
            if not settings.mps_root:
                raise ValueError(f"resource plan for {plan.resource!r}: MPS sharing needs allocate.mps_root")
            # The full resource name is the directory, as NVIDIA's MPS daemon lays it out:
            # /mps/nvidia.com/gpu/pipe in the container, <mpsRoot>/nvidia.com/gpu/pipe on the host.
            pipe = posixpath.join(MPS_CONTAINER_ROOT, plan.resource, "pipe")
            fixed_envs[MPS_PIPE_ENV] = pipe
            mps_mounts = (
                Mount(pipe, host_path(settings.mps_root, posixpath.join(plan.resource, "pipe"))),
                Mount("/dev/shm", host_path(settings.mps_root, "shm")),
            )
        self._mps_mounts = mps_mounts
        if settings.gdrcopy_enabled:
            fixed_envs["NVIDIA_GDRCOPY"] = "enabled"
        if settings.gds_enabled:
            fixed_envs["NVIDIA_GDS"] = "enabled"
        if settings.mofed_enabled:
            fixed_envs["NVIDIA_MOFED"] = "enabled"
        self._fixed_envs = fixed_envs

        self._imex_mounts = tuple(
            Mount(posixpath.join(VOLUME_MOUNTS_ROOT, "imex", c), VOLUME_MOUNTS_HOST_PATH) for c in channels
        )
        self._imex_specs = tuple(self._spec(c.path) for c in selected)
        self._control_specs = tuple(self._spec(p) for p in CONTROL_DEVICES)

        self._mig_minors_path = settings.mig_minors_path
        self._mig_minors: dict[str, int] | None = None
        self._node_specs: dict[str, tuple[DeviceSpec, ...]] = {}
        if self._pass_specs:
            for entry in self._entries.values():
                if not entry.device.is_mig:
                    self._node_specs[entry.device.id] = (self._spec(f"/dev/nvidia{entry.device.gpu_minor}"),)
            if any(d.is_mig for d in plan.devices):
                try:
                    self._mig_minors = read_mig_minors(self._mig_minors_path)
                except OSError:
                    # Not fatal here: only an Allocate that needs it fails, and it retries the read.
                    self._mig_minors = None

    def _spec(self, container_path: str) -> DeviceSpec:
        return DeviceSpec(container_path, host_path(self._dev_root, container_path), "rw")

    def allocate(self, device_ids: Sequence[str]) -> ContainerResponse:
        """Build the response for one container request; raises AllocationError."""
        entries = self._validate(device_ids)
        if self._imex_error:
            raise AllocationError(f"failed to get allocate response: {self._imex_error}")
        list_ids = list(dict.fromkeys(e.list_id for e in entries))

        envs: dict[str, str] = {}
        annotations: dict[str, str] = {}
        cdi_devices: tuple[str, ...] = ()
        if self._cdi_annotations or self._cdi_cri:
            names = [self._cdi_gpu_prefix + i for i in list_ids]
            names.extend(self._extra_cdi)
            if names:
                if self._cdi_annotations:
                    key = f"{self._annotation_key_prefix}{self._uuid_factory()}"
                    annotations[key] = ",".join(names)
                if self._cdi_cri:
                    cdi_devices = tuple(names)
        envs.update(self._fixed_envs)
        mounts: list[Mount] = list(self._mps_mounts)
        if self._all_cdi:
            return ContainerResponse(envs, tuple(mounts), (), annotations, cdi_devices)

        if self._envvar:
            envs[VISIBLE_DEVICES] = ",".join(list_ids)
            if self._imex_env:
                envs[IMEX_CHANNELS] = self._imex_env
        if self._volume_mounts:
            envs[VISIBLE_DEVICES] = VOLUME_MOUNTS_ROOT
            mounts.extend(Mount(f"{VOLUME_MOUNTS_ROOT}/{i}", VOLUME_MOUNTS_HOST_PATH) for i in list_ids)
            mounts.extend(self._imex_mounts)
        devices: tuple[DeviceSpec, ...] = ()
        if self._pass_specs:
            devices = self._device_specs(entries)
        return ContainerResponse(envs, tuple(mounts), devices, annotations, cdi_devices)

    def allocate_all(self, requests: Iterable[Sequence[str]]) -> list[ContainerResponse]:
        """One response per container request, in order; the first bad request fails the call (as NVIDIA)."""
        return [self.allocate(ids) for ids in requests]

    def _validate(self, device_ids: Sequence[str]) -> list[_Entry]:
        entries: list[_Entry] = []
        for device_id in device_ids:
            entry = self._entries.get(device_id)
            if entry is None:
                raise AllocationError(
                    f'invalid allocation request for "{self._resource}": invalid request: unknown device: {device_id}'
                )
            entries.append(entry)
        if self._max_one and len(device_ids) > 1 and any("::" in i for i in device_ids):
            raise AllocationError(
                f'invalid allocation request for "{self._resource}": invalid request: '
                f"maximum request size for shared resources is 1; found {len(device_ids)}"
            )
        return entries

    def _device_specs(self, entries: list[_Entry]) -> tuple[DeviceSpec, ...]:
        specs = [s for s in self._control_specs if self._exists(s.host_path)]
        seen: set[str] = set()
        for entry in entries:
            per_device = self._node_specs.get(entry.device.id)
            if per_device is None:
                per_device = self._mig_specs(entry.device)
            for spec in per_device:
                if spec.container_path not in seen:
                    seen.add(spec.container_path)
                    specs.append(spec)
        specs.extend(self._imex_specs)
        return tuple(specs)

    def _mig_specs(self, device: AllocatableDevice) -> tuple[DeviceSpec, ...]:
        """Parent GPU node, then the GI and CI capability nodes (NVIDIA's order)."""
        minors = self._mig_minors
        if minors is None:
            try:
                minors = read_mig_minors(self._mig_minors_path)
            except OSError as exc:
                raise AllocationError(
                    f"failed to get allocate response: MIG device {device.id} (index {device.index}): "
                    f"cannot read the MIG capability minors file {self._mig_minors_path}: "
                    f"{exc.strerror or exc}"
                ) from exc
            self._mig_minors = minors
        gpu = f"gpu{device.gpu_minor}"
        gi_key = f"{gpu}/gi{device.mig_gi}/access"
        ci_key = f"{gpu}/gi{device.mig_gi}/ci{device.mig_ci}/access"
        caps: list[DeviceSpec] = [self._spec(f"/dev/nvidia{device.gpu_minor}")]
        for key in (gi_key, ci_key):
            minor = minors.get(key)
            if minor is None:
                raise AllocationError(
                    f"failed to get allocate response: MIG device {device.id} (index {device.index}): "
                    f"no entry {key!r} in the MIG capability minors file {self._mig_minors_path}"
                )
            caps.append(self._spec(f"{MIG_CAPS_DIR}/nvidia-cap{minor}"))
        result = tuple(caps)
        # Cache per device: the minors of a MIG device only change with a new MIG layout, and a
        # new layout means a new plan and a new Allocator.
        self._node_specs[device.id] = result
        return result
