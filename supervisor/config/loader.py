"""Resolving the config: flags, env vars and the config file into one `Config`.

Precedence is NVIDIA's (`api/config/v1/flags.go` updateFromCLIFlag): a flag, or else an env var
(urfave/cli counts an env var as setting the flag), wins over the file, which wins over the
default. The first env var of a setting that is present wins even when empty, and empty means
what urfave/cli makes of it: "" for a string, false for a boolean, [""] for a list (not a valid
strategy), unset for the IMEX channel list. gpuvisor's own settings treat an empty env var as
unset instead (Kubernetes manifests often template empty values), except the metrics address.

Then come NVIDIA's checks of the whole (`main.go` validateFlags: MPS needs an MPS root and no
`mixed` MIG strategy) and `config.go`'s fix-ups (an empty dev root is the driver root). Every
bad input is one ConfigError; nothing else escapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.socketnames import DRA_SERVICE_SOCKET_NAME, UNIX_PATH_MAX, dra_registration_socket_name
from supervisor.config import nvidia
from supervisor.config.errors import ConfigError, Invalid, kind, show
from supervisor.config.flags import FLAG_FORMS, IGNORED_ARGS, decode_text
from supervisor.config.model import Config
from supervisor.config.named import SOURCE_FILE, SOURCE_NONE, ChoiceError, choose_config, input_problem
from supervisor.config.names import DRA_DRIVER
from supervisor.config.sections import parse_health, parse_resources, parse_sharing
from supervisor.config.settings import SETTINGS, SETTINGS_BY_NAME, Setting
from supervisor.config.yamlfile import read_config_file

CONFIG_VERSION = "v1"
FlagsArg = argparse.Namespace | Mapping[str, object] | None


@dataclass
class Given:
    """What the command line set (raw or typed values by setting name) and how it was written."""

    values: dict[str, object] = field(default_factory=dict)
    forms: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def read_given(flags: FlagsArg, settings: Sequence[Setting] = SETTINGS) -> Given:
    """The values `flags` holds for `settings` (an argparse Namespace or a mapping by setting name)."""
    if flags is None:
        return Given()
    names = {s.name for s in settings}
    raw = dict(vars(flags)) if isinstance(flags, argparse.Namespace) else dict(flags)
    forms = raw.get(FLAG_FORMS)
    ignored = raw.get(IGNORED_ARGS)
    return Given(
        values={k: v for k, v in raw.items() if k in names and v is not None},
        forms=dict(forms) if isinstance(forms, Mapping) else {},
        ignored=[str(a) for a in ignored] if isinstance(ignored, list | tuple) else [],
    )


def _checked(setting: Setting, value: object, source: str, key: str) -> Any:
    try:
        return setting.check(value)
    except Invalid as exc:
        raise ConfigError(source, key + exc.at, exc.reason) from None


def _from_env(setting: Setting, raw: str, origin: str) -> tuple[bool, Any]:
    """(set, value) for an env var that is present, by urfave/cli's rules for NVIDIA's settings."""
    if setting.gpuvisor:
        if raw == "" and not setting.env_empty_is_value:
            return False, None
        return True, _checked(setting, decode_text(setting, raw), origin, "")
    if raw == "":
        if setting.kind in ("ints", "int", "float", "duration"):
            return False, None  # IntSliceFlag's, IntFlag's, Float64Flag's and GenericFlag's Apply ignore ""
        empty: object = {"bool": False, "strings": [""], "string": ""}[setting.kind]
        return True, _checked(setting, empty, origin, "")
    try:
        value = decode_text(setting, raw)
    except Invalid as exc:
        raise ConfigError(origin, "", exc.reason) from None
    return True, _checked(setting, value, origin, "")


def resolve_setting(
    setting: Setting,
    given: Given,
    environ: Mapping[str, str],
    tree: Mapping[str, Any],
    own: Mapping[str, Any],
    source: str,
) -> tuple[Any, str]:
    """(value, where it came from), by precedence flag > env var > file > default.

    `tree` is NVIDIA's part of the file (`decode_file`), `own` its `gpuvisor:` section (`own_section`).
    """
    if setting.name in given.values:
        form = given.forms.get(setting.name) or (setting.flags[0] if setting.flags else setting.name)
        origin = f"flag {form}" if setting.flags else f"argument {setting.name}"
        try:
            value = decode_text(setting, given.values[setting.name])
        except Invalid as exc:
            raise ConfigError(origin, "", exc.reason) from None
        return _checked(setting, value, origin, ""), origin
    for var in setting.envs:
        if var in environ:
            origin = f"env {var}"
            is_set, value = _from_env(setting, environ[var], origin)
            if is_set:
                return value, origin
            break  # urfave/cli looks no further than the first env var present
    if setting.file_key is not None:
        if setting.gpuvisor:
            raw = _own_lookup(own, setting.file_key.split(".")[1:], source)
        else:
            raw = nvidia.lookup(tree, setting.file_key)
        if raw is not None:
            return _checked(setting, raw, source, setting.file_key), f"file {setting.file_key}"
    return setting.default, "default"


def decode_file(data: object, source: str) -> tuple[Mapping[str, Any], dict[str, Any], list[str]]:
    """The file's top level, NVIDIA's part of it decoded (`nvidia.decode`) and the keys NVIDIA
    does not know; the version checked as NVIDIA's parseConfigFrom checks it. `data` None is no file."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(source, "", f"the config file must be a mapping, not {kind(data)}")
    root: Mapping[str, Any] = data or {}
    tree, unknown = nvidia.decode(root, source)
    version = tree.get("version", "")
    if version not in ("", CONFIG_VERSION):
        raise ConfigError(
            source, "version", f"unsupported config version {show(version)}: only v1 is supported"
        )
    return root, tree, unknown


def own_section(root: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """The top-level `gpuvisor:` section (NVIDIA's plugin ignores it); exact key names."""
    own = root.get(nvidia.OWN_SECTION)
    if own is None:
        return {}
    if not isinstance(own, Mapping):
        raise ConfigError(source, nvidia.OWN_SECTION, f"this section must be a mapping, not {kind(own)}")
    return own


def _own_lookup(own: Mapping[str, Any], path: list[str], source: str) -> Any:
    """A key of the `gpuvisor:` section, nested ones (`dra.memorySharing`) by their mappings."""
    value: Any = own
    for i, key in enumerate(path):
        if value is None:
            return None
        if not isinstance(value, Mapping):
            where = ".".join(["gpuvisor", *path[:i]])
            raise ConfigError(source, where, f"this section must be a mapping, not {kind(value)}")
        value = value.get(key)
    return value


def _own_unknown(own: Mapping[str, Any], unknown: list[str]) -> None:
    own_keys = [s.file_key.split(".")[1:] for s in SETTINGS if s.gpuvisor and s.file_key]
    known = {k[0] for k in own_keys} | {"health"}
    unknown.extend(f"gpuvisor.{k}" for k in own if k not in known)
    for section in sorted({k[0] for k in own_keys if len(k) > 1}):
        inner = own.get(section)
        if isinstance(inner, Mapping):
            names = {k[1] for k in own_keys if len(k) > 1 and k[0] == section}
            unknown.extend(f"gpuvisor.{section}.{k}" for k in inner if k not in names)
    health = own.get("health")
    if isinstance(health, Mapping):
        unknown.extend(f"gpuvisor.health.{k}" for k in health if k not in ("xids", "transientQuietSeconds"))


def _check_whole(config_values: Mapping[str, Any], strategy: str, source: str) -> None:
    """main.go validateFlags (and config-manager's), for what spans several settings."""
    problem = input_problem(
        srcdir=config_values["config_file_srcdir"],
        node_name=config_values["node_name"],
        node_label=config_values["node_label"],
        config_file=config_values["config_file"],
    )
    if problem is not None:
        raise ConfigError("--config-file-srcdir", "", problem)
    if config_values["node_health"] and not config_values["node_name"]:
        raise ConfigError(
            "--node-health",
            "",
            "needs the node name: set NODE_NAME (the downward API's spec.nodeName) or --node-name",
        )
    if strategy != "mps":
        return
    if config_values["mig_strategy"] == "mixed":
        raise ConfigError(source, "sharing.mps", "MPS sharing is not supported with the mixed MIG strategy")
    if not config_values["mps_root"]:
        raise ConfigError(
            source, "sharing.mps", "MPS sharing needs an MPS root: set flags.mpsRoot, --mps-root or MPS_ROOT"
        )


def _check_dra(config_values: Mapping[str, Any], strategy: str, source: str) -> None:
    """What a DRA node needs: its name (the pool), and no device-plugin sharing (DRA shares devices
    through claims, not through replicas of extended resources)."""
    if config_values["mode"] != "dra":
        return
    if not config_values["node_name"]:
        raise ConfigError(
            source,
            "gpuvisor.mode",
            "mode dra needs this node's name for its ResourceSlice pool: set NODE_NAME (the downward API's "
            "spec.nodeName) or --node-name",
        )
    for name, path in (
        (
            "gpuvisor.kubeletPluginsDir",
            os.path.join(config_values["kubelet_plugins_dir"], DRA_DRIVER, DRA_SERVICE_SOCKET_NAME),
        ),
        (
            "gpuvisor.kubeletRegistryDir",
            os.path.join(config_values["kubelet_registry_dir"], dra_registration_socket_name(DRA_DRIVER)),
        ),
    ):
        if len(path.encode()) > UNIX_PATH_MAX:
            raise ConfigError(
                source,
                name,
                f"the DRA worker's socket {path} would be {len(path.encode())} bytes long, over the "
                f"{UNIX_PATH_MAX} a unix socket path may have: use a shorter directory",
            )
    if strategy != "none":
        raise ConfigError(
            source,
            f"sharing.{'mps' if strategy == 'mps' else 'timeSlicing'}",
            "mode dra does not take device-plugin sharing (time-slicing or MPS replicas): remove it, or use "
            "mode device-plugin",
        )


def ignored_notice(given: Given) -> list[str]:
    """The notice for arguments the flag syntax ignored (none when there were none)."""
    if not given.ignored:
        return []
    return [
        "command-line arguments from the first one that is not a flag are ignored, as NVIDIA's binaries ignore them "
        f"(a boolean flag takes no separate value: write --flag=false): {' '.join(map(show, given.ignored))}"
    ]


def _notices(given: Given, values: Mapping[str, Any]) -> list[str]:
    notices = ignored_notice(given)
    for name in ("cdi_feature_flags", "cdi_disable_hooks"):
        if values[name]:
            flag = SETTINGS_BY_NAME[name].flags[0]
            notices.append(
                f"{flag} {','.join(values[name])}: accepted, but gpuvisor writes its own CDI spec, which it does not "
                "change, and does not pass it to nvidia-ctk"
            )
    return notices


def load_config(flags: FlagsArg, environ: Mapping[str, str], node_label: str | None = None) -> Config:
    """Resolve the config from parsed flags (an argparse Namespace from `add_run_arguments`'s
    parser, or a mapping of setting name to value), the environment and the file it names.

    With --config-file-srcdir the file is the named config the node's label chooses
    (supervisor/config/named.py): `node_label` is the label's value ("" when the node has none),
    or None while it is not known yet; then, if no config can be chosen without it, the result
    is a config with no file whose `awaiting_label` says why (nothing is planned until the label
    is read). Call it again to reload: the file is re-read each time. Raises ConfigError.
    """
    given = read_given(flags)

    def setting(name: str) -> Any:
        return resolve_setting(SETTINGS_BY_NAME[name], given, environ, {}, {}, "")[0]

    srcdir = setting("config_file_srcdir")
    if not srcdir:
        path = setting("config_file")
        data: object = read_config_file(path) if path else None
        config = config_from_data(data, flags=flags, environ=environ, source=path or "<no config file>")
        return dataclasses.replace(config, config_source=SOURCE_FILE if path else SOURCE_NONE)
    try:
        choice = choose_config(
            srcdir, node_label or "", setting("default_config"), setting("fallback_strategies")
        )
    except ChoiceError as exc:
        if node_label is None:
            config = config_from_data(None, flags=flags, environ=environ, source="<no config chosen yet>")
            return dataclasses.replace(config, awaiting_label=str(exc))
        where = (
            f"node label {setting('node_label')}={node_label}" if node_label else f"{srcdir} (no node label)"
        )
        raise ConfigError(where, "", str(exc)) from None
    data = read_config_file(choice.path) if choice.path else None
    config = config_from_data(data, flags=flags, environ=environ, source=choice.path or "<the empty config>")
    return dataclasses.replace(
        config, config_file=choice.path, config_name=choice.name, config_source=choice.source
    )


def config_from_data(
    data: object,
    *,
    flags: FlagsArg = None,
    environ: Mapping[str, str] | None = None,
    source: str = "<config>",
) -> Config:
    """Resolve the config from already-parsed file contents (`data`, None for no file).

    `source` names the file in errors. Raises ConfigError for any bad input, never another error.
    """
    given = read_given(flags)
    env = environ if environ is not None else {}
    root, tree, unknown = decode_file(data, source)
    own = own_section(root, source)
    _own_unknown(own, unknown)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        values[setting.name], sources[setting.name] = resolve_setting(setting, given, env, tree, own, source)
    if values["driver_root"] == "":
        # NVIDIA only ever joins paths onto it (Go's filepath.Join: "" adds nothing, as "/"), so
        # "" is "/"; gpuvisor's os.path.join would make paths relative instead.
        values["driver_root"] = "/"
    if values["dev_root"] == "":  # config.go: an empty dev root is the driver root
        values["dev_root"] = values["driver_root"]
        if sources["dev_root"] == "default":
            sources["dev_root"] = "default (the driver root)"

    notices = _notices(given, values)
    resources = parse_resources(tree.get("resources"), source, unknown)
    sharing = parse_sharing(tree.get("sharing"), source, unknown, notices)
    health = parse_health(own.get("health"), source)
    _check_whole(values, sharing.strategy, source)
    _check_dra(values, sharing.strategy, source)
    return Config(
        **values,
        resources=resources,
        sharing=sharing,
        health=health,
        sources=tuple(sources.items()),
        unknown_keys=tuple(unknown),
        notices=tuple(notices),
    )
