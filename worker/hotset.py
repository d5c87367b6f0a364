"""The hot set: the functions a worker runs and the names they use, laid out together in the zygote.

CPython 3.11 writes the reference count of every object a worker touches, and a forked worker
gets its own copy of each zygote page it writes: 4 KiB for one word. The objects a worker
touches on every start are, for the most part, the code objects of the ~450 functions it runs
and the identifier strings those use, and the imports left them scattered over the zygote's
memory, one or two to a page, among objects no worker touches. Laid out next to each other,
they fill a few dozen pages instead of several hundred. Two steps, both in the zygote only:

- **The names**, as soon as the zygote starts: importing this module interns each hot name
  (worker/zygote.py imports it before anything else), while the heap is young and holds few
  free blocks, so the strings sit together. Every module imported later gets these strings for
  those names, not new ones: the compiler and marshal intern identifiers, and an interned string
  is the one string of its value. (A name the interpreter's own start-up had interned already,
  for `os` or `codecs`, stays where it is.) Interning changes no behaviour.
- **The functions**, after the imports and before `gc.freeze()` (`relocate`): each hot
  function's code object is replaced by a copy made then, with the code objects of the functions
  it defines (closures, comprehensions) copied too, so the copies sit together. The originals are
  kept, so the copies do not fall into the holes they would leave. A copy is the same code
  (`CodeType.replace`): equal to the original, same constants, same line table.

The set is recorded, not computed: `python -m tests.benchmarks.hotrecord --write` runs the
benchmark's nodes, profiles the functions their workers run, and writes `hotset.txt` beside
this module with those functions and the names their code uses. A stale set costs memory only:
a name no module uses is one string more, and a function not found is skipped and counted.
Both steps run while the supervisor is still importing, so a start does not wait for them; what
the set saves a worker is in docs/performance.md.
"""

from __future__ import annotations

import os
import sys
import types

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hotset.txt")
HEADER = "# gpuvisor hot set 1"
MAX_BYTES = 256 * 1024
MAX_NAMES = 8192
MAX_FUNCTIONS = 4096
MAX_ENTRY = 256  # characters of one name, or of one whole module:qualname


def is_name(text: str) -> bool:
    """An ASCII identifier: a name the compiler interns."""
    return len(text) <= MAX_ENTRY and text.isascii() and text.isidentifier()


def is_function(text: str) -> bool:
    """`module:qualname`, both dotted names."""
    module, colon, qualname = text.partition(":")
    return (
        bool(colon)
        and len(text) <= MAX_ENTRY
        and all(is_name(part) for part in (*module.split("."), *qualname.split(".")))
    )


def parse(data: bytes) -> tuple[list[str], list[str]]:
    """(names, functions) of a hot set file: its header line, then `name NAME` and `func
    MODULE:QUALNAME` lines (blank lines and `#` comments aside). Raises ValueError saying what
    is wrong and on which line."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"over the limit of {MAX_BYTES} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not ASCII (byte {exc.start})") from None
    lines = text.splitlines()
    if not lines or lines[0] != HEADER:
        raise ValueError(f"line 1: not {HEADER!r}")
    names: list[str] = []
    functions: list[str] = []
    for number, line in enumerate(lines[1:], start=2):
        if line.startswith("name ") and is_name(line[5:]):
            names.append(line[5:])
        elif line.startswith("func ") and is_function(line[5:]):
            functions.append(line[5:])
        elif line.startswith("#") or not line.strip():
            continue
        else:
            raise ValueError(f"line {number}: not `name NAME` or `func MODULE:QUALNAME`: {line[:80]!r}")
        if len(names) > MAX_NAMES or len(functions) > MAX_FUNCTIONS:
            raise ValueError(f"line {number}: over {MAX_NAMES} names or {MAX_FUNCTIONS} functions")
    return names, functions


def _read(path: str) -> tuple[list[str], list[str], str | None]:
    """(names, functions, None), or empty lists and why the file could not be had."""
    try:
        with open(path, "rb") as fh:
            names, functions = parse(fh.read(MAX_BYTES + 1))
    except (OSError, ValueError) as exc:
        return [], [], f"{path}: {exc}"
    return names, functions, None


_names, FUNCTIONS, PROBLEM = _read(PATH)
# Interned, and held for the life of the process: an interned string no object refers to is freed.
NAMES = tuple(sys.intern(name) for name in _names)


def functions_named(module: types.ModuleType, qualname: str) -> list[types.FunctionType]:
    """The functions named `qualname` in `module`, looked up in the namespaces of the module and
    its classes only (no attribute of any other object is read, so no code of theirs runs): a
    function, or the functions behind a staticmethod or classmethod (`__func__`) or a property
    (its getter, setter and deleter; enum's too), each with the functions it wraps
    (`__wrapped__`, as functools.wraps sets it: a @contextmanager's generator, say)."""
    found: object = module
    for part in qualname.split("."):
        if not isinstance(found, (types.ModuleType, type)):
            return []
        space = vars(found)
        if part not in space:
            return []
        found = space[part]
    candidates: list[object] = [found]
    if isinstance(found, (staticmethod, classmethod)):
        candidates = [found.__func__]
    elif isinstance(found, (property, types.DynamicClassAttribute)):  # enum's property is the latter
        candidates = [found.fget, found.fset, found.fdel]
    out: list[types.FunctionType] = []
    for candidate in candidates:
        for _ in range(4):  # a wrapper of a wrapper at most, and so on: bounded
            if not isinstance(candidate, types.FunctionType) or candidate.__qualname__ != qualname:
                break
            out.append(candidate)
            candidate = candidate.__dict__.get("__wrapped__")
    return out


def _copy(code: types.CodeType, made: dict[int, types.CodeType]) -> types.CodeType:
    """A copy of `code` made now, the code objects among its constants copied too (once each)."""
    new = made.get(id(code))
    if new is None:
        consts = tuple(_copy(c, made) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        new = made[id(code)] = code.replace(co_consts=consts)
    return new


_KEPT: list[types.CodeType] = []  # the originals: their memory is not handed to anything else


def relocate(functions: list[str] | None = None) -> tuple[int, int]:
    """Give each hot function (default FUNCTIONS) a copy of its code object made now, all of
    them together. Returns (functions given one, entries not found: a module not imported, a
    name no longer there)."""
    made: dict[int, types.CodeType] = {}
    copies: set[int] = set()
    done = missing = 0
    for entry in FUNCTIONS if functions is None else functions:
        module_name, _, qualname = entry.partition(":")
        module = sys.modules.get(module_name)
        try:
            found = functions_named(module, qualname) if module is not None else []
        except Exception:  # a namespace that is not what it seems: that entry is skipped
            found = []
        if not found:
            missing += 1
            continue
        for function in found:
            if id(function.__code__) in copies:  # listed twice
                continue
            if id(function.__code__) not in made:
                _KEPT.append(function.__code__)
            function.__code__ = _copy(function.__code__, made)
            copies.add(id(function.__code__))
            done += 1
    return done, missing
