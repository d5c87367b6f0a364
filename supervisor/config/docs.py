"""The settings tables of docs/, generated from the declarations (`python -m supervisor.config --markdown`).

`gpuvisor run`'s table (docs/configuration.md) comes from `SETTINGS`; `gpuvisor labels` passes its
own rows and notes (docs/node-labels.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from supervisor.config.settings import SETTINGS, Setting

RUN_NOTES = (
    "Precedence: flag > env var > config file > default. Flags follow Go's syntax, as NVIDIA's: a boolean "
    "flag takes no separate value (`--pass-device-specs=false`, not `--pass-device-specs false`), and "
    "arguments from the first non-flag one on are ignored. Only in the config file: `resources.gpus`, "
    "`resources.mig`, `sharing.timeSlicing` / `sharing.mps`, and `gpuvisor.health` "
    '(`xids: {"<xid>": ignore|transient|until-reset}`, `transientQuietSeconds`).'
)


def settings_markdown(settings: Sequence[Setting] = SETTINGS, notes: str = RUN_NOTES) -> str:
    """A settings table for docs/ (`gpuvisor run`'s by default), then `notes` as a paragraph."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| Flag | Env var | Config file key | Default | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in settings:
        flags = ", ".join(f"`{f}`" for f in s.flags) or "—"
        envs = ", ".join(f"`{e}`" for e in s.envs) or "—"
        key = f"`{s.file_key}`" if s.file_key else "—"
        default = s.default_text()
        default = default if default.startswith("(") or " " in default else f"`{default}`"
        description = s.help + (f" One of: {', '.join(f'`{c}`' for c in s.choices)}." if s.choices else "")
        lines.append(f"| {flags} | {envs} | {key} | {cell(default)} | {cell(description)} |")
    lines.append("")
    lines.append(notes)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.config", description="gpuvisor configuration")
    parser.add_argument("--markdown", action="store_true", help="print the settings table as Markdown")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    parser.print_help()
    return 0
