"""The file-only sections: `resources`, `sharing` and gpuvisor's own `gpuvisor.health`.

`resources` and `sharing` follow NVIDIA's own decoders in `api/config/v1` (resources.go,
replicas.go, sharing.go) rule by rule: which keys must be present, what a null means, what a
device reference may be, that `rename: ""` is an error while a missing `rename` is not, and that
with both `timeSlicing` and `mps` present MPS is the strategy used (`Sharing.SharingStrategy()`).
NVIDIA then ignores custom `resources`, `rename` and `devices`; gpuvisor honours them
(docs/compatibility.md), so they are kept here with the meaning NVIDIA's parser gives them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.config import gojson
from supervisor.config.errors import ConfigError, Invalid, kind, show
from supervisor.config.limits import MAX_LIST_ITEMS, MAX_PATTERN_LENGTH, MAX_REPLICAS
from supervisor.config.model import (
    DeviceSelector,
    HealthConfig,
    ResourcePattern,
    ResourcesConfig,
    SharedResource,
    SharingConfig,
)
from supervisor.config.names import SHARED_SUFFIX, device_ref, new_resource_name
from supervisor.config.settings import seconds

XID_ACTIONS = ("ignore", "transient", "until-reset")
MAX_XIDS = 1024


def _field(decode: Any, value: object, source: str, key: str) -> Any:
    try:
        return decode(value)
    except Invalid as exc:
        raise ConfigError(source, key + exc.at, exc.reason) from None


def _resource_name(value: object) -> str:
    # ResourceName.UnmarshalJSON: a JSON string (null reads as ""), then NewResourceName.
    return new_resource_name("" if value is None else gojson.go_string(value, coerce=False))


def _object(value: object, source: str, key: str, missing: str) -> Mapping[str, Any]:
    # A custom UnmarshalJSON that reads into map[string]json.RawMessage: null gives an empty map.
    if value is None:
        raise ConfigError(source, key, missing)
    if not isinstance(value, Mapping):
        raise ConfigError(source, key, f"must be a mapping, not {kind(value)}")
    return value


# --- resources -------------------------------------------------------------------------------


def _patterns(value: object, source: str, key: str, unknown: list[str]) -> tuple[ResourcePattern, ...]:
    """[]Resource (resources.go Resource.UnmarshalJSON): `pattern` and `name` must both be keys."""
    items = _field(gojson.go_list, value, source, key)
    out = []
    for i, item in enumerate(items):
        at = f"{key}[{i}]"
        entry = _object(item, source, at, "resources must have a 'pattern' field set")
        if "pattern" not in entry:
            raise ConfigError(source, f"{at}.pattern", "resources must have a 'pattern' field set")
        if "name" not in entry:
            raise ConfigError(source, f"{at}.name", "resources must have a 'name' field set")
        raw = entry["pattern"]
        pattern = (
            ""
            if raw is None
            else _field(lambda v: gojson.go_string(v, coerce=False), raw, source, f"{at}.pattern")
        )
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise ConfigError(
                source, f"{at}.pattern", f"too long: {len(pattern)} characters, at most {MAX_PATTERN_LENGTH}"
            )
        name = _field(_resource_name, entry["name"], source, f"{at}.name")
        unknown.extend(f"{at}.{k}" for k in entry if k not in ("pattern", "name"))
        out.append(ResourcePattern(pattern=pattern, name=name))
    return tuple(out)


def parse_resources(tree: Mapping[str, Any] | None, source: str, unknown: list[str]) -> ResourcesConfig:
    section = tree or {}
    lists: dict[str, tuple[ResourcePattern, ...]] = {}
    for name in ("gpus", "mig"):
        result: tuple[ResourcePattern, ...] = ()
        # A slice decoded twice (two spellings of the key) is replaced: the last one counts.
        for occurrence in section.get(name) or ():
            result = () if occurrence is None else _patterns(occurrence, source, f"resources.{name}", unknown)
        lists[name] = result
    return ResourcesConfig(gpus=lists["gpus"], mig=lists["mig"])


# --- sharing ---------------------------------------------------------------------------------


def _device(item: object) -> str:
    # ReplicatedDevices: a uint as a GPU index (null reads as 0), else a string reference.
    if item is None:
        return "0"
    if isinstance(item, int | float) and not isinstance(item, bool):
        try:
            return str(gojson.go_int(item, unsigned=True))
        except Invalid:
            pass
    if isinstance(item, str):
        return device_ref(item)
    raise Invalid(
        f"unsupported device {show(item)} ({kind(item)}): use a GPU index, an i:j MIG index, or a UUID"
    )


def _devices(value: object, source: str, key: str) -> DeviceSelector:
    """ReplicatedDevices.UnmarshalJSON: "all", a count > 0, or a list of references."""
    if value is None or isinstance(value, str):
        text = value or ""
        if text != "all":
            raise ConfigError(
                source, key, f"devices set as {show(text)} but the only valid string input is 'all'"
            )
        return DeviceSelector(all=True)
    if isinstance(value, int | float) and not isinstance(value, bool):
        count = _field(gojson.go_int, value, source, key)
        if count <= 0:
            raise ConfigError(source, key, f"device count must be > 0, not {count}")
        return DeviceSelector(count=count)
    if isinstance(value, list):
        if len(value) > MAX_LIST_ITEMS:
            raise ConfigError(source, key, f"too many items: {len(value)}, at most {MAX_LIST_ITEMS}")
        refs: list[str] = []
        for i, item in enumerate(value):
            ref = _field(_device, item, source, f"{key}[{i}]")
            if ref not in refs:
                refs.append(ref)
        return DeviceSelector(refs=tuple(refs))
    raise ConfigError(
        source, key, f'invalid devices {show(value)}: use "all", a count > 0, or a list of device references'
    )


def _replicas(entry: Mapping[str, Any], source: str, at: str) -> int:
    if "replicas" not in entry:
        raise ConfigError(source, f"{at}.replicas", "no replicas specified")
    raw = entry["replicas"]
    replicas = 0 if raw is None else _field(gojson.go_int, raw, source, f"{at}.replicas")
    if replicas < 2:
        raise ConfigError(source, f"{at}.replicas", "number of replicas must be >= 2")
    if replicas > MAX_REPLICAS:
        raise ConfigError(
            source,
            f"{at}.replicas",
            f"{replicas} replicas is more than gpuvisor's limit of {MAX_REPLICAS}: that many devices of even one GPU "
            "cannot fit the kubelet's 4 MiB ListAndWatch message",
        )
    return replicas


def _entry(item: object, source: str, at: str, unknown: list[str]) -> tuple[str, str, DeviceSelector, int]:
    """ReplicatedResource.UnmarshalJSON: name, then devices (default "all"), replicas, rename."""
    entry = _object(item, source, at, "no resource name specified")
    if "name" not in entry:
        raise ConfigError(source, f"{at}.name", "no resource name specified")
    name = _field(_resource_name, entry["name"], source, f"{at}.name")
    devices = _devices(entry.get("devices", "all"), source, f"{at}.devices")
    replicas = _replicas(entry, source, at)
    rename = _field(_resource_name, entry["rename"], source, f"{at}.rename") if "rename" in entry else ""
    unknown.extend(f"{at}.{k}" for k in entry if k not in ("name", "devices", "replicas", "rename"))
    return name, rename, devices, replicas


@dataclasses.dataclass
class _Replicated:
    rename_by_default: bool
    fail: bool | None  # None: not given (each strategy has its default)
    resources: list[SharedResource]


def _replicated(value: object, source: str, key: str, unknown: list[str]) -> _Replicated:
    """ReplicatedResources.UnmarshalJSON."""
    spec = _object(value, source, f"{key}.resources", "no resources specified")
    raw_rbd = spec.get("renameByDefault")
    rename_by_default = (
        False if raw_rbd is None else _field(gojson.go_bool, raw_rbd, source, f"{key}.renameByDefault")
    )
    fail: bool | None = None
    if spec.get("failRequestsGreaterThanOne") is not None:
        fail = _field(
            gojson.go_bool, spec["failRequestsGreaterThanOne"], source, f"{key}.failRequestsGreaterThanOne"
        )
    raw_resources = spec.get("resources")
    items = [] if raw_resources is None else _field(gojson.go_list, raw_resources, source, f"{key}.resources")
    if not items:
        raise ConfigError(source, f"{key}.resources", "no resources specified")
    resources = []
    for i, item in enumerate(items):
        name, rename, devices, replicas = _entry(item, source, f"{key}.resources[{i}]", unknown)
        if rename_by_default and not rename:
            rename = name + SHARED_SUFFIX  # NVIDIA does not check the length of the default rename
        resources.append(SharedResource(name=name, rename=rename, devices=devices, replicas=replicas))
    unknown.extend(
        f"{key}.{k}" for k in spec if k not in ("renameByDefault", "failRequestsGreaterThanOne", "resources")
    )
    return _Replicated(rename_by_default, fail, resources)


def _occurrences(values: Sequence[object], source: str, key: str, unknown: list[str]) -> _Replicated | None:
    # Decoding the same key twice (two spellings) decodes into the same struct: the later one
    # replaces the fields it holds, and keeps failRequestsGreaterThanOne when it holds none. A
    # null clears the `mps` pointer; for the `timeSlicing` value it is an error (no resources).
    state: _Replicated | None = None
    for value in values:
        if value is None and key.endswith(".mps"):
            state = None
            continue
        decoded = _replicated(value, source, key, unknown)
        if state is not None and decoded.fail is None:
            decoded.fail = state.fail
        state = decoded
    return state


def parse_sharing(
    tree: Mapping[str, Any] | None, source: str, unknown: list[str], notices: list[str]
) -> SharingConfig:
    section = tree or {}
    time_slicing = _occurrences(section.get("timeSlicing") or (), source, "sharing.timeSlicing", unknown)
    mps = _occurrences(section.get("mps") or (), source, "sharing.mps", unknown)
    if mps is not None:
        if time_slicing is not None:
            notices.append(
                "sharing.timeSlicing is ignored: sharing.mps is set too, and MPS is the strategy used (as in NVIDIA's plugin)"
            )
        strategy, chosen, fail_default = (
            "mps",
            mps,
            True,
        )  # config.go: MPS fails requests > 1 unless told not to
    elif time_slicing is not None:
        strategy, chosen, fail_default = "time-slicing", time_slicing, False
    else:
        return SharingConfig()
    return SharingConfig(
        strategy=strategy,
        rename_by_default=chosen.rename_by_default,
        fail_requests_greater_than_one=fail_default if chosen.fail is None else chosen.fail,
        resources=tuple(chosen.resources),
    )


# --- gpuvisor.health (gpuvisor's own) ---------------------------------------------------------


def _xid(raw: object) -> int:
    text = raw.strip() if isinstance(raw, str) else None
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if text and (text.isdigit() or (text[0] in "+-" and text[1:].isdigit())) and text.isascii():
        return int(text)
    raise Invalid(f"invalid XID {show(raw)}: XIDs are integers")


def parse_health(value: object, source: str) -> HealthConfig:
    if value is None:
        return HealthConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(source, "gpuvisor.health", f"this section must be a mapping, not {kind(value)}")
    raw_xids = value.get("xids")
    if raw_xids is not None and not isinstance(raw_xids, Mapping):
        raise ConfigError(
            source, "gpuvisor.health.xids", f"this section must be a mapping, not {kind(raw_xids)}"
        )
    if raw_xids is not None and len(raw_xids) > MAX_XIDS:
        raise ConfigError(
            source, "gpuvisor.health.xids", f"too many XIDs: {len(raw_xids)}, at most {MAX_XIDS}"
        )
    xids: dict[int, str] = {}
    for raw_xid, action in (raw_xids or {}).items():
        key = f"gpuvisor.health.xids.{raw_xid}"
        xid = _field(_xid, raw_xid, source, key)
        if xid < 0:
            raise ConfigError(source, key, f"invalid XID {xid}: XIDs are not negative")
        if xid in xids:
            raise ConfigError(source, key, f"XID {xid} is listed twice")
        if action not in XID_ACTIONS:
            raise ConfigError(
                source, key, f"invalid value {show(action)}: must be one of {', '.join(XID_ACTIONS)}"
            )
        xids[xid] = str(action)
    quiet = value.get("transientQuietSeconds")
    quiet_seconds = (
        HealthConfig.transient_quiet_seconds
        if quiet is None
        else _field(seconds(positive=False), quiet, source, "gpuvisor.health.transientQuietSeconds")
    )
    return HealthConfig(xids=tuple(sorted(xids.items())), transient_quiet_seconds=quiet_seconds)
