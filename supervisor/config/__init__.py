"""gpuvisor's configuration: NVIDIA-compatible flags, env vars and config file, plus gpuvisor's own.

Every input is taken as NVIDIA's k8s-device-plugin v0.20.0 takes it (same names, same Go rules
for text, same precedence flag > env var > file > default), with gpuvisor's own settings beside
them and every count from outside bounded. One module per job:

- `settings`  every setting declared once (flags, env vars, file key, Go type, default, check, help);
- `flags`     Go's flag syntax for `gpuvisor run` (`add_run_arguments`) and `gpuvisor labels`;
- `yamlfile`  the file read as go-yaml v2 and sigs.k8s.io/yaml read it, bounded;
- `nvidia`    NVIDIA's file layout decoded as encoding/json decodes it (`gojson`: its value rules);
- `sections`  `resources`, `sharing` and `gpuvisor.health`; `names`: resource names, device references;
- `memory`    `gpuvisor.dra.memorySharing`, the request policy of GPUs shared by memory;
- `loader`    precedence and whole-config checks: `load_config`, `config_from_data`;
- `named`     which named config a node runs (NVIDIA's config-manager rules: label, default, fallbacks);
- `fingerprint` what a config file holds now, cheap to compare (a change, or an event that changed nothing);
- `version`   gpuvisor's version, written once (pyproject.toml's metadata is built from it);
- `model`     the resolved `Config`; `errors`: `ConfigError`; `limits`: the bounds; `golang`: Go's
              text rules; `docs`: the docs' settings tables (`python -m supervisor.config --markdown`).

This package's public names are the ones importers used before it was split up.
"""

from supervisor.config.docs import main, settings_markdown
from supervisor.config.errors import EXIT_CONFIG_ERROR, ConfigError
from supervisor.config.flags import RunArgumentParser, add_run_arguments, parse_go_flags
from supervisor.config.loader import CONFIG_VERSION, config_from_data, load_config
from supervisor.config.model import (
    Config,
    DeviceSelector,
    HealthConfig,
    ResourcePattern,
    ResourcesConfig,
    SharedResource,
    SharingConfig,
)
from supervisor.config.names import (
    DRA_DRIVER,
    MAX_RESOURCE_NAME_LENGTH,
    RESOURCE_DOMAIN,
    SHARED_SUFFIX,
    new_resource_name,
)
from supervisor.config.sections import XID_ACTIONS
from supervisor.config.settings import (
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    DISCOVERY_STRATEGIES,
    LOG_FORMATS,
    LOG_LEVELS,
    MIG_STRATEGIES,
    SETTINGS,
    SETTINGS_BY_NAME,
    SHARED_POLICIES,
    Setting,
)
from supervisor.config.yamlfile import parse_config_text, read_config_file

__all__ = [
    "CONFIG_VERSION",
    "DEVICE_ID_STRATEGIES",
    "DEVICE_LIST_STRATEGIES",
    "DISCOVERY_STRATEGIES",
    "DRA_DRIVER",
    "EXIT_CONFIG_ERROR",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_RESOURCE_NAME_LENGTH",
    "MIG_STRATEGIES",
    "RESOURCE_DOMAIN",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "SHARED_POLICIES",
    "SHARED_SUFFIX",
    "XID_ACTIONS",
    "Config",
    "ConfigError",
    "DeviceSelector",
    "HealthConfig",
    "ResourcePattern",
    "ResourcesConfig",
    "RunArgumentParser",
    "Setting",
    "SharedResource",
    "SharingConfig",
    "add_run_arguments",
    "config_from_data",
    "load_config",
    "main",
    "new_resource_name",
    "parse_config_text",
    "parse_go_flags",
    "read_config_file",
    "settings_markdown",
]
