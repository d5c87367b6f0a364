"""`gpuvisor.dra.memorySharing`: full GPUs shared by the memory each claim asks for.

With it, a DRA node publishes each full GPU with `allowMultipleAllocations` and a request policy
on its `memory` capacity (KEP-5075 consumable capacity), so several claims share one GPU by the
memory they ask for and the scheduler keeps the sum within the GPU's. The value is a step, a
default and a minimum, each a Kubernetes quantity of whole MiB:

    gpuvisor:
      dra:
        memorySharing: {step: 1Gi, default: 4Gi, minimum: 1Gi}

or as a flag or env var, `--dra-memory-sharing step=1Gi,default=4Gi,minimum=1Gi` (off: "" or
`off`). `step` is required; `minimum` defaults to the step and `default` to the minimum. The
rules are those the API server applies to a request policy's range (validateRequestPolicyRange),
checked here so a bad value is refused at load with its reason instead of every slice later:
the minimum at least 1Mi (a share of nothing cannot be pinned), the default at least the
minimum, and the default a whole number of steps above the minimum. What depends on a GPU's
memory (`minimum + step` and the default within it) is checked per GPU when the slices are built.

Quantities here are integers with an optional suffix (Ki, Mi, Gi, Ti binary; k, M, G, T
decimal): the subset of apimachinery's grammar a memory size needs; a fraction is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.config.errors import Invalid, kind, show

MIB = 1 << 20
MAX_BYTES = 1 << 50  # a GPU's memory is far below a PiB
KEYS = ("step", "default", "minimum")
_SUFFIX = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip
_QUANTITY = re.compile(r"([0-9]{1,16})(Ki|Mi|Gi|Ti|k|M|G|T)?")


@dataclass(frozen=True)
class MemorySharing:
    """The request policy of a shared GPU's `memory` capacity, in bytes."""

    step: int
    default: int
    minimum: int


def quantity(value: object, key: str) -> int:
    """A memory size in bytes from a quantity (text, or a YAML integer of bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and (m := _QUANTITY.fullmatch(value.strip())):
        number = int(m.group(1)) * _SUFFIX[m.group(2) or ""]
    else:
        raise Invalid(
            f"{key}: {show(value) if isinstance(value, str) else kind(value)} is not a memory quantity "
            "(an integer with an optional Ki, Mi, Gi, Ti, k, M, G or T suffix, e.g. 4Gi)"
        )
    if not 0 <= number <= MAX_BYTES:
        raise Invalid(f"{key}: {value} is out of range (0 to 1Pi)")
    if number % MIB:
        raise Invalid(f"{key}: {value} is not a whole number of MiB (shares are pinned in MiB)")
    return number


def _pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in KEYS:
            raise Invalid(
                f"{show(item.strip())}: expected step=, default= or minimum= (e.g. step=1Gi,default=4Gi)"
            )
        if key in out:
            raise Invalid(f"{key} is given twice")
        out[key] = value.strip()
    return out


def memory_sharing(value: object) -> MemorySharing | None:
    """The setting's check: None (off), or the policy with every rule that needs no GPU checked."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "off")):
        return None
    if isinstance(value, str):
        raw: Mapping[Any, Any] = _pairs(value)
    elif isinstance(value, Mapping):
        raw = value
    else:
        raise Invalid(f"must be a mapping of step, default and minimum, or off; not {kind(value)}")
    unknown = [str(k) for k in raw if k not in KEYS]
    if unknown:
        raise Invalid(f"unknown key {show(unknown[0])}: the keys are step, default and minimum")
    if "step" not in raw:
        raise Invalid("step is required (the size shares grow by, e.g. 1Gi)")
    step = quantity(raw["step"], "step")
    minimum = quantity(raw["minimum"], "minimum") if "minimum" in raw else step
    default = quantity(raw["default"], "default") if "default" in raw else minimum
    if step < MIB:
        raise Invalid("step: must be at least 1Mi")
    if minimum < MIB:
        raise Invalid("minimum: must be at least 1Mi (a share of no memory cannot be pinned)")
    if default < minimum:
        raise Invalid(f"default {default // MIB}Mi is less than the minimum {minimum // MIB}Mi")
    if (default - minimum) % step:
        raise Invalid(
            f"default {default // MIB}Mi is not a whole number of steps ({step // MIB}Mi) above the minimum "
            f"({minimum // MIB}Mi), as the API server requires of a request policy"
        )
    return MemorySharing(step=step, default=default, minimum=minimum)
