"""The resolved configuration: plain, immutable, typed data, as the rest of gpuvisor uses it.

`Config` has one field per setting (same name, same order as `settings.SETTINGS`), then the
sections that exist only in the file (`resources`, `sharing`, `gpuvisor.health`), then what the
loader learned on the way: where each setting came from, the file keys it ignored, and notices
(inputs taken as NVIDIA takes them but worth a warning, e.g. arguments after a positional one).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from supervisor.config.memory import MemorySharing

# Fields of Config that are not settings.
SECTION_FIELDS = (
    "resources",
    "sharing",
    "health",
    "sources",
    "unknown_keys",
    "notices",
    "config_name",
    "config_source",
    "awaiting_label",
)


@lru_cache(maxsize=256)
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
    (GPU index "i", MIG index "i:j", "GPU-…"/"MIG-…" UUID); an empty `refs` selects none."""

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
    cdi_feature_flags: tuple[str, ...]
    cdi_disable_hooks: tuple[str, ...]
    node_name: str
    node_label: str
    config_file_srcdir: str
    default_config: str
    fallback_strategies: tuple[str, ...]
    kubeconfig: str
    kube_api_qps: float
    kube_api_burst: int
    simulate: str | None
    sysfs_root: str | None
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
    labels_output_file: str
    node_health: bool
    mode: str
    kubelet_plugins_dir: str
    kubelet_registry_dir: str
    dra_claims_dir: str
    pod_resources_socket: str
    dra_memory_sharing: MemorySharing | None
    dra_mig_on_demand: bool
    disable_healthchecks: tuple[str, ...]
    enable_healthchecks: tuple[str, ...]
    resources: ResourcesConfig = ResourcesConfig()
    sharing: SharingConfig = SharingConfig()
    health: HealthConfig = HealthConfig()
    sources: tuple[tuple[str, str], ...] = ()  # (setting name, "flag --x" | "env X" | "file …" | "default")
    unknown_keys: tuple[str, ...] = ()  # file keys that were ignored, e.g. "flags.gfd.color"
    notices: tuple[str, ...] = ()  # inputs taken as NVIDIA takes them, worth a warning
    # Which config file this is (supervisor/config/named.py): its name ("" unless it is one of the
    # named configs of --config-file-srcdir) and where the
    # choice came from (file, none, label, default, fallback-*); with --config-file-srcdir and no
    # config to be had without the node's label, why (the supervisor then plans nothing yet).
    config_name: str = ""
    config_source: str = "none"
    awaiting_label: str = ""

    def describe(self) -> dict[str, Any]:
        """The merged config as JSON-able data, for logging once at start."""
        names = [f.name for f in dataclasses.fields(self) if f.name not in SECTION_FIELDS]
        return {
            "settings": {name: _jsonable(getattr(self, name)) for name in names},
            "sources": dict(self.sources),
            "resources": _jsonable(dataclasses.asdict(self.resources)),
            "sharing": _jsonable(dataclasses.asdict(self.sharing)),
            "health": {
                "xids": {str(xid): action for xid, action in self.health.xids},
                "transientQuietSeconds": self.health.transient_quiet_seconds,
            },
            "unknownKeys": list(self.unknown_keys),
            "notices": list(self.notices),
            "config": {
                "name": self.config_name,
                "source": self.config_source,
                "awaiting": self.awaiting_label,
            },
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, MemorySharing):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
