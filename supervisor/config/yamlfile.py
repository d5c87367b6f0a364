"""Reading the config file: YAML (or JSON) into plain data, as NVIDIA's plugin reads it.

NVIDIA reads its file with sigs.k8s.io/yaml, which parses YAML with go-yaml v2 and turns the
result into JSON before decoding it. Both steps decide what a plain scalar means, so gpuvisor
follows them rather than PyYAML's YAML 1.1 defaults:

- plain scalars resolve by go-yaml v2's rules (`resolve.go`): `y`/`n`/`yes`/`on`/... are
  booleans, `1e3` and `08` are floats, `0o17` and `0x1F` integers, `2001-02-03` a timestamp,
  and `1:2` stays the string "1:2" (no base-60 numbers);
- merge keys (`<<`) apply where they stand, as go-yaml v2 does (a later explicit key wins, an
  earlier one is overwritten by the merged map);
- mapping keys become strings as sigs.k8s.io/yaml makes them (`94` -> "94", `true` -> "true");
  a null or timestamp key is an error there, and here;
- a timestamp becomes the text Go's JSON encoder writes for it (RFC 3339), and NaN or an
  infinity anywhere fails the file, since JSON cannot hold them.

The result is JSON-shaped data: dicts with string keys, lists, str, int, float, bool, None.
Everything is bounded: the file's size, the number of nodes after alias expansion (a "billion
laughs" file), and the nesting depth.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any, Final

from supervisor.config import golang
from supervisor.config.errors import ConfigError
from supervisor.config.limits import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES

_PLAIN_TAG: Final = "!gpuvisor/plain"
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"

# go-yaml v2's resolve table: plain scalars looked up as a whole.
_PLAIN_MAP: Final[dict[str, object]] = {
    **dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), True),
    **dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), False),
    **dict.fromkeys(("", "~", "null", "Null", "NULL"), None),
    **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf),
}
_YAML_STYLE_FLOAT: Final = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_DOT_FLOAT: Final = re.compile(r"\.[0-9_]+([eE][-+]?[0-9_]+)?")
# go-yaml v2's timestamp layouts: 2006-1-2T15:4:5.999999999Z07:00 (T or t), "2006-1-2 15:4:5.999999999", 2006-1-2.
_TIMESTAMP: Final = re.compile(
    r"(\d{4})-(\d{1,2})-(\d{1,2})"
    r"(?:(?:[Tt](\d{1,2}):(\d{1,2}):(\d{1,2})(?:[.,](\d+))?(Z|[+-]\d\d:\d\d))"
    r"|(?: (\d{1,2}):(\d{1,2}):(\d{1,2})(?:[.,](\d+))?))?"
)


class GoTimestamp(str):
    """A YAML timestamp, held as the RFC 3339 text Go's JSON encoder writes for it."""


def _days_in(year: int, month: int) -> int:
    """Days in `month` (1-12) of `year`, Gregorian (calendar.monthrange without the calendar module)."""
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _timestamp(text: str) -> GoTimestamp | None:
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        return None
    year, month, day = int(match[1]), int(match[2]), int(match[3])
    if not 1 <= month <= 12 or not 1 <= day <= _days_in(year, month):
        return None
    if match[4] is not None:  # 2006-1-2T15:4:5.999999999Z07:00
        clock, fraction, zone = match.group(4, 5, 6), match[7] or "", match[8]
    elif match[9] is not None:  # "2006-1-2 15:4:5.999999999", UTC
        clock, fraction, zone = match.group(9, 10, 11), match[12] or "", "Z"
    else:  # 2006-1-2
        clock, fraction, zone = ("0", "0", "0"), "", "Z"
    hour, minute, second = (int(part) for part in clock)
    if hour >= 24 or minute >= 60 or second >= 60:
        return None
    fraction = fraction[:9].rstrip("0")  # nanoseconds, trailing zeros dropped (RFC3339Nano)
    if zone in ("+00:00", "-00:00"):
        zone = "Z"
    return GoTimestamp(
        f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}{'.' + fraction if fraction else ''}{zone}"
    )


def _float(text: str) -> float | str:
    # strconv.ParseFloat fails (go-yaml then keeps the string) where Python would give an infinity.
    value = float(text)
    return text if math.isinf(value) else value


def resolve_plain(text: str) -> object:
    """What go-yaml v2 makes of an untagged plain scalar (resolve.go)."""
    if text in _PLAIN_MAP:
        return _PLAIN_MAP[text]
    first = text[0]
    if first == ".":
        if _DOT_FLOAT.fullmatch(text) and golang.underscore_ok(text):
            return _float(text.replace("_", ""))
        return text
    if not (first.isascii() and (first.isdigit() or first in "+-")):
        return text
    stamp = _timestamp(text)
    if stamp is not None:
        return stamp
    plain = text.replace("_", "")
    for parse in (golang.parse_int, golang.parse_uint):
        try:
            return parse(plain, 0, 64)
        except ValueError:
            pass
    if _YAML_STYLE_FLOAT.fullmatch(plain) and not isinstance(_float(plain), str):
        return float(plain)
    if plain.startswith(("0b", "-0b")):
        try:
            return golang.parse_int(plain.replace("0b", "", 1), 2, 64)
        except ValueError:
            pass
    return text


@functools.cache
def _loader() -> type[Any]:
    """The loader class, made on first use: PyYAML is imported only when a file is read (most
    nodes run with no config file, and `gpuvisor run` starts without loading it)."""
    import yaml

    class _GoYamlLoader(yaml.SafeLoader):
        """A SafeLoader that resolves plain scalars and builds mappings as go-yaml v2 does."""

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is yaml.ScalarNode and implicit[0]:
                return _MERGE_TAG if value == "<<" else _PLAIN_TAG
            # Quoted scalars are strings, sequences and mappings keep their kind: PyYAML's defaults.
            return super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            if not isinstance(node, yaml.MappingNode):
                raise yaml.constructor.ConstructorError(None, None, "expected a mapping", node.start_mark)
            out: dict[str, object] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self._merge(out, value_node)
                    continue
                key = _json_key(self.construct_object(key_node, deep=True), key_node)
                out[key] = self.construct_object(value_node, deep=True)
            return out

        def _merge(self, out: dict[str, object], node: Any) -> None:
            # go-yaml v2 decode.go merge(): a map, or a sequence of maps with the earlier ones winning.
            if isinstance(node, yaml.MappingNode):
                out.update(self.construct_mapping(node))
                return
            if isinstance(node, yaml.SequenceNode) and all(
                isinstance(n, yaml.MappingNode) for n in node.value
            ):
                for sub in reversed(node.value):
                    out.update(self.construct_mapping(sub))
                return
            raise yaml.constructor.ConstructorError(
                None, None, "map merge requires map or sequence of maps as the value", node.start_mark
            )

        def construct_plain(self, node: Any) -> object:
            return resolve_plain(node.value)

        def construct_binary(self, node: Any) -> object:
            # go-yaml decodes !!binary into a Go string of the bytes; JSON then holds it as text.
            raw = self.construct_yaml_binary(node)
            return bytes(raw).decode("utf-8", "replace")

        def construct_timestamp(self, node: Any) -> object:
            return _timestamp(str(node.value)) or str(node.value)

        def construct_fallback(self, node: Any) -> object:
            # A tag go-yaml does not know: the node is taken for what it is.
            if isinstance(node, yaml.MappingNode):
                return self.construct_mapping(node, deep=True)
            if isinstance(node, yaml.SequenceNode):
                return [self.construct_object(n, deep=True) for n in node.value]
            return str(node.value)

    _GoYamlLoader.yaml_implicit_resolvers = {}
    _GoYamlLoader.add_constructor(_PLAIN_TAG, _GoYamlLoader.construct_plain)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:map", _GoYamlLoader.construct_mapping)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:set", _GoYamlLoader.construct_mapping)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:omap", _GoYamlLoader.construct_fallback)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:pairs", _GoYamlLoader.construct_fallback)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:binary", _GoYamlLoader.construct_binary)
    _GoYamlLoader.add_constructor("tag:yaml.org,2002:timestamp", _GoYamlLoader.construct_timestamp)
    _GoYamlLoader.add_constructor(None, _GoYamlLoader.construct_fallback)
    return _GoYamlLoader


def _json_key(key: object, node: Any) -> str:
    """sigs.k8s.io/yaml's map-key conversion (string, int, float and bool keys; nothing else)."""
    import yaml  # loaded already: this runs inside the loader

    if isinstance(key, GoTimestamp) or key is None or isinstance(key, list | dict | tuple):
        raise yaml.constructor.ConstructorError(
            None, None, f"unsupported map key {key!r}: use a string, a number or a boolean", node.start_mark
        )
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        if key > golang.INT64_MAX:  # go-yaml gives a uint64, which sigs.k8s.io/yaml refuses as a key
            raise yaml.constructor.ConstructorError(None, None, f"unsupported map key {key}", node.start_mark)
        return str(key)
    if isinstance(key, float):
        text = golang.format_float32(key)
        return {"+Inf": ".inf", "-Inf": "-.inf", "NaN": ".nan"}.get(text, text)
    return str(key)


def _check_tree(root: object, source: str) -> None:
    """Bound the tree (nodes counted as go-yaml expands aliases, depth) and refuse NaN/infinity."""
    budget = MAX_CONFIG_NODES
    stack: list[tuple[object, int, str]] = [(root, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        budget -= 1
        if budget < 0:
            raise ConfigError(
                source, "", f"too large: more than {MAX_CONFIG_NODES} values once aliases are expanded"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(source, "", f"nested deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(
                source, path, f"holds {node!r}, which JSON (and so NVIDIA's config reader) cannot represent"
            )


def parse_config_text(text: str, source: str) -> object:
    """Parse YAML or JSON text (JSON is read as YAML); errors name the line and column."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(source, "", f"too large: more than {MAX_CONFIG_BYTES} bytes")
    import yaml

    try:
        # Only the first document counts, as for go-yaml's Unmarshal. _GoYamlLoader is a SafeLoader.
        data = next(iter(yaml.load_all(text, Loader=_loader())), None)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(source, "", f"not valid YAML or JSON: {where}{exc.problem or exc}") from None
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError, TypeError) as exc:
        raise ConfigError(source, "", f"not valid YAML or JSON: {exc}") from None
    _check_tree(data, source)
    return data


def read_config_file(path: str) -> object:
    """Read and parse the config file at `path` (at most MAX_CONFIG_BYTES)."""
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size > MAX_CONFIG_BYTES:
                raise ConfigError(path, "", f"too large: more than {MAX_CONFIG_BYTES} bytes")
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the config file: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(path, "", f"too large: more than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(path, "", "the config file is not UTF-8 text") from None
    return parse_config_text(text, path)
