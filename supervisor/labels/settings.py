"""`gpuvisor labels` settings: GPU Feature Discovery's flags, env vars and config-file keys.

Each setting is one `Setting` row of `LABEL_SETTINGS` (flags, env vars in GFD's order, file key,
Go flag type, default, check), read by the config package's own machinery, so `gpuvisor labels`
takes its inputs exactly as `gpuvisor run` takes the same kinds of input. That is GFD v0.20.0's
way too: it is built from NVIDIA's repository with the device plugin's urfave/cli and config
decoding (cmd/gpu-feature-discovery/main.go, internal/flags/kubeclient.go and node.go,
api/config/v1). So:

- flags follow Go's syntax (`-oneshot` is `--oneshot`; `--oneshot false` is true, and "false"
  ends the flags; no abbreviations);
- precedence is flag > env var > config file (`flags.*`, `flags.gfd.*`) > default, and the first
  env var of a setting that is present wins even when empty (`GFD_MIG_STRATEGY` before
  `MIG_STRATEGY`), empty meaning what urfave/cli makes of it: "" for a string (so
  `GFD_OUTPUT_FILE=""` is stdout), false for a boolean, unset for the sleep interval and the
  Kubernetes client's numbers; gpuvisor's own settings count an empty env var as unset;
- the file is decoded whole as NVIDIA's `Config` (a wrong type anywhere in it is refused, keys
  match case-insensitively) and its `sharing` by gpuvisor's parser of that section, which
  follows NVIDIA's; nothing else of the device plugin's config applies here.

Settings GFD has no file key for (the Kubernetes client and node identity) come from flags and
env vars only. gpuvisor's own `--simulate`, `--log-format` and `--log-level` are `gpuvisor run`'s
rows themselves.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from supervisor.config import golang
from supervisor.config.docs import settings_markdown
from supervisor.config.errors import ConfigError, Invalid, show
from supervisor.config.flags import add_go_arguments
from supervisor.config.loader import (
    FlagsArg,
    decode_file,
    ignored_notice,
    own_section,
    read_given,
    resolve_setting,
)
from supervisor.config.named import input_problem
from supervisor.config.sections import parse_resources, parse_sharing
from supervisor.config.settings import (
    DISCOVERY_STRATEGIES,
    MIG_STRATEGIES,
    SETTINGS_BY_NAME,
    Setting,
    any_string,
    choice,
)
from supervisor.config.yamlfile import read_config_file
from supervisor.labels.host import DEFAULT_MACHINE_TYPE_FILE
from supervisor.labels.rules import LabelConfig, SharingView

DEFAULT_OUTPUT_FILE: Final = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
GFD_DISCOVERY_STRATEGIES: Final = (*DISCOVERY_STRATEGIES, "vfio")  # GFD's validateFlags (main.go:132-142)
UNSUPPORTED_DISCOVERY: Final = ("tegra", "vfio")  # GFD's CUDA and VFIO paths, not implemented here
MIN_SLEEP_S: Final = 1.0
_NS: Final = 1e9


def sleep_interval(value: object) -> float | None:
    """GFD's Duration (api/config/v1/duration.go): "infinite" (None here), a Go duration string,
    or, from the file only, a number of nanoseconds. gpuvisor refuses intervals under a second
    (GFD would relabel in a busy loop) and numbers beyond Go's int64 nanoseconds."""
    hint = ""
    if isinstance(value, str):
        if value == "infinite":  # Duration.parse: exactly this word
            return None
        try:
            nanoseconds: float = golang.parse_duration(value)
        except ValueError:
            raise Invalid(
                f"invalid duration {value!r}: use a Go duration such as 60s, 5m or 1h30m, or infinite"
            ) from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        nanoseconds = value
        hint = ' (a number is nanoseconds, as in GFD: write a string such as "60s")'
    else:
        raise Invalid(f"must be a duration, not {show(value)}")
    if not math.isfinite(nanoseconds) or nanoseconds > golang.INT64_MAX:
        raise Invalid(f"out of range: {show(value)}{hint}")
    if nanoseconds / _NS < MIN_SLEEP_S:
        raise Invalid(f"must be at least {MIN_SLEEP_S:g}s or infinite, not {show(value)}{hint}")
    return nanoseconds / _NS


LABEL_SETTINGS: Final[tuple[Setting, ...]] = (
    # GFD v0.20.0: cmd/gpu-feature-discovery/main.go:51-119 (names, env vars, Go flag types,
    # defaults), internal/flags/kubeclient.go:42-67 and node.go:30-52; file keys from
    # api/config/v1/flags.go:118-181 (UpdateFromCLIFlags)
    Setting("mig_strategy", ("--mig-strategy",), ("GFD_MIG_STRATEGY", "MIG_STRATEGY"), "flags.migStrategy", "string",
            "none", choice(*MIG_STRATEGIES), "How MIG devices are labelled.", choices=MIG_STRATEGIES),
    Setting("fail_on_init_error", ("--fail-on-init-error",), ("GFD_FAIL_ON_INIT_ERROR", "FAIL_ON_INIT_ERROR"),
            "flags.failOnInitError", "bool", True, bool,
            "Exit when NVML cannot be initialised; false labels without GPU labels."),
    Setting("oneshot", ("--oneshot",), ("GFD_ONESHOT",), "flags.gfd.oneshot", "bool", False, bool,
            "Label once and exit."),
    Setting("no_timestamp", ("--no-timestamp",), ("GFD_NO_TIMESTAMP",), "flags.gfd.noTimestamp", "bool", False, bool,
            "Leave out the nvidia.com/gfd.timestamp label."),
    Setting("sleep_interval", ("--sleep-interval",), ("GFD_SLEEP_INTERVAL",), "flags.gfd.sleepInterval", "duration",
            60.0, sleep_interval, "Time between labellings (a Go duration, e.g. 60s), or infinite.", default_doc="60s"),
    Setting("output_file", ("--output-file", "--output", "-o"), ("GFD_OUTPUT_FILE",), "flags.gfd.outputFile", "string",
            DEFAULT_OUTPUT_FILE, any_string, "The features.d file NFD reads; empty writes to stdout."),
    Setting("machine_type_file", ("--machine-type-file",), ("GFD_MACHINE_TYPE_FILE",), "flags.gfd.machineTypeFile",
            "string", DEFAULT_MACHINE_TYPE_FILE, any_string,
            "File holding the machine type (DMI product name); empty gives unknown."),
    Setting("config_file", ("--config-file",), ("GFD_CONFIG_FILE", "CONFIG_FILE"), None, "string", "", any_string,
            "The config file (the same file gpuvisor run reads)."),
    Setting("use_node_feature_api", ("--use-node-feature-api",), ("GFD_USE_NODE_FEATURE_API", "USE_NODE_FEATURE_API"),
            "flags.useNodeFeatureAPI", "bool", True, bool,
            "Publish an NFD NodeFeature object instead of the features.d file."),
    Setting("device_discovery_strategy", ("--device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",),
            "flags.deviceDiscoveryStrategy", "string", "auto", choice(*GFD_DISCOVERY_STRATEGIES),
            "How devices are found (tegra and vfio, GFD's CUDA and VFIO paths, are refused by gpuvisor).",
            choices=GFD_DISCOVERY_STRATEGIES),
    Setting("driver_root_ctr_path", ("--driver-root-ctr-path", "--container-driver-root"),
            ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"), "flags.plugin.containerDriverRoot", "string",
            "/driver-root", any_string,
            "Where the driver root is mounted in the container (accepted for GFD compatibility)."),
    Setting("kubeconfig", ("--kubeconfig",), ("KUBECONFIG",), None, "string", "", any_string,
            "kubeconfig for the NodeFeature API; empty uses the pod's service account."),
    SETTINGS_BY_NAME["kube_api_qps"],  # the very rows of `gpuvisor run` (and of NVIDIA's DRA driver)
    SETTINGS_BY_NAME["kube_api_burst"],
    Setting("namespace", ("--namespace",), ("NAMESPACE",), None, "string", "default", any_string,
            "Namespace of the NodeFeature object."),
    Setting("node_name", ("--node-name",), ("NODE_NAME",), None, "string", "", any_string,
            "This node's name (NodeFeature API)."),
    Setting("pod_name", ("--pod-name",), ("POD_NAME",), None, "string", "", any_string,
            "This pod's name, for the NodeFeature object's owner references."),
    # config-manager's inputs, the very rows of `gpuvisor run`: the Node's label picks the config
    # (supervisor/labels/nodeconfig.py), as NVIDIA's chart has config-manager do for GFD
    SETTINGS_BY_NAME["config_file_srcdir"],
    SETTINGS_BY_NAME["node_label"],
    SETTINGS_BY_NAME["default_config"],
    SETTINGS_BY_NAME["fallback_strategies"],
    # gpuvisor's own: the very rows of `gpuvisor run`
    SETTINGS_BY_NAME["simulate"],
    SETTINGS_BY_NAME["log_format"],
    SETTINGS_BY_NAME["log_level"],
)  # fmt: skip

_BY_NAME: Final = {s.name: s for s in LABEL_SETTINGS}

LABEL_NOTES: Final = (
    "Precedence: flag > env var (the first of its names that is present, even when empty) > config file > "
    "default. Flags follow Go's syntax, as GFD's: a boolean flag takes no separate value (`--oneshot=false`, "
    "not `--oneshot false`), and arguments from the first non-flag one on are ignored. The config file's "
    "`sharing` section shapes the labels; the rest of it is checked as NVIDIA's `Config` and not used."
)


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
    config_file_srcdir: str  # the named configs; "" when the config is --config-file's
    node_label: str
    default_config: str
    fallback_strategies: tuple[str, ...]
    simulate: str | None  # None: real NVML
    log_format: str
    log_level: str
    sharing: SharingView = field(default_factory=SharingView)
    sources: tuple[tuple[str, str], ...] = ()
    notices: tuple[str, ...] = ()  # inputs taken as GFD takes them, worth a warning

    @property
    def label_config(self) -> LabelConfig:
        return LabelConfig(mig_strategy=self.mig_strategy, sharing=self.sharing)


def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting's flag on `parser` (a RunArgumentParser), read with Go's flag syntax as GFD reads it."""
    add_go_arguments(
        parser,
        LABEL_SETTINGS,
        groups={
            False: "GPU Feature Discovery options (Go flag syntax: --flag=value or --flag value)",
            True: "gpuvisor options",
        },
        error_prefix="gpuvisor labels",
        version_format="gpuvisor labels {version} (GPU Feature Discovery v0.20.0 labels)",
    )


def load_label_settings(
    flags: FlagsArg, environ: Mapping[str, str], chosen: str | None = None
) -> LabelSettings:
    """Resolve the settings from parsed flags (a Namespace from `add_label_arguments`' parser, or a
    mapping by setting name), the environment and the config file they name, or the named config
    `chosen` by the node's label ("" for the empty config; see supervisor/labels/nodeconfig.py).

    Call again to reload (SIGHUP): the file is read each time. Raises ConfigError.
    """
    given = read_given(flags, LABEL_SETTINGS)
    path, _ = resolve_setting(_BY_NAME["config_file"], given, environ, {}, {}, "")
    if chosen is not None:
        path = chosen
    source = path or "<no config file>"
    # GFD decodes the whole file into NVIDIA's Config (api/config/v1/config.go parseConfigFrom):
    # a wrong type or a bad `resources` entry fails it even though the labels never use them.
    root, tree, unknown = decode_file(read_config_file(path) if path else None, source)
    own = own_section(root, source)
    values: dict[str, Any] = {}
    sources: list[tuple[str, str]] = []
    for setting in LABEL_SETTINGS:
        values[setting.name], origin = resolve_setting(setting, given, environ, tree, own, source)
        sources.append((setting.name, origin))
    if chosen is not None:
        values["config_file"] = chosen  # what runs: the named config the node's label chose
    strategy = values["device_discovery_strategy"]
    if strategy in UNSUPPORTED_DISCOVERY:
        raise ConfigError(dict(sources)["device_discovery_strategy"], "", f"device discovery strategy {show(strategy)} "
                          "is GFD's CUDA/VFIO path, which gpuvisor does not implement: use auto or nvml")  # fmt: skip
    notices = ignored_notice(given)
    problem = input_problem(
        srcdir=values["config_file_srcdir"],
        node_name=values["node_name"],
        node_label=values["node_label"],
        config_file="" if chosen is not None else values["config_file"],
    )
    if problem is not None:
        raise ConfigError(dict(sources)["config_file_srcdir"], "", problem)
    parse_resources(tree.get("resources"), source, unknown)
    # NVIDIA's sharing rules, without the device plugin's checks across settings (an MPS root):
    # GFD labels MPS sharing without one.
    sharing = parse_sharing(tree.get("sharing"), source, unknown, notices)
    return LabelSettings(
        **values, sharing=SharingView.from_config(sharing), sources=tuple(sources), notices=tuple(notices)
    )


def label_settings_markdown() -> str:
    """The settings table of docs/node-labels.md."""
    return settings_markdown(LABEL_SETTINGS, LABEL_NOTES)
