"""Typed values from the config file, as Go's encoding/json gives them to NVIDIA's structs.

NVIDIA's file goes YAML -> JSON -> Go structs. What a key accepts is therefore its Go type's
JSON rule, plus one twist of sigs.k8s.io/yaml: a number or boolean headed for a plain Go string
field is turned into its text first (`mpsRoot: 1.5` is "1.5"), but not for types with their own
decoder (resource names, device lists), which must be real strings. So `passDeviceSpecs: "true"`
is refused (a string is not a bool), `replicas: 2.0` is 2, `replicas: 2.5` is refused.

Each decoder takes a value from `yamlfile` (None is handled by the caller: for NVIDIA a null
leaves a pointer unset) and returns the typed value or raises Invalid. Strings and lists are
bounded here (limits.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from supervisor.config import golang
from supervisor.config.errors import Invalid, kind, show
from supervisor.config.limits import MAX_LIST_ITEMS, MAX_STRING_LENGTH

T = TypeVar("T")


def _bounded(text: str) -> str:
    if len(text) > MAX_STRING_LENGTH:
        raise Invalid(f"too long: {len(text)} characters, at most {MAX_STRING_LENGTH}")
    return text


def go_string(value: object, *, coerce: bool = True) -> str:
    """A JSON string into a Go string; with `coerce`, YAML numbers and booleans become their text."""
    if isinstance(value, str):
        return _bounded(value)
    if coerce:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            return golang.format_float32(value)
    raise Invalid(f"must be a string, not {kind(value)}")


def go_bool(value: object) -> bool:
    """A JSON boolean (YAML true/false/yes/no/on/off/y/n); a string such as "true" is refused."""
    if isinstance(value, bool):
        return value
    raise Invalid(f"must be a boolean (true or false), not {kind(value)} {show(value)}")


def go_int(value: object, *, unsigned: bool = False) -> int:
    """A JSON number into a Go int64 (or uint64): integral and in range; 2.0 counts, 2.5 does not."""
    number: int | None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float):
        number = golang.json_integer(value)
    else:
        number = None
    low, high = (0, golang.UINT64_MAX) if unsigned else (golang.INT64_MIN, golang.INT64_MAX)
    if number is None or not low <= number <= high:
        what = "a non-negative integer" if unsigned else "an integer"
        raise Invalid(
            f"must be {what}, not {show(value) if not isinstance(value, list | dict) else kind(value)}"
        )
    return number


def go_list(value: object) -> list[object]:
    """A JSON array (bounded in length)."""
    if not isinstance(value, list):
        raise Invalid(f"must be a list, not {kind(value)}")
    if len(value) > MAX_LIST_ITEMS:
        raise Invalid(f"too many items: {len(value)}, at most {MAX_LIST_ITEMS}")
    return value


def _items(value: object, decode: Callable[[object], T], zero: T) -> list[T]:
    out: list[T] = []
    for i, item in enumerate(go_list(value)):
        try:
            out.append(zero if item is None else decode(item))
        except Invalid as exc:
            raise Invalid(exc.reason, f"[{i}]{exc.at}") from None
    return out


def go_string_list(value: object) -> list[str]:
    """A JSON array into []string: a null item is "" (Go's zero value), other non-strings are refused."""
    return _items(value, lambda item: go_string(item, coerce=False), "")


def go_int_list(value: object) -> list[int]:
    """A JSON array into []int: a null item is 0 (Go's zero value)."""
    return _items(value, go_int, 0)


def string_or_list(value: object) -> list[str]:
    """NVIDIA's deviceListStrategy: one string (taken whole, commas included) or a list of strings."""
    if isinstance(value, str):
        return [_bounded(value)]
    if isinstance(value, list):
        return go_string_list(value)
    raise Invalid(f"must be a string or a list of strings, not {kind(value)}")


def go_duration(value: object) -> object:
    """NVIDIA's Duration (flags.gfd.sleepInterval): a number of nanoseconds, "infinite", or a Go duration."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise Invalid("invalid duration: use a number of nanoseconds or a duration such as 60s")
    if isinstance(value, str) and value != "infinite":
        try:
            golang.parse_duration(value)
        except ValueError as exc:
            raise Invalid(f"{exc}: use a duration such as 60s, 1m30s or infinite") from None
    return value
