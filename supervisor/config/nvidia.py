"""NVIDIA's config file layout (`api/config/v1`), decoded the way encoding/json decodes it.

The tree below is NVIDIA v0.20.0's `Config` struct: each field by its JSON name, with the Go type
that decides what it accepts. Decoding follows encoding/json:

- keys match a struct field exactly, or else case-insensitively (`MIGStrategy` is
  `migStrategy`); keys are taken in sorted order (sigs.k8s.io/yaml writes the JSON object that
  way), and a later key for the same field overwrites, or for a struct merges into, the earlier;
- a null leaves a non-pointer field as it is and clears a pointer (absent, so the flag's default
  applies);
- fields with their own decoder (resource lists, the sharing strategies) are handed to
  `sections`, every occurrence kept, since decoding them twice is not the same as once.

Keys NVIDIA does not know are collected (gpuvisor logs them); the top-level `gpuvisor` section
is gpuvisor's own and is left to the loader. Fields NVIDIA reads but the device plugin does not
use (`flags.gfd`, `flags.useNodeFeatureAPI`) are still type-checked, because NVIDIA fails a
file in which they have the wrong type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from supervisor.config import gojson
from supervisor.config.errors import ConfigError, Invalid, kind

OWN_SECTION: Final = "gpuvisor"


@dataclass(frozen=True)
class Leaf:
    """A field of a plain Go type: `decode` gives its typed value or raises Invalid."""

    decode: Callable[[object], object]
    pointer: bool = True  # a Go pointer or slice: null clears it; a plain value ignores null


@dataclass(frozen=True)
class Custom:
    """A field whose Go type has its own UnmarshalJSON: every occurrence, raw, in decode order."""

    pointer: bool = False


@dataclass(frozen=True)
class Struct:
    fields: Mapping[str, Leaf | Custom | Struct]
    pointer: bool = False
    _folded: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._folded.update({fold(name): name for name in self.fields})

    def match(self, key: str) -> str | None:
        """The field a JSON key lands in: the exact name first, else a case-insensitive match."""
        if key in self.fields:
            return key
        return self._folded.get(fold(key))


def fold(key: str) -> str:
    """bytes.EqualFold against ASCII field names: ASCII case, plus the Kelvin sign and long s,
    the only non-ASCII letters that simple-fold to ASCII ones."""
    return "".join({"\u212a": "k", "\u017f": "s"}.get(c, c.lower() if c.isascii() else c) for c in key)


def _string(value: object) -> object:
    return gojson.go_string(value, coerce=True)


STRING: Final = Leaf(_string)
BOOL: Final = Leaf(gojson.go_bool)
STRATEGIES: Final = Leaf(gojson.string_or_list)

CONFIG: Final = Struct(
    {
        "version": Leaf(_string, pointer=False),
        "flags": Struct(
            {
                "migStrategy": STRING,
                "failOnInitError": BOOL,
                "mpsRoot": STRING,
                "nvidiaDriverRoot": STRING,
                "nvidiaDevRoot": STRING,
                "gdrcopyEnabled": BOOL,
                "gdsEnabled": BOOL,
                "mofedEnabled": BOOL,
                "useNodeFeatureAPI": BOOL,
                "deviceDiscoveryStrategy": STRING,
                "plugin": Struct(
                    {
                        "passDeviceSpecs": BOOL,
                        "deviceListStrategy": STRATEGIES,
                        "deviceIDStrategy": STRING,
                        "cdiAnnotationPrefix": STRING,
                        "nvidiaCTKPath": STRING,
                        "containerDriverRoot": STRING,
                        "sharedDevicesAllocationPolicy": STRING,
                    },
                    pointer=True,
                ),
                "gfd": Struct(
                    {
                        "oneshot": BOOL,
                        "noTimestamp": BOOL,
                        "sleepInterval": Leaf(gojson.go_duration),
                        "outputFile": STRING,
                        "machineTypeFile": STRING,
                    },
                    pointer=True,
                ),
            }
        ),
        "resources": Struct({"gpus": Custom(pointer=True), "mig": Custom(pointer=True)}),
        "sharing": Struct({"timeSlicing": Custom(pointer=False), "mps": Custom(pointer=True)}),
        "imex": Struct(
            {"channelIDs": Leaf(gojson.go_int_list), "required": Leaf(gojson.go_bool, pointer=False)}
        ),
    }
)


def leaf_at(dotted: str) -> Leaf | Custom | Struct | None:
    """The schema node at a dotted key (for checking that settings name real NVIDIA keys)."""
    node: Leaf | Custom | Struct = CONFIG
    for part in dotted.split("."):
        if not isinstance(node, Struct) or part not in node.fields:
            return None
        node = node.fields[part]
    return node


def decode(root: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """NVIDIA's part of the file as a tree by canonical field names, typed; plus unknown keys.

    In the tree, a leaf is its typed value (None: a pointer that null cleared), a struct a dict,
    and a Custom field the list of its raw occurrences (None for a null that cleared a pointer).
    """
    tree: dict[str, Any] = {}
    unknown: list[str] = []
    _decode_struct(root, CONFIG, "", tree, unknown, source)
    return tree, unknown


def _decode_struct(
    data: Mapping[str, Any], node: Struct, path: str, out: dict[str, Any], unknown: list[str], source: str
) -> None:
    # Code point order is UTF-8 byte order: the order of Go's sorted JSON keys. (Keys are strings
    # from the YAML reader; data built in code may hold others, which then match no field.)
    for key in sorted(data, key=str):
        if not path and key == OWN_SECTION:
            continue
        where = f"{path}.{key}" if path else key
        name = node.match(key) if isinstance(key, str) else None
        if name is None:
            unknown.append(where)
            continue
        child, value = node.fields[name], data[key]
        if isinstance(child, Custom):
            out.setdefault(name, []).append(value)
            continue
        if value is None:
            if child.pointer:
                out[name] = None
            continue
        if isinstance(child, Struct):
            if not isinstance(value, Mapping):
                raise ConfigError(source, where, f"this section must be a mapping, not {kind(value)}")
            target = out.get(name)
            if not isinstance(target, dict):
                target = out[name] = {}
            _decode_struct(value, child, where, target, unknown, source)
            continue
        try:
            out[name] = child.decode(value)
        except Invalid as exc:
            raise ConfigError(source, where + exc.at, exc.reason) from None


def lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    """The decoded value at a dotted key, or None when it (or a section above it) is absent."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node
