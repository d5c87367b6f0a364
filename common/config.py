"""gpuvisor's configuration: NVIDIA-compatible flags, env vars and config file, plus gpuvisor's own.

Each setting is declared once, as a `Setting` in `SETTINGS`, and that one table drives the
argparse options (`add_run_arguments`), the loader (`load_config`) and the README table
(`settings_markdown`, or `python -m common.config --markdown`). Precedence is NVIDIA's:
flag > env var > config file > default, decided per setting.

Design choices worth knowing:
- Flags reach the loader as raw strings (argparse does no type conversion), so a bad value is a
  `ConfigError` that names the flag, the same as a bad env var or file key, and the CLI can exit
  with `EXIT_CONFIG_ERROR` (78, EX_CONFIG) for all three alike.
- Boolean flags take an optional value (`--pass-device-specs`, `--pass-device-specs=false`), as
  Go's flag packages do; booleans from flags and env vars accept Go's `strconv.ParseBool` forms.
- An env var set to the empty string counts as unset (Kubernetes manifests often template
  empty values), except where empty has a meaning of its own (`GPUVISOR_METRICS_ADDRESS=""`
  turns the metrics endpoint off).
- The file is read with a YAML loader that does not turn `1:2` into the YAML 1.1 base-60 integer
  62: an unquoted `i:j` MIG index must stay a string, as it does for NVIDIA's Go YAML parser.
- The structured sections (`resources`, `sharing`, `gpuvisor.health`) exist only in the file
  and are parsed by hand below; unknown keys anywhere are ignored but collected in
  `Config.unknown_keys` so the supervisor can log them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

EXIT_CONFIG_ERROR: Final = 78  # EX_CONFIG from sysexits.h
RESOURCE_DOMAIN: Final = "nvidia.com"
MAX_RESOURCE_NAME_LENGTH: Final = 63  # NVIDIA's limit on the fully-qualified name
SHARED_SUFFIX: Final = ".shared"
CONFIG_VERSION: Final = "v1"

MIG_STRATEGIES: Final = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES: Final = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: Final = ("uuid", "index")
SHARED_POLICIES: Final = ("distributed", "packed")
DISCOVERY_STRATEGIES: Final = ("auto", "nvml", "tegra")
LOG_FORMATS: Final = ("text", "json")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
XID_ACTIONS: Final = ("ignore", "transient", "until-reset")

# The kubelet's rule for the name part of an extended resource (REFERENCE.md section 2).
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MIG_INDEX = re.compile(r"[0-9]+:[0-9]+")
_GPU_INDEX = re.compile(r"[0-9]+")
_INTEGER = re.compile(r"[-+]?[0-9]+")
_PORT = re.compile(r"[0-9]{1,5}")

_GO_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class ConfigError(Exception):
    """A bad setting: where it came from, which key, and why it is wrong."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        super().__init__(source, key, reason)
        self.source = source  # a file path, "flag --x" or "env VAR"
        self.key = key  # e.g. "sharing.timeSlicing.resources[0].replicas"; "" for flags/env
        self.reason = reason

    def __str__(self) -> str:
        parts = ["config error", self.source]
        if self.key:
            parts.append(self.key)
        parts.append(self.reason)
        return ": ".join(parts)


class _Invalid(ValueError):
    """Raised by value parsers; the loader wraps it into a ConfigError with source and key."""


# --- value parsers: each takes a raw value (a string from a flag or env var, or whatever the
# --- YAML/JSON file holds) and returns the typed value or raises _Invalid.

Parser = Callable[[object], Any]


def _show(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def parse_go_bool(value: object) -> bool:
    """A boolean as Go's strconv.ParseBool reads it (1 t T TRUE true True, 0 f F FALSE false False)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value in _GO_TRUE:
            return True
        if value in _GO_FALSE:
            return False
    raise _Invalid(f"invalid boolean {_show(value)}: use true or false")


def _string(value: object) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid(f"must be a string, not {_kind(value)}")


def _nonempty_string(value: object) -> str:
    text = _string(value)
    if not text:
        raise _Invalid("must not be empty")
    return text


def _optional_string(value: object) -> str | None:
    text = _string(value)
    return text or None


def _choice(*choices: str) -> Parser:
    def parse(value: object) -> str:
        text = _string(value)
        if text not in choices:
            raise _Invalid(f"invalid value {_show(text)}: must be one of {', '.join(choices)}")
        return text

    return parse


def _split_list(value: object) -> list[str]:
    """A comma-separated string, or a list whose items may themselves be comma-separated
    (a repeated flag, or a list in the file)."""
    if isinstance(value, str):
        pieces = value.split(",")
    elif isinstance(value, list | tuple):
        pieces = []
        for item in value:
            pieces.extend(_string(item).split(","))
    else:
        raise _Invalid(f"must be a string or a list of strings, not {_kind(value)}")
    return [p.strip() for p in pieces if p.strip()]


def _strategy_list(value: object) -> tuple[str, ...]:
    items = _split_list(value)
    if not items:
        raise _Invalid(f"must name at least one of {', '.join(DEVICE_LIST_STRATEGIES)}")
    out: list[str] = []
    for item in items:
        if item not in DEVICE_LIST_STRATEGIES:
            raise _Invalid(
                f"invalid device list strategy {_show(item)}: must be one of {', '.join(DEVICE_LIST_STRATEGIES)}"
            )
        if item not in out:  # NVIDIA keeps a set; keep the first order for stable plans
            out.append(item)
    return tuple(out)


def _token_list(value: object) -> tuple[str, ...]:
    return tuple(item.lower() for item in _split_list(value))


def _integer(value: object) -> int:
    if isinstance(value, bool):
        raise _Invalid(f"must be an integer, not {_kind(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value.strip())
    raise _Invalid(f"must be an integer, not {_show(value)}")


def _int_at_least(minimum: int) -> Parser:
    def parse(value: object) -> int:
        number = _integer(value)
        if number < minimum:
            raise _Invalid(f"must be >= {minimum}, not {number}")
        return number

    return parse


def _seconds(*, positive: bool) -> Parser:
    def parse(value: object) -> float:
        number: float
        if isinstance(value, bool):
            raise _Invalid(f"must be a number of seconds, not {_kind(value)}")
        if isinstance(value, int | float):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise _Invalid(f"must be a number of seconds, not {_show(value)}") from None
        else:
            raise _Invalid(f"must be a number of seconds, not {_kind(value)}")
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise _Invalid(f"must be a {'positive' if positive else 'non-negative'} number of seconds, not {_show(value)}")
        return number

    return parse


def _imex_channel_ids(value: object) -> tuple[int, ...]:
    items: list[object]
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    else:
        raise _Invalid(f"must be a list of channel IDs, not {_kind(value)}")
    ids = [_integer(item) for item in items]
    # NVIDIA v0.20 supports no channel or channel 0 only.
    if ids not in ([], [0]):
        raise _Invalid(f"invalid IMEX channel IDs {ids}: only [] or [0] is supported")
    return tuple(ids)


def _address(value: object) -> str:
    text = _string(value).strip()
    if not text:
        return ""  # empty: metrics endpoint off
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") or host.endswith("]")
    if (
        not sep
        or not _PORT.fullmatch(port)
        or int(port) > 65535
        or (bracketed and not (host.startswith("[") and host.endswith("]")))
    ):
        raise _Invalid(f"invalid address {_show(text)}: use host:port, :port, or empty to disable")
    return text


# --- the settings table ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: it drives the CLI flag, the env var, the file key and the docs."""

    name: str  # the Config field and the argparse dest
    flags: tuple[str, ...]
    envs: tuple[str, ...]
    file_key: str | None  # dotted path in the config file
    kind: str  # "bool" (flag takes an optional value), "list" (flag may repeat), or "value"
    default: Any
    parse: Parser
    help: str
    choices: tuple[str, ...] = ()
    default_doc: str | None = None  # how the docs show the default, when repr is not right
    env_empty_is_value: bool = False
    gpuvisor: bool = False  # gpuvisor's own setting (not one of NVIDIA's)

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, tuple):
            return ",".join(str(v) for v in self.default) or "(none)"
        if self.default is None or self.default == "":
            return "(none)"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def _s(
    name: str,
    flags: tuple[str, ...],
    envs: tuple[str, ...],
    file_key: str | None,
    default: Any,
    parse: Parser,
    help: str,
    *,
    kind: str = "value",
    choices: tuple[str, ...] = (),
    default_doc: str | None = None,
    env_empty_is_value: bool = False,
    gpuvisor: bool = False,
) -> Setting:
    return Setting(
        name=name,
        flags=flags,
        envs=envs,
        file_key=file_key,
        kind=kind,
        default=default,
        parse=_choice(*choices) if choices and parse is _string else parse,
        help=help,
        choices=choices,
        default_doc=default_doc,
        env_empty_is_value=env_empty_is_value,
        gpuvisor=gpuvisor,
    )


SETTINGS: Final[tuple[Setting, ...]] = (
    # NVIDIA k8s-device-plugin v0.20.0 (REFERENCE.md section 3)
    _s("mig_strategy", ("--mig-strategy",), ("MIG_STRATEGY",), "flags.migStrategy", "none", _string,
       "How MIG devices are advertised: none (MIG-enabled GPUs as full GPUs), single (MIG devices as "
       "nvidia.com/gpu), mixed (nvidia.com/mig-<profile>).", choices=MIG_STRATEGIES),
    _s("fail_on_init_error", ("--fail-on-init-error",), ("FAIL_ON_INIT_ERROR",), "flags.failOnInitError", True,
       parse_go_bool, "Exit with an error when NVML cannot be initialised; false keeps running with no devices.",
       kind="bool"),
    _s("driver_root", ("--driver-root", "--nvidia-driver-root"), ("NVIDIA_DRIVER_ROOT",), "flags.nvidiaDriverRoot",
       "/", _nonempty_string, "Root of the NVIDIA driver installation on the host."),
    _s("dev_root", ("--dev-root",), ("NVIDIA_DEV_ROOT",), "flags.nvidiaDevRoot", None, _nonempty_string,
       "Root under which the /dev/nvidia* device nodes are found.", default_doc="the driver root"),
    _s("pass_device_specs", ("--pass-device-specs",), ("PASS_DEVICE_SPECS",), "flags.plugin.passDeviceSpecs", False,
       parse_go_bool, "Return DeviceSpecs (/dev/nvidia* nodes) in Allocate responses.", kind="bool"),
    _s("device_list_strategy", ("--device-list-strategy",), ("DEVICE_LIST_STRATEGY",),
       "flags.plugin.deviceListStrategy", ("envvar",), _strategy_list,
       "How devices are passed to the container runtime (comma list, or a list in the file).",
       kind="list", choices=DEVICE_LIST_STRATEGIES),
    _s("device_id_strategy", ("--device-id-strategy",), ("DEVICE_ID_STRATEGY",), "flags.plugin.deviceIDStrategy",
       "uuid", _string, "How devices are named to the container runtime.", choices=DEVICE_ID_STRATEGIES),
    _s("gds_enabled", ("--gds-enabled",), ("GDS_ENABLED",), "flags.gdsEnabled", False, parse_go_bool,
       "Set NVIDIA_GDS=enabled (GPUDirect Storage) in containers.", kind="bool"),
    _s("mofed_enabled", ("--mofed-enabled",), ("MOFED_ENABLED",), "flags.mofedEnabled", False, parse_go_bool,
       "Set NVIDIA_MOFED=enabled in containers.", kind="bool"),
    _s("gdrcopy_enabled", ("--gdrcopy-enabled",), ("GDRCOPY_ENABLED",), "flags.gdrcopyEnabled", False, parse_go_bool,
       "Set NVIDIA_GDRCOPY=enabled in containers.", kind="bool"),
    _s("cdi_annotation_prefix", ("--cdi-annotation-prefix",), ("CDI_ANNOTATION_PREFIX",),
       "flags.plugin.cdiAnnotationPrefix", "cdi.k8s.io/", _nonempty_string,
       "Prefix of the CDI annotations (cdi-annotations strategy)."),
    _s("nvidia_cdi_hook_path", ("--nvidia-cdi-hook-path",), ("NVIDIA_CDI_HOOK_PATH",), "flags.plugin.nvidiaCTKPath",
       "/usr/bin/nvidia-ctk", _nonempty_string, "Path of nvidia-ctk used as the CDI hook."),
    _s("driver_root_ctr_path", ("--driver-root-ctr-path",), ("DRIVER_ROOT_CTR_PATH",),
       "flags.plugin.containerDriverRoot", "/driver-root", _nonempty_string,
       "Where the driver root is mounted inside the plugin's container."),
    _s("mps_root", ("--mps-root",), ("MPS_ROOT",), "flags.mpsRoot", "", _string,
       "Host directory for MPS pipes and shared memory; required for MPS sharing."),
    _s("shared_devices_allocation_policy", ("--shared-devices-allocation-policy",),
       ("SHARED_DEVICES_ALLOCATION_POLICY",), "flags.plugin.sharedDevicesAllocationPolicy", "distributed",
       _string, "How replicas are picked: spread over GPUs, or packed onto few.", choices=SHARED_POLICIES),
    _s("device_discovery_strategy", ("--device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",),
       "flags.deviceDiscoveryStrategy", "auto", _string, "How devices are discovered.",
       choices=DISCOVERY_STRATEGIES),
    _s("imex_channel_ids", ("--imex-channel-ids",), ("IMEX_CHANNEL_IDS",), "imex.channelIDs", (),
       _imex_channel_ids, "IMEX channels to inject (only [] or [0]).", kind="list"),
    _s("imex_required", ("--imex-required",), ("IMEX_REQUIRED",), "imex.required", False, parse_go_bool,
       "Fail allocation when a requested IMEX channel is missing.", kind="bool"),
    _s("kubelet_socket", ("--kubelet-socket",), ("KUBELET_SOCKET",), None,
       "/var/lib/kubelet/device-plugins/kubelet.sock", _nonempty_string,
       "The kubelet's registration socket; workers serve in its directory."),
    _s("config_file", ("--config-file",), ("CONFIG_FILE",), None, "", _string,
       "Path of the YAML or JSON config file."),
    # gpuvisor's own (the file section `gpuvisor:` is ignored by NVIDIA's plugin)
    _s("simulate", ("--simulate",), ("GPUVISOR_SIMULATE",), "gpuvisor.simulate", None, _optional_string,
       "Run on the NVML simulator: a built-in profile name or a node YAML path; absent uses real NVML.",
       default_doc="(real NVML)", gpuvisor=True),
    _s("run_dir", ("--run-dir",), ("GPUVISOR_RUN_DIR",), "gpuvisor.runDir", "/run/gpuvisor", _nonempty_string,
       "Directory for plans, the control socket and other runtime state.", gpuvisor=True),
    _s("metrics_address", ("--metrics-address",), ("GPUVISOR_METRICS_ADDRESS",), "gpuvisor.metricsAddress",
       "0.0.0.0:9475", _address, "host:port of /metrics, /healthz and /readyz; empty disables.",
       env_empty_is_value=True, gpuvisor=True),
    _s("log_format", ("--log-format",), ("GPUVISOR_LOG_FORMAT",), "gpuvisor.logFormat", "text", _string,
       "Log line format.", choices=LOG_FORMATS, gpuvisor=True),
    _s("log_level", ("--log-level",), ("GPUVISOR_LOG_LEVEL",), "gpuvisor.logLevel", "info", _string,
       "Lowest level logged.", choices=LOG_LEVELS, gpuvisor=True),
    _s("cdi_spec_dir", ("--cdi-spec-dir",), ("CDI_SPEC_DIR",), "gpuvisor.cdiSpecDir", "/var/run/cdi",
       _nonempty_string, "Directory of CDI spec files.", gpuvisor=True),
    _s("mig_minors_path", ("--mig-minors-path",), ("GPUVISOR_MIG_MINORS_PATH",), "gpuvisor.migMinorsPath",
       "/proc/driver/nvidia-caps/mig-minors", _nonempty_string,
       "Where the MIG capability device minors are read from.", gpuvisor=True),
    _s("cdi_spec_format", ("--cdi-spec-format",), ("GPUVISOR_CDI_SPEC_FORMAT",), "gpuvisor.cdiSpecFormat", "json",
       _string, "File format of the CDI spec gpuvisor writes (cdi-annotations / cdi-cri strategies).",
       choices=("json", "yaml"), gpuvisor=True),
    _s("cdi_nvidia_ctk", ("--cdi-nvidia-ctk",), ("GPUVISOR_CDI_NVIDIA_CTK",), "gpuvisor.cdiNvidiaCtk", False,
       parse_go_bool, "Let nvidia-ctk cdi generate write the full CDI spec; falls back to gpuvisor's own.",
       kind="bool", gpuvisor=True),
    _s("mps_control_binary", ("--mps-control-binary",), ("GPUVISOR_MPS_CONTROL",), "gpuvisor.mpsControlBinary",
       "nvidia-cuda-mps-control", _nonempty_string,
       "CUDA MPS control binary: a path, or a name looked up on PATH, then under the driver root.", gpuvisor=True),
    _s("mps_exclusive_process", ("--mps-exclusive-process",), ("GPUVISOR_MPS_EXCLUSIVE_PROCESS",),
       "gpuvisor.mpsExclusiveProcess", False, parse_go_bool,
       "Put MPS-shared GPUs in EXCLUSIVE_PROCESS compute mode while their daemon runs.", kind="bool",
       gpuvisor=True),
    _s("rediscovery_interval", ("--rediscovery-interval",), ("GPUVISOR_REDISCOVERY_INTERVAL",),
       "gpuvisor.rediscoveryInterval", 60.0, _seconds(positive=False),
       "Seconds between device rediscoveries (MIG changes, lost GPUs); 0 disables.", gpuvisor=True),
    _s("heartbeat_timeout", ("--heartbeat-timeout",), ("GPUVISOR_HEARTBEAT_TIMEOUT",), "gpuvisor.heartbeatTimeout",
       10.0, _seconds(positive=True),
       "Seconds of worker heartbeat silence before it counts as hung (workers beat 4 times per timeout).",
       gpuvisor=True),
    _s("start_retries", ("--start-retries",), ("GPUVISOR_START_RETRIES",), "gpuvisor.startRetries", 5,
       _int_at_least(0), "Quick worker failures in a row before the worker is left FATAL.", gpuvisor=True),
    _s("start_seconds", ("--start-seconds",), ("GPUVISOR_START_SECONDS",), "gpuvisor.startSeconds", 10.0,
       _seconds(positive=True),
       "A worker that dies sooner than this after its start failed quickly (counts toward --start-retries).",
       gpuvisor=True),
    _s("zygote", ("--zygote",), ("GPUVISOR_ZYGOTE",), "gpuvisor.zygote", True, parse_go_bool,
       "Fork workers from a pre-imported zygote process (fast restarts, shared memory pages); "
       "false starts each worker by exec.", kind="bool", gpuvisor=True),
    _s("probe_interval", ("--probe-interval",), ("GPUVISOR_PROBE_INTERVAL",), "gpuvisor.probeInterval", 10.0,
       _seconds(positive=True),
       "Seconds between NVML health probes of every GPU (they catch what sends no event, and transient "
       "faults recover only after a passing probe).", gpuvisor=True),
    _s("disable_healthchecks", (), ("DP_DISABLE_HEALTHCHECKS",), None, (), _token_list,
       "NVIDIA's health-check switch: all, xids, or a comma list of XIDs to ignore.", gpuvisor=True),
    _s("enable_healthchecks", (), ("DP_ENABLE_HEALTHCHECKS",), None, (), _token_list,
       "NVIDIA's health-check switch: all, or a comma list of XIDs to treat as fatal.", gpuvisor=True),
)  # fmt: skip

SETTINGS_BY_NAME: Final[Mapping[str, Setting]] = {s.name: s for s in SETTINGS}


# --- the resolved config ----------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    # NVIDIA's resource patterns: `*` matches any run of characters, everything else is literal.
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


@dataclass(frozen=True)
class ResourcePattern:
    """`resources.gpus[]` / `resources.mig[]`: devices whose product name (GPU) or profile (MIG)
    matches `pattern` are advertised as `name`."""

    pattern: str
    name: str  # fully qualified, e.g. "nvidia.com/a100"

    def matches(self, value: str) -> bool:
        return _glob_regex(self.pattern).fullmatch(value) is not None


@dataclass(frozen=True)
class ResourcesConfig:
    gpus: tuple[ResourcePattern, ...] = ()
    mig: tuple[ResourcePattern, ...] = ()


@dataclass(frozen=True)
class DeviceSelector:
    """Which devices of a resource a sharing entry covers: all, the first `count`, or `refs`
    (GPU index "i", MIG index "i:j", "GPU-…"/"MIG-…" UUID)."""

    all: bool = False
    count: int = 0
    refs: tuple[str, ...] = ()


@dataclass(frozen=True)
class SharedResource:
    """One `sharing.<strategy>.resources[]` entry."""

    name: str  # fully qualified original resource, e.g. "nvidia.com/gpu"
    rename: str  # fully qualified resource the replicas are advertised as; "" keeps `name`
    devices: DeviceSelector
    replicas: int


@dataclass(frozen=True)
class SharingConfig:
    strategy: str = "none"  # none | time-slicing | mps
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[SharedResource, ...] = ()


@dataclass(frozen=True)
class HealthConfig:
    """`gpuvisor.health`: per-XID actions (parsed here, interpreted by the health policy)."""

    xids: tuple[tuple[int, str], ...] = ()  # (xid, action), sorted by xid
    transient_quiet_seconds: float = 60.0

    def xid_actions(self) -> dict[int, str]:
        return dict(self.xids)


@dataclass(frozen=True)
class Config:
    """Everything resolved: one field per `Setting` (same name), then the file-only sections."""

    mig_strategy: str
    fail_on_init_error: bool
    driver_root: str
    dev_root: str
    pass_device_specs: bool
    device_list_strategy: tuple[str, ...]
    device_id_strategy: str
    gds_enabled: bool
    mofed_enabled: bool
    gdrcopy_enabled: bool
    cdi_annotation_prefix: str
    nvidia_cdi_hook_path: str
    driver_root_ctr_path: str
    mps_root: str
    shared_devices_allocation_policy: str
    device_discovery_strategy: str
    imex_channel_ids: tuple[int, ...]
    imex_required: bool
    kubelet_socket: str
    config_file: str
    simulate: str | None
    run_dir: str
    metrics_address: str
    log_format: str
    log_level: str
    cdi_spec_dir: str
    mig_minors_path: str
    cdi_spec_format: str
    cdi_nvidia_ctk: bool
    mps_control_binary: str
    mps_exclusive_process: bool
    rediscovery_interval: float
    heartbeat_timeout: float
    start_retries: int
    start_seconds: float
    zygote: bool
    probe_interval: float
    disable_healthchecks: tuple[str, ...]
    enable_healthchecks: tuple[str, ...]
    resources: ResourcesConfig = ResourcesConfig()
    sharing: SharingConfig = SharingConfig()
    health: HealthConfig = HealthConfig()
    sources: tuple[tuple[str, str], ...] = ()  # (setting name, "flag --x" | "env X" | "file …" | "default")
    unknown_keys: tuple[str, ...] = ()  # file keys that were ignored, e.g. "flags.gfd"

    def describe(self) -> dict[str, Any]:
        """The merged config as JSON-able data, for logging once at start."""
        return {
            "settings": {s.name: _jsonable(getattr(self, s.name)) for s in SETTINGS},
            "sources": dict(self.sources),
            "resources": _jsonable(dataclasses.asdict(self.resources)),
            "sharing": _jsonable(dataclasses.asdict(self.sharing)),
            "health": {
                "xids": {str(xid): action for xid, action in self.health.xids},
                "transientQuietSeconds": self.health.transient_quiet_seconds,
            },
            "unknownKeys": list(self.unknown_keys),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# --- argparse ---------------------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every setting that has a flag to `parser` (used by `gpuvisor run`).

    Every dest defaults to None, meaning "not given": the loader then falls through to the env
    var, the file and the default. Values stay strings; `load_config` parses them.
    """
    groups = {
        False: parser.add_argument_group("NVIDIA device plugin options"),
        True: parser.add_argument_group("gpuvisor options"),
    }
    for setting in SETTINGS:
        if not setting.flags:
            continue
        help_text = setting.help
        if setting.choices:
            help_text += f" One of: {', '.join(setting.choices)}."
        env = f"env {', '.join(setting.envs)}; " if setting.envs else ""
        help_text += f" ({env}default {setting.default_text()})"
        kwargs: dict[str, Any] = {"dest": setting.name, "default": None, "help": help_text.replace("%", "%%")}
        if setting.kind == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif setting.kind == "list":
            kwargs.update(action="append", metavar="LIST")
        else:
            kwargs["metavar"] = "VALUE" if not setting.choices else "{" + ",".join(setting.choices) + "}"
        groups[setting.gpuvisor].add_argument(*setting.flags, **kwargs)


# --- loading ----------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader minus YAML 1.1's base-60 numbers, so that `devices: [1:2]` stays "1:2"."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        # types-PyYAML leaves BaseResolver.resolve untyped.
        tag = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        if (
            kind is yaml.ScalarNode
            and implicit[0]
            and ":" in value
            and tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
        ):
            return "tag:yaml.org,2002:str"
        return tag


def parse_config_text(text: str, source: str) -> object:
    """Parse YAML or JSON text (JSON is read as YAML); errors name the line and column."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(source, "", f"not valid YAML or JSON: {where}{exc.problem or exc}") from None
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
        raise ConfigError(source, "", f"not valid YAML or JSON: {exc}") from None


def read_config_file(path: str) -> object:
    """Read and parse the config file at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, "", "the config file is not UTF-8 text") from None
    return parse_config_text(text, path)


def _given_flags(flags: argparse.Namespace | Mapping[str, object] | None) -> dict[str, object]:
    if flags is None:
        return {}
    raw = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
    return {name: value for name, value in raw.items() if name in SETTINGS_BY_NAME and value is not None}


def load_config(flags: argparse.Namespace | Mapping[str, object] | None, environ: Mapping[str, str]) -> Config:
    """Resolve the config from parsed flags (an argparse Namespace from `add_run_arguments`, or a
    mapping of setting name to raw value), the environment and the config file it names.

    Call it again to reload: the file is re-read each time. Raises ConfigError.
    """
    given = _given_flags(flags)
    path, _ = _resolve_setting(SETTINGS_BY_NAME["config_file"], given, environ, {}, "")
    data: object = read_config_file(path) if path else None
    return config_from_data(data, flags=given, environ=environ, source=path or "<no config file>")


def config_from_data(
    data: object,
    *,
    flags: argparse.Namespace | Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    source: str = "<config>",
) -> Config:
    """Resolve the config from already-parsed file contents (`data`, None for no file).

    `source` names the file in errors. Raises ConfigError for any bad input, never another error.
    """
    given = _given_flags(flags)
    env = environ if environ is not None else {}
    root = _mapping(data, source, "", what="the config file")
    _check_version(root, source)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        values[setting.name], sources[setting.name] = _resolve_setting(setting, given, env, root, source)
    if values["dev_root"] is None:
        values["dev_root"] = values["driver_root"]
        sources["dev_root"] = "default (the driver root)"

    gpuvisor_section = _mapping(root.get("gpuvisor"), source, "gpuvisor")
    resources = _parse_resources(root.get("resources"), source)
    sharing = _parse_sharing(root.get("sharing"), source)
    health = _parse_health(gpuvisor_section.get("health"), source)
    _check_sharing(sharing, values, source)
    return Config(
        **values,
        resources=resources,
        sharing=sharing,
        health=health,
        sources=tuple(sources.items()),
        unknown_keys=tuple(_unknown_keys(root, _SCHEMA, "")),
    )


def _mapping(value: object, source: str, key: str, *, what: str = "") -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(source, key, f"{what or 'this'} must be a mapping, not {_kind(value)}")
    return value


def _check_version(root: Mapping[Any, Any], source: str) -> None:
    version = root.get("version")
    if version is None:
        return
    if version != CONFIG_VERSION:
        raise ConfigError(source, "version", f"unsupported config version {_show(version)}: only v1 is supported")


def _lookup(root: Mapping[Any, Any], dotted: str, source: str) -> object:
    """The value at a dotted file key, or None when it (or a section above it) is absent."""
    node: Mapping[Any, Any] = root
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            return None
        node = _mapping(nxt, source, ".".join(parts[: i + 1]), what="this section")
    return node.get(parts[-1])


def _resolve_setting(
    setting: Setting, given: Mapping[str, object], environ: Mapping[str, str], root: Mapping[Any, Any], source: str
) -> tuple[Any, str]:
    """(value, where it came from), by precedence flag > env var > file > default."""
    if setting.name in given:
        origin = f"flag {setting.flags[0]}" if setting.flags else f"argument {setting.name}"
        return _parse_value(setting, given[setting.name], origin, ""), origin
    for var in setting.envs:
        raw = environ.get(var)
        if raw is None or (raw == "" and not setting.env_empty_is_value):
            continue
        origin = f"env {var}"
        return _parse_value(setting, raw, origin, ""), origin
    if setting.file_key is not None:
        raw_file = _lookup(root, setting.file_key, source)
        if raw_file is not None:
            return _parse_value(setting, raw_file, source, setting.file_key), f"file {setting.file_key}"
    return setting.default, "default"


def _parse_value(setting: Setting, raw: object, source: str, key: str) -> Any:
    try:
        return setting.parse(raw)
    except _Invalid as exc:
        raise ConfigError(source, key, str(exc)) from None


# --- the file-only sections -------------------------------------------------------------------


def normalize_resource_name(value: object) -> str:
    """`gpu` → `nvidia.com/gpu`; checks the domain, the kubelet's name rule and the 63-char limit."""
    name = _nonempty_string(value)
    domain, slash, part = name.rpartition("/")
    if slash and domain != RESOURCE_DOMAIN:
        raise _Invalid(f"invalid resource name {_show(name)}: the domain must be {RESOURCE_DOMAIN}")
    if not _NAME_PART.fullmatch(part):
        raise _Invalid(
            f"invalid resource name {_show(name)}: use letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    full = f"{RESOURCE_DOMAIN}/{part}"
    if len(full) > MAX_RESOURCE_NAME_LENGTH:
        raise _Invalid(f"fully-qualified resource name must be at most {MAX_RESOURCE_NAME_LENGTH} characters: {full}")
    return full


def _field(parser: Parser, value: object, source: str, key: str) -> Any:
    try:
        return parser(value)
    except _Invalid as exc:
        raise ConfigError(source, key, str(exc)) from None


def _list(value: object, source: str, key: str) -> list[object]:
    if not isinstance(value, list):
        raise ConfigError(source, key, f"must be a list, not {_kind(value)}")
    return value


def _parse_patterns(value: object, source: str, key: str) -> tuple[ResourcePattern, ...]:
    if value is None:
        return ()
    out = []
    for i, item in enumerate(_list(value, source, key)):
        item_key = f"{key}[{i}]"
        entry = _mapping(item, source, item_key, what="each entry")
        pattern = _field(_nonempty_string, entry.get("pattern"), source, f"{item_key}.pattern")
        name = _field(normalize_resource_name, entry.get("name"), source, f"{item_key}.name")
        out.append(ResourcePattern(pattern=pattern, name=name))
    return tuple(out)


def _parse_resources(value: object, source: str) -> ResourcesConfig:
    section = _mapping(value, source, "resources")
    return ResourcesConfig(
        gpus=_parse_patterns(section.get("gpus"), source, "resources.gpus"),
        mig=_parse_patterns(section.get("mig"), source, "resources.mig"),
    )


def _device_ref(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str):
        text = value.strip()
        if _GPU_INDEX.fullmatch(text) or _MIG_INDEX.fullmatch(text):
            return text
        if (text.startswith(("GPU-", "MIG-"))) and len(text) > 4:
            return text
    raise _Invalid(f"invalid device reference {_show(value)}: use a GPU index, an i:j MIG index, or a GPU-/MIG- UUID")


def _parse_devices(value: object, source: str, key: str) -> DeviceSelector:
    if value == "all":
        return DeviceSelector(all=True)
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(source, key, f"device count must be > 0, not {value}")
        return DeviceSelector(count=value)
    if isinstance(value, list):
        if not value:
            raise ConfigError(source, key, "the device list must not be empty")
        refs: list[str] = []
        for i, item in enumerate(value):
            ref = _field(_device_ref, item, source, f"{key}[{i}]")
            if ref not in refs:
                refs.append(ref)
        return DeviceSelector(refs=tuple(refs))
    raise ConfigError(
        source, key, f'invalid devices {_show(value)}: use "all", a count > 0, or a list of device references'
    )


def _parse_sharing(value: object, source: str) -> SharingConfig:
    section = _mapping(value, source, "sharing")
    time_slicing, mps = section.get("timeSlicing"), section.get("mps")
    if time_slicing is not None and mps is not None:
        raise ConfigError(source, "sharing", "timeSlicing and mps are mutually exclusive: set only one")
    if time_slicing is None and mps is None:
        return SharingConfig()
    strategy, key, body = ("mps", "sharing.mps", mps) if mps is not None else ("time-slicing", "sharing.timeSlicing", time_slicing)
    spec = _mapping(body, source, key)
    raw_rename_by_default = spec.get("renameByDefault")
    rename_by_default: bool = (
        False
        if raw_rename_by_default is None
        else _field(parse_go_bool, raw_rename_by_default, source, f"{key}.renameByDefault")
    )
    raw_fail = spec.get("failRequestsGreaterThanOne")
    # NVIDIA's defaults: a time-sliced replica may be requested in any number, an MPS one not.
    fail: bool = (
        strategy == "mps"
        if raw_fail is None
        else _field(parse_go_bool, raw_fail, source, f"{key}.failRequestsGreaterThanOne")
    )
    raw_resources = spec.get("resources")
    if raw_resources is None or raw_resources == []:
        raise ConfigError(source, f"{key}.resources", "resources must not be empty")
    resources = []
    for i, item in enumerate(_list(raw_resources, source, f"{key}.resources")):
        item_key = f"{key}.resources[{i}]"
        entry = _mapping(item, source, item_key, what="each entry")
        name = _field(normalize_resource_name, entry.get("name"), source, f"{item_key}.name")
        raw_rename = entry.get("rename")
        if raw_rename is not None and raw_rename != "":
            rename = _field(normalize_resource_name, raw_rename, source, f"{item_key}.rename")
        elif rename_by_default:
            rename = _field(normalize_resource_name, name + SHARED_SUFFIX, source, f"{item_key}.name")
        else:
            rename = ""
        devices_raw = entry.get("devices")
        # NVIDIA: no `devices` means all of them.
        devices = _parse_devices("all" if devices_raw is None else devices_raw, source, f"{item_key}.devices")
        replicas = entry.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int | None):
            raise ConfigError(source, f"{item_key}.replicas", f"replicas must be an integer, not {_show(replicas)}")
        if replicas is None or replicas < 2:
            raise ConfigError(source, f"{item_key}.replicas", "number of replicas must be >= 2")
        resources.append(SharedResource(name=name, rename=rename, devices=devices, replicas=replicas))
    return SharingConfig(
        strategy=strategy,
        rename_by_default=rename_by_default,
        fail_requests_greater_than_one=fail,
        resources=tuple(resources),
    )


def _check_sharing(sharing: SharingConfig, values: Mapping[str, Any], source: str) -> None:
    if sharing.strategy != "mps":
        return
    if not values["mps_root"]:
        raise ConfigError(source, "sharing.mps", "MPS sharing needs an MPS root: set flags.mpsRoot, --mps-root or MPS_ROOT")
    if values["mig_strategy"] == "mixed":
        raise ConfigError(source, "sharing.mps", "MPS sharing is not supported with the mixed MIG strategy")
    for i, entry in enumerate(sharing.resources):
        if entry.name.startswith(f"{RESOURCE_DOMAIN}/mig-"):
            raise ConfigError(source, f"sharing.mps.resources[{i}].name", "MPS sharing is not supported for MIG devices")


def _parse_health(value: object, source: str) -> HealthConfig:
    section = _mapping(value, source, "gpuvisor.health")
    xids: dict[int, str] = {}
    for raw_xid, action in _mapping(section.get("xids"), source, "gpuvisor.health.xids").items():
        key = f"gpuvisor.health.xids.{raw_xid}"
        try:
            xid = _integer(raw_xid)
        except _Invalid:
            raise ConfigError(source, key, f"invalid XID {_show(raw_xid)}: XIDs are integers") from None
        if xid < 0:
            raise ConfigError(source, key, f"invalid XID {xid}: XIDs are not negative")
        if xid in xids:
            raise ConfigError(source, key, f"XID {xid} is listed twice")
        xids[xid] = _field(_choice(*XID_ACTIONS), action, source, key)
    quiet = section.get("transientQuietSeconds")
    quiet_seconds = (
        HealthConfig.transient_quiet_seconds
        if quiet is None
        else _field(_seconds(positive=False), quiet, source, "gpuvisor.health.transientQuietSeconds")
    )
    return HealthConfig(xids=tuple(sorted(xids.items())), transient_quiet_seconds=quiet_seconds)


# --- unknown keys -----------------------------------------------------------------------------

# A tree of the keys the file may hold: a dict is a mapping of known keys, a one-item list is a
# list whose items follow that schema, None is a leaf (its contents are not checked for keys).
Schema = dict[str, Any] | list[Any] | None


def _build_schema() -> dict[str, Any]:
    pattern: list[Any] = [{"pattern": None, "name": None}]
    strategy = {
        "renameByDefault": None,
        "failRequestsGreaterThanOne": None,
        "resources": [{"name": None, "rename": None, "devices": None, "replicas": None}],
    }
    schema: dict[str, Any] = {
        "version": None,
        "resources": {"gpus": pattern, "mig": pattern},
        "sharing": {"timeSlicing": strategy, "mps": strategy},
        "gpuvisor": {"health": {"xids": None, "transientQuietSeconds": None}},
    }
    for setting in SETTINGS:
        if setting.file_key is None:
            continue
        node = schema
        *parents, leaf = setting.file_key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = None
    return schema


_SCHEMA: Final = _build_schema()


def _unknown_keys(data: object, schema: Schema, prefix: str) -> list[str]:
    out: list[str] = []
    if isinstance(schema, dict) and isinstance(data, Mapping):
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(key, str) and key in schema:
                out.extend(_unknown_keys(value, schema[key], path))
            else:
                out.append(path)
    elif isinstance(schema, list) and isinstance(data, list):
        for i, item in enumerate(data):
            out.extend(_unknown_keys(item, schema[0], f"{prefix}[{i}]"))
    return out


# --- docs ---------------------------------------------------------------------------------------


def settings_markdown() -> str:
    """The settings table for the README, generated from SETTINGS."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| Flag | Env var | Config file key | Default | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        flags = ", ".join(f"`{f}`" for f in s.flags) or "—"
        envs = ", ".join(f"`{e}`" for e in s.envs) or "—"
        key = f"`{s.file_key}`" if s.file_key else "—"
        default = s.default_text()
        default = default if default.startswith("(") or " " in default else f"`{default}`"
        description = s.help + (f" One of: {', '.join(f'`{c}`' for c in s.choices)}." if s.choices else "")
        lines.append(f"| {flags} | {envs} | {key} | {cell(default)} | {cell(description)} |")
    lines.append("")
    lines.append(
        "Precedence: flag > env var > config file > default. Only in the config file: `resources.gpus`, "
        "`resources.mig`, `sharing.timeSlicing` / `sharing.mps`, and `gpuvisor.health` "
        "(`xids: {\"<xid>\": ignore|transient|until-reset}`, `transientQuietSeconds`)."
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.config", description="gpuvisor configuration")
    parser.add_argument("--markdown", action="store_true", help="print the settings table as Markdown")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
