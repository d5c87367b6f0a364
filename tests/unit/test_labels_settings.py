"""`gpuvisor labels` settings: GFD's names, defaults and precedence (flag > env > config file > default).

NVIDIA's source for each: cmd/gpu-feature-discovery/main.go:51-119 (flags, env names, defaults),
internal/flags/kubeclient.go:42-67 and node.go:30-52, api/config/v1/flags.go:118-181 (the file
keys and `c.IsSet` precedence), api/config/v1/duration.go (durations), api/config/v1/config.go
(the file decoded whole), and urfave/cli v2.27.7 as NVIDIA vendors it
(vendor/github.com/urfave/cli/v2: flag.go flagFromEnvOrFile, flag_*.go Apply).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import build_parser
from supervisor.config import ConfigError
from supervisor.config.nvidia import Leaf, leaf_at
from supervisor.labels.daemon import Labeller
from supervisor.labels.host import DEFAULT_MACHINE_TYPE_FILE
from supervisor.labels.settings import (
    DEFAULT_OUTPUT_FILE,
    LABEL_SETTINGS,
    label_settings_markdown,
    load_label_settings,
)
from tests.helpers import REPO


def load(
    flags: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    config: str | None = None,
    tmp: Path | None = None,
) -> Any:
    flags = dict(flags or {})
    if config is not None:
        assert tmp is not None
        path = tmp / "config.yaml"
        path.write_text(config)
        flags["config_file"] = str(path)
    return load_label_settings(flags, env or {})


def test_defaults_are_gfds() -> None:
    """No flag, env or file: GFD v0.20.0's defaults (main.go:51-119, kubeclient.go:55-64, node.go:35)."""
    s = load()
    assert (s.mig_strategy, s.fail_on_init_error, s.oneshot, s.no_timestamp) == ("none", True, False, False)
    assert s.sleep_interval == 60.0
    assert s.output_file == DEFAULT_OUTPUT_FILE == "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    assert s.machine_type_file == DEFAULT_MACHINE_TYPE_FILE == "/sys/class/dmi/id/product_name"
    assert s.use_node_feature_api is True  # main.go:102: the NodeFeature API by default
    assert (s.device_discovery_strategy, s.driver_root_ctr_path) == ("auto", "/driver-root")
    assert (s.kube_api_qps, s.kube_api_burst, s.namespace, s.node_name, s.pod_name, s.kubeconfig) == (
        5.0,
        10,
        "default",
        "",
        "",
        "",
    )


def test_gfd_env_name_wins_over_the_shared_one() -> None:
    """GFD_MIG_STRATEGY beats MIG_STRATEGY; each env var alone works (main.go:56, 62, 98, 104)."""
    both = load(env={"GFD_MIG_STRATEGY": "single", "MIG_STRATEGY": "mixed"})
    assert both.mig_strategy == "single"
    assert load(env={"MIG_STRATEGY": "mixed"}).mig_strategy == "mixed"
    assert load(env={"FAIL_ON_INIT_ERROR": "false"}).fail_on_init_error is False
    assert load(env={"GFD_FAIL_ON_INIT_ERROR": "0", "FAIL_ON_INIT_ERROR": "true"}).fail_on_init_error is False
    assert load(env={"USE_NODE_FEATURE_API": "F"}).use_node_feature_api is False
    assert load(env={"CONTAINER_DRIVER_ROOT": "/drv"}).driver_root_ctr_path == "/drv"


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    """Precedence per setting, the file's flags.* and flags.gfd.* keys included (flags.go:33-34)."""
    config = "version: v1\nflags:\n  migStrategy: mixed\n  gfd: {sleepInterval: 5m, noTimestamp: true, outputFile: /x/gfd}\n"
    s = load(config=config, tmp=tmp_path)
    assert (s.mig_strategy, s.sleep_interval, s.no_timestamp, s.output_file) == (
        "mixed",
        300.0,
        True,
        "/x/gfd",
    )
    s = load(env={"MIG_STRATEGY": "single", "GFD_SLEEP_INTERVAL": "2s"}, config=config, tmp=tmp_path)
    assert (s.mig_strategy, s.sleep_interval) == ("single", 2.0)
    s = load(
        {"mig_strategy": "none", "sleep_interval": "infinite"}, {"MIG_STRATEGY": "single"}, config, tmp_path
    )
    assert (s.mig_strategy, s.sleep_interval) == ("none", None)
    assert dict(s.sources)["mig_strategy"] == "flag --mig-strategy"
    assert dict(s.sources)["no_timestamp"] == "file flags.gfd.noTimestamp"


def test_config_file_from_either_env_name(tmp_path: Path) -> None:
    """GFD_CONFIG_FILE, then CONFIG_FILE, name the file (main.go:98)."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("flags: {migStrategy: single}\n")
    b.write_text("flags: {migStrategy: mixed}\n")
    assert load(env={"GFD_CONFIG_FILE": str(a), "CONFIG_FILE": str(b)}).mig_strategy == "single"
    assert load(env={"CONFIG_FILE": str(b)}).mig_strategy == "mixed"


def test_an_empty_env_var_is_a_value_and_ends_the_search_as_in_urfave_cli() -> None:
    """The first env var present wins even when empty (flag.go:378-393 flagFromEnvOrFile): "" is the
    string "" (flag_string.go:56-59) and false for a boolean (flag_bool.go:113-128), and the next
    name is not tried. (Until this fix an empty one was skipped and MIG_STRATEGY="" meant unset.)"""
    s = load(
        env={
            "GFD_OUTPUT_FILE": "",
            "GFD_MACHINE_TYPE_FILE": "",
            "GFD_FAIL_ON_INIT_ERROR": "",
            "FAIL_ON_INIT_ERROR": "true",
        }
    )
    assert (s.output_file, s.machine_type_file, s.fail_on_init_error) == ("", "", False)
    assert dict(s.sources)["fail_on_init_error"] == "env GFD_FAIL_ON_INIT_ERROR"
    with pytest.raises(ConfigError, match='env GFD_MIG_STRATEGY: invalid value ""'):
        load(env={"GFD_MIG_STRATEGY": "", "MIG_STRATEGY": "mixed"})


def test_an_empty_config_file_env_var_hides_the_other_name(tmp_path: Path) -> None:
    """GFD_CONFIG_FILE="" is the string "": no config file, CONFIG_FILE is not looked at (flag.go:379-383)."""
    b = tmp_path / "b.yaml"
    b.write_text("flags: {migStrategy: mixed}\n")
    s = load(env={"GFD_CONFIG_FILE": "", "CONFIG_FILE": str(b)})
    assert (s.mig_strategy, s.config_file) == ("none", "")


def test_an_empty_env_var_of_a_number_or_duration_is_unset(tmp_path: Path) -> None:
    """GenericFlag, IntFlag and Float64Flag ignore an empty env value (flag_generic.go:82-90,
    flag_int.go:52-63, flag_float64.go:51-61): the file or the default applies."""
    s = load(env={"GFD_SLEEP_INTERVAL": "", "KUBE_API_QPS": "", "KUBE_API_BURST": ""},
             config="flags: {gfd: {sleepInterval: 5m}}\n", tmp=tmp_path)  # fmt: skip
    assert (s.sleep_interval, s.kube_api_qps, s.kube_api_burst) == (300.0, 5.0, 10)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60.0), ("1m30s", 90.0), ("1.5h", 5400.0), ("2h45m", 9900.0), ("1500ms", 1.5), ("3000000us", 3.0),
     ("+10s", 10.0), ("1h0.5m", 3630.0)],
)  # fmt: skip
def test_go_durations(text: str, seconds: float) -> None:
    """Durations read as Go's time.ParseDuration reads them (duration.go:61-71)."""
    assert load({"sleep_interval": text}).sleep_interval == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "10", "1x", "s", "1m 30s", "1..5s", " 60s", "60s ", "--5s", "+-5s", " infinite", "Infinite"]
)
def test_bad_go_durations(text: str) -> None:
    """Anything ParseDuration (and Duration.parse's exact "infinite") refuses is refused, with the flag named:
    no blanks around it, one sign only (duration.go:61-71)."""
    with pytest.raises(ConfigError, match="flag --sleep-interval"):
        load({"sleep_interval": text})


def test_a_number_in_the_file_is_nanoseconds_like_gfd(tmp_path: Path) -> None:
    """sleepInterval: 60 in the file is 60 ns to GFD (duration.go:46-48): refused, with a hint."""
    with pytest.raises(ConfigError, match=r"flags\.gfd\.sleepInterval: .*nanoseconds"):
        load(config="flags: {gfd: {sleepInterval: 60}}\n", tmp=tmp_path)
    assert load(config="flags: {gfd: {sleepInterval: 90000000000}}\n", tmp=tmp_path).sleep_interval == 90.0


def test_sharing_is_gfds_reading_of_the_file(tmp_path: Path) -> None:
    """The sharing section: strategy, renameByDefault and each resource's first entry; MPS needs no MPS root here."""
    s = load(config="version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
                    "    - {name: gpu, replicas: 2}\n    - {name: nvidia.com/gpu, replicas: 5, devices: [0]}\n",
             tmp=tmp_path)  # fmt: skip
    assert (s.sharing.strategy, s.sharing.rename_by_default, dict(s.sharing.replicas)) == (
        "mps",
        True,
        {"nvidia.com/gpu": 2},
    )


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ("version: v2\n", "version"),
        ("flags: {migStrategy: 5}\n", "flags.migStrategy"),
        ("flags: {gfd: {oneshot: sometimes}}\n", "flags.gfd.oneshot"),
        ("flags: {gfd: [1]}\n", "flags.gfd"),
        ("sharing: {timeSlicing: {resources: [{name: gpu}]}}\n", "sharing.timeSlicing.resources[0].replicas"),
        ("sharing: {mps: {resources: [{name: 'bad name', replicas: 2}]}}\n", "sharing.mps.resources[0].name"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, config: str, key: str) -> None:
    """A bad file value is a ConfigError naming the file and the key."""
    with pytest.raises(ConfigError) as err:
        load(config=config, tmp=tmp_path)
    assert err.value.key == key and err.value.source == str(tmp_path / "config.yaml")


def test_kube_client_settings() -> None:
    """--kubeconfig/KUBECONFIG, KUBE_API_QPS (any number; negative: no limit) and KUBE_API_BURST, NODE_NAME..."""
    s = load(
        env={
            "KUBECONFIG": "/k",
            "KUBE_API_QPS": "-1",
            "KUBE_API_BURST": "3",
            "NODE_NAME": "n1",
            "NAMESPACE": "gpu",
            "POD_NAME": "p",
        }
    )
    assert (s.kubeconfig, s.kube_api_qps, s.kube_api_burst, s.node_name, s.namespace, s.pod_name) == (
        "/k",
        -1.0,
        3,
        "n1",
        "gpu",
        "p",
    )
    with pytest.raises(ConfigError, match="env KUBE_API_BURST"):
        load(env={"KUBE_API_BURST": "2.5"})


@pytest.mark.parametrize(
    ("text", "value"), [("16", 16), ("0x10", 16), ("0o20", 16), ("020", 16), ("1_6", 16), ("+16", 16)]
)
def test_kube_api_burst_is_a_go_integer(text: str, value: int) -> None:
    """KUBE_API_BURST is an IntFlag: strconv.ParseInt(s, 0, 64) (flag_int.go:52-54), so 0x10 is 16."""
    assert load(env={"KUBE_API_BURST": text}).kube_api_burst == value


@pytest.mark.parametrize("text", ["2.0", " 3", "3 ", "1e1", "0x", "1__0", "9223372036854775808"])
def test_kube_api_burst_refuses_what_parseint_refuses(text: str) -> None:
    """What strconv.ParseInt(s, 0, 64) refuses (no fraction, exponent, blanks or overflow) is refused."""
    with pytest.raises(ConfigError, match="env KUBE_API_BURST: invalid value"):
        load(env={"KUBE_API_BURST": text})


@pytest.mark.parametrize(
    ("text", "value"),
    [("2.5", 2.5), ("1e1", 10.0), (".5", 0.5), ("5.", 5.0), ("0x1p-2", 0.25), ("1_0", 10.0)],
)
def test_kube_api_qps_is_a_go_float(text: str, value: float) -> None:
    """KUBE_API_QPS is a Float64Flag: strconv.ParseFloat(s, 64) (flag_float64.go:52-53), hex floats included."""
    assert load(env={"KUBE_API_QPS": text}).kube_api_qps == value


@pytest.mark.parametrize("text", [" 3", "3 ", "0x10", "1e", "_1", "1e400", "+nan"])
def test_kube_api_qps_refuses_what_parsefloat_refuses(text: str) -> None:
    """What strconv.ParseFloat refuses (blanks, a hex float without p exponent, overflow, a signed NaN) is refused."""
    with pytest.raises(ConfigError, match="env KUBE_API_QPS: invalid value"):
        load(env={"KUBE_API_QPS": text})


@pytest.mark.parametrize("strategy", ["tegra", "vfio"])
def test_gfd_only_discovery_strategies_are_refused_clearly(strategy: str) -> None:
    """tegra and vfio are valid to GFD (main.go:132-142) but not implemented here: a clear refusal."""
    with pytest.raises(ConfigError, match="does not implement"):
        load({"device_discovery_strategy": strategy})
    with pytest.raises(ConfigError, match="must be one of auto, nvml, tegra, vfio"):
        load({"device_discovery_strategy": "cuda"})


def test_documented_table_is_current() -> None:
    """docs/node-labels.md's settings table is the one generated from the declarations."""
    page = (Path(REPO) / "docs" / "node-labels.md").read_text()
    start, end = "<!-- label-settings:start -->\n", "<!-- label-settings:end -->"
    assert start in page and end in page
    assert page.split(start, 1)[1].split(end, 1)[0] == label_settings_markdown()


# --- the file is decoded as NVIDIA's Config (api/config/v1), by the same decoder as `gpuvisor run`'s ---


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ('flags: {gfd: {oneshot: "true"}}\n', "flags.gfd.oneshot"),
        ('flags: {failOnInitError: "false"}\n', "flags.failOnInitError"),
        ('flags: {plugin: {passDeviceSpecs: "true"}}\n', "flags.plugin.passDeviceSpecs"),
        ("resources: {gpus: [{pattern: '*'}]}\n", "resources.gpus[0].name"),
        ("imex: {channelIDs: [a]}\n", "imex.channelIDs[0]"),
    ],
)
def test_the_whole_file_is_decoded_as_nvidias_config(tmp_path: Path, config: str, key: str) -> None:
    """A string for a Go *bool is refused, even in a part the labels do not use: GFD decodes the whole
    file into NVIDIA's Config (config.go:113-136 parseConfigFrom, flags.go:59-115 the *bool fields,
    resources.go Resource.UnmarshalJSON). (Until this fix the labels accepted these.)"""
    with pytest.raises(ConfigError) as err:
        load(config=config, tmp=tmp_path)
    assert err.value.key == key


def test_file_keys_match_case_insensitively_as_encoding_json_does(tmp_path: Path) -> None:
    """`MigStrategy` and `gfd: {OneShot: ...}` land in migStrategy and oneshot: encoding/json matches a
    key to a field case-insensitively when no exact match exists (flags.go:59-115 json tags).
    (Until this fix the labels ignored them.)"""
    s = load(config="flags:\n  MigStrategy: mixed\n  GFD: {OneShot: true, NOTIMESTAMP: true}\n", tmp=tmp_path)
    assert (s.mig_strategy, s.oneshot, s.no_timestamp) == ("mixed", True, True)


def test_a_number_for_a_string_key_becomes_its_text(tmp_path: Path) -> None:
    """`outputFile: 1.5` is the path "1.5": sigs.k8s.io/yaml turns a YAML number headed for a Go string
    into its text (flags.go:113 OutputFile *string). (Until this fix the labels refused it.)"""
    s = load(config="flags: {gfd: {outputFile: 1.5, machineTypeFile: 7}}\n", tmp=tmp_path)
    assert (s.output_file, s.machine_type_file) == ("1.5", "7")


def test_mps_sharing_with_the_mixed_strategy_loads(tmp_path: Path) -> None:
    """GFD's config load has no MPS-root or mixed-strategy check (those are the device plugin's
    validateFlags); a MIG-enabled GPU then fails the labelling itself (lm/nvml.go:206-207)."""
    s = load(
        {"mig_strategy": "mixed"},
        config="sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n",
        tmp=tmp_path,
    )
    assert (s.mig_strategy, s.sharing.strategy) == ("mixed", "mps")


# --- the command line is read with Go's flag syntax, as GFD's urfave/cli app reads it ---


def parse(*argv: str) -> Any:
    return load_label_settings(build_parser().parse_args(["labels", *argv]), {})


def test_a_single_dash_flag_is_the_same_flag() -> None:
    """`-oneshot` is --oneshot (Go's flag package takes -name and --name alike), not `-o neshot`.
    (Until this fix argparse read it as --output-file "neshot".)"""
    s = parse("-oneshot", "-no-timestamp")
    assert (s.oneshot, s.no_timestamp, s.output_file) == (True, True, DEFAULT_OUTPUT_FILE)


def test_a_boolean_flag_takes_no_separate_value() -> None:
    """`--oneshot false` sets oneshot true, and "false" is a positional argument that ends the flags
    (Go's boolFlag; GFD's action ignores arguments); a notice says so. (Until this fix: "false".)"""
    s = parse("--oneshot", "false", "--mig-strategy", "mixed")
    assert (s.oneshot, s.mig_strategy) == (True, "none")
    assert len(s.notices) == 1 and '"false" "--mig-strategy" "mixed"' in s.notices[0]
    assert parse("--oneshot=false").oneshot is False


@pytest.mark.parametrize(("argv", "message"), [(("--one",), "flag --one: flag provided but not defined"),
                                               (("--output-file", "a", "-o", "b"), "two forms of the same flag")])  # fmt: skip
def test_flags_are_not_abbreviated_nor_given_twice(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No abbreviations (Go's FlagSet), and two spellings of one flag are an error (urfave/cli's
    normalizeFlags): exit 78 with one line. (Until this fix argparse took `--one` for --oneshot.)"""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 78
    err = capsys.readouterr().err
    assert err.startswith("gpuvisor labels: config error: ") and message in err and len(err.splitlines()) == 1


def test_the_longest_go_duration_is_a_sleep_interval_the_loop_can_wait_on() -> None:
    """`--sleep-interval 2562047h47m16.854775807s` (Go's largest Duration, time.go maxDuration) loads, and
    the loop waits on it until a signal instead of failing (Event.wait refuses waits that long)."""
    s = load({"sleep_interval": "2562047h47m16.854775807s", "simulate": "pcie-l4"})
    assert s.sleep_interval == pytest.approx(9223372036.854776)
    labeller = Labeller(s, lambda chosen: s)
    stopper = threading.Timer(0.2, lambda: labeller._on_stop(signal.SIGTERM, None))
    stopper.start()
    try:
        labeller.wait()
    finally:
        stopper.cancel()
    assert labeller._stop_signal == signal.SIGTERM


def test_every_gfd_file_key_is_a_field_of_nvidias_config() -> None:
    """Each GFD setting's file key names a plain field of NVIDIA's Config (api/config/v1/flags.go:59-115):
    nvidia.lookup of a misspelt key would quietly find nothing."""
    for setting in LABEL_SETTINGS:
        if setting.file_key is not None and not setting.gpuvisor:
            assert isinstance(leaf_at(setting.file_key), Leaf), setting.file_key


def test_named_configs_need_the_node_and_exclude_a_config_file(tmp_path: Path) -> None:
    """--config-file-srcdir (config-manager's input) needs NODE_NAME and refuses CONFIG_FILE beside
    it, as `gpuvisor run` does; the chosen config is then what the settings read."""
    (tmp_path / "ts4").write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
    )
    with pytest.raises(ConfigError, match="invalid <node-name>: must not be empty string"):
        load_label_settings({}, {"CONFIG_FILE_SRCDIR": str(tmp_path)})
    both = {"CONFIG_FILE_SRCDIR": str(tmp_path), "NODE_NAME": "n1", "CONFIG_FILE": str(tmp_path / "ts4")}
    with pytest.raises(ConfigError, match=r"--config-file \(CONFIG_FILE\) is set too"):
        load_label_settings({}, both)
    settings = load_label_settings(
        {}, {"CONFIG_FILE_SRCDIR": str(tmp_path), "NODE_NAME": "n1"}, str(tmp_path / "ts4")
    )
    assert settings.config_file == str(tmp_path / "ts4")
    assert settings.sharing.replicas == {"nvidia.com/gpu": 4}
