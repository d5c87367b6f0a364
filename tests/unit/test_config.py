"""Tests of supervisor.config: the settings table, precedence, the file format and every error text."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.socketnames import UNIX_PATH_MAX, socket_name
from supervisor.config import (
    EXIT_CONFIG_ERROR,
    SETTINGS,
    Config,
    ConfigError,
    DeviceSelector,
    RunArgumentParser,
    SharedResource,
    add_run_arguments,
    config_from_data,
    load_config,
    main,
    parse_config_text,
    settings_markdown,
)


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = RunArgumentParser(prog="gpuvisor run")
    add_run_arguments(parser)
    return parser.parse_args(list(argv))


def load_file(
    tmp_path: Path, text: str, *argv: str, env: dict[str, str] | None = None, name: str = "c.yaml"
) -> Config:
    path = tmp_path / name
    path.write_text(text)
    return load_config(parse_flags(*argv), {"CONFIG_FILE": str(path), **(env or {})})


def file_error(tmp_path: Path, text: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_file(tmp_path, text, **kwargs)
    return str(info.value)


def test_exit_code_is_ex_config() -> None:
    """A config error exits with EX_CONFIG (78), the code the supervisor treats as 'do not retry'."""
    assert EXIT_CONFIG_ERROR == 78


def test_every_setting_is_a_config_field() -> None:
    """The settings table and the Config dataclass name the same settings, in the same order."""
    field_names = [f.name for f in dataclasses.fields(Config)]
    assert field_names[: len(SETTINGS)] == [s.name for s in SETTINGS]
    assert set(field_names[len(SETTINGS) :]) == {
        "resources",
        "sharing",
        "health",
        "sources",
        "unknown_keys",
        "notices",
        "config_name",
        "config_source",
        "awaiting_label",
    }


def test_defaults() -> None:
    """With no flags, env or file every setting takes NVIDIA's (or gpuvisor's) documented default."""
    config = load_config(None, {})
    assert config.mig_strategy == "none"
    assert config.fail_on_init_error is True
    assert config.driver_root == "/" and config.dev_root == "/"
    assert config.pass_device_specs is False
    assert config.device_list_strategy == ("envvar",)
    assert config.device_id_strategy == "uuid"
    assert (config.gds_enabled, config.mofed_enabled, config.gdrcopy_enabled) == (False, False, False)
    assert config.cdi_annotation_prefix == "cdi.k8s.io/"
    assert config.nvidia_cdi_hook_path == "/usr/bin/nvidia-ctk"
    assert config.driver_root_ctr_path == "/driver-root"
    assert config.mps_root == ""
    assert config.shared_devices_allocation_policy == "distributed"
    assert config.device_discovery_strategy == "auto"
    assert config.imex_channel_ids == () and config.imex_required is False
    assert config.kubelet_socket == "/var/lib/kubelet/device-plugins/kubelet.sock"
    assert config.simulate is None
    assert config.run_dir == "/run/gpuvisor"
    assert config.metrics_address == "0.0.0.0:9475"
    assert (config.log_format, config.log_level) == ("text", "info")
    assert config.cdi_spec_dir == "/var/run/cdi"
    assert config.mig_minors_path == "/proc/driver/nvidia-caps/mig-minors"
    assert (config.rediscovery_interval, config.heartbeat_timeout, config.start_retries) == (60.0, 10.0, 5)
    assert (config.start_seconds, config.zygote) == (10.0, True)
    assert config.sharing.strategy == "none" and config.sharing.resources == ()
    assert config.unknown_keys == ()
    assert dict(config.sources)["mig_strategy"] == "default"


PRECEDENCE_FILE = """
version: v1
flags:
  migStrategy: single
  nvidiaDriverRoot: /file-root
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [volume-mounts]
gpuvisor:
  logLevel: warning
"""


@pytest.mark.parametrize(
    ("argv", "env", "name", "expected", "source"),
    [
        ((), {}, "mig_strategy", "single", "file flags.migStrategy"),
        ((), {"MIG_STRATEGY": "mixed"}, "mig_strategy", "mixed", "env MIG_STRATEGY"),
        (("--mig-strategy", "none"), {"MIG_STRATEGY": "mixed"}, "mig_strategy", "none", "flag --mig-strategy"),
        ((), {}, "driver_root", "/file-root", "file flags.nvidiaDriverRoot"),
        ((), {"NVIDIA_DRIVER_ROOT": "/env-root"}, "driver_root", "/env-root", "env NVIDIA_DRIVER_ROOT"),
        (("--nvidia-driver-root=/flag-root",), {"NVIDIA_DRIVER_ROOT": "/e"}, "driver_root", "/flag-root", "flag --nvidia-driver-root"),
        ((), {}, "pass_device_specs", True, "file flags.plugin.passDeviceSpecs"),
        ((), {"PASS_DEVICE_SPECS": "F"}, "pass_device_specs", False, "env PASS_DEVICE_SPECS"),
        (("--pass-device-specs",), {"PASS_DEVICE_SPECS": "false"}, "pass_device_specs", True, "flag --pass-device-specs"),
        ((), {}, "device_list_strategy", ("volume-mounts",), "file flags.plugin.deviceListStrategy"),
        ((), {"DEVICE_LIST_STRATEGY": "cdi-cri,envvar"}, "device_list_strategy", ("cdi-cri", "envvar"), "env DEVICE_LIST_STRATEGY"),
        (("--device-list-strategy", "cdi-annotations"), {"DEVICE_LIST_STRATEGY": "envvar"}, "device_list_strategy",
         ("cdi-annotations",), "flag --device-list-strategy"),
        ((), {}, "log_level", "warning", "file gpuvisor.logLevel"),
        ((), {"GPUVISOR_LOG_LEVEL": "debug"}, "log_level", "debug", "env GPUVISOR_LOG_LEVEL"),
        (("--log-level", "error"), {"GPUVISOR_LOG_LEVEL": "debug"}, "log_level", "error", "flag --log-level"),
        ((), {}, "device_id_strategy", "uuid", "default"),
    ],
)  # fmt: skip
def test_precedence_flag_env_file_default(
    tmp_path: Path, argv: tuple[str, ...], env: dict[str, str], name: str, expected: object, source: str
) -> None:
    """Each setting resolves flag > env var > config file > default, and records where it came from."""
    config = load_file(tmp_path, PRECEDENCE_FILE, *argv, env=env)
    assert getattr(config, name) == expected
    assert dict(config.sources)[name] == source


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ((), {}, "/"),
        (("--driver-root", "/run/nvidia/driver"), {}, "/run/nvidia/driver"),
        ((), {"NVIDIA_DRIVER_ROOT": "/host"}, "/host"),
        (("--driver-root", "/d"), {"NVIDIA_DEV_ROOT": "/dev-host"}, "/dev-host"),
    ],
)
def test_dev_root_defaults_to_driver_root(argv: tuple[str, ...], env: dict[str, str], expected: str) -> None:
    """--dev-root defaults to the resolved driver root, whatever set that; its own setting wins."""
    assert load_config(parse_flags(*argv), env).dev_root == expected


GO_BOOLS = [("1", True), ("t", True), ("T", True), ("TRUE", True), ("true", True), ("True", True),
            ("0", False), ("f", False), ("F", False), ("FALSE", False), ("false", False), ("False", False)]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), GO_BOOLS)
def test_bool_env_accepts_go_parsebool_forms(text: str, expected: bool) -> None:
    """Boolean env vars accept exactly Go's strconv.ParseBool spellings."""
    assert load_config(None, {"GDS_ENABLED": text}).gds_enabled is expected
    assert load_config(None, {"FAIL_ON_INIT_ERROR": text}).fail_on_init_error is expected


@pytest.mark.parametrize(("text", "expected"), GO_BOOLS)
def test_bool_flag_with_value(text: str, expected: bool) -> None:
    """Boolean flags take Go's forms after `=` (--flag=false), like Go's flag packages."""
    assert load_config(parse_flags(f"--mofed-enabled={text}"), {}).mofed_enabled is expected


def test_bare_bool_flag_means_true() -> None:
    """A bare boolean flag (--pass-device-specs) is true; an absent one falls through."""
    assert load_config(parse_flags("--pass-device-specs"), {}).pass_device_specs is True
    assert load_config(parse_flags("--imex-required", "--gdrcopy-enabled"), {}).imex_required is True
    assert load_config(parse_flags(), {"PASS_DEVICE_SPECS": "true"}).pass_device_specs is True


@pytest.mark.parametrize("text", ["yes", "on", "2", " true", "tRUE"])
def test_bool_rejects_other_forms(text: str) -> None:
    """Anything ParseBool rejects is a config error naming the env var and the value."""
    with pytest.raises(ConfigError) as info:
        load_config(None, {"PASS_DEVICE_SPECS": text})
    assert (
        str(info.value) == f'config error: env PASS_DEVICE_SPECS: invalid boolean "{text}": use true or false'
    )


def test_empty_env_of_gpuvisor_settings_counts_as_unset_except_metrics_address() -> None:
    """gpuvisor's own empty env vars are unset (default), except GPUVISOR_METRICS_ADDRESS where empty disables.

    (NVIDIA's settings take an empty env var as urfave/cli does: tests/conformance/test_nvidia_parity.py.)"""
    config = load_config(
        None, {"GPUVISOR_LOG_LEVEL": "", "GPUVISOR_ZYGOTE": "", "GPUVISOR_METRICS_ADDRESS": ""}
    )
    assert config.log_level == "info" and config.zygote is True
    assert config.metrics_address == ""


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ((), {"MIG_STRATEGY": "bogus"}, 'config error: env MIG_STRATEGY: invalid value "bogus": must be one of none, single, mixed'),
        (("--mig-strategy=bogus",), {}, 'config error: flag --mig-strategy: invalid value "bogus": must be one of none, single, mixed'),
        (("--device-id-strategy", "serial"), {}, 'config error: flag --device-id-strategy: invalid value "serial": must be one of uuid, index'),
        ((), {"DEVICE_LIST_STRATEGY": "envvar,nfs"},
         'config error: env DEVICE_LIST_STRATEGY: invalid device list strategy "nfs": must be one of envvar, volume-mounts, cdi-annotations, cdi-cri'),
        (("--device-list-strategy", ","), {},
         'config error: flag --device-list-strategy: invalid device list strategy "": must be one of envvar, volume-mounts, cdi-annotations, cdi-cri'),
        ((), {"IMEX_CHANNEL_IDS": "1"}, "config error: env IMEX_CHANNEL_IDS: invalid IMEX channel IDs [1]: only [] or [0] is supported"),
        ((), {"IMEX_CHANNEL_IDS": "zero"}, 'config error: env IMEX_CHANNEL_IDS: invalid integer "zero" in "zero"'),
        ((), {"GPUVISOR_START_RETRIES": "-1"}, "config error: env GPUVISOR_START_RETRIES: must be >= 0 and <= 1000, not -1"),
        ((), {"GPUVISOR_START_RETRIES": "1001"}, "config error: env GPUVISOR_START_RETRIES: must be >= 0 and <= 1000, not 1001"),
        ((), {"GPUVISOR_START_RETRIES": "many"}, 'config error: env GPUVISOR_START_RETRIES: must be an integer, not "many"'),
        (("--heartbeat-timeout", "0"), {},
         'config error: flag --heartbeat-timeout: must be a positive number of seconds up to 31536000, not "0"'),
        (("--rediscovery-interval", "nan"), {},
         'config error: flag --rediscovery-interval: must be a non-negative number of seconds up to 31536000, not "nan"'),
        (("--probe-interval", "1e9"), {},
         'config error: flag --probe-interval: must be a positive number of seconds up to 31536000, not "1e9"'),
        (("--run-dir", "x" * 4097), {}, "config error: flag --run-dir: too long: 4097 characters, at most 4096"),
        (("--metrics-address", "localhost"), {},
         'config error: flag --metrics-address: invalid address "localhost": use host:port, :port, or empty to disable'),
        ((), {"GPUVISOR_METRICS_ADDRESS": "[::1:9475"},
         'config error: env GPUVISOR_METRICS_ADDRESS: invalid address "[::1:9475": use host:port, :port, or empty to disable'),
        (("--log-format", "xml"), {}, 'config error: flag --log-format: invalid value "xml": must be one of text, json'),
        (("--kubelet-socket", ""), {},
         "config error: flag --kubelet-socket: must not be empty: gpuvisor serves and registers beside the kubelet's socket"),
    ],
)  # fmt: skip
def test_flag_and_env_errors(argv: tuple[str, ...], env: dict[str, str], expected: str) -> None:
    """A bad flag or env value is a ConfigError naming the flag or variable, the value and the rule."""
    with pytest.raises(ConfigError) as info:
        load_config(parse_flags(*argv), env)
    assert str(info.value) == expected


# The longest plugin dir whose workers' sockets fit: 107 bytes less "/gpuvisor-r-<tag><nn>.sock".
LONGEST_PLUGIN_DIR = "/" + "d" * (UNIX_PATH_MAX - len("/gpuvisor-r-00000000.sock") - 1)


def test_a_kubelet_socket_whose_dir_cannot_hold_a_worker_socket_is_refused() -> None:
    """A --kubelet-socket in a dir where even a one-byte resource name's worker socket is over the
    unix socket limit is a config error naming the flag, the path, the limit and the size; a dir one
    byte shorter is taken."""
    ok = f"{LONGEST_PLUGIN_DIR}/kubelet.sock"
    assert load_config(parse_flags("--kubelet-socket", ok), {}).kubelet_socket == ok
    too_long = f"{LONGEST_PLUGIN_DIR}d/kubelet.sock"
    with pytest.raises(ConfigError) as info:
        load_config(parse_flags("--kubelet-socket", too_long), {})
    worker = f"{LONGEST_PLUGIN_DIR}d/gpuvisor-r-00000000.sock"
    assert str(info.value) == (
        f"config error: flag --kubelet-socket: the directory of {too_long} is too long: a worker's socket "
        f"there, {worker} at its shortest, must fit a unix socket path (at most 107 bytes, it has 108)"
    )


def test_a_kubelet_socket_path_over_the_limit_is_refused() -> None:
    """A kubelet socket path (KUBELET_SOCKET too) that is itself over 107 bytes is refused with its size."""
    path = "/k/" + "s" * 110 + ".sock"
    with pytest.raises(ConfigError, match=r"^config error: env KUBELET_SOCKET: /k/s+\.sock is too long: it must fit a "
                       r"unix socket path \(at most 107 bytes, it has 118\)$"):  # fmt: skip
        load_config(parse_flags(), {"KUBELET_SOCKET": path})


@pytest.mark.parametrize(
    ("flag", "socket", "key"),
    [
        ("--kubelet-plugins-dir", "gpu.nvidia.com/dra.sock", "gpuvisor.kubeletPluginsDir"),
        ("--kubelet-registry-dir", "gpu.nvidia.com-reg.sock", "gpuvisor.kubeletRegistryDir"),
    ],
)
def test_a_dra_socket_over_the_limit_is_refused(flag: str, socket: str, key: str) -> None:
    """In DRA mode a plugins or registry dir whose DRA socket path is over 107 bytes is a config
    error naming the setting, the path and its size."""
    directory = "/" + "p" * 100
    with pytest.raises(ConfigError) as info:
        load_config(parse_flags("--mode", "dra", "--node-name", "n1", flag, directory), {})
    path = f"{directory}/{socket}"
    assert key in str(info.value) and path in str(info.value)
    assert f"{len(path)} bytes long, over the 107" in str(info.value)


def test_every_resource_name_fits_where_the_shortest_does() -> None:
    """Where the check takes the dir, a worker socket of any resource name fits: the worker cuts a
    long name short (common/socketnames.py), so plans need no check of their own."""
    for name in ("g", "gpu", "a" * 63 + ".shared", "é" * 40):
        path = os.path.join(
            LONGEST_PLUGIN_DIR, socket_name(f"nvidia.com/{name}", "abcdef", 255, LONGEST_PLUGIN_DIR)
        )
        assert len(path.encode()) <= UNIX_PATH_MAX, path


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0.5", 0.5),
        (" 3 ", 3.0),
        ("2s", None),
        ("abc", None),
        ("0", None),
        ("-1", None),
        ("inf", None),
        ("nan", None),
    ],
)
def test_probe_interval_env_is_read_once_here(value: str, seconds: float | None) -> None:
    """GPUVISOR_PROBE_INTERVAL has one reader, this package: a number of seconds becomes
    `probe_interval` (what the health monitor is given); anything else is a config error."""
    if seconds is None:
        with pytest.raises(ConfigError, match="env GPUVISOR_PROBE_INTERVAL"):
            load_config(parse_flags(), {"GPUVISOR_PROBE_INTERVAL": value})
    else:
        assert load_config(parse_flags(), {"GPUVISOR_PROBE_INTERVAL": value}).probe_interval == seconds


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("0.0.0.0:9475", "0.0.0.0:9475"),
        (":9475", ":9475"),
        ("[::]:9100", "[::]:9100"),
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("", ""),
    ],
)
def test_metrics_address_forms(flag: str, expected: str) -> None:
    """The metrics address takes host:port, :port, a bracketed IPv6 host, port 0, or empty (off)."""
    assert load_config(parse_flags("--metrics-address", flag), {}).metrics_address == expected


def test_list_flags_repeat_and_split_on_commas() -> None:
    """A list flag may repeat and each value may be a comma list; duplicates collapse, first order kept."""
    ns = parse_flags(
        "--device-list-strategy", "cdi-cri,envvar", "--device-list-strategy", "envvar,volume-mounts"
    )
    assert load_config(ns, {}).device_list_strategy == ("cdi-cri", "envvar", "volume-mounts")
    assert load_config(parse_flags("--imex-channel-ids", "0"), {}).imex_channel_ids == (0,)


def test_mapping_input_and_foreign_namespace_entries() -> None:
    """load_config takes a mapping of setting names too, and ignores unrelated Namespace entries."""
    ns = parse_flags("--log-format", "json")
    ns.command = "run"  # what a subcommand parser adds
    assert load_config(ns, {}).log_format == "json"
    config = load_config({"mig_strategy": "mixed", "pass_device_specs": True, "simulate": "dgx-h100"}, {})
    assert (config.mig_strategy, config.pass_device_specs, config.simulate) == ("mixed", True, "dgx-h100")


def test_healthcheck_env_vars_parsed_into_tokens() -> None:
    """DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS are split into lower-cased tokens, not interpreted."""
    config = load_config(None, {"DP_DISABLE_HEALTHCHECKS": "XIDS, 94,", "DP_ENABLE_HEALTHCHECKS": "all"})
    assert config.disable_healthchecks == ("xids", "94")
    assert config.enable_healthchecks == ("all",)


FULL_YAML = """
version: v1
flags:
  migStrategy: mixed
  failOnInitError: false
  nvidiaDriverRoot: /run/nvidia/driver
  nvidiaDevRoot: /
  gdsEnabled: true
  mofedEnabled: false
  gdrcopyEnabled: true
  deviceDiscoveryStrategy: nvml
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
    cdiAnnotationPrefix: example.com/
    nvidiaCTKPath: /opt/nvidia-ctk
    containerDriverRoot: /drv
    sharedDevicesAllocationPolicy: packed
resources:
  gpus:
    - pattern: "*H100*"
      name: h100
  mig:
    - pattern: 1g.10gb
      name: mig-small
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
      - name: gpu
        replicas: 4
      - name: nvidia.com/mig-small
        devices: [0:1, 1:2, "3", GPU-00000000-0000-0000-0000-000000000000, MIG-abcdef01-0000-0000-0000-000000000000]
        replicas: 2
imex:
  channelIDs: [0]
  required: true
gpuvisor:
  simulate: mig-a100
  runDir: /tmp/gv
  metricsAddress: ":9999"
  logFormat: json
  logLevel: debug
  cdiSpecDir: /etc/cdi
  migMinorsPath: /tmp/mig-minors
  rediscoveryInterval: 0
  heartbeatTimeout: 2.5
  startRetries: 3
  health:
    xids:
      94: transient
      "79": until-reset
      13: ignore
    transientQuietSeconds: 30
"""


def _as_json(yaml_text: str) -> str:
    return json.dumps(parse_config_text(yaml_text, "<test>"))


def test_full_file_yaml_and_json_agree(tmp_path: Path) -> None:
    """Every file key lands in its Config field, and the same content as JSON gives the same Config."""
    from_yaml = load_file(tmp_path, FULL_YAML)
    from_json = load_file(tmp_path, _as_json(FULL_YAML), name="c.json")
    assert dataclasses.replace(from_yaml, config_file="") == dataclasses.replace(from_json, config_file="")
    c = from_yaml
    assert (c.mig_strategy, c.fail_on_init_error, c.driver_root, c.dev_root) == (
        "mixed",
        False,
        "/run/nvidia/driver",
        "/",
    )
    assert (c.gds_enabled, c.mofed_enabled, c.gdrcopy_enabled, c.device_discovery_strategy) == (
        True,
        False,
        True,
        "nvml",
    )
    assert (c.pass_device_specs, c.device_list_strategy, c.device_id_strategy) == (
        True,
        ("envvar", "cdi-cri"),
        "index",
    )
    assert (c.cdi_annotation_prefix, c.nvidia_cdi_hook_path, c.driver_root_ctr_path) == (
        "example.com/",
        "/opt/nvidia-ctk",
        "/drv",
    )
    assert c.shared_devices_allocation_policy == "packed"
    assert (c.imex_channel_ids, c.imex_required) == ((0,), True)
    assert (c.simulate, c.run_dir, c.metrics_address, c.log_format, c.log_level) == (
        "mig-a100",
        "/tmp/gv",
        ":9999",
        "json",
        "debug",
    )
    assert (c.cdi_spec_dir, c.mig_minors_path) == ("/etc/cdi", "/tmp/mig-minors")
    assert (c.rediscovery_interval, c.heartbeat_timeout, c.start_retries) == (0.0, 2.5, 3)
    assert [(p.pattern, p.name) for p in c.resources.gpus] == [("*H100*", "nvidia.com/h100")]
    assert [(p.pattern, p.name) for p in c.resources.mig] == [("1g.10gb", "nvidia.com/mig-small")]
    assert c.sharing.strategy == "time-slicing" and c.sharing.rename_by_default is True
    assert c.sharing.fail_requests_greater_than_one is False
    assert c.sharing.resources == (
        SharedResource("nvidia.com/gpu", "nvidia.com/gpu.shared", DeviceSelector(all=True), 4),
        SharedResource(
            "nvidia.com/mig-small", "nvidia.com/mig-small.shared",
            DeviceSelector(refs=("0:1", "1:2", "3", "GPU-00000000-0000-0000-0000-000000000000",
                                 "MIG-abcdef01-0000-0000-0000-000000000000")), 2,
        ),
    )  # fmt: skip
    assert c.health.xid_actions() == {13: "ignore", 79: "until-reset", 94: "transient"}
    assert c.health.transient_quiet_seconds == 30.0
    assert c.unknown_keys == ()


def test_unquoted_mig_index_stays_a_string() -> None:
    """`1:2` in YAML is the MIG index "1:2", not YAML 1.1's base-60 integer 62."""
    assert parse_config_text("devices: [1:2, 10:30, 1:2.5]", "<t>") == {"devices": ["1:2", "10:30", "1:2.5"]}
    assert parse_config_text("i: 12\nf: 1.5\nh: 0x10", "<t>") == {"i": 12, "f": 1.5, "h": 16}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("y", True), ("n", False), ("On", True), ("OFF", False), ("~", None), ("", None), ("1e3", 1000.0), ("08", 8.0),
        ("0o17", 15), ("017", 15), ("0x1F", 31), ("-0b101", -5), ("1_000", 1000), (".5", 0.5), ("+.5", 0.5),
        ("18446744073709551615", 18446744073709551615), ("1e400", "1e400"), ("yEs", "yEs"), ("0x", "0x"),
        ("2001-2-3", "2001-02-03T00:00:00Z"), ("2001-02-03t04:05:06.50+01:00", "2001-02-03T04:05:06.5+01:00"),
        ("2001-02-30", "2001-02-30"), ("1:2", "1:2"), ("GPU-1", "GPU-1"),
    ],
)  # fmt: skip
def test_plain_scalars_resolve_as_go_yaml_v2(text: str, value: object) -> None:
    """Plain YAML scalars mean what go-yaml v2 (NVIDIA's parser) makes of them, not PyYAML's YAML 1.1."""
    # go.yaml.in/yaml/v2 v2.4.3 resolve.go resolve(): the map of y/n/on/off/null words, ParseInt
    # base 0 with '_' removed, ParseUint, yamlStyleFloat, then timestamps (time.Parse layouts).
    parsed = parse_config_text(f"k: {text}", "<t>")
    assert isinstance(parsed, dict) and parsed["k"] == value and isinstance(parsed["k"], type(value))


def test_keys_become_strings_and_merges_apply_in_order() -> None:
    """Keys become strings as sigs.k8s.io/yaml makes them; a merge key overwrites the keys before it, not after."""
    assert parse_config_text("{n: 1, 94: 2, 1.5: 3, true: 4}", "<t>") == {
        "false": 1,
        "94": 2,
        "1.5": 3,
        "true": 4,
    }
    base = "b: &b {p: 1, q: 2}\n"
    merged = parse_config_text(base + "m: {p: 0, <<: *b, q: 9}", "<t>")
    assert isinstance(merged, dict) and merged["m"] == {"p": 1, "q": 9}
    assert parse_config_text("---\na: 1\n---\na: 2\n", "<t>") == {"a": 1}  # the first document only
    for bad in ("{~: 1}", "{2001-01-01: 1}", "{[1]: 2}"):
        with pytest.raises(ConfigError, match="not valid YAML or JSON"):
            parse_config_text(bad, "<t>")


def test_unknown_keys_are_ignored_and_reported(tmp_path: Path) -> None:
    """Unknown keys anywhere (typos, keys NVIDIA does not know) do not fail the load but are listed."""
    config = load_file(
        tmp_path,
        """
version: v1
flags:
  migStrategy: mixed
  gfd: {oneshot: true, color: red}
  plugin: {passDeviceSpec: true}
sharing:
  timeSlicing:
    resources:
      - {name: gpu, replicas: 2, color: red}
gpuvisor: {runDri: /x, health: {xid: {}}}
extra: 1
""",
    )
    assert config.mig_strategy == "mixed" and config.pass_device_specs is False
    assert config.unknown_keys == (
        "extra",
        "flags.gfd.color",
        "flags.plugin.passDeviceSpec",
        "gpuvisor.runDri",
        "gpuvisor.health.xid",
        "sharing.timeSlicing.resources[0].color",
    )


def test_sharing_defaults_per_strategy(tmp_path: Path) -> None:
    """failRequestsGreaterThanOne defaults false for time-slicing and true for MPS; devices defaults to all."""
    ts = load_file(tmp_path, "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}")
    assert ts.sharing.fail_requests_greater_than_one is False
    assert ts.sharing.resources[0] == SharedResource("nvidia.com/gpu", "", DeviceSelector(all=True), 2)
    mps = load_file(
        tmp_path, "flags: {mpsRoot: /run/nvidia/mps}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}"
    )
    assert mps.sharing.strategy == "mps" and mps.sharing.fail_requests_greater_than_one is True
    explicit = load_file(
        tmp_path,
        "sharing: {mps: {failRequestsGreaterThanOne: false, resources: [{name: gpu, replicas: 3, devices: 2}]}}",
        env={"MPS_ROOT": "/mps"},
    )
    assert explicit.sharing.fail_requests_greater_than_one is False
    assert explicit.sharing.resources[0].devices == DeviceSelector(count=2)


def test_rename_wins_over_rename_by_default(tmp_path: Path) -> None:
    """An explicit `rename` is used as is (normalised); renameByDefault only names entries without one."""
    config = load_file(
        tmp_path,
        "sharing: {timeSlicing: {renameByDefault: true, resources: "
        "[{name: gpu, rename: nvidia.com/ts-gpu, replicas: 2, devices: [0]}, {name: gpu, replicas: 2}]}}",
    )
    assert [r.rename for r in config.sharing.resources] == ["nvidia.com/ts-gpu", "nvidia.com/gpu.shared"]


LONG = "x" * 60
TS = "sharing:\n  timeSlicing:\n    resources:\n"


BAD_NAME = (
    "the part after nvidia.com/ must be lower-case letters, digits, '-' and '.', starting and ending with a "
    "letter or digit (a DNS-1123 subdomain)"
)


@pytest.mark.parametrize(
    ("text", "key_and_reason"),
    [
        (TS + "      - {name: gpu, replicas: 1}", "sharing.timeSlicing.resources[0].replicas: number of replicas must be >= 2"),
        (TS + "      - {name: gpu, replicas: 2}\n      - {name: gpu}", "sharing.timeSlicing.resources[1].replicas: no replicas specified"),
        (TS + "      - {name: gpu, replicas: two}", 'sharing.timeSlicing.resources[0].replicas: must be an integer, not "two"'),
        (TS + "      - {name: gpu, replicas: true}", "sharing.timeSlicing.resources[0].replicas: must be an integer, not True"),
        (TS + "      - {name: gpu, replicas: 2.5}", "sharing.timeSlicing.resources[0].replicas: must be an integer, not 2.5"),
        (TS + "      - {name: gpu, replicas: 65537}",
         "sharing.timeSlicing.resources[0].replicas: 65537 replicas is more than gpuvisor's limit of 65536: that many "
         "devices of even one GPU cannot fit the kubelet's 4 MiB ListAndWatch message"),
        ("sharing: {timeSlicing: {resources: []}}", "sharing.timeSlicing.resources: no resources specified"),
        ("sharing: {timeSlicing: {renameByDefault: true}}", "sharing.timeSlicing.resources: no resources specified"),
        ("sharing: {timeSlicing: {resources: {name: gpu}}}", "sharing.timeSlicing.resources: must be a list, not a mapping"),
        (TS + f"      - {{name: {LONG}, replicas: 2}}",
         f"sharing.timeSlicing.resources[0].name: fully-qualified resource name must be at most 63 characters: nvidia.com/{LONG}"),
        (TS + "      - {name: gpu, rename: " + LONG + ", replicas: 2}",
         f"sharing.timeSlicing.resources[0].rename: fully-qualified resource name must be at most 63 characters: nvidia.com/{LONG}"),
        (TS + "      - {name: example.com/gpu, replicas: 2}",
         f'sharing.timeSlicing.resources[0].name: invalid resource name "nvidia.com/example.com/gpu": {BAD_NAME}'),
        (TS + "      - {name: 'gpu!', replicas: 2}", f'sharing.timeSlicing.resources[0].name: invalid resource name "nvidia.com/gpu!": {BAD_NAME}'),
        (TS + "      - {replicas: 2}", "sharing.timeSlicing.resources[0].name: no resource name specified"),
        (TS + "      - {name: 7, replicas: 2}", "sharing.timeSlicing.resources[0].name: must be a string, not an integer"),
        (TS + "      - {name: gpu, replicas: 2, devices: 0}", "sharing.timeSlicing.resources[0].devices: device count must be > 0, not 0"),
        (TS + "      - {name: gpu, replicas: 2, devices: -3}", "sharing.timeSlicing.resources[0].devices: device count must be > 0, not -3"),
        (TS + "      - {name: gpu, replicas: 2, devices: [0, foo]}",
         'sharing.timeSlicing.resources[0].devices[1]: invalid device reference "foo": use a GPU index, an i:j MIG index, '
         "or a GPU-<uuid> / MIG-<uuid> UUID"),
        (TS + "      - {name: gpu, replicas: 2, devices: [-1]}",
         "sharing.timeSlicing.resources[0].devices[0]: unsupported device -1 (an integer): use a GPU index, an i:j MIG index, or a UUID"),
        (TS + "      - {name: gpu, replicas: 2, devices: some}",
         "sharing.timeSlicing.resources[0].devices: devices set as \"some\" but the only valid string input is 'all'"),
        (TS + "      - {name: gpu, replicas: 2, devices: true}",
         'sharing.timeSlicing.resources[0].devices: invalid devices True: use "all", a count > 0, or a list of device references'),
        ("sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}",
         "sharing.mps: MPS sharing needs an MPS root: set flags.mpsRoot, --mps-root or MPS_ROOT"),
        ("flags: {migStrategy: mixed, mpsRoot: /m}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}",
         "sharing.mps: MPS sharing is not supported with the mixed MIG strategy"),
        ("sharing: {timeSlicing: {renameByDefault: maybe, resources: [{name: gpu, replicas: 2}]}}",
         'sharing.timeSlicing.renameByDefault: must be a boolean (true or false), not a string "maybe"'),
        ("sharing: {timeSlicing: 5}", "sharing.timeSlicing.resources: must be a mapping, not an integer"),
        ("version: v2", 'version: unsupported config version "v2": only v1 is supported'),
        ("version: 1", 'version: unsupported config version "1": only v1 is supported'),
        ("flags: 5", "flags: this section must be a mapping, not an integer"),
        ("flags: {plugin: [1]}", "flags.plugin: this section must be a mapping, not a list"),
        ("flags: {migStrategy: bogus}", 'flags.migStrategy: invalid value "bogus": must be one of none, single, mixed'),
        ("flags: {failOnInitError: 3}", "flags.failOnInitError: must be a boolean (true or false), not an integer 3"),
        ("flags: {plugin: {deviceListStrategy: [envvar, 3]}}", "flags.plugin.deviceListStrategy[1]: must be a string, not an integer"),
        ("flags: {plugin: {deviceListStrategy: 3}}", "flags.plugin.deviceListStrategy: must be a string or a list of strings, not an integer"),
        ("flags: {gfd: {sleepInterval: 5x}}",
         'flags.gfd.sleepInterval: unknown unit \'x\' in duration \'5x\': use a duration such as 60s, 1m30s or infinite'),
        ("imex: {channelIDs: [0, 1]}", "imex.channelIDs: invalid IMEX channel IDs [0, 1]: only [] or [0] is supported"),
        ("imex: {channelIDs: [0.5]}", "imex.channelIDs[0]: must be an integer, not 0.5"),
        ("resources: {gpus: [{name: big}]}", "resources.gpus[0].pattern: resources must have a 'pattern' field set"),
        ("resources: {gpus: [{pattern: x}]}", "resources.gpus[0].name: resources must have a 'name' field set"),
        ("resources: {mig: [{pattern: '1g*', name: ''}]}", f'resources.mig[0].name: invalid resource name "nvidia.com/": {BAD_NAME}'),
        ("resources: {gpus: {pattern: x}}", "resources.gpus: must be a list, not a mapping"),
        ("resources: {gpus: [{pattern: " + "y" * 257 + ", name: x}]}", "resources.gpus[0].pattern: too long: 257 characters, at most 256"),
        ("gpuvisor: {health: {xids: {94: reboot}}}",
         'gpuvisor.health.xids.94: invalid value "reboot": must be one of ignore, transient, until-reset'),
        ("gpuvisor: {health: {xids: {abc: ignore}}}", 'gpuvisor.health.xids.abc: invalid XID "abc": XIDs are integers'),
        ("gpuvisor: {health: {xids: {'094': ignore, 94: transient}}}", "gpuvisor.health.xids.94: XID 94 is listed twice"),
        ("gpuvisor: {health: {transientQuietSeconds: -1}}",
         "gpuvisor.health.transientQuietSeconds: must be a non-negative number of seconds up to 31536000, not -1"),
        ("gpuvisor: {startRetries: 1.5}", "gpuvisor.startRetries: must be an integer, not 1.5"),
        ("gpuvisor: 3", "gpuvisor: this section must be a mapping, not an integer"),
        ("[1, 2]", "the config file must be a mapping, not a list"),
        ("flags: {migStrategy: [}", "not valid YAML or JSON: line 1, column 23: expected the node content, but found '}'"),
        ("extra: .nan", "extra: holds nan, which JSON (and so NVIDIA's config reader) cannot represent"),
        ("a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
         "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
         "f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]",
         "too large: more than 100000 values once aliases are expanded"),
        ("n: " + "[" * 70 + "]" * 70, "nested deeper than 64 levels"),
        (TS + "      - {name: gpu, replicas: 2, devices: [" + ", ".join(["0"] * 1025) + "]}",
         "sharing.timeSlicing.resources[0].devices: too many items: 1025, at most 1024"),
    ],
)  # fmt: skip
def test_file_errors(tmp_path: Path, text: str, key_and_reason: str) -> None:
    """Every invalid file gives `config error: <path>: <key>: <reason>` with the exact text."""
    assert file_error(tmp_path, text) == f"config error: {tmp_path / 'c.yaml'}: {key_and_reason}"


def test_error_carries_source_key_and_reason(tmp_path: Path) -> None:
    """ConfigError keeps source, key and reason apart for the caller."""
    path = tmp_path / "c.yaml"
    path.write_text("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}")
    with pytest.raises(ConfigError) as info:
        load_config(None, {"CONFIG_FILE": str(path)})
    assert (info.value.source, info.value.key, info.value.reason) == (
        str(path),
        "sharing.timeSlicing.resources[0].replicas",
        "number of replicas must be >= 2",
    )


def test_missing_config_file(tmp_path: Path) -> None:
    """A config file that cannot be read is a ConfigError naming the path (from flag or env alike)."""
    missing = str(tmp_path / "nope.yaml")
    for flags, env in ((parse_flags("--config-file", missing), {}), (None, {"CONFIG_FILE": missing})):
        with pytest.raises(ConfigError) as info:
            load_config(flags, env)
        assert (
            str(info.value)
            == f"config error: {missing}: cannot read the config file: No such file or directory"
        )


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    """An empty file (or one holding only `version: v1`) leaves every setting at its default."""
    assert load_file(tmp_path, "") == load_file(tmp_path, "version: v1")
    assert load_file(tmp_path, "").mig_strategy == "none"


def test_reload_rereads_the_file(tmp_path: Path) -> None:
    """Calling load_config again with the same flags and env picks up a changed file."""
    path = tmp_path / "c.yaml"
    env = {"CONFIG_FILE": str(path)}
    path.write_text("flags: {migStrategy: single}")
    assert load_config(None, env).mig_strategy == "single"
    path.write_text('{"flags": {"migStrategy": "mixed"}}')
    assert load_config(None, env).mig_strategy == "mixed"


def test_describe_is_json_and_complete(tmp_path: Path) -> None:
    """describe() is JSON-serialisable and shows every setting, its source, sections and ignored keys."""
    config = load_file(tmp_path, FULL_YAML + "bogus: 1\n", "--log-level", "error")
    described = config.describe()
    json.dumps(described)
    assert set(described["settings"]) == {s.name for s in SETTINGS}
    assert described["settings"]["device_list_strategy"] == ["envvar", "cdi-cri"]
    assert described["sources"]["log_level"] == "flag --log-level"
    assert described["sharing"]["resources"][0]["rename"] == "nvidia.com/gpu.shared"
    assert described["health"]["xids"] == {"13": "ignore", "79": "until-reset", "94": "transient"}
    assert described["unknownKeys"] == ["bogus"]


def test_markdown_table_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """The settings table (docs/configuration.md) has one row per setting with its flags, env vars,
    file key and default."""
    table = settings_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(SETTINGS)
    for setting, row in zip(SETTINGS, rows, strict=True):
        for name in (*setting.flags, *setting.envs, setting.file_key or "—"):
            assert name in row
    assert (
        "| `--dev-root`, `--nvidia-dev-root` | `NVIDIA_DEV_ROOT` | `flags.nvidiaDevRoot` | the driver root |"
        in table
    )
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == table


def test_argparse_help_mentions_env_and_default() -> None:
    """`gpuvisor run --help` shows each flag with its env var and default."""
    parser = RunArgumentParser(prog="gpuvisor run")
    add_run_arguments(parser)
    text = parser.format_help()
    assert "--mig-strategy {none,single,mixed}" in text
    assert "env MIG_STRATEGY; default none" in text
    assert "--pass-device-specs" in text and "--flag=false (never a separate value)" in " ".join(text.split())


# --- property: any file content gives a Config or a ConfigError, never another exception ---------

KEYS = sorted(
    {
        "version", "flags", "plugin", "resources", "gpus", "mig", "pattern", "name", "sharing", "timeSlicing",
        "mps", "renameByDefault", "failRequestsGreaterThanOne", "rename", "devices", "replicas", "imex",
        "channelIDs", "required", "gpuvisor", "health", "xids", "transientQuietSeconds",
        *(s.file_key.rsplit(".", 1)[-1] for s in SETTINGS if s.file_key),
    }
)  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        ["all", "v1", "1:2", "GPU-1", "MIG-x", "gpu", "mixed", "single", "true", "94", "/m", ":1"]
    ),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=5), st.integers(-2, 100), st.none())
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6))
def test_any_mapping_gives_config_or_config_error(data: dict[str, Any]) -> None:
    """Any mapping loaded as a config file yields a Config or a ConfigError, never another exception."""
    try:
        config = config_from_data(data, environ={}, source="prop.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("config error: prop.yaml")
    else:
        json.dumps(config.describe())
