"""Which of the named configs a node runs: NVIDIA's config-manager rules, as a pure function.

NVIDIA's chart mounts a ConfigMap of named config files and runs `config-manager`
(cmd/config-manager/main.go, v0.20.0) beside the plugin: it watches the node's label
(`nvidia.com/device-plugin.config` by default), picks a file and sends the plugin SIGHUP.
gpuvisor takes the same inputs (`--config-file-srcdir`, `--node-label`, `--default-config`,
`--fallback-strategies`) and makes the same choice itself (updateConfigName, main.go:335-393):

- the names are the directory's entries that are not directories and do not start with ".."
  (a ConfigMap volume's `..data` machinery); none at all is an error, whatever else is set;
- a label value names the config, which must exist;
- no label (or an empty one): `--default-config` when set, which must exist;
- else the fallback strategies in order: `named` (a config called `default`), `single` (the
  only config), `empty` (no config file: defaults, flags and env vars only); an unknown strategy
  is an error when it is reached, and none succeeding is an error.

Where NVIDIA's config-manager fails (it exits and its sidecar restarts), gpuvisor refuses the
choice and keeps the config it runs (supervisor/desired/replan.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from supervisor.config.limits import MAX_LIST_ITEMS

DEFAULT_NODE_LABEL: Final = "nvidia.com/device-plugin.config"
NAMED_FALLBACK: Final = "default"  # config-manager's NamedConfigFallback
FALLBACK_STRATEGIES: Final = ("named", "single", "empty")

# Where a chosen config came from: the metric's `source` label and status's word.
SOURCE_LABEL: Final = "label"
SOURCE_DEFAULT: Final = "default"
SOURCE_FILE: Final = "file"  # --config-file, no named configs
SOURCE_NONE: Final = "none"  # no config file at all


class ChoiceError(ValueError):
    """No config can be chosen; the text says why, in config-manager's words where it has them."""


@dataclass(frozen=True)
class Choice:
    name: str  # the config's name ("" for the empty config)
    path: str  # its file ("" for the empty config)
    source: str  # label, default, fallback-named, fallback-single, fallback-empty

    def describe(self, node_label: str = DEFAULT_NODE_LABEL) -> str:
        what = f"config {self.name!r}" if self.name else "the empty config"
        return {
            SOURCE_LABEL: f"{what}, named by the node label {node_label}",
            SOURCE_DEFAULT: f"{what}, the default (no node label)",
        }.get(
            self.source,
            f"{what}, by the fallback {self.source.removeprefix('fallback-')!r} (no node label, no default)",
        )


def input_problem(*, srcdir: str, node_name: str, node_label: str, config_file: str) -> str | None:
    """Why config-manager's inputs cannot be used (its validateFlags, main.go:228-242, for what
    gpuvisor takes from it), or None; both `gpuvisor run` and `gpuvisor labels` check them."""
    if not srcdir:
        return None
    if not node_name:
        return (
            "invalid <node-name>: must not be empty string: set NODE_NAME "
            "(the downward API's spec.nodeName) or --node-name, the Node whose label chooses the config"
        )
    if not node_label:
        return "invalid <node-label>: must not be empty string"
    if config_file:
        return (
            "--config-file (CONFIG_FILE) is set too: the node label "
            "chooses the config file from the directory, so set one or the other"
        )
    return None


def config_names(srcdir: str) -> list[str]:
    """The configs in `srcdir`, sorted (config-manager's getConfigFileNameMap). Raises ChoiceError."""
    names = []
    try:
        with os.scandir(srcdir) as entries:
            for entry in entries:
                # A ConfigMap's keys are symlinks into ..data: is_dir() without following them,
                # as Go's DirEntry.IsDir() looks at the entry itself.
                if not entry.name.startswith("..") and not entry.is_dir(follow_symlinks=False):
                    names.append(entry.name)
                    if len(names) > MAX_LIST_ITEMS:
                        raise ChoiceError(f"{srcdir} holds more than {MAX_LIST_ITEMS} configs")
    except OSError as exc:
        raise ChoiceError(
            f"error getting list of configuration files: error reading directory {srcdir}: {exc.strerror or exc}"
        ) from None
    return sorted(names)


def choose_config(srcdir: str, label: str, default: str, fallbacks: Sequence[str]) -> Choice:
    """The config a node with this label value runs ("" for no label). Raises ChoiceError."""
    names = config_names(srcdir)
    if not names:
        raise ChoiceError(f"no configuration files available in {srcdir}")

    def pick(name: str, source: str) -> Choice:
        return Choice(name, os.path.join(srcdir, name), source)

    if label:
        if label not in names:
            raise ChoiceError(f"specified config {label} does not exist (configs: {', '.join(names)})")
        return pick(label, SOURCE_LABEL)
    if default:
        if default not in names:
            raise ChoiceError(
                f"specified config {default} (the default config) does not exist (configs: {', '.join(names)})"
            )
        return pick(default, SOURCE_DEFAULT)
    for strategy in fallbacks:
        if strategy == "named" and NAMED_FALLBACK in names:
            return pick(NAMED_FALLBACK, "fallback-named")
        if strategy == "single" and len(names) == 1:
            return pick(names[0], "fallback-single")
        if strategy == "empty":
            return Choice("", "", "fallback-empty")
        if strategy not in FALLBACK_STRATEGIES:
            raise ChoiceError(f"unknown fallback strategy: {strategy}")
    raise ChoiceError(
        "no config was set, no default was provided, and all fallbacks failed "
        f"(fallbacks: [{', '.join(fallbacks)}]; configs: {', '.join(names)})"
    )
