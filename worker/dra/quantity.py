"""Kubernetes resource quantities ("1Gi", "512M", "1.5e9"), as a claim's MPS memory limits carry them.

The grammar and the rounding are k8s.io/apimachinery's (pkg/api/resource/quantity.go, the
comment above `type Quantity` and `ParseQuantity`; `Quantity.UnmarshalJSON` for JSON):

    <quantity>  ::= <sign>? <number> <suffix>
    <number>    ::= <digits> | <digits> "." <digits>? | "." <digits>
    <suffix>    ::= "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"      (powers of 1024)
                  | "m" | "k" | "M" | "G" | "T" | "P" | "E"          (powers of 1000; m is 1/1000)
                  | ("e" | "E") <sign>? <digits>                     (a decimal exponent)

A JSON string is parsed with the blanks around it trimmed, a JSON number as its own text, and
`Quantity.Value` rounds a fraction up to the next integer. Bounded: at most `MAX_TEXT` characters, an
exponent of at most `MAX_EXPONENT`, and a value that fits in an int64 (apimachinery's `Quantity.Value`
is an int64; a limit beyond it names no memory a GPU has).
"""

from __future__ import annotations

import math
import re

MAX_TEXT = 64
MAX_EXPONENT = 30
MAX_VALUE = (1 << 63) - 1

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(
    r"(?P<sign>[+-])?(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
)


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the text says why."""


def parse_quantity(text: str) -> int:
    """The quantity's value, rounded up to an integer as apimachinery's `Quantity.Value` rounds it."""
    from fractions import Fraction  # here: a worker whose claims set no limit never loads it

    if len(text) > MAX_TEXT:
        raise QuantityError(f"a quantity of {len(text)} characters, at most {MAX_TEXT}")
    stripped = text.strip()
    match = _QUANTITY.fullmatch(stripped)
    if not stripped or match is None or not (match["int"] or match["frac"]):
        raise QuantityError(f"{text!r} is no quantity (quantities must match the regular expression "
                            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$')")  # fmt: skip
    number = Fraction(int(match["int"] or "0"))
    if match["frac"]:
        number += Fraction(int(match["frac"]), 10 ** len(match["frac"]))
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        number *= _BINARY[suffix]
    elif suffix == "m":
        number /= 1000
    elif suffix in _DECIMAL:
        number *= 10 ** _DECIMAL[suffix]
    else:  # a decimal exponent
        exponent = int(suffix[1:])
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(f"{text!r}: an exponent of {exponent}, at most {MAX_EXPONENT} either way")
        number *= Fraction(10) ** exponent
    if match["sign"] == "-":
        number = -number
    value = math.ceil(number)
    if abs(value) > MAX_VALUE:
        raise QuantityError(f"{text!r} is over {MAX_VALUE}, the largest quantity a Kubernetes object holds")
    return value


def json_quantity(value: object) -> int:
    """A quantity as JSON holds it: a string, or a number written as its own text."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise QuantityError(f"a quantity is a string or a number, not {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is no quantity")
        return parse_quantity(repr(value))
    return parse_quantity(str(value) if isinstance(value, int) else value)
