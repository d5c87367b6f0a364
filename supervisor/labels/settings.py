"""`gpuvisor labels` settings: GPU Feature Discovery's flags, env vars and config-file keys.

Each setting is declared once in `LABEL_SETTINGS` (flags, env vars in GFD's order, file key,
default, parser); that table drives the argparse options, the loader and the README. The names,
defaults and precedence are those of NVIDIA's `gpu-feature-discovery` v0.20.0
(cmd/gpu-feature-discovery/main.go, internal/flags/kubeclient.go and node.go,
api/config/v1/flags.go): flag > env var (the first of its names that is set, so `GFD_MIG_STRATEGY`
beats `MIG_STRATEGY`) > config file (`flags.*`, `flags.gfd.*`) > default. Settings GFD has no file
key for (the Kubernetes client and node identity) come from flags and env vars only.

The config file is the one `gpuvisor run` reads. GFD uses only its `version`, `flags` and
`sharing`; the `sharing` section is parsed by gpuvisor's own loader so both commands accept and
refuse the same sharing configs, except that MPS here needs no MPS root (GFD labels MPS sharing
without one).

As elsewhere in gpuvisor, an env var set to the empty string counts as unset, except where empty
means something to GFD: `GFD_OUTPUT_FILE=""` writes to stdout, `GFD_MACHINE_TYPE_FILE=""` gives
machine type "unknown".
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from common.config import ConfigError, config_from_data, parse_go_bool, read_config_file
from supervisor.labels.rules import MIG_STRATEGIES, LabelConfig, SharingView

DEFAULT_OUTPUT_FILE: Final = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
DEFAULT_MACHINE_TYPE_FILE: Final = "/sys/class/dmi/id/product_name"
DISCOVERY_STRATEGIES: Final = ("auto", "nvml", "tegra", "vfio")  # GFD's validateFlags
MIN_SLEEP_S: Final = 1.0
MAX_PATH_LENGTH: Final = 4096

Parser = Callable[[object], Any]


class _Bad(ValueError):
    """A value parser's complaint; the loader adds where the value came from."""


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad(f"must be a string, not {type(value).__name__}")
    if len(value) > MAX_PATH_LENGTH:
        raise _Bad(f"is longer than {MAX_PATH_LENGTH} characters")
    return value


def _choice(*choices: str) -> Parser:
    def parse(value: object) -> str:
        text = _text(value)
        if text not in choices:
            raise _Bad(f"invalid value {text!r}: must be one of {', '.join(choices)}")
        return text

    return parse


def _bool(value: object) -> bool:
    try:
        return parse_go_bool(value)
    except ValueError as exc:
        raise _Bad(str(exc)) from None


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_TERM = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> float:
    """Seconds in a Go duration string ("60s", "1m30s", "1.5h", "500ms"), as time.ParseDuration reads it."""
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    while pos < len(body):
        match = _GO_TERM.match(body, pos)
        if match is None:
            raise _Bad(f"invalid duration {text!r}: use a Go duration such as 60s, 5m or 1h30m, or infinite")
        total += float(match.group(1)) * _GO_UNITS[match.group(2)]
        pos = match.end()
    if not body:
        raise _Bad(f"invalid duration {text!r}")
    return sign * total


def _sleep_interval(value: object) -> float | None:
    """GFD's Duration (api/config/v1/duration.go): "infinite" (None here), a Go duration string,
    or, in the file only, a number of nanoseconds. gpuvisor refuses intervals under a second:
    GFD would relabel in a busy loop."""
    if isinstance(value, bool):
        raise _Bad("must be a duration, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value) / 1e9
        hint = " (a number is nanoseconds, as in GFD: write a string such as \"60s\")"
    elif isinstance(value, str):
        if value.strip() == "infinite":
            return None
        seconds, hint = parse_go_duration(value), ""
    else:
        raise _Bad(f"must be a duration, not {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < MIN_SLEEP_S:
        raise _Bad(f"must be at least {MIN_SLEEP_S:g}s or infinite, not {value!r}{hint}")
    return seconds


def _number(*, minimum: float, integer: bool) -> Parser:
    def parse(value: object) -> float:
        if isinstance(value, bool):
            raise _Bad("must be a number")
        try:
            number = float(value) if isinstance(value, int | float) else float(_text(value).strip())
        except ValueError:
            raise _Bad(f"must be a number, not {value!r}") from None
        if not math.isfinite(number) or number < minimum or (integer and not number.is_integer()):
            bound = f" >= {minimum:g}" if math.isfinite(minimum) else ""
            raise _Bad(f"must be {'an integer' if integer else 'a finite number'}{bound}, not {value!r}")
        return int(number) if integer else number

    return parse


@dataclass(frozen=True)
class LabelSetting:
    """One setting of `gpuvisor labels`, declared once."""

    name: str
    flags: tuple[str, ...]
    envs: tuple[str, ...]
    file_key: str | None
    default: Any
    parse: Parser
    help: str
    kind: str = "value"  # "bool": the flag takes an optional value, as Go's bool flags do
    env_empty_is_value: bool = False
    gpuvisor: bool = False


def _s(name: str, flags: tuple[str, ...], envs: tuple[str, ...], file_key: str | None, default: Any, parse: Parser, help: str, **kw: Any) -> LabelSetting:
    return LabelSetting(name, flags, envs, file_key, default, parse, help, **kw)


LABEL_SETTINGS: Final[tuple[LabelSetting, ...]] = (
    _s("mig_strategy", ("--mig-strategy",), ("GFD_MIG_STRATEGY", "MIG_STRATEGY"), "flags.migStrategy", "none",
       _choice(*MIG_STRATEGIES), "How MIG devices are labelled: none, single or mixed."),
    _s("fail_on_init_error", ("--fail-on-init-error",), ("GFD_FAIL_ON_INIT_ERROR", "FAIL_ON_INIT_ERROR"),
       "flags.failOnInitError", True, _bool, "Exit when NVML cannot be initialised; false labels without GPU labels.",
       kind="bool"),
    _s("oneshot", ("--oneshot",), ("GFD_ONESHOT",), "flags.gfd.oneshot", False, _bool, "Label once and exit.",
       kind="bool"),
    _s("no_timestamp", ("--no-timestamp",), ("GFD_NO_TIMESTAMP",), "flags.gfd.noTimestamp", False, _bool,
       "Leave out the nvidia.com/gfd.timestamp label.", kind="bool"),
    _s("sleep_interval", ("--sleep-interval",), ("GFD_SLEEP_INTERVAL",), "flags.gfd.sleepInterval", 60.0,
       _sleep_interval, "Time between labellings (a Go duration, e.g. 60s), or infinite."),
    _s("output_file", ("--output-file", "--output", "-o"), ("GFD_OUTPUT_FILE",), "flags.gfd.outputFile",
       DEFAULT_OUTPUT_FILE, _text, "The features.d file NFD reads; empty writes to stdout.", env_empty_is_value=True),
    _s("machine_type_file", ("--machine-type-file",), ("GFD_MACHINE_TYPE_FILE",), "flags.gfd.machineTypeFile",
       DEFAULT_MACHINE_TYPE_FILE, _text, "File holding the machine type (DMI product name).",
       env_empty_is_value=True),
    _s("config_file", ("--config-file",), ("GFD_CONFIG_FILE", "CONFIG_FILE"), None, "", _text,
       "The config file (the same file gpuvisor run reads)."),
    _s("use_node_feature_api", ("--use-node-feature-api",), ("GFD_USE_NODE_FEATURE_API", "USE_NODE_FEATURE_API"),
       "flags.useNodeFeatureAPI", True, _bool, "Publish an NFD NodeFeature object instead of the features.d file.",
       kind="bool"),
    _s("device_discovery_strategy", ("--device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",),
       "flags.deviceDiscoveryStrategy", "auto", _choice(*DISCOVERY_STRATEGIES),
       "How devices are found: auto or nvml (tegra and vfio are GFD's, not supported by gpuvisor)."),
    _s("driver_root_ctr_path", ("--driver-root-ctr-path", "--container-driver-root"),
       ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"), "flags.plugin.containerDriverRoot", "/driver-root", _text,
       "Where the driver root is mounted in the container (accepted for GFD compatibility)."),
    _s("kubeconfig", ("--kubeconfig",), ("KUBECONFIG",), None, "", _text,
       "kubeconfig for the NodeFeature API; empty uses the pod's service account."),
    _s("kube_api_qps", ("--kube-api-qps",), ("KUBE_API_QPS",), None, 5.0, _number(minimum=-math.inf, integer=False),
       "Requests per second to the API server (0: the client default, 5; negative: no limit)."),
    _s("kube_api_burst", ("--kube-api-burst",), ("KUBE_API_BURST",), None, 10, _number(minimum=0, integer=True),
       "Burst of requests to the API server (0: the client default, 10)."),
    _s("namespace", ("--namespace",), ("NAMESPACE",), None, "default", _text, "Namespace of the NodeFeature object."),
    _s("node_name", ("--node-name",), ("NODE_NAME",), None, "", _text, "This node's name (NodeFeature API)."),
    _s("pod_name", ("--pod-name",), ("POD_NAME",), None, "", _text,
       "This pod's name, for the NodeFeature object's owner references."),
    _s("simulate", ("--simulate",), ("GPUVISOR_SIMULATE",), "gpuvisor.simulate", "", _text,
       "Label a simulated node: a built-in profile name or a node YAML path.", gpuvisor=True),
    _s("log_format", ("--log-format",), ("GPUVISOR_LOG_FORMAT",), "gpuvisor.logFormat", "text", _choice("text", "json"),
       "Log line format.", gpuvisor=True),
    _s("log_level", ("--log-level",), ("GPUVISOR_LOG_LEVEL",), "gpuvisor.logLevel", "info",
       _choice("debug", "info", "warning", "error", "critical"), "Lowest level logged.", gpuvisor=True),
)  # fmt: skip

_BY_NAME: Final = {s.name: s for s in LABEL_SETTINGS}


@dataclass(frozen=True)
class LabelSettings:
    """Everything `gpuvisor labels` runs with, resolved."""

    mig_strategy: str
    fail_on_init_error: bool
    oneshot: bool
    no_timestamp: bool
    sleep_interval: float | None  # seconds; None is "infinite"
    output_file: str
    machine_type_file: str
    config_file: str
    use_node_feature_api: bool
    device_discovery_strategy: str
    driver_root_ctr_path: str
    kubeconfig: str
    kube_api_qps: float
    kube_api_burst: int
    namespace: str
    node_name: str
    pod_name: str
    simulate: str
    log_format: str
    log_level: str
    sharing: SharingView = field(default_factory=SharingView)
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def label_config(self) -> LabelConfig:
        return LabelConfig(mig_strategy=self.mig_strategy, sharing=self.sharing)


def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting's flag on `parser`; dests default to None ("not given"), values stay strings."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("gpuvisor")
    except PackageNotFoundError:
        ours = "unknown"
    parser.add_argument("--version", action="version", version=f"gpuvisor labels {ours} (GPU Feature Discovery v0.20.0 labels)")
    for setting in LABEL_SETTINGS:
        envs = f"env {', '.join(setting.envs)}; " if setting.envs else ""
        help_text = f"{setting.help} ({envs}default {default_text(setting)})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": setting.name, "default": None, "help": help_text}
        if setting.kind == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs["metavar"] = "VALUE"
        parser.add_argument(*setting.flags, **kwargs)


def _lookup(root: Mapping[Any, Any], dotted: str, source: str) -> object:
    node: object = root
    for part in dotted.split("."):
        if node is None:
            return None
        if not isinstance(node, Mapping):
            raise ConfigError(source, dotted, f"{part!r} sits under a value that is not a mapping")
        node = node.get(part)
    return node


def _resolve(setting: LabelSetting, given: Mapping[str, object], environ: Mapping[str, str], root: Mapping[Any, Any], source: str) -> tuple[Any, str]:
    if given.get(setting.name) is not None:
        origin = f"flag {setting.flags[0]}"
        return _parse(setting, given[setting.name], origin, ""), origin
    for var in setting.envs:
        raw = environ.get(var)
        if raw is None or (raw == "" and not setting.env_empty_is_value):
            continue
        return _parse(setting, raw, f"env {var}", ""), f"env {var}"
    if setting.file_key is not None:
        raw_file = _lookup(root, setting.file_key, source)
        if raw_file is not None:
            return _parse(setting, raw_file, source, setting.file_key), f"file {setting.file_key}"
    return setting.default, "default"


def _parse(setting: LabelSetting, raw: object, source: str, key: str) -> Any:
    try:
        return setting.parse(raw)
    except _Bad as exc:
        raise ConfigError(source, key, str(exc)) from None


def load_label_settings(flags: argparse.Namespace | Mapping[str, object] | None, environ: Mapping[str, str]) -> LabelSettings:
    """Resolve the settings from parsed flags, the environment and the config file they name.

    Call again to reload (SIGHUP): the file is read each time. Raises ConfigError.
    """
    given = dict(vars(flags) if isinstance(flags, argparse.Namespace) else (flags or {}))
    path, _ = _resolve(_BY_NAME["config_file"], given, environ, {}, "")
    data = read_config_file(path) if path else None
    source = path or "<no config file>"
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(source, "", "the config file must be a mapping")
    root: Mapping[Any, Any] = data or {}
    values: dict[str, Any] = {}
    sources: list[tuple[str, str]] = []
    for setting in LABEL_SETTINGS:
        values[setting.name], origin = _resolve(setting, given, environ, root, source)
        sources.append((setting.name, origin))
    if values["device_discovery_strategy"] in ("tegra", "vfio"):
        origin = dict(sources)["device_discovery_strategy"]
        raise ConfigError(origin, "", f"device discovery strategy {values['device_discovery_strategy']!r} is GFD's "
                          "CUDA/VFIO path, which gpuvisor does not implement: use auto or nvml")  # fmt: skip
    # gpuvisor's own loader reads `sharing` (and checks `version`), with a placeholder MPS root:
    # an MPS root matters to the device plugin's daemons, not to the labels.
    sharing_doc = {key: root[key] for key in ("version", "sharing") if key in root}
    sharing = config_from_data(sharing_doc, flags={"mps_root": "/", "mig_strategy": "none"}, source=source).sharing
    return LabelSettings(**values, sharing=SharingView.from_config(sharing), sources=tuple(sources))


def default_text(setting: LabelSetting) -> str:
    """How the help and the docs show a default."""
    if isinstance(setting.default, bool):
        return "true" if setting.default else "false"
    if setting.name == "sleep_interval":
        return "60s"
    if setting.name == "kube_api_qps":
        return "5"
    return str(setting.default) if setting.default != "" else "(none)"


def settings_markdown() -> str:
    """The settings table for the README's "Node labels" section."""
    rows = ["| Flag | Env var | Config file key | Default | Description |", "| --- | --- | --- | --- | --- |"]
    for s in LABEL_SETTINGS:
        key = f"`{s.file_key}`" if s.file_key else "—"
        default = default_text(s)
        default = default if default.startswith("(") else f"`{default}`"
        rows.append(f"| {', '.join(f'`{f}`' for f in s.flags)} | {', '.join(f'`{e}`' for e in s.envs)} | {key} | {default} | {s.help} |")
    return "\n".join(rows) + "\n"
