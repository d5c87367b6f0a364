"""`gpuvisor run`'s command line, read the way NVIDIA's binary reads its own.

NVIDIA's plugin parses flags with Go's `flag` package under urfave/cli v2, whose rules differ
from argparse's, and an operator's DaemonSet args must mean the same to gpuvisor:

- `-name` and `--name` are the same flag; a value follows as `--name=value` or `--name value`
  (even one that starts with '-'); no abbreviations;
- a boolean flag takes no separate value: `--pass-device-specs false` sets it true, and "false"
  is a positional argument;
- the first positional argument (or `--`) ends the flags: it and everything after it are
  ignored, as NVIDIA's action ignores them (gpuvisor says so in a notice); `help` or `h` there
  prints the help;
- an undefined flag, a missing value, a bad boolean or integer, or two spellings of one flag
  (`--driver-root` and `--nvidia-driver-root`) is an error; a repeated list flag appends;
- `-h`/`--help` and `-v`/`--version` are urfave/cli's own flags.

`RunArgumentParser` is the argparse parser of the `run` command: `add_run_arguments` declares
every setting on it (so `--help` lists them) and switches its parsing to these rules. Parse
errors exit with EXIT_CONFIG_ERROR and one line, like every other config error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import golang
from common.config.errors import EXIT_CONFIG_ERROR, ConfigError, Invalid, show
from common.config.limits import MAX_STRING_LENGTH
from common.config.settings import SETTINGS, SETTINGS_BY_FLAG, Setting

HELP_FLAGS = ("help", "h")
VERSION_FLAGS = ("version", "v")
FLAG_FORMS = "flag_forms"  # Namespace attribute: setting name -> the flag as it was written
IGNORED_ARGS = "ignored_args"  # Namespace attribute: the arguments NVIDIA's parser would ignore


@dataclass
class GoFlags:
    """What the command line set: typed values by setting name, and how each flag was written."""

    values: dict[str, Any] = field(default_factory=dict)
    forms: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    help: bool = False
    version: bool = False


def split_list(text: str) -> list[str]:
    """urfave/cli's slice flags: split on commas, trim each item, keep empty ones."""
    return [golang.trim_space(item) for item in text.split(",")]


def decode_text(setting: Setting, raw: Any) -> Any:
    """A flag or env value (text, or already typed by parse_go_flags) as the setting's Go type."""
    if setting.gpuvisor and setting.kind != "bool":
        return raw
    if setting.kind == "bool":
        if isinstance(raw, bool):
            return raw
        try:
            return golang.parse_bool(str(raw))
        except ValueError:
            if setting.gpuvisor:
                return raw  # its own check words the error
            raise Invalid(f"invalid boolean {show(raw)}: use true or false") from None
    texts = raw if isinstance(raw, list | tuple) else [raw]
    if setting.kind == "string":
        text = str(texts[-1])
        if len(text) > MAX_STRING_LENGTH:
            raise Invalid(f"too long: {len(text)} characters, at most {MAX_STRING_LENGTH}")
        return text
    items = [item for text in texts for item in (split_list(text) if isinstance(text, str) else [text])]
    if setting.kind == "strings":
        for item in items:
            if len(item) > MAX_STRING_LENGTH:
                raise Invalid(f"too long: {len(item)} characters, at most {MAX_STRING_LENGTH}")
        return [str(item) for item in items]
    numbers = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            numbers.append(item)
            continue
        try:
            numbers.append(golang.parse_int(str(item), 0, 64))
        except ValueError:
            raise Invalid(f"invalid integer {show(item)} in {show(','.join(map(str, items)))}") from None
    return numbers


def parse_go_flags(argv: Sequence[str]) -> GoFlags:
    """Go's FlagSet.Parse under urfave/cli v2, over gpuvisor's settings; raises ConfigError."""
    out = GoFlags()
    args = list(argv)
    while args:
        arg = args[0]
        if len(arg) < 2 or arg[0] != "-":
            break  # a positional argument: the flags end here
        dashes = 2 if arg[1] == "-" else 1
        if arg == "--":
            args.pop(0)
            break
        name = arg[dashes:]
        if not name or name[0] in "-=":
            raise ConfigError(f"flag {arg}", "", "bad flag syntax")
        args.pop(0)
        value: str | None = None
        if "=" in name[1:]:
            name, value = name.split("=", 1)
        form = "-" * dashes + name
        if name in HELP_FLAGS or name in VERSION_FLAGS:
            try:
                wanted = golang.parse_bool(value) if value is not None else True
            except ValueError:
                raise ConfigError(f"flag {form}", "", f"invalid boolean value {show(value)}") from None
            if name in HELP_FLAGS:
                out.help = wanted
            else:
                out.version = wanted
            continue
        setting = SETTINGS_BY_FLAG.get(name)
        if setting is None:
            raise ConfigError(f"flag {form}", "", "flag provided but not defined")
        earlier = out.forms.get(setting.name)
        if earlier is not None and earlier.lstrip("-") != name:
            raise ConfigError(f"flag {form}", "", f"cannot use two forms of the same flag: {earlier} and {form}")
        out.forms[setting.name] = form
        try:
            if setting.kind == "bool":
                out.values[setting.name] = decode_text(setting, "true" if value is None else value)
                continue
            if value is None:
                if not args:
                    raise ConfigError(f"flag {form}", "", "flag needs an argument")
                value = args.pop(0)
            if setting.kind in ("strings", "ints"):
                out.values.setdefault(setting.name, []).extend(decode_text(setting, value))
            else:
                out.values[setting.name] = decode_text(setting, value)
        except Invalid as exc:
            raise ConfigError(f"flag {form}", "", exc.reason) from None
    if args and args[0] in HELP_FLAGS:  # urfave/cli's `help` command
        out.help = True
    out.ignored = args
    return out


class RunArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose `add_run_arguments` parser reads NVIDIA's flag syntax.

    Until `add_run_arguments` is called on it, it is a plain ArgumentParser (the other
    subcommands of `gpuvisor` keep argparse's rules).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go_flags = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if not self.go_flags:
            return super().parse_known_args(args, namespace)
        namespace = namespace if namespace is not None else argparse.Namespace()
        try:
            flags = parse_go_flags(sys.argv[1:] if args is None else args)
        except ConfigError as exc:
            self.exit(EXIT_CONFIG_ERROR, f"gpuvisor: {exc}\n")
        if flags.help:
            self.print_help()
            self.exit(0)
        if flags.version:
            self.exit(0, f"gpuvisor {importlib.metadata.version('gpuvisor')}\n")
        for setting in SETTINGS:
            if setting.flags:
                setattr(namespace, setting.name, flags.values.get(setting.name))
        setattr(namespace, FLAG_FORMS, flags.forms)
        setattr(namespace, IGNORED_ARGS, flags.ignored)
        return namespace, []


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every setting that has a flag on `parser` (a RunArgumentParser: `gpuvisor run`).

    The declarations give `--help` its text; parsing follows NVIDIA's rules (see the module
    docstring), and every value reaches `load_config` for checking.
    """
    if not isinstance(parser, RunArgumentParser):
        raise TypeError("add_run_arguments needs a RunArgumentParser: `gpuvisor run` reads NVIDIA's flag syntax")
    parser.go_flags = True
    groups = {
        False: parser.add_argument_group("NVIDIA device plugin options (Go flag syntax: --flag=value or --flag value)"),
        True: parser.add_argument_group("gpuvisor options"),
    }
    for setting in SETTINGS:
        if not setting.flags:
            continue
        help_text = setting.help
        if setting.choices:
            help_text += f" One of: {', '.join(setting.choices)}."
        if setting.kind == "bool":
            help_text += " A boolean: --flag, or --flag=false (never a separate value)."
        elif setting.kind in ("strings", "ints"):
            help_text += " A comma list; may repeat."
        env = f"env {', '.join(setting.envs)}; " if setting.envs else ""
        help_text += f" ({env}default {setting.default_text()})"
        kwargs: dict[str, Any] = {"dest": setting.name, "default": None, "help": help_text.replace("%", "%%")}
        if setting.kind == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = "{" + ",".join(setting.choices) + "}" if setting.choices else "VALUE"
        groups[setting.gpuvisor].add_argument(*setting.flags, **kwargs)
