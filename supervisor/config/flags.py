"""`gpuvisor run`'s and `gpuvisor labels`' command lines, read the way NVIDIA's binaries read theirs.

NVIDIA's plugin and its GPU Feature Discovery parse flags with Go's `flag` package under
urfave/cli v2 (the same go.mod), whose rules differ from argparse's, and an operator's DaemonSet
args must mean the same to gpuvisor:

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

`RunArgumentParser` is the argparse parser of those commands: `add_go_arguments` declares a
command's settings on it (so `--help` lists them) and switches its parsing to these rules over
them (`add_run_arguments` for `run`'s). Parse errors exit with EXIT_CONFIG_ERROR and one line,
like every other config error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import golang
from supervisor.config.errors import EXIT_CONFIG_ERROR, ConfigError, Invalid, show
from supervisor.config.limits import MAX_STRING_LENGTH
from supervisor.config.settings import SETTINGS, SETTINGS_BY_FLAG, Setting, flag_table

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
    if setting.kind in ("string", "duration"):
        text = str(texts[-1])
        if len(text) > MAX_STRING_LENGTH:
            raise Invalid(f"too long: {len(text)} characters, at most {MAX_STRING_LENGTH}")
        return text
    if setting.kind in ("int", "float"):
        return _number(setting.kind, texts[-1])
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


def _number(kind_: str, raw: object) -> int | float:
    """An IntFlag's value (strconv.ParseInt(s, 0, 64)) or a Float64Flag's (strconv.ParseFloat)."""
    if kind_ == "int" and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind_ == "float" and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    try:
        return golang.parse_int(str(raw), 0, 64) if kind_ == "int" else golang.parse_float(str(raw))
    except ValueError:
        what = (
            "an integer (Go syntax: 16, 0x10, -1)" if kind_ == "int" else "a number (Go syntax: 5, 2.5, 1e3)"
        )
        raise Invalid(f"invalid value {show(str(raw))}: must be {what}") from None


def parse_go_flags(argv: Sequence[str], table: Mapping[str, Setting] = SETTINGS_BY_FLAG) -> GoFlags:
    """Go's FlagSet.Parse under urfave/cli v2, over the settings of `table` (`flag_table`: flag
    names without dashes; `gpuvisor run`'s by default); raises ConfigError."""
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
        setting = table.get(name)
        if setting is None:
            raise ConfigError(f"flag {form}", "", "flag provided but not defined")
        earlier = out.forms.get(setting.name)
        if earlier is not None and earlier.lstrip("-") != name:
            raise ConfigError(
                f"flag {form}", "", f"cannot use two forms of the same flag: {earlier} and {form}"
            )
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


def installed_version() -> str:
    """gpuvisor's version, for every --version (supervisor/config/version.py, which the installed package's
    metadata is built from)."""
    from supervisor.config.version import VERSION

    return VERSION


class RunArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reads NVIDIA's flag syntax once `add_go_arguments` gave it settings.

    Until then it is a plain ArgumentParser (the other subcommands of `gpuvisor` keep argparse's
    rules). `gpuvisor run` (`add_run_arguments`) and `gpuvisor labels` (GFD's flags, under the
    same urfave/cli) use it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go_settings: tuple[Setting, ...] = ()  # empty: argparse's own rules
        self.go_table: Mapping[str, Setting] = {}
        self.error_prefix = "gpuvisor"  # what a one-line flag error starts with
        self.version_format = "gpuvisor {version}"  # what --version prints

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if not self.go_settings:
            return super().parse_known_args(args, namespace)
        namespace = namespace if namespace is not None else argparse.Namespace()
        try:
            flags = parse_go_flags(sys.argv[1:] if args is None else args, self.go_table)
        except ConfigError as exc:
            self.exit(EXIT_CONFIG_ERROR, f"{self.error_prefix}: {exc}\n")
        if flags.help:
            self.print_help()
            self.exit(0)
        if flags.version:  # on stdout, as urfave/cli prints it (argparse's exit() writes stderr)
            print(self.version_format.format(version=installed_version()))
            self.exit(0)
        for setting in self.go_settings:
            if setting.flags:
                setattr(namespace, setting.name, flags.values.get(setting.name))
        setattr(namespace, FLAG_FORMS, flags.forms)
        setattr(namespace, IGNORED_ARGS, flags.ignored)
        return namespace, []


def add_go_arguments(
    parser: argparse.ArgumentParser,
    settings: Sequence[Setting],
    *,
    groups: Mapping[bool, str],
    error_prefix: str,
    version_format: str,
) -> None:
    """Declare every setting of `settings` that has a flag on `parser` (a RunArgumentParser) and
    switch its parsing to Go's flag syntax over them.

    The declarations give `--help` its text (`groups`: the group title of NVIDIA's settings,
    False, and of gpuvisor's own, True); parsing follows the module docstring's rules, and every
    value reaches the loader for checking.
    """
    if not isinstance(parser, RunArgumentParser):
        raise TypeError("add_go_arguments needs a RunArgumentParser: the command reads NVIDIA's flag syntax")
    parser.go_settings = tuple(settings)
    parser.go_table = flag_table(settings)
    parser.error_prefix = error_prefix
    parser.version_format = version_format
    titled = {own: parser.add_argument_group(title) for own, title in groups.items()}
    for setting in settings:
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
        titled[setting.gpuvisor].add_argument(*setting.flags, **kwargs)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `gpuvisor run`'s settings on `parser` (a RunArgumentParser), in NVIDIA's flag syntax."""
    add_go_arguments(
        parser,
        SETTINGS,
        groups={
            False: "NVIDIA device plugin options (Go flag syntax: --flag=value or --flag value)",
            True: "gpuvisor options",
        },
        error_prefix="gpuvisor",
        version_format="gpuvisor {version}",
    )
