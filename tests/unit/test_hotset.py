"""The hot set (worker/hotset.py): its file read with bounds and clear errors, its names interned
as the ones later code uses, its functions given code copies that behave as the originals."""

from __future__ import annotations

import importlib
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker import hotset

GOOD = hotset.HEADER + "\n# a comment\n\nname alpha\nname _beta2\nfunc pkg.mod:Cls.method\nfunc mod:f\n"


def test_a_hot_set_file_gives_its_names_and_functions_in_order() -> None:
    """Header, `name` and `func` lines, comments and blank lines skipped."""
    assert hotset.parse(GOOD.encode()) == (["alpha", "_beta2"], ["pkg.mod:Cls.method", "mod:f"])


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"name alpha\n", "line 1"),
        (b"", "line 1"),
        ((hotset.HEADER + "\nname caf\xc3\xa9\n").encode("latin-1"), "not ASCII"),
        ((hotset.HEADER + "\nname two words\n").encode(), "line 2"),
        ((hotset.HEADER + "\nname 2x\n").encode(), "line 2"),
        ((hotset.HEADER + "\n\nfunc no_colon\n").encode(), "line 3"),
        ((hotset.HEADER + "\nfunc mod:f.<locals>.g\n").encode(), "line 2"),
        ((hotset.HEADER + "\nnames alpha\n").encode(), "line 2"),
        ((hotset.HEADER + "\nname " + "a" * (hotset.MAX_ENTRY + 1) + "\n").encode(), "line 2"),
        ((hotset.HEADER + "\n" + "name a\n" * (hotset.MAX_NAMES + 1)).encode(), "over"),
        ((hotset.HEADER + "\n" + "func m:f\n" * (hotset.MAX_FUNCTIONS + 1)).encode(), "over"),
        ((hotset.HEADER + "\nfunc " + "m." * 130 + "m:f\n").encode(), "line 2"),
        (b"#" * (hotset.MAX_BYTES + 1), "over the limit"),
    ],
)
def test_a_malformed_hot_set_is_refused_with_what_and_where(data: bytes, says: str) -> None:
    """A missing header, non-ASCII bytes, a line that is neither `name NAME` (an ASCII
    identifier) nor `func MODULE:QUALNAME`, an entry over MAX_ENTRY, more names than MAX_NAMES, a
    file over MAX_BYTES, more functions than MAX_FUNCTIONS, a function entry over MAX_ENTRY in
    all: each a ValueError naming the problem and its line."""
    with pytest.raises(ValueError, match=says):
        hotset.parse(data)


def test_a_missing_or_bad_file_is_a_problem_said_not_an_exception(tmp_path: Path) -> None:
    """_read turns a file that is not there, or one parse refuses, into empty lists and the
    reason with the path: the zygote logs it and goes on without the set."""
    missing = tmp_path / "none.txt"
    names, functions, problem = hotset._read(str(missing))
    assert (names, functions) == ([], []) and problem is not None and str(missing) in problem
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"not a hot set\n")
    assert hotset._read(str(bad))[2] == f"{bad}: line 1: not {hotset.HEADER!r}"


def test_the_names_interned_at_import_are_the_strings_code_compiled_later_uses() -> None:
    """Every hot name is held interned, and code compiled after the import refers to that very
    string for the name (the compiler interns identifiers): the layout the zygote wants."""
    assert hotset.PROBLEM is None, hotset.PROBLEM
    assert len(hotset.NAMES) > 100
    assert all(sys.intern(n) is n for n in hotset.NAMES)
    name = hotset.NAMES[len(hotset.NAMES) // 2]
    assert sys.intern(name) is name
    code = compile(f"obj.{name}", "<test>", "eval")
    assert code.co_names[-1] is name


MODULE = textwrap.dedent(
    """
    import contextlib

    @contextlib.contextmanager
    def managed():
        yield "managed"

    def plain(x):
        return x + 1

    def maker(n):
        def inner(y):
            return [y * k for k in range(n)]
        return inner

    class Cls:
        def method(self):
            return "method"

        @staticmethod
        def static():
            return "static"

        @classmethod
        def klass(cls):
            return cls.__name__

        @property
        def prop(self):
            return self._p

        @prop.setter
        def prop(self, value):
            self._p = value
    """
)


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """A module of functions of every kind relocate() looks up, in sys.modules while the test runs."""
    mod = types.ModuleType("gv_hotset_probe")
    exec(compile(MODULE, "gv_hotset_probe.py", "exec"), mod.__dict__)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _codes(m: types.ModuleType) -> dict[str, types.CodeType]:
    """The code object of each kind of function in the probe module, by kind."""
    cls = vars(m.Cls)
    return {
        "plain": m.plain.__code__,
        "maker": m.maker.__code__,
        "method": cls["method"].__code__,
        "static": cls["static"].__func__.__code__,
        "klass": cls["klass"].__func__.__code__,
        "get": cls["prop"].fget.__code__,
        "set": cls["prop"].fset.__code__,
        "wrapper": m.managed.__code__,
        "wrapped": m.managed.__wrapped__.__code__,
    }


def test_relocated_functions_get_equal_new_code_and_behave_the_same(module: types.ModuleType) -> None:
    """A function, a method, a staticmethod, a classmethod, a property's getter and setter, and
    a @contextmanager's wrapper and the generator it wraps each get a new code object equal to
    the old; a closure made afterwards runs a copy of its code too; every one answers as before;
    an entry listed twice is given one copy, and entries not found (no such module, no such
    name) are counted, not raised."""
    m = module
    old = _codes(m)
    old_inner = m.maker(2).__code__
    entries = [
        f"gv_hotset_probe:{q}"
        for q in ("plain", "maker", "Cls.method", "Cls.static", "Cls.klass", "Cls.prop", "managed")
    ]
    done, missing = hotset.relocate(
        [*entries, "gv_hotset_probe:plain", "no_such_module:f", "gv_hotset_probe:nope"]
    )
    assert (done, missing) == (9, 2)
    new = _codes(m)
    for key in old:
        assert new[key] is not old[key] and new[key] == old[key], key
    inner = m.maker(2)
    assert inner.__code__ is not old_inner and inner.__code__ == old_inner
    assert inner.__code__ in m.maker.__code__.co_consts
    assert m.plain(1) == 2 and inner(3) == [0, 3]
    obj = m.Cls()
    obj.prop = 5
    assert (obj.method(), m.Cls.static(), m.Cls.klass(), obj.prop) == ("method", "static", "Cls", 5)
    with m.managed() as value:
        assert value == "managed"
    assert all(any(kept is old[key] for kept in hotset._KEPT) for key in old)


def test_the_recorded_set_names_functions_the_zygotes_modules_still_have() -> None:
    """The committed hotset.txt reads, and at least 95 % of its functions are found once the
    zygote's modules are imported (looked up only: nothing is relocated here). Fewer means the
    set has gone stale: `python -m tests.benchmarks.hotrecord --write` records it anew."""
    from worker.zygote import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
    found = 0
    for entry in hotset.FUNCTIONS:
        module_name, _, qualname = entry.partition(":")
        module = sys.modules.get(module_name)
        found += bool(module is not None and hotset.functions_named(module, qualname))
    assert len(hotset.FUNCTIONS) > 100
    assert found >= 0.95 * len(hotset.FUNCTIONS), (found, len(hotset.FUNCTIONS))
