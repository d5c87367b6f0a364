"""The config error every bad input becomes, and the helpers that word its reasons.

A bad flag, env var or file key is one `ConfigError` naming where it came from, the key and why:
`config error: <source>: <key>: <reason>`. The CLI prints it on one line and exits with
`EXIT_CONFIG_ERROR` (78, EX_CONFIG from sysexits.h); a reload logs it and keeps the running config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from common.exitcodes import EXIT_CONFIG_ERROR

__all__ = ["EXIT_CONFIG_ERROR", "ConfigError"]


class ConfigError(Exception):
    """A bad setting: where it came from, which key, and why it is wrong."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        super().__init__(source, key, reason)
        self.source = source  # a file path, "flag --x" or "env VAR"
        self.key = key  # e.g. "sharing.timeSlicing.resources[0].replicas"; "" for flags/env
        self.reason = reason

    def __str__(self) -> str:
        parts = ["config error", self.source]
        if self.key:
            parts.append(self.key)
        parts.append(self.reason)
        return ": ".join(parts)


class Invalid(ValueError):
    """Raised by value parsers; the loader wraps it into a ConfigError with source and key.

    `at` extends the key for a problem inside the value, e.g. "[2]" or "[0].name".
    """

    def __init__(self, reason: str, at: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.at = at


def show(value: object) -> str:
    """A value as an error message quotes it: strings in JSON quotes, shortened past 80 characters."""
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def kind(value: object) -> str:
    """What a value from the file is, in words ("a string", "a list", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__
