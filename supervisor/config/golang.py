"""Go's rules for text, as NVIDIA's plugin applies them to its flags, env vars and config file.

NVIDIA's plugin is a Go program: a boolean flag is read by `strconv.ParseBool`, an integer list
by `strconv.ParseInt(s, 0, 64)`, a device reference is a UUID only if `google/uuid.Parse` takes
it, a resource name must be a Kubernetes DNS-1123 subdomain, and so on. Each function here is one
of those rules, ported from its Go source (the version NVIDIA v0.20.0 builds with) so that
gpuvisor accepts and rejects exactly the same text. They raise ValueError or return False;
callers turn that into a ConfigError with the key and source.
"""

from __future__ import annotations

import re
import struct
from typing import Final

# strconv.ParseBool
_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})

# unicode.IsSpace: Go's strings.TrimSpace trims these (Python's str.strip() also trims \x1c-\x1f).
_GO_SPACE: Final = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
UINT64_MAX: Final = (1 << 64) - 1

# k8s.io/apimachinery/pkg/util/validation: IsDNS1123Subdomain
_DNS1123_LABEL: Final = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN: Final = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
DNS1123_SUBDOMAIN_MAX_LENGTH: Final = 253

_HEX: Final = frozenset("0123456789abcdefABCDEF")


def parse_bool(text: str) -> bool:
    """strconv.ParseBool: exactly 1 t T TRUE true True and 0 f F FALSE false False."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r}")


def trim_space(text: str) -> str:
    """strings.TrimSpace."""
    return text.strip(_GO_SPACE)


def _digits(text: str, base: int) -> int:
    if not text:
        raise ValueError("no digits")
    value = 0
    for char in text:
        digit = int(char, 36) if char.isascii() and char.isalnum() else 99
        if digit >= base:
            raise ValueError(f"invalid digit {char!r}")
        value = value * base + digit
    return value


def underscore_ok(text: str) -> bool:
    """strconv's underscoreOK: '_' only between digits, or between a base prefix and a digit."""
    saw, i, hexa = "^", 0, False
    if text[:1] in ("+", "-"):
        text = text[1:]
    if len(text) >= 2 and text[0] == "0" and text[1].lower() in "box":
        i, saw, hexa = 2, "0", text[1].lower() == "x"
    for char in text[i:]:
        if (char.isdigit() and char.isascii()) or (hexa and char.lower() in "abcdef"):
            saw = "0"
        elif char == "_":
            if saw != "0":
                return False
            saw = "_"
        elif saw == "_":
            return False
        else:
            saw = "!"
    return saw != "_"


def parse_uint(text: str, base: int = 10, bits: int = 64) -> int:
    """strconv.ParseUint. Base 0 reads a 0x / 0o / 0b / 0 (octal) prefix and allows '_' between
    digits, as Go integer literals do."""
    if not text:
        raise ValueError("invalid syntax: empty")
    original = text
    if base == 0:
        base = 10
        if text[0] == "0":
            prefix = text[1:2].lower()
            if len(text) >= 3 and prefix in ("b", "o", "x"):
                base, text = {"b": 2, "o": 8, "x": 16}[prefix], text[2:]
            else:
                base, text = 8, text[1:] or "0"
        if "_" in text:
            if not underscore_ok(original):
                raise ValueError(f"invalid syntax: {original!r}")
            text = text.replace("_", "") or "0"
    value = _digits(text, base)
    if value > (1 << bits) - 1:
        raise ValueError(f"value out of range: {original!r}")
    return value


def parse_int(text: str, base: int = 10, bits: int = 64) -> int:
    """strconv.ParseInt: an optional sign, then ParseUint's digits, within the signed range."""
    if not text:
        raise ValueError("invalid syntax: empty")
    negative = text[0] == "-"
    magnitude = parse_uint(text[1:] if text[0] in "+-" else text, base, bits)
    limit = 1 << (bits - 1)
    if (negative and magnitude > limit) or (not negative and magnitude >= limit):
        raise ValueError(f"value out of range: {text!r}")
    return -magnitude if negative else magnitude


def _float_syntax(text: str) -> bool:
    """strconv's readFloat consumes all of `text`: a sign, decimal digits with an optional point
    and `e` exponent, or `0x` hex digits with a required `p` exponent; '_' between digits."""
    i = 1 if text[:1] in ("+", "-") else 0
    hexa = len(text) > i + 2 and text[i] == "0" and text[i + 1] in "xX"
    digits = "0123456789abcdefABCDEF" if hexa else "0123456789"
    i += 2 if hexa else 0
    seen_digit = seen_point = False
    while i < len(text):
        char = text[i]
        if char == "." and not seen_point:
            seen_point = True
        elif char in digits:
            seen_digit = True
        elif char != "_":
            break
        i += 1
    if not seen_digit:
        return False
    if i < len(text) and text[i] in ("pP" if hexa else "eE"):
        i += 1
        if i < len(text) and text[i] in "+-":
            i += 1
        if i >= len(text) or text[i] not in "0123456789":
            return False
        while i < len(text) and (text[i] in "0123456789" or text[i] == "_"):
            i += 1
    elif hexa:
        return False  # a hex mantissa needs a p exponent
    return i == len(text) and ("_" not in text or underscore_ok(text))


def parse_float(text: str) -> float:
    """strconv.ParseFloat(s, 64): Go's float literal syntax (no blanks), "Inf"/"Infinity" with an
    optional sign and "NaN" in any case; an overflow is an error, an underflow is 0."""
    special = text.lower()
    if special.lstrip("+-") in ("inf", "infinity") and len(special) - len(special.lstrip("+-")) <= 1:
        return float("-inf") if special.startswith("-") else float("inf")
    if special == "nan":
        return float("nan")
    if not _float_syntax(text):
        raise ValueError(f"invalid syntax: {text!r}")
    plain = text.replace("_", "")
    try:
        value = float.fromhex(plain) if plain.lstrip("+-")[:2] in ("0x", "0X") else float(plain)
    except OverflowError:
        value = float("inf")
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"value out of range: {text!r}")
    return value


def json_integer(value: float) -> int | None:
    """The integer a YAML float becomes in NVIDIA's config decoding, or None if it is not one.

    sigs.k8s.io/yaml turns YAML into JSON: encoding/json writes a float64 without a fraction or
    exponent when it is integral and 1e-6 <= |f| < 1e21, and only such text decodes into a Go int.
    """
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        return None
    if value != 0 and not 1e-6 <= abs(value) < 1e21:
        return None
    return int(value)


def format_float32(value: float) -> str:
    """strconv.FormatFloat(f, 'g', -1, 32): how sigs.k8s.io/yaml writes a YAML float that lands
    in a Go string field (e.g. `mpsRoot: 1.5` becomes "1.5", `1e6` becomes "1e+06")."""
    try:
        single = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        single = float("inf") if value > 0 else float("-inf")
    if single != single:
        return "NaN"
    if single in (float("inf"), float("-inf")):
        return "+Inf" if single > 0 else "-Inf"
    if single == 0:
        return "-0" if str(single).startswith("-") else "0"
    sign = "-" if single < 0 else ""
    magnitude = abs(single)
    # The shortest decimal digits that read back as the same float32.
    for precision in range(1, 10):
        mantissa, _, exponent = f"{magnitude:.{precision - 1}e}".partition("e")
        if struct.unpack("f", struct.pack("f", float(f"{mantissa}e{exponent}")))[0] == magnitude:
            break
    digits = mantissa.replace(".", "").rstrip("0") or "0"
    point = int(exponent) + 1  # decimal point position after the first digit, as Go's digs.dp
    eprec = 6
    if eprec > len(digits) and len(digits) >= point:
        eprec = len(digits)
    exp = point - 1
    if exp < -4 or exp >= eprec:
        head = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{head}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return f"{sign}{digits}{'0' * (point - len(digits))}"
    return f"{sign}{digits[:point]}.{digits[point:]}"


def is_uuid(text: str) -> bool:
    """github.com/google/uuid Parse: 36 chars with dashes, 38 with any two characters around
    them (braces in practice), `urn:uuid:` + 36, or 32 hex digits."""
    if len(text) == 32:
        return all(c in _HEX for c in text)
    if len(text) == 36 + 9:
        if text[:9].lower() != "urn:uuid:":
            return False
        text = text[9:]
    elif len(text) == 38:
        text = text[1:37]
    elif len(text) != 36:
        return False
    if any(text[i] != "-" for i in (8, 13, 18, 23)):
        return False
    return all(
        text[i] in _HEX and text[i + 1] in _HEX
        for i in (0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34)
    )


def is_dns1123_subdomain(text: str) -> bool:
    """IsDNS1123Subdomain: lower-case alphanumeric labels joined by '.', '-' inside a label."""
    return len(text) <= DNS1123_SUBDOMAIN_MAX_LENGTH and _DNS1123_SUBDOMAIN.fullmatch(text) is not None


_DURATION_UNITS: Final = {
    "ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000,
    "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
}  # fmt: skip
_DURATION_PART: Final = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")


def parse_duration(text: str) -> int:
    """time.ParseDuration, in nanoseconds: `[-+]?([0-9]*(\\.[0-9]*)?[a-z]+)+`, or "0"."""
    rest = text[1:] if text[:1] in ("-", "+") else text
    negative = text[:1] == "-"
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"invalid duration {text!r}")
    total = 0
    while rest:
        match = _DURATION_PART.match(rest)
        assert match is not None  # the pattern matches the empty string
        whole, fraction, unit = match.group(1), match.group(2), match.group(3)
        if not whole and not fraction:
            raise ValueError(f"invalid duration {text!r}")
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        scale = _DURATION_UNITS.get(unit)
        if scale is None:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        value = int(whole or "0")
        if value > (1 << 63) // scale:
            raise ValueError(f"invalid duration {text!r}")
        value *= scale
        if fraction:
            value += int(float("0." + fraction) * scale)
        total += value
        if total > 1 << 63:
            raise ValueError(f"invalid duration {text!r}")
        rest = rest[match.end() :]
    if not negative and total > INT64_MAX:
        raise ValueError(f"invalid duration {text!r}")
    return -total if negative else total
