"""A claim's opaque device configuration, read as NVIDIA's DRA driver reads it.

The scheduler copies the configuration of a claim's DeviceClasses (`spec.config`) and of the
claim itself (`spec.devices.config`) into the allocation, `status.allocation.devices.config`,
each entry with its `source` (`FromClass` or `FromClaim`) and the `requests` it applies to; that
list is what a kubelet plugin reads. The rules are those of kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1, with the feature gates `TimeSlicingSettings` and `MPSSupport` on (off, NVIDIA refuses
either strategy; an operator who brings such claims has them on):

- which entries (cmd/gpu-kubelet-plugin/device_state.go, `GetOpaqueDeviceConfigs`): an entry
  without `opaque` is an error; another driver's entry is skipped; every entry of this driver is
  decoded strictly (`configapi.StrictDecoder`, api.go: an unknown field is an error), class
  entries before claim entries, each source in its order, so that later wins;
- which entry applies to which device (`prepareDevices`): NVIDIA puts a default `MigDeviceConfig`
  and a default `GpuConfig` (no sharing) first, then walks the list from its end for each of its
  allocation results: the first entry naming the result's request (the request as the result
  names it, `<request>/<subrequest>` included) applies, and is an error when its kind does not fit
  the device (a `GpuConfig` on a MIG device, a `MigDeviceConfig` on a GPU, any other kind of the
  group); an entry for all requests (`requests` empty) applies to the first device it fits, and
  is skipped by one it does not fit;
- defaults and checks, only for the entries that apply (gpuconfig.go, migconfig.go `Normalize`;
  validate.go, sharing.go `Validate`, `GetTimeSlicingConfig`, `GetMpsConfig`): a strategy is
  `TimeSlicing` or `MPS`; TimeSlicing's `interval` defaults to `Default` and is one of `Default`,
  `Short`, `Medium`, `Long`; an `mpsConfig` with TimeSlicing, or a `timeSlicingConfig` with MPS, is
  an error on a GPU; a MIG device's TimeSlicing changes nothing (NVIDIA sets no timeslice on one);
  memory limits are Kubernetes quantities (worker.dra.quantity), at least 1 MiB once rounded down to
  MiB (sharing.go `limit.Megabyte`), and a per-device limit names a device of the config's group by
  UUID or by its index among their UUIDs, sorted (sharing.go `uuidSet.Normalize`).

gpuvisor differs where NVIDIA's decoder fails another way or not at all:
- `defaultActiveThreadPercentage` must be 1..100: NVIDIA's `Validate` lets 0 through to its daemon,
  which is then told to give clients no threads;
- a `timeSlicingConfig` without its `interval` (or `null`) is refused: NVIDIA's `Validate`
  dereferences the missing interval and panics;
- an entry naming a request the claim does not have is refused (the API server refuses such a
  claim; NVIDIA would ignore the entry);
- two MPS entries that apply to devices of one claim are refused: gpuvisor runs one MPS control
  daemon per claim (worker.dra.edits.ClaimMps), NVIDIA one per entry;
- duplicate keys in one JSON object cannot be seen here (the claim arrives parsed): the last wins.
Admin access: NVIDIA applies a sharing entry to an adminAccess device like any other; gpuvisor
checks the entry the same way but applies no sharing to an adminAccess device, which is prepared
beside a device another claim holds and must not change that claim's GPU (see docs/dra.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.dracheckpoint import MPS, TIME_SLICING, DeviceSharing
from common.model import AllocatableDevice
from worker.dra.claims import ClaimError, ClaimRef
from worker.dra.quantity import QuantityError, json_quantity

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"  # the only version NVIDIA's scheme registers (api.go)
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
# The group's other kinds (api.go AddKnownTypes): they decode, but configure no GPU or MIG device.
OTHER_KINDS = (
    "VfioDeviceConfig",
    "ComputeDomainChannelConfig",
    "ComputeDomainDaemonConfig",
    "ComputeDomain",
    "ComputeDomainClique",
)
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}  # sharing.go TimeSliceInterval.Int
SOURCES = ("FromClass", "FromClaim")
MAX_CONFIGS = 64  # resource.k8s.io/v1 AllocationConfigMaxSize
MAX_REQUESTS = 32  # DeviceRequestsMaxSize
MAX_PARAMETERS_BYTES = 10 * 1024  # OpaqueParametersMaxLength
MIB = 1 << 20


class ClaimConfigError(ClaimError):
    """A claim's configuration that cannot be applied; the text names the entry, the field and why."""


@dataclass(frozen=True)
class MpsSettings:
    """An mpsConfig as decoded: limits in bytes, per-device keys as written."""

    active_thread_percentage: int | None = None
    pinned_memory_limit: int | None = None
    per_device: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Entry:
    """One entry of this driver, decoded (not yet defaulted or checked)."""

    where: str  # "config[2] of the allocation (FromClaim, requests gpu)"
    kind: str
    requests: tuple[str, ...]
    strategy: str | None = None  # None: no `sharing`
    interval: str | None = None
    time_slicing_given: bool = False
    mps: MpsSettings | None = None


DEFAULT_MIG = Entry("NVIDIA's default MigDeviceConfig", MIG_CONFIG, ())
DEFAULT_GPU = Entry("NVIDIA's default GpuConfig", GPU_CONFIG, ())


# --------------------------------------------------------------------------- decoding
def _object(value: Any, path: str, fields: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected an object, not {_json_type(value)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:  # configapi.StrictDecoder: json.SerializerOptions{Strict: true}
        raise ValueError(f'{path}: unknown field "{unknown[0]}" (known: {", ".join(fields)})')
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), "an object"
    )


def _string(value: Any, path: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: expected a string, not {_json_type(value)}")
    return value


def _int(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: expected an integer, not {_json_type(value)} {value!r:.20}")
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"{path}: {value} does not fit in an int")
    return value


def _quantity(value: Any, path: str) -> int:
    try:
        return json_quantity(value)
    except QuantityError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _mps(value: Any, path: str) -> MpsSettings | None:
    if value is None:
        return None
    fields = (
        "defaultActiveThreadPercentage",
        "defaultPinnedDeviceMemoryLimit",
        "defaultPerDevicePinnedMemoryLimit",
    )
    obj = _object(value, path, fields)
    pinned = obj.get("defaultPinnedDeviceMemoryLimit")
    per_device = obj.get("defaultPerDevicePinnedMemoryLimit")
    limits: list[tuple[str, int]] = []
    if per_device is not None:
        if not isinstance(per_device, dict):
            raise ValueError(
                f"{path}.defaultPerDevicePinnedMemoryLimit: expected an object, not {_json_type(per_device)}"
            )
        for key, limit in per_device.items():
            # A null value is a zero Quantity to Go: refused below as a limit under 1 MiB.
            limits.append(
                (
                    key,
                    0
                    if limit is None
                    else _quantity(limit, f"{path}.defaultPerDevicePinnedMemoryLimit.{key}"),
                )
            )
    return MpsSettings(
        active_thread_percentage=_int(obj.get("defaultActiveThreadPercentage"), f"{path}.defaultActiveThreadPercentage"),
        pinned_memory_limit=None if pinned is None else _quantity(pinned, f"{path}.defaultPinnedDeviceMemoryLimit"),
        per_device=tuple(limits),
    )  # fmt: skip


def decode_parameters(params: Any, where: str, requests: tuple[str, ...]) -> Entry:
    """One entry's `opaque.parameters`, decoded strictly; raises ValueError naming the field."""
    if not isinstance(params, dict):
        raise ValueError(f"parameters: expected an object, not {_json_type(params)}")
    size = len(json.dumps(params, separators=(",", ":")))
    if size > MAX_PARAMETERS_BYTES:
        raise ValueError(f"parameters: {size} bytes, the API allows at most {MAX_PARAMETERS_BYTES}")
    api_version = _string(params.get("apiVersion"), "parameters.apiVersion") or ""
    kind = _string(params.get("kind"), "parameters.kind") or ""
    if not kind:
        raise ValueError("parameters.kind: missing (NVIDIA's decoder needs apiVersion and kind)")
    if not api_version:
        raise ValueError("parameters.apiVersion: missing (NVIDIA's decoder needs apiVersion and kind)")
    if api_version != API_VERSION or kind not in (GPU_CONFIG, MIG_CONFIG, *OTHER_KINDS):
        raise ValueError(
            f'parameters: no kind "{kind}" is registered for version "{api_version}": NVIDIA\'s GPU '
            f"driver reads kinds {GPU_CONFIG} and {MIG_CONFIG} of {API_VERSION}"
        )
    if kind in OTHER_KINDS:
        return Entry(where, kind, requests)  # NVIDIA decodes these too; they fit no device here
    if kind == GPU_CONFIG:
        sharing_fields: tuple[str, ...] = ("strategy", "timeSlicingConfig", "mpsConfig")
    else:
        sharing_fields = ("strategy", "mpsConfig")  # MigDeviceSharing has no timeSlicingConfig
    _object(params, "parameters", ("apiVersion", "kind", "sharing"))
    sharing = params.get("sharing")
    if sharing is None:
        return Entry(where, kind, requests)
    obj = _object(sharing, "parameters.sharing", sharing_fields)
    interval: str | None = None
    ts = obj.get("timeSlicingConfig")
    if ts is not None:
        interval = _string(_object(ts, "parameters.sharing.timeSlicingConfig", ("interval",)).get("interval"),
                           "parameters.sharing.timeSlicingConfig.interval")  # fmt: skip
    return Entry(
        where,
        kind,
        requests,
        strategy=_string(obj.get("strategy"), "parameters.sharing.strategy") or "",
        interval=interval,
        time_slicing_given=ts is not None,
        mps=_mps(obj.get("mpsConfig"), "parameters.sharing.mpsConfig"),
    )


def claim_requests(claim: Mapping[str, Any]) -> set[str]:
    """The request names an entry may give: each request, and `<request>/<subrequest>` of its
    firstAvailable list (resource.k8s.io/v1 DeviceConfiguration.requests), plus whatever the
    allocation's results name (a claim stored without its spec)."""
    names: set[str] = set()
    spec = claim.get("spec")
    requests = spec.get("devices", {}).get("requests") if isinstance(spec, dict) else None
    for request in requests if isinstance(requests, list) else ():
        if isinstance(request, dict) and isinstance(request.get("name"), str):
            names.add(request["name"])
            for sub in request.get("firstAvailable") or ():
                if isinstance(sub, dict) and isinstance(sub.get("name"), str):
                    names.add(f"{request['name']}/{sub['name']}")
    status = claim.get("status")
    results = (
        status.get("allocation", {}).get("devices", {}).get("results") if isinstance(status, dict) else None
    )
    for result in results if isinstance(results, list) else ():
        if isinstance(result, dict) and isinstance(result.get("request"), str):
            names.add(result["request"])
            names.add(result["request"].partition("/")[0])
    return names


def entries(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[Entry]:
    """This driver's entries of the allocation's config, class ones first (lowest precedence first)."""
    allocation = claim.get("status", {}).get("allocation", {})
    raw = allocation.get("devices", {}).get("config") if isinstance(allocation, dict) else None
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ClaimConfigError(f"claim {ref}: status.allocation.devices.config is not a list")
    if len(raw) > MAX_CONFIGS:
        raise ClaimConfigError(
            f"claim {ref}: {len(raw)} configuration entries, the API allows at most {MAX_CONFIGS}"
        )
    by_source: dict[str, list[Entry]] = {source: [] for source in SOURCES}
    known = claim_requests(claim)
    for i, item in enumerate(raw):
        at = f"status.allocation.devices.config[{i}]"
        if not isinstance(item, dict):
            raise ClaimConfigError(f"claim {ref}: {at} is not an object")
        source = item.get("source")
        if source not in SOURCES:
            raise ClaimConfigError(
                f"claim {ref}: {at}.source: invalid config source {source!r} (FromClass or FromClaim)"
            )
        opaque = item.get("opaque")
        if not isinstance(opaque, dict):
            raise ClaimConfigError(f"claim {ref}: {at}: only opaque parameters are supported by this driver")
        if opaque.get("driver") != driver:
            continue  # a request may be met by several drivers: each skips the others' entries
        requests = item.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ClaimConfigError(f"claim {ref}: {at}.requests is not a list of request names")
        if len(requests) > MAX_REQUESTS:
            raise ClaimConfigError(
                f"claim {ref}: {at}.requests: {len(requests)} names, at most {MAX_REQUESTS}"
            )
        for name in requests:
            if name not in known:
                raise ClaimConfigError(f"claim {ref}: {at}.requests: the claim has no request {name!r}")
        named = f" requests {', '.join(requests)}" if requests else " all requests"
        where = f"{at} ({source},{named})"
        try:
            entry = decode_parameters(opaque.get("parameters"), where, tuple(requests))
        except ValueError as exc:
            raise ClaimConfigError(f"claim {ref}: {at}.opaque.{exc}") from None
        by_source[source].append(entry)
    return [e for source in SOURCES for e in by_source[source]]


# --------------------------------------------------------------------------- which entry where
def _fits(entry: Entry, device: AllocatableDevice) -> bool:
    if entry.kind == GPU_CONFIG:
        return not device.is_mig
    if entry.kind == MIG_CONFIG:
        return device.is_mig
    return entry.kind != "VfioDeviceConfig"  # gpuvisor has no vfio devices; the others fit (and fail)


def assign(
    decoded: Sequence[Entry], results: Sequence[tuple[str, AllocatableDevice]], ref: ClaimRef
) -> list[Entry]:
    """The entry that applies to each (request as the result names it, device), in order."""
    ordered = [DEFAULT_MIG, DEFAULT_GPU, *decoded]
    out: list[Entry] = []
    for request, device in results:
        for entry in reversed(ordered):
            if request in entry.requests:
                if not _fits(entry, device):
                    what = "a MIG device" if device.is_mig else "a full GPU"
                    raise ClaimConfigError(
                        f"claim {ref}: {entry.where}: cannot apply {entry.kind} to device {device.id} "
                        f"of request {request}, {what}"
                    )
                out.append(entry)
                break
            if not entry.requests and _fits(entry, device):
                out.append(entry)
                break
    return out


# --------------------------------------------------------------------------- defaults and checks
def _checked(entry: Entry, ref: ClaimRef) -> Entry:
    """The entry with NVIDIA's defaults, or ClaimConfigError; only entries that apply are checked."""
    at = f"claim {ref}: {entry.where}"
    if entry.kind in OTHER_KINDS:
        raise ClaimConfigError(f"{at}: kind {entry.kind} configures no GPU or MIG device (runtime object is not a "
                          "recognized configuration)")  # fmt: skip
    if entry.strategy is None:
        return entry
    field = "opaque.parameters.sharing"
    if entry.strategy not in (TIME_SLICING, MPS):
        raise ClaimConfigError(f"{at}: {field}.strategy: unknown GPU sharing strategy {entry.strategy!r}, "
                          f"supported GPU sharing strategies: {TIME_SLICING}, {MPS}")  # fmt: skip
    if entry.strategy == TIME_SLICING:
        if entry.kind == MIG_CONFIG:
            return entry  # NVIDIA sets no timeslice on a MIG device
        if entry.mps is not None:
            raise ClaimConfigError(
                f"{at}: {field}.mpsConfig: cannot use MpsConfig with the '{TIME_SLICING}' strategy"
            )
        if entry.time_slicing_given and entry.interval is None:
            raise ClaimConfigError(
                f"{at}: {field}.timeSlicingConfig.interval: missing; give one of {', '.join(INTERVALS)}"
            )
        interval = entry.interval or "Default"
        if interval not in INTERVALS:
            raise ClaimConfigError(f"{at}: {field}.timeSlicingConfig.interval: unknown time-slice interval "
                              f"{interval!r}, supported time-slice intervals: {', '.join(INTERVALS)}")  # fmt: skip
        return Entry(entry.where, entry.kind, entry.requests, TIME_SLICING, interval, True)
    if entry.time_slicing_given:
        raise ClaimConfigError(
            f"{at}: {field}.timeSlicingConfig: cannot use TimeSlicingConfig with the '{MPS}' strategy"
        )
    mps = entry.mps or MpsSettings()
    pct = mps.active_thread_percentage
    if pct is not None and not 1 <= pct <= 100:
        raise ClaimConfigError(f"{at}: {field}.mpsConfig.defaultActiveThreadPercentage: {pct} is outside 1..100 "
                          "(the share of a GPU's threads each client gets)")  # fmt: skip
    return Entry(entry.where, entry.kind, entry.requests, MPS, mps=mps)


def _mib_floor(limit: int, at: str, what: str) -> int:
    """NVIDIA hands the daemon `<bytes / 1 MiB>M`: the bytes that stand for, refused under 1 MiB."""
    mib = int(limit / MIB) if limit < 0 else limit // MIB  # Go's division truncates toward zero
    if mib <= 0:
        raise ClaimConfigError(
            f"{at}: {what}: invalid limit: value set too low ({limit} bytes, at least 1Mi)"
        )
    return mib * MIB


def _mps_sharing(entry: Entry, devices: Sequence[AllocatableDevice], ref: ClaimRef) -> list[DeviceSharing]:
    at = f"claim {ref}: {entry.where}"
    field = "opaque.parameters.sharing.mpsConfig"
    mps = entry.mps or MpsSettings()
    uuids = sorted({d.uuid for d in devices})
    pinned = None
    if mps.pinned_memory_limit is not None and uuids:
        pinned = _mib_floor(mps.pinned_memory_limit, at, f"{field}.defaultPinnedDeviceMemoryLimit")
    per_device: dict[str, int] = {}
    for key, limit in mps.per_device:
        if key in uuids:
            uuid = key
        else:
            try:
                index = int(key, 10)
            except ValueError:
                raise ClaimConfigError(f"{at}: {field}.defaultPerDevicePinnedMemoryLimit: invalid device: {key!r} is "
                                  f"neither the UUID of one of its devices ({', '.join(uuids)}) nor an index") from None  # fmt: skip
            if not 0 <= index < len(uuids):
                raise ClaimConfigError(f"{at}: {field}.defaultPerDevicePinnedMemoryLimit: invalid device index: {index} "
                                  f"(its devices are 0..{len(uuids) - 1}, by UUID sorted)")  # fmt: skip
            uuid = uuids[index]
        per_device[uuid] = _mib_floor(limit, at, f"{field}.defaultPerDevicePinnedMemoryLimit.{key}")
    return [
        DeviceSharing(
            MPS,
            uuid=d.uuid,
            gpu_uuid=d.gpu_uuid,
            active_thread_percentage=mps.active_thread_percentage,
            pinned_memory_limit=pinned,
            per_device_pinned_memory_limit=tuple(sorted(per_device.items())),
        )
        for d in devices
    ]


@dataclass(frozen=True)
class Result:
    """One allocation result of this driver, as resolution needs it."""

    request: str  # as the result names it: `<request>` or `<request>/<subrequest>`
    device: AllocatableDevice
    admin_access: bool = False


def resolve(
    claim: Mapping[str, Any],
    ref: ClaimRef,
    driver: str,
    results: Sequence[Result],
    skipped: Callable[[str], None] = lambda text: None,
) -> list[DeviceSharing | None]:
    """The sharing of each result, in order (None: none). Raises ClaimConfigError naming the entry,
    the field and why; `skipped` hears of sharing not applied to an adminAccess device."""
    assigned = assign(entries(claim, ref, driver), [(r.request, r.device) for r in results], ref)
    checked: dict[int, Entry] = {}
    groups: dict[int, list[int]] = {}  # entry -> the results it applies to
    for i, entry in enumerate(assigned):
        key = id(entry)
        if key not in checked:
            checked[key] = _checked(entry, ref)
        groups.setdefault(key, []).append(i)
    out: list[DeviceSharing | None] = [None] * len(results)
    mps_groups = 0
    for key, members in groups.items():
        entry = checked[key]
        if entry.strategy is None or (entry.strategy == TIME_SLICING and entry.kind == MIG_CONFIG):
            continue
        admin = [i for i in members if results[i].admin_access]
        if admin:
            names = ", ".join(results[i].device.id for i in admin)
            skipped(f"claim {ref}: {entry.where}: {entry.strategy} not applied to {names}, prepared with "
                    "admin access beside the claim that holds it")  # fmt: skip
        members = [i for i in members if not results[i].admin_access]
        if not members:
            continue
        if entry.strategy == TIME_SLICING:
            for i in members:
                d = results[i].device
                out[i] = DeviceSharing(
                    TIME_SLICING, uuid=d.uuid, gpu_uuid=d.gpu_uuid, interval=entry.interval or ""
                )
            continue
        mps_groups += 1
        if mps_groups > 1:
            raise ClaimConfigError(f"claim {ref}: {entry.where}: a second MPS configuration in one claim: gpuvisor "
                              "runs one MPS control daemon per claim, give its devices one MPS entry")  # fmt: skip
        for i, sharing in zip(
            members, _mps_sharing(entry, [results[i].device for i in members], ref), strict=True
        ):
            out[i] = sharing
    return out
