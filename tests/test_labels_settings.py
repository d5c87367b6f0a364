"""`gpuvisor labels` settings: GFD's names, defaults and precedence (flag > env > config file > default).

NVIDIA's source for each: cmd/gpu-feature-discovery/main.go:51-119 (flags, env names, defaults),
internal/flags/kubeclient.go:42-67 and node.go:30-52, api/config/v1/flags.go:101-170 (the file
keys and `c.IsSet` precedence), api/config/v1/duration.go (durations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError
from supervisor.labels.settings import (
    DEFAULT_MACHINE_TYPE_FILE,
    DEFAULT_OUTPUT_FILE,
    load_label_settings,
    parse_go_duration,
    settings_markdown,
)


def load(flags: dict[str, Any] | None = None, env: dict[str, str] | None = None, config: str | None = None, tmp: Path | None = None) -> Any:
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
    assert (s.kube_api_qps, s.kube_api_burst, s.namespace, s.node_name, s.pod_name, s.kubeconfig) == (5.0, 10, "default", "", "", "")


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
    assert (s.mig_strategy, s.sleep_interval, s.no_timestamp, s.output_file) == ("mixed", 300.0, True, "/x/gfd")
    s = load(env={"MIG_STRATEGY": "single", "GFD_SLEEP_INTERVAL": "2s"}, config=config, tmp=tmp_path)
    assert (s.mig_strategy, s.sleep_interval) == ("single", 2.0)
    s = load({"mig_strategy": "none", "sleep_interval": "infinite"}, {"MIG_STRATEGY": "single"}, config, tmp_path)
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


def test_empty_env_is_unset_except_where_gfd_gives_empty_a_meaning() -> None:
    """MIG_STRATEGY="" is unset (gpuvisor's rule); GFD_OUTPUT_FILE="" means stdout and
    GFD_MACHINE_TYPE_FILE="" means "unknown", as in GFD (output.go:74, machine-type.go:45)."""
    s = load(env={"MIG_STRATEGY": "", "GFD_OUTPUT_FILE": "", "GFD_MACHINE_TYPE_FILE": ""})
    assert (s.mig_strategy, s.output_file, s.machine_type_file) == ("none", "", "")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60.0), ("1m30s", 90.0), ("1.5h", 5400.0), ("2h45m", 9900.0), ("1500ms", 1.5), ("0", 0.0),
     ("3000000us", 3.0), ("+10s", 10.0), ("-1s", -1.0)],
)  # fmt: skip
def test_go_durations(text: str, seconds: float) -> None:
    """Durations read as Go's time.ParseDuration reads them (duration.go:61-71)."""
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "1x", "s", "1m 30s", "1..5s"])
def test_bad_go_durations(text: str) -> None:
    """Anything ParseDuration refuses is refused, with the flag named."""
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
    assert (s.sharing.strategy, s.sharing.rename_by_default, dict(s.sharing.replicas)) == ("mps", True, {"nvidia.com/gpu": 2})


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ("version: v2\n", "version"),
        ("flags: {migStrategy: 5}\n", "flags.migStrategy"),
        ("flags: {gfd: {oneshot: sometimes}}\n", "flags.gfd.oneshot"),
        ("flags: {gfd: [1]}\n", "flags.gfd.oneshot"),
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
    s = load(env={"KUBECONFIG": "/k", "KUBE_API_QPS": "-1", "KUBE_API_BURST": "3", "NODE_NAME": "n1", "NAMESPACE": "gpu", "POD_NAME": "p"})
    assert (s.kubeconfig, s.kube_api_qps, s.kube_api_burst, s.node_name, s.namespace, s.pod_name) == ("/k", -1.0, 3, "n1", "gpu", "p")
    with pytest.raises(ConfigError, match="env KUBE_API_BURST"):
        load(env={"KUBE_API_BURST": "2.5"})


@pytest.mark.parametrize("strategy", ["tegra", "vfio"])
def test_gfd_only_discovery_strategies_are_refused_clearly(strategy: str) -> None:
    """tegra and vfio are valid to GFD (main.go:132-142) but not implemented here: a clear refusal."""
    with pytest.raises(ConfigError, match="does not implement"):
        load({"device_discovery_strategy": strategy})
    with pytest.raises(ConfigError, match="must be one of auto, nvml, tegra, vfio"):
        load({"device_discovery_strategy": "cuda"})


def test_readme_table_is_current() -> None:
    """The README's "Node labels" settings table is the one generated from the declarations."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- label-settings:start -->\n", "<!-- label-settings:end -->"
    assert start in readme and end in readme
    assert readme.split(start, 1)[1].split(end, 1)[0] == settings_markdown()
