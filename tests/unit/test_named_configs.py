"""The node's config chosen by its label: NVIDIA's config-manager rules (supervisor/config/named.py)
and the settings that turn it on (`--config-file-srcdir` and friends).

Each case of `test_the_choice_follows_config_manager` is a branch of config-manager's
updateConfigName (cmd/config-manager/main.go:335-393, v0.20.0), named in its id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ConfigError, load_config
from supervisor.config.named import Choice, ChoiceError, choose_config, config_names
from supervisor.labels.nodeconfig import NodeConfig
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"


def configs(tmp_path: Path, *names: str) -> str:
    directory = tmp_path / "configs"
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text("version: v1\n")
    return str(directory)


def test_names_are_the_files_not_the_configmap_machinery(tmp_path: Path) -> None:
    """A ConfigMap volume: keys are symlinks into ..data (counted), `..data` and the timestamped
    dir are not, nor is any directory (getConfigFileNameMap)."""
    directory = tmp_path / "cm"
    data = directory / "..2026_11_20_10_00_00.123"
    data.mkdir(parents=True)
    (data / "a").write_text("version: v1\n")
    (data / "b").write_text("version: v1\n")
    os.symlink("..2026_11_20_10_00_00.123", directory / "..data")
    for key in ("a", "b"):
        os.symlink(f"..data/{key}", directory / key)
    (directory / "subdir").mkdir()
    (directory / ".hidden").write_text("")
    assert config_names(str(directory)) == [".hidden", "a", "b"]


@pytest.mark.parametrize(
    ("names", "label", "default", "fallbacks", "want"),
    [
        (["a", "b"], "b", "a", ["named"], Choice("b", "b", "label")),
        (["a", "b"], "", "a", ["named"], Choice("a", "a", "default")),
        (["default", "b"], "", "", ["named", "single"], Choice("default", "default", "fallback-named")),
        (["only"], "", "", ["named", "single"], Choice("only", "only", "fallback-single")),
        (["a", "b"], "", "", ["named", "single", "empty"], Choice("", "", "fallback-empty")),
        (["a", "b"], "", "", ["empty", "bogus"], Choice("", "", "fallback-empty")),
    ],
    ids=["label names a config", "no label: the default", "fallback named", "fallback single",
         "fallback empty after two that fail", "an unknown strategy after one that succeeds is never reached"],
)  # fmt: skip
def test_the_choice_follows_config_manager(
    tmp_path: Path, names: list[str], label: str, default: str, fallbacks: list[str], want: Choice
) -> None:
    """Label, then default, then each fallback in order."""
    srcdir = configs(tmp_path, *names)
    got = choose_config(srcdir, label, default, fallbacks)
    path = os.path.join(srcdir, want.path) if want.path else ""
    assert got == Choice(want.name, path, want.source)


@pytest.mark.parametrize(
    ("names", "label", "default", "fallbacks", "error"),
    [
        ([], "a", "", [], "no configuration files available"),
        (["a"], "missing", "a", [], "specified config missing does not exist"),
        (["a"], "", "missing", [], "specified config missing (the default config) does not exist"),
        (["a", "b"], "", "", ["bogus"], "unknown fallback strategy: bogus"),
        (["a", "b"], "", "", ["named", "single"], "no config was set, no default was provided, and all fallbacks failed"),
        (["a", "b"], "", "", [""], "unknown fallback strategy: "),
    ],
    ids=["no configs at all, even with a label", "a label naming no config", "a default naming no config",
         "an unknown strategy reached", "every fallback fails", "FALLBACK_STRATEGIES= is one empty strategy"],
)  # fmt: skip
def test_where_config_manager_fails_the_choice_is_refused(
    tmp_path: Path, names: list[str], label: str, default: str, fallbacks: list[str], error: str
) -> None:
    """Each of config-manager's errors is a ChoiceError with its words."""
    with pytest.raises(ChoiceError, match=error.replace("(", r"\(").replace(")", r"\)")):
        choose_config(configs(tmp_path, *names), label, default, fallbacks)


def test_an_unreadable_directory_is_a_choice_error(tmp_path: Path) -> None:
    """A directory that does not exist: config-manager's "error reading directory", with the path."""
    with pytest.raises(ChoiceError, match=f"error reading directory {tmp_path / 'none'}"):
        choose_config(str(tmp_path / "none"), "", "", ["empty"])


# --- the settings and load_config ---------------------------------------------------------------


def env_for(srcdir: str, **extra: str) -> dict[str, str]:
    return {"CONFIG_FILE_SRCDIR": srcdir, "NODE_NAME": "gpu-1", **extra}


def test_load_config_reads_the_chosen_file_and_says_which(tmp_path: Path) -> None:
    """The label's config is read; its name, path and source are in the Config."""
    srcdir = configs(tmp_path, "default")
    Path(srcdir, "ts4").write_text(TS4)
    config = load_config(None, env_for(srcdir, DEFAULT_CONFIG="default"), node_label="ts4")
    assert (config.config_name, config.config_source) == ("ts4", "label")
    assert config.config_file == os.path.join(srcdir, "ts4")
    assert config.sharing.strategy == "time-slicing"
    plain = load_config(None, env_for(srcdir, DEFAULT_CONFIG="default"), node_label="")
    assert (plain.config_name, plain.config_source, plain.sharing.strategy) == ("default", "default", "none")


def test_before_the_label_is_read_a_failed_choice_waits_for_it(tmp_path: Path) -> None:
    """Label unknown (None) and no default or fallback works: a config with no file that says why
    (nothing is planned until the label comes); with the label read, the same failure is a ConfigError."""
    srcdir = configs(tmp_path, "a", "b")
    waiting = load_config(None, env_for(srcdir, FALLBACK_STRATEGIES="named,single"))
    assert waiting.awaiting_label.startswith("no config was set") and waiting.config_file == ""
    with pytest.raises(ConfigError, match=rf"{srcdir} \(no node label\): no config was set"):
        load_config(None, env_for(srcdir, FALLBACK_STRATEGIES="named,single"), node_label="")
    with pytest.raises(
        ConfigError, match=r"node label nvidia\.com/device-plugin\.config=c: specified config c"
    ):
        load_config(None, env_for(srcdir), node_label="c")


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"CONFIG_FILE_SRCDIR": "/x"}, "invalid <node-name>: must not be empty string"),
        ({"CONFIG_FILE_SRCDIR": "/x", "NODE_NAME": "n", "NODE_LABEL": ""}, "invalid <node-label>: must not be empty"),
        ({"CONFIG_FILE_SRCDIR": "/x", "NODE_NAME": "n", "CONFIG_FILE": "/c.yaml"}, "--config-file .* is set too"),
        ({"GPUVISOR_NODE_HEALTH": "true"}, "--node-health: needs the node name"),
    ],
    ids=["srcdir without a node name", "an empty label name", "both a config file and named configs",
         "node health without a node name"],
)  # fmt: skip
def test_settings_that_cannot_work_are_config_errors(env: dict[str, str], error: str) -> None:
    """config-manager's validateFlags, and gpuvisor's own: refused at start with the reason (exit 78)."""
    with pytest.raises(ConfigError, match=error):
        load_config(None, env)


def test_config_manager_env_vars_are_read_with_urfave_rules(tmp_path: Path) -> None:
    """FALLBACK_STRATEGIES is a comma list (items trimmed), NODE_LABEL defaults to config-manager's."""
    srcdir = configs(tmp_path, "only")
    config = load_config(None, env_for(srcdir, FALLBACK_STRATEGIES=" named , single "))
    assert config.fallback_strategies == ("named", "single")
    assert (config.config_name, config.config_source) == ("only", "fallback-single")
    assert config.node_label == "nvidia.com/device-plugin.config"
    assert config.node_health is False and config.kubeconfig == ""


def node_watch(api: RunningApiServer, tmp_path: Path, **kw: Any) -> NodeConfig:
    """The labeller's watch of Node gpu-node-1's config label, on the fake API server (not started)."""
    return NodeConfig(
        node_name="gpu-node-1",
        node_label="nvidia.com/device-plugin.config",
        srcdir=configs(tmp_path, "a"),
        default="a",
        fallbacks=("named",),
        kubeconfig=str(api.kubeconfig),
        environ={},
        on_change=lambda: None,
        **kw,
    )


def test_the_labellers_node_watch_is_rate_limited_by_its_flags(api: RunningApiServer, tmp_path: Path) -> None:
    """`gpuvisor labels`' watch of its Node for the config label uses `--kube-api-qps` and
    `--kube-api-burst`, as its NodeFeature output does, not client-go's defaults."""
    api.state.add_node("gpu-node-1")
    watcher = node_watch(api, tmp_path, qps=2.5, burst=3)
    watcher.start()
    try:
        assert wait_until(watcher.seen.is_set)
        assert watcher._client is not None
        limiter = watcher._client.limiter
        assert (limiter.qps, limiter.burst) == (2.5, 3)
    finally:
        watcher.stop()


def test_the_labellers_node_watch_says_why_it_cannot_read_the_node(
    api: RunningApiServer, tmp_path: Path
) -> None:
    """With the API server away, the label watch's failure is what the labeller logs while it waits
    for its Node (`watch_error`), and it is empty again once the Node is read."""
    api.state.add_node("gpu-node-1")
    api.stop()
    watcher = node_watch(api, tmp_path)
    assert watcher.watch_error == ""
    watcher.start()
    try:
        assert wait_until(lambda: "no answer from the API server" in watcher.watch_error)
        assert not watcher.seen.is_set()
        api.start()
        assert wait_until(watcher.seen.is_set, 30)
        assert wait_until(lambda: watcher.watch_error == "")
    finally:
        watcher.stop()
