"""common/methodcache.py: the cache of the code `@dataclass` compiles.

Each test makes classes in a fresh module of its own (registered in sys.modules, as `dataclasses`
looks a class's module up there) with the cache installed on a file in tmp_path, as the entry
points install it on the package's file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import marshal
import os
import sys
import types
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import methodcache

SOURCE = """
import dataclasses
import fcntl
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
    """No test leaves the cache installed or its modules behind."""
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


def _codes(cls: type) -> dict[str, tuple[object, ...]]:
    """Each generated method's code object, with what code equality leaves out (its file name,
    names, first line, line and exception tables)."""
    out: dict[str, tuple[object, ...]] = {}
    for name in METHODS:
        code = getattr(cls.__dict__.get(name), "__code__", None)
        if code is not None:
            out[name] = (
                code, code.co_filename, code.co_name, code.co_qualname, code.co_firstlineno,
                code.co_linetable, code.co_exceptiontable, code.co_flags,
            )  # fmt: skip
    return out


def test_methods_from_the_cache_are_the_code_the_compiler_makes(tmp_path: Path) -> None:
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


def test_a_second_start_compiles_nothing_and_writes_nothing(tmp_path: Path) -> None:
    """The first run compiles every text and writes the file; the next run takes them all from
    it, compiles none, and leaves the file as it was."""
    path = os.path.join(tmp_path, "code.bin")
    _, (taken, compiled) = _cached(path, "gvtest_b")
    assert taken == 0 and compiled > 0
    written = os.stat(path).st_mtime_ns, os.path.getsize(path)
    _, (taken2, compiled2) = _cached(path, "gvtest_b")
    assert (taken2, compiled2) == (compiled, 0)
    assert (os.stat(path).st_mtime_ns, os.path.getsize(path)) == written


def test_a_changed_class_is_compiled_anew_and_its_old_texts_go(tmp_path: Path) -> None:
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


def test_the_modules_future_flags_do_not_reach_the_compiled_code(tmp_path: Path) -> None:
    """The text is compiled as `exec` compiles it in `dataclasses` (no inherited `from __future__
    import annotations`, which methodcache itself has): the annotations of the generated
    `__init__` are the types, not their names, on a miss and on a hit alike."""
    path = os.path.join(tmp_path, "code.bin")
    for _ in range(2):
        module, _counts = _cached(path, "gvtest_d")
        assert module.Box.__init__.__annotations__["name"] is str
        assert module.Box.__init__.__code__.co_flags == _module("gvtest_d").Box.__init__.__code__.co_flags


def _craft(index: Any, sections: list[bytes]) -> bytes:
    """A file in the layout methodcache documents, written here independently of its writer:
    `index` marshalled with its true length and CRC-32, then the sections as given."""
    head = marshal.dumps(index)
    return b"".join(
        [
            methodcache.HEADER,
            importlib.util.MAGIC_NUMBER,
            len(head).to_bytes(4, "little"),
            zlib.crc32(head).to_bytes(4, "little"),
            head,
            *sections,
        ]
    )


def _entry(blob: bytes, offset: int = 0) -> tuple[int, int, int]:
    return (offset, len(blob), zlib.crc32(blob))


def _damaged(good: bytes, damage: str) -> bytes:
    """`good` (a file written for module gvtest_e) damaged one way."""
    start = len(methodcache.HEADER) + len(importlib.util.MAGIC_NUMBER)
    head = int.from_bytes(good[start : start + 4], "little")
    body = good[start + 8 + head :]  # the one section
    texts_of_strings = marshal.dumps({"def __create_fn__(): pass": "not code"})
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "header": b"X" + good[1:],
        "magic": good[: len(methodcache.HEADER)] + b"\0\0\r\n" + good[start:],
        "index crc": good[: start + 4]
        + (zlib.crc32(b"other") & 0xFFFFFFFF).to_bytes(4, "little")
        + good[start + 8 :],
        "index a list": _craft([("gvtest_e", 0, len(body))], [body]),
        "entry shape": _craft({"gvtest_e": (0, len(body))}, [body]),
        "entry outside": _craft({"gvtest_e": (len(body), len(body), zlib.crc32(body))}, [body]),
        "section crc": good[:-1] + bytes([good[-1] ^ 0xFF]),
        "section a list": _craft({"gvtest_e": _entry(marshal.dumps([1]))}, [marshal.dumps([1])]),
        "section of strings": _craft({"gvtest_e": _entry(texts_of_strings)}, [texts_of_strings]),
        "huge": good,
    }[damage]


@pytest.mark.parametrize(
    "damage",
    [
        "empty", "truncated", "header", "magic", "index crc", "index a list", "entry shape", "entry outside",
        "section crc", "section a list", "section of strings", "huge",
    ],
)  # fmt: skip
def test_a_damaged_file_is_ignored_and_written_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A file cut short, of another program or Python (header, bytecode magic), whose index or a
    section fails its CRC-32, is of the wrong shape or points outside the file, or over the size
    bound: the classes are compiled as without a cache, nothing raises, and the file is written
    again whole."""
    path = os.path.join(tmp_path, "code.bin")
    _, (_, total) = _cached(path, "gvtest_e")
    with open(path, "rb") as fh:
        good = fh.read()
    if damage == "huge":
        monkeypatch.setattr(methodcache, "MAX_FILE_BYTES", len(good) - 1)
    with open(path, "wb") as fh:
        fh.write(_damaged(good, damage))
    module, (taken, compiled) = _cached(path, "gvtest_e")
    assert (taken, compiled) == (0, total)
    assert module.Point(1) == module.Point(1, 0, ())
    monkeypatch.undo()
    assert _cached(path, "gvtest_e")[1] == (total, 0)


def test_the_crafted_layout_is_the_one_read(tmp_path: Path) -> None:
    """The layout _craft writes (and the damage cases alter) is the one methodcache reads: a
    good section in it is taken, so the damage cases fail for their damage alone."""
    path = os.path.join(tmp_path, "code.bin")
    _, (_, total) = _cached(path, "gvtest_e")
    section = marshal.dumps(methodcache._File(path).section("gvtest_e"))
    with open(path, "wb") as fh:
        fh.write(_craft({"gvtest_e": _entry(section)}, [section]))
    assert _cached(path, "gvtest_e")[1] == (total, 0)


def test_a_section_over_the_bound_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A section of more texts than MAX_SECTION_TEXTS is not one of ours: its module compiles."""
    path = os.path.join(tmp_path, "code.bin")
    _, (_, total) = _cached(path, "gvtest_i")
    monkeypatch.setattr(methodcache, "MAX_SECTION_TEXTS", total - 1)
    methodcache.install(path)
    _module("gvtest_i")
    assert methodcache.release(write=False) == (0, total)


def test_a_text_taken_leaves_the_table_and_the_file_is_closed(tmp_path: Path) -> None:
    """A text found is taken out of its section as it is used (no text is held until the
    release: freed then, it left holes in the heap), and release() unmaps the file."""
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_j")
    methodcache.install(path)
    table = methodcache._table
    assert table is not None and table.file.map is not None
    mapped = table.file.map
    _module("gvtest_j")
    assert table.opened == {"gvtest_j": {}}
    methodcache.release(write=False)
    assert mapped.closed


def test_a_write_waits_for_the_lock_and_gives_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write takes an exclusive lock on the folder (the supervisor and the zygote write at
    about the same moment): while another holds it, the write waits LOCK_WAIT and is skipped,
    leaving the file as it was; once it is free, the write is made."""
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_k")
    before = os.stat(path).st_mtime_ns
    monkeypatch.setattr(methodcache, "LOCK_WAIT", 0.2)
    holder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert not methodcache._write(path, {"gvtest_other": {}})
        assert os.stat(path).st_mtime_ns == before
    finally:
        os.close(holder)
    assert methodcache._write(path, {"gvtest_other": {}})
    assert set(methodcache._File(path).index) == {"gvtest_k", "gvtest_other"}


def test_without_bytecode_writing_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PYTHONDONTWRITEBYTECODE (sys.dont_write_bytecode), as the image runs, a run that
    compiled texts writes no file: it is written at build time instead."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = os.path.join(tmp_path, "code.bin")
    methodcache.install(path)
    _module("gvtest_f")
    _taken, compiled = methodcache.release()
    assert compiled > 0 and not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_a_write_keeps_the_sections_of_other_modules(tmp_path: Path) -> None:
    """Two processes (the supervisor, the zygote) each write the sections of their own modules:
    a write keeps the sections the file has of the other modules."""
    path = os.path.join(tmp_path, "code.bin")
    _cached(path, "gvtest_g1")
    _cached(path, "gvtest_g2", SOURCE.replace("Box", "Crate"))
    assert _cached(path, "gvtest_g1")[1][1] == 0
    assert _cached(path, "gvtest_g2", SOURCE.replace("Box", "Crate"))[1][1] == 0
    assert set(methodcache._File(path).index) == {"gvtest_g1", "gvtest_g2"}


def test_a_text_met_twice_in_a_module_is_no_miss(tmp_path: Path) -> None:
    """Two classes of one module can make the same method text: a cold run counts it compiled
    once, and a warm run compiles the second (its entry was taken by the first) without counting
    a miss, so a warm file is not written again at every start."""
    twice = (
        SOURCE
        + "\n@dataclasses.dataclass(frozen=True)\nclass Other:\n    x: int\n    y: int = 0\n    tags: tuple[str, ...] = ()\n"
    )
    path = os.path.join(tmp_path, "code.bin")
    _, (_, distinct) = _cached(os.path.join(tmp_path, "once.bin"), "gvtest_h0")
    assert _cached(path, "gvtest_h", twice)[1] == (0, distinct)  # Other's texts are all Point's
    mtime = os.stat(path).st_mtime_ns
    module, (taken, compiled) = _cached(path, "gvtest_h", twice)
    assert compiled == 0 and taken > 0
    assert os.stat(path).st_mtime_ns == mtime
    assert module.Other(1) != module.Point(1) and repr(module.Other(1)) == "Other(x=1, y=0, tags=())"


def test_release_undoes_install(tmp_path: Path) -> None:
    """Outside install() and release(), `dataclasses` compiles with the builtin exec again, and
    release() without install() is a no-op."""
    methodcache.install(os.path.join(tmp_path, "code.bin"))
    assert "exec" in dataclasses.__dict__
    methodcache.release(write=False)
    assert "exec" not in dataclasses.__dict__
    assert methodcache.release() == (0, 0)


def test_the_file_lies_beside_the_packages_bytecode() -> None:
    """The file is where this interpreter keeps common's .pyc files (its __pycache__, or under
    PYTHONPYCACHEPREFIX), named for the interpreter as they are."""
    path = methodcache.cache_path()
    assert os.path.dirname(path) == os.path.dirname(importlib.util.cache_from_source(methodcache.__file__))
    assert os.path.basename(path) == f"dataclass-code.{sys.implementation.cache_tag}.bin"
