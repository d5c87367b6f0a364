"""The typed field readers `common.messages` decodes every payload with, and `_Flat`, the codec of
a kind whose fields are all flat: each reader names the field and says what was wrong with it.

Apart from the message kinds only so that the one module of the wire format stays a readable
size; nothing but `common.messages` imports them (the leading underscores say so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Self, TypeAlias

CONTROL_TOPIC = b"control"  # common.messages' topic of the control socket (here for its kinds' modules)

# What JSON can carry: the type of command arguments and replies (the status document).
Json: TypeAlias = "dict[str, Json] | list[Json] | str | int | float | bool | None"


class MessageError(ValueError):
    """A message could not be encoded or decoded; the text says why."""


# ---------------------------------------------------------------------------------------------
# Typed field readers: each names the field and says what was wrong with it.


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _require(obj: Mapping[str, Json], name: str, path: str) -> Json:
    if name not in obj:
        raise MessageError(f"missing field {_where(path, name)!r}")
    return obj[name]


def _str(obj: Mapping[str, Json], name: str, path: str = "") -> str:
    value = _require(obj, name, path)
    if not isinstance(value, str):
        raise MessageError(f"field {_where(path, name)!r} must be a string, not {type(value).__name__}")
    return value


def _bool(obj: Mapping[str, Json], name: str, path: str = "") -> bool:
    value = _require(obj, name, path)
    if not isinstance(value, bool):
        raise MessageError(f"field {_where(path, name)!r} must be a boolean, not {type(value).__name__}")
    return value


def _int(obj: Mapping[str, Json], name: str, path: str = "", minimum: int = 0) -> int:
    value = _require(obj, name, path)
    # bool is an int in Python; on the wire true is not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageError(f"field {_where(path, name)!r} must be an integer, not {type(value).__name__}")
    if value < minimum:
        raise MessageError(f"field {_where(path, name)!r} must be >= {minimum}, got {value}")
    return value


def _finite(value: Json, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MessageError(f"field {where!r} must be a number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise MessageError(f"field {where!r} must be a finite number, got {value!r}")
    return number


def _float(obj: Mapping[str, Json], name: str, path: str = "") -> float:
    return _finite(_require(obj, name, path), _where(path, name))


def _object(value: Json, where: str) -> dict[str, Json]:
    if not isinstance(value, dict):
        raise MessageError(f"{where} must be a JSON object, not {type(value).__name__}")
    return value


def _dict(obj: Mapping[str, Json], name: str, path: str = "") -> dict[str, Json]:
    return dict(_object(_require(obj, name, path), f"field {_where(path, name)!r}"))


def _number_dict(obj: Mapping[str, Json], name: str, path: str = "") -> dict[str, float]:
    raw = _dict(obj, name, path)
    return {key: _finite(value, f"{_where(path, name)}.{key}") for key, value in raw.items()}


def _list(obj: Mapping[str, Json], name: str, path: str = "") -> list[Json]:
    value = _require(obj, name, path)
    if not isinstance(value, list):
        raise MessageError(f"field {_where(path, name)!r} must be a list, not {type(value).__name__}")
    return value


def _only(obj: Mapping[str, Json], allowed: Iterable[str], path: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        where = f" in {path!r}" if path else ""
        raise MessageError(f"unexpected field(s) {', '.join(map(repr, extra))}{where}")


class _Flat:
    """The payload codec of a kind whose fields are all flat (str, int, bool, number maps):
    `_FIELDS` names each field with its reader, which also validates it; nothing else is needed."""

    _FIELDS: ClassVar[tuple[tuple[str, Callable[[Mapping[str, Json], str], object]], ...]] = ()

    def to_payload(self) -> dict[str, Json]:
        out: dict[str, Json] = {}
        for name, _ in self._FIELDS:
            value = getattr(self, name)
            out[name] = dict(value) if isinstance(value, dict) else value
        return out

    @classmethod
    def from_payload(cls, p: Mapping[str, Json]) -> Self:
        _only(p, (name for name, _ in cls._FIELDS), "payload")
        # Each reader checked its field's type; the dataclass fields declare the same types.
        values: dict[str, Any] = {name: read(p, name) for name, read in cls._FIELDS}
        return cls(**values)
