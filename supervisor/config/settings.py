"""Every setting, declared once: flag names, env vars, file key, Go type, default, check, help.

The one table `SETTINGS` drives the command line (`flags.py`), the loader (`loader.py`) and the
settings table of docs/configuration.md (`docs.py`). NVIDIA's settings come first, with NVIDIA v0.20.0's names and aliases
(`cmd/nvidia-device-plugin/main.go`) and its Go flag types:

- `string`  a urfave/cli StringFlag: an env var set to "" is the value "";
- `bool`    a BoolFlag: `--flag` or `--flag=false`, never a separate value; env "" is false;
- `strings` a StringSliceFlag: comma lists (each item trimmed, empty items kept), repeatable;
- `ints`    an IntSliceFlag: comma lists of Go integers (`0x10`, `0o7`), repeatable; env "" is unset;
- `int`     an IntFlag: one Go integer (`strconv.ParseInt(s, 0, 64)`); env "" is unset;
- `float`   a Float64Flag: one Go float (`strconv.ParseFloat`); env "" is unset;
- `duration` GFD's GenericFlag of a Duration: the text as given (its check parses it); env "" is unset.

`check` then validates the typed value (a choice, a list of strategies, [] or [0] for IMEX).
gpuvisor's own settings (`gpuvisor=True`) use the same flag syntax, but their env vars count as
unset when empty (unless `env_empty_is_value`) and their checks take the raw value as given.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from common.socketnames import UNIX_PATH_MAX, shortest_socket_path
from supervisor.config import golang
from supervisor.config.errors import Invalid, kind, show
from supervisor.config.limits import MAX_SECONDS, MAX_START_RETRIES, MAX_STRING_LENGTH
from supervisor.config.memory import memory_sharing
from supervisor.config.named import DEFAULT_NODE_LABEL

MIG_STRATEGIES: Final = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES: Final = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES: Final = ("uuid", "index")
SHARED_POLICIES: Final = ("distributed", "packed")
DISCOVERY_STRATEGIES: Final = ("auto", "nvml", "tegra")
LOG_FORMATS: Final = ("text", "json")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
MODES: Final = ("device-plugin", "dra")
KINDS: Final = ("string", "bool", "strings", "ints", "int", "float", "duration")

_INTEGER = re.compile(r"[-+]?[0-9]+")
_PORT = re.compile(r"[0-9]{1,5}")

Check = Callable[[Any], Any]


# --- checks of NVIDIA's settings (typed values in) ---------------------------------------------


def any_string(value: str) -> str:
    return value


def kube_api_qps(value: float) -> float:
    # client-go's rest.Config.QPS: 0 is its default, a negative value no rate limit; NaN and
    # infinities (which strconv.ParseFloat reads) mean nothing there and are refused.
    if not math.isfinite(value):
        raise Invalid(f"must be a finite number, not {value}")
    return value


def kube_api_burst(value: int) -> int:
    # client-go's token bucket refuses every request with a negative burst: refused here at once.
    if value < 0:
        raise Invalid(f"must be an integer >= 0, not {value}")
    return value


def choice(*choices: str) -> Check:
    def check(value: str) -> str:
        if value not in choices:
            raise Invalid(f"invalid value {show(value)}: must be one of {', '.join(choices)}")
        return value

    return check


def kubelet_socket(value: str) -> str:
    if not value:
        # NVIDIA then serves without registering; gpuvisor's workers serve beside kubelet.sock
        # and register with it, so an empty path is refused (docs/compatibility.md).
        raise Invalid("must not be empty: gpuvisor serves and registers beside the kubelet's socket")
    # A socket path over the limit makes gRPC fail to add its port, again on every restart: refused
    # here instead. The workers bind beside it under absolute paths (worker/main.py).
    size = len(value.encode())
    if size > UNIX_PATH_MAX:
        raise Invalid(
            f"{value} is too long: it must fit a unix socket path (at most {UNIX_PATH_MAX} bytes, it has {size})"
        )
    worker = shortest_socket_path(os.path.dirname(os.path.abspath(value)))
    size = len(worker.encode())
    if size > UNIX_PATH_MAX:
        raise Invalid(
            f"the directory of {value} is too long: a worker's socket there, {worker} at its shortest, must "
            f"fit a unix socket path (at most {UNIX_PATH_MAX} bytes, it has {size})"
        )
    return value


def strategy_list(value: Sequence[str]) -> tuple[str, ...]:
    """spec.NewDeviceListStrategies: every item a known strategy ("" included: it is not one);
    an empty list is valid. NVIDIA keeps a set; the first order is kept for stable plans."""
    out: list[str] = []
    for item in value:
        if item not in DEVICE_LIST_STRATEGIES:
            raise Invalid(
                f"invalid device list strategy {show(item)}: must be one of {', '.join(DEVICE_LIST_STRATEGIES)}"
            )
        if item not in out:
            out.append(item)
    return tuple(out)


def imex_channel_ids(value: Sequence[int]) -> tuple[int, ...]:
    """spec.AssertChannelIDsValid: [] or [0]."""
    ids = list(value)
    if ids not in ([], [0]):
        raise Invalid(f"invalid IMEX channel IDs {show(ids)}: only [] or [0] is supported")
    return tuple(ids)


def string_tuple(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value)


# --- checks of gpuvisor's own settings (raw values in: text from flags/env, YAML from the file) --


def go_bool_text(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return golang.parse_bool(value)
        except ValueError:
            pass
    raise Invalid(f"invalid boolean {show(value)}: use true or false")


def own_string(value: object) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, not {kind(value)}")
    if len(value) > MAX_STRING_LENGTH:
        raise Invalid(f"too long: {len(value)} characters, at most {MAX_STRING_LENGTH}")
    return value


def own_nonempty(value: object) -> str:
    text = own_string(value)
    if not text:
        raise Invalid("must not be empty")
    return text


def own_optional(value: object) -> str | None:
    return own_string(value) or None


def own_choice(*choices: str) -> Check:
    def check(value: object) -> str:
        return str(choice(*choices)(own_string(value)))

    return check


def own_int(minimum: int, maximum: int) -> Check:
    def check(value: object) -> int:
        number: int
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            number = int(value.strip())
        else:
            raise Invalid(
                f"must be an integer, not {show(value) if isinstance(value, str | float) else kind(value)}"
            )
        if not minimum <= number <= maximum:
            raise Invalid(f"must be >= {minimum} and <= {maximum}, not {number}")
        return number

    return check


def seconds(*, positive: bool) -> Check:
    def check(value: object) -> float:
        number: float
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise Invalid(f"must be a number of seconds, not {kind(value)}")
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise Invalid(f"must be a number of seconds, not {show(value)}") from None
        if not math.isfinite(number) or number < 0 or (positive and number == 0) or number > MAX_SECONDS:
            raise Invalid(
                f"must be a {'positive' if positive else 'non-negative'} number of seconds up to {MAX_SECONDS:.0f}, "
                f"not {show(value)}"
            )
        return number

    return check


def address(value: object) -> str:
    text = own_string(value).strip()
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
        raise Invalid(f"invalid address {show(text)}: use host:port, :port, or empty to disable")
    return text


def token_list(value: object) -> tuple[str, ...]:
    """DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS: lower-cased comma tokens (os.Getenv semantics)."""
    text = own_string(value)
    return tuple(t.strip().lower() for t in text.split(",") if t.strip())


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: it drives the CLI flag, the env var, the file key and the docs."""

    name: str  # the Config field
    flags: tuple[str, ...]  # the first is the canonical name, the others NVIDIA's aliases
    envs: tuple[str, ...]  # the first one set wins (urfave/cli), even when set to ""
    file_key: str | None  # dotted path in the config file
    kind: str  # one of KINDS: the Go flag type (how text becomes a value)
    default: Any
    check: Check
    help: str
    choices: tuple[str, ...] = ()
    default_doc: str | None = None  # how the docs show the default, when repr is not right
    env_empty_is_value: bool = False  # gpuvisor's own settings only
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


def _s(name: str, flags: tuple[str, ...], envs: tuple[str, ...], file_key: str | None, kind_: str, default: Any,
       check: Check, help_: str, **extra: Any) -> Setting:  # fmt: skip
    if extra.get("choices") and check is any_string:
        check = choice(*extra["choices"])
    return Setting(name, flags, envs, file_key, kind_, default, check, help_, **extra)


SETTINGS: Final[tuple[Setting, ...]] = (
    # NVIDIA k8s-device-plugin v0.20.0 (cmd/nvidia-device-plugin/main.go:61-192)
    _s("mig_strategy", ("--mig-strategy",), ("MIG_STRATEGY",), "flags.migStrategy", "string", "none", any_string,
       "How MIG devices are advertised: none (MIG-enabled GPUs as full GPUs), single (MIG devices as "
       "nvidia.com/gpu), mixed (nvidia.com/mig-<profile>).", choices=MIG_STRATEGIES),
    _s("fail_on_init_error", ("--fail-on-init-error",), ("FAIL_ON_INIT_ERROR",), "flags.failOnInitError", "bool",
       True, bool, "Exit with an error when NVML cannot be initialised; false keeps running with no devices."),
    _s("driver_root", ("--driver-root", "--nvidia-driver-root"), ("NVIDIA_DRIVER_ROOT",), "flags.nvidiaDriverRoot",
       "string", "/", any_string, "Root of the NVIDIA driver installation on the host."),
    _s("dev_root", ("--dev-root", "--nvidia-dev-root"), ("NVIDIA_DEV_ROOT",), "flags.nvidiaDevRoot", "string", "",
       any_string, "Root under which the /dev/nvidia* device nodes are found; empty means the driver root.",
       default_doc="the driver root"),
    _s("pass_device_specs", ("--pass-device-specs",), ("PASS_DEVICE_SPECS",), "flags.plugin.passDeviceSpecs", "bool",
       False, bool, "Return DeviceSpecs (/dev/nvidia* nodes) in Allocate responses."),
    _s("device_list_strategy", ("--device-list-strategy",), ("DEVICE_LIST_STRATEGY",),
       "flags.plugin.deviceListStrategy", "strings", ("envvar",), strategy_list,
       "How devices are passed to the container runtime (comma list, or a string or list in the file).",
       choices=DEVICE_LIST_STRATEGIES),
    _s("device_id_strategy", ("--device-id-strategy",), ("DEVICE_ID_STRATEGY",), "flags.plugin.deviceIDStrategy",
       "string", "uuid", any_string, "How devices are named to the container runtime.", choices=DEVICE_ID_STRATEGIES),
    _s("gds_enabled", ("--gds-enabled",), ("GDS_ENABLED",), "flags.gdsEnabled", "bool", False, bool,
       "Set NVIDIA_GDS=enabled (GPUDirect Storage) in containers."),
    _s("mofed_enabled", ("--mofed-enabled",), ("MOFED_ENABLED",), "flags.mofedEnabled", "bool", False, bool,
       "Set NVIDIA_MOFED=enabled in containers."),
    _s("gdrcopy_enabled", ("--gdrcopy-enabled",), ("GDRCOPY_ENABLED",), "flags.gdrcopyEnabled", "bool", False, bool,
       "Set NVIDIA_GDRCOPY=enabled in containers."),
    _s("cdi_annotation_prefix", ("--cdi-annotation-prefix",), ("CDI_ANNOTATION_PREFIX",),
       "flags.plugin.cdiAnnotationPrefix", "string", "cdi.k8s.io/", any_string,
       "Prefix of the CDI annotations (cdi-annotations strategy); may be empty."),
    _s("nvidia_cdi_hook_path", ("--nvidia-cdi-hook-path", "--nvidia-ctk-path"), ("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
       "flags.plugin.nvidiaCTKPath", "string", "/usr/bin/nvidia-ctk", any_string,
       "Path of nvidia-ctk used as the CDI hook."),
    _s("driver_root_ctr_path", ("--driver-root-ctr-path", "--container-driver-root"),
       ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"), "flags.plugin.containerDriverRoot", "string",
       "/driver-root", any_string, "Where the driver root is mounted inside the plugin's container."),
    _s("mps_root", ("--mps-root",), ("MPS_ROOT",), "flags.mpsRoot", "string", "", any_string,
       "Host directory for MPS pipes and shared memory; required for MPS sharing."),
    _s("shared_devices_allocation_policy", ("--shared-devices-allocation-policy",),
       ("SHARED_DEVICES_ALLOCATION_POLICY",), "flags.plugin.sharedDevicesAllocationPolicy", "string", "distributed",
       any_string, "How replicas are picked: spread over GPUs, or packed onto few.", choices=SHARED_POLICIES),
    _s("device_discovery_strategy", ("--device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",),
       "flags.deviceDiscoveryStrategy", "string", "auto", any_string, "How devices are discovered.",
       choices=DISCOVERY_STRATEGIES),
    _s("imex_channel_ids", ("--imex-channel-ids",), ("IMEX_CHANNEL_IDS",), "imex.channelIDs", "ints", (),
       imex_channel_ids, "IMEX channels to inject (only [] or [0]); a channel whose device node is missing is "
       "skipped with a warning."),
    _s("imex_required", ("--imex-required",), ("IMEX_REQUIRED",), "imex.required", "bool", False, bool,
       "A configured IMEX channel must exist: a missing one fails the start of the resource's worker."),
    _s("kubelet_socket", ("--kubelet-socket",), ("KUBELET_SOCKET",), None, "string",
       "/var/lib/kubelet/device-plugins/kubelet.sock", kubelet_socket,
       "The kubelet's registration socket; workers serve in its directory."),
    _s("config_file", ("--config-file",), ("CONFIG_FILE",), None, "string", "", any_string,
       "Path of the YAML or JSON config file."),
    _s("cdi_feature_flags", ("--cdi-feature-flags",), ("CDI_FEATURE_FLAGS",), None, "strings", (), string_tuple,
       "NVIDIA's CDI spec generator feature flags: accepted; gpuvisor's own CDI spec has no such features."),
    _s("cdi_disable_hooks", ("--cdi-disable-hooks",), ("CDI_DISABLE_HOOKS",), None, "strings", (), string_tuple,
       "OCI hooks NVIDIA's CDI spec generator leaves out: accepted; gpuvisor's own CDI spec has no hooks."),
    # NVIDIA's config-manager v0.20.0 (cmd/config-manager/main.go:135-210): its sidecar's inputs,
    # taken by the supervisor itself, which chooses the node's config by its label.
    _s("node_name", ("--node-name",), ("NODE_NAME",), None, "string", "", any_string,
       "This node's name (the downward API's spec.nodeName): the Node whose label chooses the config, "
       "on which --node-health writes, and the name of its DRA pool (needed with --mode dra)."),
    _s("node_label", ("--node-label",), ("NODE_LABEL",), None, "string", DEFAULT_NODE_LABEL, any_string,
       "The node label whose value names the config to run (with --config-file-srcdir)."),
    _s("config_file_srcdir", ("--config-file-srcdir",), ("CONFIG_FILE_SRCDIR",), None, "string", "", any_string,
       "Directory of named config files (a ConfigMap mounted as a directory); the node label picks one, "
       "by config-manager's rules. Empty: off (--config-file, if any, is the config)."),
    _s("default_config", ("--default-config",), ("DEFAULT_CONFIG",), None, "string", "", any_string,
       "The named config to run when the node has no label (or an empty one)."),
    _s("fallback_strategies", ("--fallback-strategies",), ("FALLBACK_STRATEGIES",), None, "strings", (),
       string_tuple, "Without a label or default config, tried in order: named (the config called default), "
       "single (the only config), empty (no config file)."),
    _s("kubeconfig", ("--kubeconfig",), ("KUBECONFIG",), None, "string", "", any_string,
       "kubeconfig for the API server (one path); empty: the pod's service account."),
    # NVIDIA's DRA driver v0.4.1 (pkg/flags/kubeclient.go:53-69), as GFD's: one limiter for every
    # request of the process (supervisor/kube/limiter.py)
    _s("kube_api_qps", ("--kube-api-qps",), ("KUBE_API_QPS",), None, "float", 5.0, kube_api_qps,
       "Requests per second to the API server (0: the client default, 5; negative: no limit)."),
    _s("kube_api_burst", ("--kube-api-burst",), ("KUBE_API_BURST",), None, "int", 10, kube_api_burst,
       "Burst of requests to the API server (0: the client default, 10)."),
    # gpuvisor's own (the file section `gpuvisor:` is ignored by NVIDIA's plugin)
    _s("simulate", ("--simulate",), ("GPUVISOR_SIMULATE",), "gpuvisor.simulate", "string", None, own_optional,
       "Run on the NVML simulator: a built-in profile name or a node YAML path; absent uses real NVML.",
       default_doc="(real NVML)", gpuvisor=True),
    _s("sysfs_root", ("--sysfs-root",), ("GPUVISOR_SYSFS_ROOT",), "gpuvisor.sysfsRoot", "string", None, own_optional,
       "The sysfs the GPUs' PCIe root complex and NUMA node are read from (the DRA attributes "
       "resource.kubernetes.io/pcieRoot and numaNode); a simulated node's tree is written by the simulator.",
       default_doc="/sys (none with --simulate)", gpuvisor=True),
    _s("run_dir", ("--run-dir",), ("GPUVISOR_RUN_DIR",), "gpuvisor.runDir", "string", "/run/gpuvisor", own_nonempty,
       "Directory for plans, the control socket and other runtime state.", gpuvisor=True),
    _s("metrics_address", ("--metrics-address",), ("GPUVISOR_METRICS_ADDRESS",), "gpuvisor.metricsAddress", "string",
       "0.0.0.0:9475", address, "host:port of /metrics, /healthz and /readyz; empty disables.",
       env_empty_is_value=True, gpuvisor=True),
    _s("log_format", ("--log-format",), ("GPUVISOR_LOG_FORMAT",), "gpuvisor.logFormat", "string", "text",
       own_choice(*LOG_FORMATS), "Log line format.", choices=LOG_FORMATS, gpuvisor=True),
    _s("log_level", ("--log-level",), ("GPUVISOR_LOG_LEVEL",), "gpuvisor.logLevel", "string", "info",
       own_choice(*LOG_LEVELS), "Lowest level logged.", choices=LOG_LEVELS, gpuvisor=True),
    _s("cdi_spec_dir", ("--cdi-spec-dir",), ("CDI_SPEC_DIR",), "gpuvisor.cdiSpecDir", "string", "/var/run/cdi",
       own_nonempty, "Directory of CDI spec files.", gpuvisor=True),
    _s("mig_minors_path", ("--mig-minors-path",), ("GPUVISOR_MIG_MINORS_PATH",), "gpuvisor.migMinorsPath", "string",
       "/proc/driver/nvidia-caps/mig-minors", own_nonempty,
       "Where the MIG capability device minors are read from.", gpuvisor=True),
    _s("cdi_spec_format", ("--cdi-spec-format",), ("GPUVISOR_CDI_SPEC_FORMAT",), "gpuvisor.cdiSpecFormat", "string",
       "json", own_choice("json", "yaml"), "File format of the CDI spec gpuvisor writes (cdi-annotations / cdi-cri "
       "strategies).", choices=("json", "yaml"), gpuvisor=True),
    _s("cdi_nvidia_ctk", ("--cdi-nvidia-ctk",), ("GPUVISOR_CDI_NVIDIA_CTK",), "gpuvisor.cdiNvidiaCtk", "bool", False,
       go_bool_text, "Let nvidia-ctk cdi generate write the full CDI spec; falls back to gpuvisor's own.",
       gpuvisor=True),
    _s("mps_control_binary", ("--mps-control-binary",), ("GPUVISOR_MPS_CONTROL",), "gpuvisor.mpsControlBinary",
       "string", "nvidia-cuda-mps-control", own_nonempty,
       "CUDA MPS control binary: a path, or a name looked up on PATH, then under the driver root.", gpuvisor=True),
    _s("mps_exclusive_process", ("--mps-exclusive-process",), ("GPUVISOR_MPS_EXCLUSIVE_PROCESS",),
       "gpuvisor.mpsExclusiveProcess", "bool", False, go_bool_text,
       "Put MPS-shared GPUs in EXCLUSIVE_PROCESS compute mode while their daemon runs.", gpuvisor=True),
    _s("rediscovery_interval", ("--rediscovery-interval",), ("GPUVISOR_REDISCOVERY_INTERVAL",),
       "gpuvisor.rediscoveryInterval", "string", 60.0, seconds(positive=False),
       "Seconds between device rediscoveries (MIG changes, lost GPUs); 0 disables.", gpuvisor=True),
    _s("heartbeat_timeout", ("--heartbeat-timeout",), ("GPUVISOR_HEARTBEAT_TIMEOUT",), "gpuvisor.heartbeatTimeout",
       "string", 10.0, seconds(positive=True),
       "Seconds of worker heartbeat silence before it counts as hung (workers beat 4 times per timeout).",
       gpuvisor=True),
    _s("start_retries", ("--start-retries",), ("GPUVISOR_START_RETRIES",), "gpuvisor.startRetries", "string", 5,
       own_int(0, MAX_START_RETRIES),
       "Quick worker failures in a row before the worker is marked FATAL; a FATAL worker is still retried "
       "when its backoff ends (capped at 30 s), never given up.",
       gpuvisor=True),
    _s("start_seconds", ("--start-seconds",), ("GPUVISOR_START_SECONDS",), "gpuvisor.startSeconds", "string", 10.0,
       seconds(positive=True),
       "A worker that dies sooner than this after its start failed quickly (counts toward --start-retries).",
       gpuvisor=True),
    _s("zygote", ("--zygote",), ("GPUVISOR_ZYGOTE",), "gpuvisor.zygote", "bool", True, go_bool_text,
       "Fork workers from a pre-imported zygote process (fast restarts, shared memory pages); "
       "--zygote=false starts each worker by exec.", gpuvisor=True),
    _s("probe_interval", ("--probe-interval",), ("GPUVISOR_PROBE_INTERVAL",), "gpuvisor.probeInterval", "string",
       10.0, seconds(positive=True),
       "Seconds between NVML health probes of every GPU (they catch what sends no event, and transient "
       "faults recover only after a passing probe).", gpuvisor=True),
    _s("labels_output_file", ("--labels-output-file",), ("GPUVISOR_LABELS_OUTPUT_FILE",), "gpuvisor.labelsOutputFile",
       "string", "", own_string, "Keep GPU Feature Discovery's node labels in this features.d file, rewritten as "
       "soon as the devices or the config change (an extension; empty: off).", default_doc="(off)", gpuvisor=True),
    _s("node_health", ("--node-health",), ("GPUVISOR_NODE_HEALTH",), "gpuvisor.nodeHealth", "bool", False,
       go_bool_text, "Write GPU health on this Node: the GPUUnhealthy condition and an Event per device taken out "
       "or brought back (an extension; needs --node-name and RBAC).", gpuvisor=True),
    _s("mode", ("--mode",), ("GPUVISOR_MODE",), "gpuvisor.mode", "string", "device-plugin",
       own_choice(*MODES), "How this node's GPUs reach pods: device-plugin (nvidia.com/* extended resources, the "
       "kubelet's device-plugin API) or dra (ResourceSlices of the DRA driver gpu.nvidia.com, claims prepared "
       "through the kubelet's DRA API); never both, and a reload switches.", choices=MODES, gpuvisor=True),
    _s("kubelet_plugins_dir", ("--kubelet-plugins-dir",), ("GPUVISOR_KUBELET_PLUGINS_DIR",),
       "gpuvisor.kubeletPluginsDir", "string", "/var/lib/kubelet/plugins", own_nonempty,
       "The kubelet's plugins dir: the DRA worker serves <dir>/gpu.nvidia.com/dra.sock and keeps its checkpoint "
       "there.", gpuvisor=True),
    _s("kubelet_registry_dir", ("--kubelet-registry-dir",), ("GPUVISOR_KUBELET_REGISTRY_DIR",),
       "gpuvisor.kubeletRegistryDir", "string", "/var/lib/kubelet/plugins_registry", own_nonempty,
       "The kubelet's plugin-watcher dir: the DRA worker registers through <dir>/gpu.nvidia.com-reg.sock.",
       gpuvisor=True),
    _s("dra_claims_dir", ("--dra-claims-dir",), ("GPUVISOR_DRA_CLAIMS_DIR",), "gpuvisor.draClaimsDir", "string", "",
       own_string, "Read ResourceClaims from <dir>/<namespace>/<name>.json (resource.k8s.io/v1 JSON) instead "
       "of the API server: simulated nodes, the demo, tests.", default_doc="(the API server)", gpuvisor=True),
    _s("pod_resources_socket", ("--pod-resources-socket",), ("GPUVISOR_POD_RESOURCES_SOCKET",),
       "gpuvisor.podResourcesSocket", "string", "/var/lib/kubelet/pod-resources/kubelet.sock", own_string,
       "The kubelet's pod-resources API: in mode dra, devices that device-plugin containers still hold are "
       "left out of the ResourceSlices (empty: the kubelet's device-manager checkpoint is read instead).",
       gpuvisor=True),
    _s("dra_memory_sharing", ("--dra-memory-sharing",), ("GPUVISOR_DRA_MEMORY_SHARING",),
       "gpuvisor.dra.memorySharing", "string", None, memory_sharing,
       "In mode dra, publish each full GPU for several claims by the memory each asks for (consumable "
       "capacity, Kubernetes 1.34+ with DRAConsumableCapacity), each claim's share enforced as an MPS "
       "client's pinned memory limit: {step, default, minimum} (e.g. step=1Gi,default=4Gi,minimum=1Gi; "
       "docs/dra.md).", default_doc="(off)", gpuvisor=True),
    _s("dra_mig_on_demand", ("--dra-mig-on-demand",), ("GPUVISOR_DRA_MIG_ON_DEMAND",), "gpuvisor.dra.migOnDemand",
       "bool", False, go_bool_text,
       "In mode dra, publish each MIG-capable GPU as partitionable (the full GPU and every placement of every "
       "MIG profile, sharing the GPU's counters; Kubernetes 1.34+ with DRAPartitionableDevices): a claim's "
       "MIG device is made at prepare and destroyed after (docs/dra.md).", gpuvisor=True),
    _s("disable_healthchecks", (), ("DP_DISABLE_HEALTHCHECKS",), None, "string", (), token_list,
       "NVIDIA's health-check switch: all, xids, or a comma list of XIDs to ignore.", gpuvisor=True),
    _s("enable_healthchecks", (), ("DP_ENABLE_HEALTHCHECKS",), None, "string", (), token_list,
       "NVIDIA's health-check switch: all, or a comma list of XIDs to treat as fatal.", gpuvisor=True),
)  # fmt: skip


def flag_table(settings: Sequence[Setting]) -> Mapping[str, Setting]:
    """Every flag name without its dashes (Go's flag package takes -name and --name alike)."""
    return {f.lstrip("-"): s for s in settings for f in s.flags}


SETTINGS_BY_NAME: Final[Mapping[str, Setting]] = {s.name: s for s in SETTINGS}
SETTINGS_BY_FLAG: Final[Mapping[str, Setting]] = flag_table(SETTINGS)
