"""common/methodcache.py: the cache of the code `@dataclass` compiles.

Each test makes classes in a fresh module of its own (registered in sys.modules, as `dataclasses`
looks a class's module up there) with the cache installed on a file in tmp_path, as the entry
points install it on the package's file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import marshal
import os
import sys
import types
from collections.abc import Iterator

import pytest

from common import methodcache

SOURCE = """
import dataclasses
import importlib.util

@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()

@dataclasses.dataclass
class Box:
    name: str
    items: list[int] = dataclasses.field(default_factory=list)
"""
METHODS = ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__")


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    before = set(sys.modules)
    yield
    methodcache.release(write=False)
    for name in set(sys.modules) - before:
        if name.startswith("gvtest_"):
            del sys.modules[name]


def _module(name: str, source: str = SOURCE) -> types.ModuleType:
    """A module made from `source`, as an import would make it."""
    sys.modules.pop(name, None)
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec", dont_inherit=True), module.__dict__)  # not this file's futures
    return module


def _cached(path: str, name: str, source: str = SOURCE) -> tuple[types.ModuleType, tuple[int, int]]:
    """The module made with the cache on `path` installed, and (taken, compiled) of that run;
    the file is written as a start writes it."""
    methodcache.install(path)
    try:
        module = _module(name, source)
    finally:
        counts = methodcache.release(write=True)
    return module, counts


def _codes(cls: type) -> dict[str, types.CodeType]:
    return {
        m: cls.__dict__[m].__code__
        for m in METHODS
        if m in cls.__dict__ and hasattr(cls.__dict__[m], "__code__")
    }


def test_methods_from_the_cache_are_the_code_the_compiler_makes(tmp_path: str) -> None:
    """A class whose methods came from the file has the same code objects (bytecode, constants,
    names) as one made without the cache, and behaves the same: init, defaults, repr, eq, hash,
    frozen."""
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_a")
    cached, (taken, compiled) = _cached(path, "gvtest_a")
    assert (taken, compiled) == (len(_codes(cached.Point)) + len(_codes(cached.Box)), 0)
    plain = _module("gvtest_a")
    for cls in ("Point", "Box"):
        assert _codes(getattr(cached, cls)) == _codes(getattr(plain, cls)), cls
    p = cached.Point(1, tags=("a",))
    assert repr(p) == "Point(x=1, y=0, tags=('a',))"
    assert p == cached.Point(1, 0, ("a",)) and hash(p) == hash(cached.Point(1, 0, ("a",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 2
    a, b = cached.Box("a"), cached.Box("b")
    a.items.append(1)
    assert b.items == [] and a == cached.Box("a", [1])


def test_a_second_start_compiles_nothing_and_writes_nothing(tmp_path: str) -> None:
    """The first run compiles every text and writes the file; the next run takes them all from
    it, compiles none, and leaves the file as it was."""
    path = os.path.join(tmp_path, "code.bin")
    _, (taken, compiled) = _cached(path, "gvtest_b")
    assert taken == 0 and compiled > 0
    written = os.stat(path).st_mtime_ns, os.path.getsize(path)
    _, (taken2, compiled2) = _cached(path, "gvtest_b")
    assert (taken2, compiled2) == (compiled, 0)
    assert (os.stat(path).st_mtime_ns, os.path.getsize(path)) == written


def test_a_changed_class_is_compiled_anew_and_its_old_texts_go(tmp_path: str) -> None:
    """A class changed since the file was written misses (its text differs) and is compiled;
    its module's section is written again with only what this run used, so old texts do not
    pile up."""
    path = os.path.join(tmp_path, "code.bin")
    _, (_, first) = _cached(path, "gvtest_c")
    changed = SOURCE.replace("    y: int = 0\n", "    y: int = 0\n    z: int = 0\n")
    module, (taken, compiled) = _cached(path, "gvtest_c", changed)
    assert compiled > 0 and taken + compiled == first
    assert module.Point(1, 2, 3).z == 3
    section = methodcache._File(path).section("gvtest_c")
    assert len(section) == first  # the Point's old texts replaced, not added to
    assert _cached(path, "gvtest_c", changed)[1] == (first, 0)


def test_the_modules_future_flags_do_not_reach_the_compiled_code(tmp_path: str) -> None:
    """The text is compiled as `exec` compiles it in `dataclasses` (no inherited `from __future__
    import annotations`, which methodcache itself has): the annotations of the generated
    `__init__` are the types, not their names, on a miss and on a hit alike."""
    path = os.path.join(tmp_path, "code.bin")
    for _ in range(2):
        module, _counts = _cached(path, "gvtest_d")
        assert module.Box.__init__.__annotations__["name"] is str
        assert module.Box.__init__.__code__.co_flags == _module("gvtest_d").Box.__init__.__code__.co_flags


@pytest.mark.parametrize(
    "damage",
    ["empty", "truncated", "header", "magic", "index", "section", "huge"],
)
def test_a_damaged_file_is_ignored_and_written_anew(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A file cut short, of another program or Python (header, bytecode magic), with an index or
    a section of the wrong shape, or over the size bound: the classes are compiled as without a
    cache, nothing raises, and the file is written again whole."""
    path = os.path.join(tmp_path, "code.bin")
    _, (_, total) = _cached(path, "gvtest_e")
    with open(path, "rb") as fh:
        good = fh.read()
    start = len(methodcache.HEADER) + len(importlib.util.MAGIC_NUMBER)
    head = int.from_bytes(good[start : start + 4], "little")
    bad = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "header": b"X" + good[1:],
        "magic": good[: len(methodcache.HEADER)] + b"\0\0\r\n" + good[start:],
        "index": good[:start] + (5).to_bytes(4, "little") + marshal.dumps([1, 2]) + good[start + 4 + head :],
        "section": good[: start + 4 + head] + b"\xff" * (len(good) - start - 4 - head),
        "huge": good,
    }[damage]
    if damage == "huge":
        monkeypatch.setattr(methodcache, "MAX_FILE_BYTES", len(good) - 1)
    with open(path, "wb") as fh:
        fh.write(bad)
    module, (taken, compiled) = _cached(path, "gvtest_e")
    assert (taken, compiled) == (0, total)
    assert module.Point(1) == module.Point(1, 0, ())
    monkeypatch.undo()
    assert _cached(path, "gvtest_e")[1] == (total, 0)


def test_without_bytecode_writing_nothing_is_written(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PYTHONDONTWRITEBYTECODE (sys.dont_write_bytecode), as the image runs, a run that
    compiled texts writes no file: it is written at build time instead."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = os.path.join(tmp_path, "code.bin")
    methodcache.install(path)
    _module("gvtest_f")
    _taken, compiled = methodcache.release()
    assert compiled > 0 and not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_a_write_keeps_the_sections_of_other_modules(tmp_path: str) -> None:
    """Two processes (the supervisor, the zygote) each write the sections of their own modules:
    a write keeps the sections the file has of the other modules."""
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_g1")
    _cached(path, "gvtest_g2", SOURCE.replace("Box", "Crate"))
    assert _cached(path, "gvtest_g1")[1][1] == 0
    assert _cached(path, "gvtest_g2", SOURCE.replace("Box", "Crate"))[1][1] == 0
    assert set(methodcache._File(path).index) == {"gvtest_g1", "gvtest_g2"}


def test_a_text_met_twice_in_a_module_is_no_miss(tmp_path: str) -> None:
    """Two classes of one module can make the same method text: the second is compiled (its
    entry was taken by the first) but is not counted as a miss, so a warm file is not written
    again at every start."""
    twice = (
        SOURCE
        + "\n@dataclasses.dataclass(frozen=True)\nclass Other:\n    x: int\n    y: int = 0\n    tags: tuple[str, ...] = ()\n"
    )
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_h", twice)
    mtime = os.stat(path).st_mtime_ns
    module, (taken, compiled) = _cached(path, "gvtest_h", twice)
    assert compiled == 0 and taken > 0
    assert os.stat(path).st_mtime_ns == mtime
    assert module.Other(1) != module.Point(1) and repr(module.Other(1)) == "Other(x=1, y=0, tags=())"


def test_release_undoes_install(tmp_path: str) -> None:
    """Outside install() and release(), `dataclasses` compiles with the builtin exec again, and
    release() without install() is a no-op."""
    methodcache.install(os.path.join(tmp_path, "code.bin"))
    assert "exec" in dataclasses.__dict__
    methodcache.release(write=False)
    assert "exec" not in dataclasses.__dict__
    assert methodcache.release() == (0, 0)


def test_the_file_lies_beside_the_packages_bytecode() -> None:
    """The file is in common's __pycache__, named for this interpreter as its .pyc files are."""
    path = methodcache.cache_path()
    assert os.path.dirname(path) == os.path.join(os.path.dirname(methodcache.__file__), "__pycache__")
    assert os.path.basename(path) == f"dataclass-code.{sys.implementation.cache_tag}.bin"
