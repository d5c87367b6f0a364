"""A cache of the code `@dataclass` compiles, kept beside the bytecode cache.

For every class it decorates, `@dataclass` writes the source of `__init__`, `__repr__`, `__eq__`,
`__hash__` and, for a frozen class, `__setattr__` and `__delattr__`, and compiles it with `exec`.
Python's bytecode cache (`__pycache__`) keeps a module's own code between runs, not this: for
the supervisor's ~80 dataclasses the compiling was ~40 ms of every start, a third of its imports
(README, Performance). While installed, this module gives `dataclasses` an `exec` of its own
that looks the source text up in a table loaded from `common/__pycache__/dataclass-code.<tag>.bin`
and runs the code object found there; only a text not in the table is compiled, exactly as
`exec` would compile it (no inherited `__future__` flags, file name `<string>`). The key is the
whole text, so a hit is the same code the compiler would make: a changed class is a new text
and compiled anew. The function objects, their globals and defaults are made by `dataclasses`
as always; only the compiling is skipped.

The file is trusted as the `.pyc` files beside it are (the same folder, written by the same
installs). It holds one section per module, written as a whole, of the texts that module's
classes made in the run that wrote it; a file of another Python (its bytecode magic), a
damaged or oversized one, or a section of the wrong shape is ignored and the classes compile as
if there were none. `install()` before the imports, `release()` after them: the table is
dropped (it is ~0.5 MB), and what was compiled is written when Python would write bytecode
(not under `PYTHONDONTWRITEBYTECODE`). The container image and the installer write the whole
file at build time with `python -m common.methodcache`, since they run with a read-only root
filesystem and without writing bytecode.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import importlib.util
import marshal
import mmap
import os
import sys
import types
from typing import Any

from common.atomicfile import write_atomic

HEADER = b"gpuvisor dataclass code\n"
MAX_FILE_BYTES = 16 << 20  # the file written for the whole project is ~0.5 MB
MAX_SECTION_TEXTS = 4096  # a module's classes make a few texts each; more is not ours
PACKAGES = ("common", "supervisor", "worker")


class _File:
    """The file, mapped (not read: a large block malloc'd and freed would raise glibc's mmap
    threshold for the rest of the process, and the tree's memory with it): its index of
    sections (module → offset and length of the marshalled {text: code})."""

    def __init__(self, path: str) -> None:
        self.map: mmap.mmap | None = None
        self.index: dict[str, tuple[int, int]] = {}
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if not 0 < size <= MAX_FILE_BYTES:
                    return
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return
        self.index = self._index()

    def _index(self) -> dict[str, tuple[int, int]]:
        start = len(HEADER) + len(importlib.util.MAGIC_NUMBER)
        assert self.map is not None
        if self.map[:start] != HEADER + importlib.util.MAGIC_NUMBER or len(self.map) < start + 4:
            return {}
        length = int.from_bytes(self.map[start : start + 4], "little")
        index = self._load(start + 4, length)
        if type(index) is not dict:
            return {}
        base, end = start + 4 + length, len(self.map)
        return {
            module: (base + where[0], where[1])
            for module, where in index.items()
            if type(module) is str
            and type(where) is tuple
            and len(where) == 2
            and all(type(n) is int for n in where)
            and where[0] >= 0
            and 0 < where[1] <= end - base - where[0]
        }

    def _load(self, offset: int, length: int) -> object:
        if self.map is None or offset < 0 or length <= 0 or offset + length > len(self.map):
            return None
        with memoryview(self.map) as whole, whole[offset : offset + length] as part:
            try:
                return marshal.loads(part)
            except (EOFError, ValueError, TypeError):
                return None

    def section(self, module: str) -> dict[str, types.CodeType]:
        """One module's texts and their code; {} where the file has none, or none readable."""
        where = self.index.get(module)
        section = self._load(*where) if where is not None else None
        if type(section) is not dict or len(section) > MAX_SECTION_TEXTS:
            return {}
        return {k: v for k, v in section.items() if type(k) is str and type(v) is types.CodeType}

    def blob(self, module: str) -> bytes:
        """One module's section as the file has it (for a rewrite that keeps it)."""
        offset, length = self.index[module]
        assert self.map is not None
        return self.map[offset : offset + length]

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None


class _Table:
    """The mapped file, the sections opened so far, and what this process took from each or
    compiled, per module.

    A text found is taken out of its section, and only its hash kept: text held until the
    release and then freed would leave ~0.75 MB of the supervisor's heap in holes. A text met a
    second time in one module (two classes can make the same method) is compiled, as without
    the cache. A section is rewritten only where something was compiled, with what this run
    used of it: the texts of a changed class do not pile up."""

    def __init__(self, path: str, *, fresh: bool = False) -> None:
        self.path = path
        self.file = _File("" if fresh else path)
        self.opened: dict[str, dict[str, types.CodeType]] = {}
        self.taken: dict[str, set[int]] = {}
        self.compiled: dict[str, dict[str, types.CodeType]] = {}
        self.hits = 0
        self.misses = 0

    def code_for(self, module: str, text: str) -> types.CodeType:
        section = self.opened.get(module)
        if section is None:
            section = self.opened[module] = self.file.section(module)
        code = section.pop(text, None)
        taken = self.taken.setdefault(module, set())
        if code is not None:
            self.hits += 1
            taken.add(hash(text))
            return code
        code = compile(text, "<string>", "exec", dont_inherit=True)
        if hash(text) not in taken:
            self.misses += 1
            compiled = self.compiled.setdefault(module, {})
            if len(compiled) < MAX_SECTION_TEXTS:
                compiled[text] = code
        return code

    def changed_sections(self) -> dict[str, dict[str, types.CodeType]]:
        """For each module that had a text compiled: what this run used of it, to be written."""
        changed = {}
        for module, compiled in self.compiled.items():
            taken = self.taken.get(module, set())
            kept = {text: code for text, code in self.file.section(module).items() if hash(text) in taken}
            changed[module] = {**kept, **compiled}
        return changed


_table: _Table | None = None


def cache_path() -> str:
    """Where this interpreter's file is: in `common/__pycache__` (or under `sys.pycache_prefix`),
    named for the interpreter as its `.pyc` files are."""
    pyc = importlib.util.cache_from_source(__file__)
    return os.path.join(os.path.dirname(pyc), f"dataclass-code.{sys.implementation.cache_tag}.bin")


def install(path: str | None = None) -> None:
    """Load the file and have `@dataclass` compile through it until `release()`. Never raises
    for the file: one that cannot be read is an empty table."""
    global _table
    if _table is not None:
        return
    _table = _Table(path or cache_path())
    dataclasses.exec = _exec  # type: ignore[attr-defined]  # found before the builtin


def release(write: bool | None = None) -> tuple[int, int]:
    """Stop, drop the table, and write the sections that had a text compiled (when `write`, by
    default when Python writes bytecode). Returns (hits, misses); never raises."""
    global _table
    table, _table = _table, None
    if table is None:
        return 0, 0
    if dataclasses.__dict__.get("exec") is _exec:
        del dataclasses.exec  # type: ignore[attr-defined]
    table.opened.clear()
    if write is None:
        write = not sys.dont_write_bytecode
    if write and table.compiled:
        _write(table.path, table.changed_sections())
    table.file.close()
    return table.hits, table.misses


def _exec(source: Any, globals: dict[str, Any] | None = None, locals: Any = None, /) -> None:
    table = _table
    if table is not None and type(source) is str and type(globals) is dict:
        source = table.code_for(str(globals.get("__name__", "")), source)
    builtins.exec(source, globals, locals)


def _write(path: str, sections: dict[str, dict[str, types.CodeType]], *, whole: bool = False) -> bool:
    """Replace these modules' sections in the file, keeping the others as the file has them now,
    or none with `whole`. Atomic, and under a lock on the folder: the supervisor and the zygote
    write at about the same moment of a first start, and neither may drop the other's sections.
    False if it could not."""
    import fcntl

    blobs: dict[str, bytes] = {module: marshal.dumps(texts) for module, texts in sections.items()}
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = _File("" if whole else path)
        try:
            for module in current.index:
                if module not in blobs:
                    blobs[module] = current.blob(module)
        finally:
            current.close()
        index: dict[str, tuple[int, int]] = {}
        offset = 0
        for module, blob in blobs.items():
            index[module] = (offset, len(blob))
            offset += len(blob)
        head = marshal.dumps(index)
        data = b"".join(
            [HEADER, importlib.util.MAGIC_NUMBER, len(head).to_bytes(4, "little"), head, *blobs.values()]
        )
        if len(data) > MAX_FILE_BYTES:
            return False
        write_atomic(path, data, 0o644)  # readable as the .pyc files beside it are
        return True
    except OSError:
        return False
    finally:
        os.close(lock)  # and the lock with it


def write_all(packages: tuple[str, ...] = PACKAGES, path: str | None = None) -> tuple[int, list[str]]:
    """Import every module of `packages`, compiling every text, and write the file anew with
    them, whatever PYTHONDONTWRITEBYTECODE says (for an image or install step). Run it in a
    fresh interpreter: a module imported before it made its classes without the cache. Returns
    the number of texts written and the modules that could not be imported, each with its error."""
    import pkgutil

    global _table
    release(write=False)
    where = path or cache_path()
    table = _table = _Table(where, fresh=True)
    dataclasses.exec = _exec  # type: ignore[attr-defined]
    failed: list[str] = []
    try:
        for name in packages:
            try:
                package = importlib.import_module(name)
            except Exception as exc:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            for info in pkgutil.walk_packages(package.__path__, f"{name}.", onerror=lambda _n: None):
                if info.name.rsplit(".", 1)[-1] == "__main__":
                    continue  # runs its program when imported
                try:
                    importlib.import_module(info.name)
                except Exception as exc:
                    failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    finally:
        release(write=False)
    if not _write(where, table.compiled, whole=True):
        raise OSError(f"cannot write {where}")
    return sum(len(v) for v in table.compiled.values()), failed


def main(argv: list[str] | None = None) -> int:
    """`python -m common.methodcache [--path FILE]`: write the file for every module of gpuvisor."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m common.methodcache",
        description="Write the cache of the code @dataclass compiles for gpuvisor's modules "
        "(for an image or install step; the start skips that compiling when it is there).",
    )
    parser.add_argument("--path", help=f"the file to write (default: {cache_path()})")
    args = parser.parse_args(argv)
    try:
        count, failed = write_all(path=args.path)
    except OSError as exc:
        print(f"common.methodcache: {exc}", file=sys.stderr)
        return 1
    for line in failed:
        print(f"common.methodcache: not imported: {line}", file=sys.stderr)
    print(f"common.methodcache: {count} texts written to {args.path or cache_path()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
