"""A cache of the code `@dataclass` compiles, kept beside the bytecode cache.

For every class it decorates, `@dataclass` writes the source of `__init__`, `__repr__`, `__eq__`,
`__hash__` and, for a frozen class, `__setattr__` and `__delattr__`, and compiles it with `exec`.
Python's bytecode cache (`__pycache__`) keeps a module's own code between runs, not this, so
without the cache every start compiles the methods of each of the supervisor's dataclasses anew
(what that costs: docs/performance.md). While installed, this module gives `dataclasses` an
`exec` of its own that looks the source text up in a table loaded from
`common/__pycache__/dataclass-code.<tag>.bin` and runs the code object found there; only a text not in the table is compiled, exactly as
`exec` would compile it (no inherited `__future__` flags, file name `<string>`). The key is the
whole text, so a hit is the same code the compiler would make: a changed class is a new text
and compiled anew. The function objects, their globals and defaults are made by `dataclasses`
as always; only the compiling is skipped.

The file is trusted as the `.pyc` files beside it are (the same folder, written by the same
installs). It holds one section per module, written as a whole, of the texts that module's
classes made in the run that wrote it; a file of another Python (its bytecode magic), a
damaged or oversized one, or a section of the wrong shape is ignored and the classes compile as
if there were none. `install()` before the imports, `release()` after them: the table is
dropped, and what was compiled is written when Python would write bytecode
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
import time
import types
import zlib
from typing import Any

from common.atomicfile import write_atomic

# The file: HEADER, the bytecode magic, the index's length and CRC-32 (4 bytes each, little
# endian), the index (marshalled {module: (offset, length, CRC-32)}, offsets from its end), then
# each module's section (marshalled {text: code}). A new layout gets a new HEADER.
HEADER = b"gpuvisor dataclass code 1\n"
MAX_FILE_BYTES = 16 << 20  # the file written for the whole project is ~0.8 MB
MAX_SECTION_TEXTS = 4096  # a module's classes make a few texts each; more is not ours
LOCK_WAIT = 2.0  # seconds a write waits for another process's write; then it is skipped
PACKAGES = ("common", "supervisor", "worker")


def _prefix() -> bytes:
    return HEADER + importlib.util.MAGIC_NUMBER


class _File:
    """The file, mapped (not read: a large block malloc'd and freed would raise glibc's mmap
    threshold for the rest of the process, and the tree's memory with it), and its index. Every
    part is checked (bounds, CRC-32, types) before it is used, and any failure reads as a part
    that is not there: a damaged file costs the compiling it would have saved, never a start."""

    def __init__(self, path: str) -> None:
        self.map: mmap.mmap | None = None
        self.index: dict[str, tuple[int, int, int]] = {}
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if not len(_prefix()) + 8 < size <= MAX_FILE_BYTES:
                    return
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.index = self._index()
        except Exception:  # an unreadable file is no file
            self.index = {}

    def _index(self) -> dict[str, tuple[int, int, int]]:
        assert self.map is not None
        start = len(_prefix())
        if self.map[:start] != _prefix():
            return {}
        length = int.from_bytes(self.map[start : start + 4], "little")
        crc = int.from_bytes(self.map[start + 4 : start + 8], "little")
        index = self._load(start + 8, length, crc)
        if type(index) is not dict:
            return {}
        base = start + 8 + length
        found = {}
        for module, where in index.items():
            if (
                type(module) is str
                and type(where) is tuple
                and len(where) == 3
                and all(type(n) is int for n in where)
            ):
                found[module] = (base + where[0], where[1], where[2])
        return found

    def _load(self, offset: int, length: int, crc: int) -> object:
        """The object marshalled at [offset, offset + length) if its CRC-32 is `crc`; else None."""
        mapped = self.map
        if mapped is None or offset < 0 or length <= 0 or offset + length > len(mapped):
            return None
        try:
            with memoryview(mapped) as whole, whole[offset : offset + length] as part:
                if zlib.crc32(part) != crc:
                    return None
                return marshal.loads(part)
        except Exception:  # closed meanwhile, or a damage the CRC did not see
            return None

    def section(self, module: str) -> dict[str, types.CodeType]:
        """One module's texts and their code; {} where the file has none, or none readable."""
        where = self.index.get(module)
        section = self._load(*where) if where is not None else None
        if type(section) is not dict or len(section) > MAX_SECTION_TEXTS:
            return {}
        return {k: v for k, v in section.items() if type(k) is str and type(v) is types.CodeType}

    def blob(self, module: str) -> bytes | None:
        """One module's section as the file has it, if intact (for a rewrite that keeps it)."""
        offset, length, crc = self.index[module]
        if self.map is None or offset < 0 or offset + length > len(self.map):
            return None
        data = self.map[offset : offset + length]
        return data if zlib.crc32(data) == crc else None

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a lookup of another thread still reading
                self.map.close()
            self.map = None


class _Table:
    """The mapped file, the sections opened so far, and what this process took from each or
    compiled, per module.

    A text found is taken out of its section, and only its hash kept: text held until the
    release and then freed would leave ~0.75 MB of the supervisor's heap in holes. A text met a
    second time in one module (two classes can make the same method) is compiled, as without
    the cache, and counted once. A section is rewritten only where something was compiled, with
    what this run used of it: the texts of a changed class do not pile up."""

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
        code = _compile(text)
        if hash(text) not in taken and text not in self.compiled.get(module, {}):
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


def _compile(text: str) -> types.CodeType:
    """`text` compiled as `exec` compiles it when `dataclasses` calls it: file name `<string>`,
    and no `__future__` flags (dataclasses.py has none; this module's must not reach it)."""
    return compile(text, "<string>", "exec", dont_inherit=True)


def cache_path() -> str:
    """Where this interpreter's file is: in `common/__pycache__` (or under `sys.pycache_prefix`),
    named for the interpreter as its `.pyc` files are. Raises NotImplementedError for an
    interpreter without a bytecode cache (`sys.implementation.cache_tag` None)."""
    pyc = importlib.util.cache_from_source(__file__)
    return os.path.join(os.path.dirname(pyc), f"dataclass-code.{sys.implementation.cache_tag}.bin")


def install(path: str | None = None, *, fresh: bool = False) -> None:
    """Map the file and have `@dataclass` compile through it until `release()` (with `fresh`,
    compile every text, as if there were no file). Never raises for the file: one that cannot
    be read is an empty table."""
    global _table
    if _table is not None:
        return
    try:
        where = path or cache_path()
    except NotImplementedError:
        return  # no bytecode cache, so no place for this one either
    _table = _Table(where, fresh=fresh)
    dataclasses.exec = _exec  # type: ignore[attr-defined]  # found before the builtin


def release(write: bool | None = None) -> tuple[int, int]:
    """Stop, drop the table, and write the sections that had a text compiled (when `write`, by
    default when Python writes bytecode). Returns (texts taken from the file, texts compiled);
    never raises."""
    global _table
    if dataclasses.__dict__.get("exec") is _exec:
        del dataclasses.exec  # type: ignore[attr-defined]
    table, _table = _table, None
    if table is None:
        return 0, 0
    table.opened.clear()
    if write is None:
        write = not sys.dont_write_bytecode
    try:
        if write and table.misses:
            _write(table.path, table.changed_sections())
    finally:
        table.file.close()
    return table.hits, table.misses


def _exec(source: Any, globals: dict[str, Any] | None = None, locals: Any = None, /) -> None:
    table = _table
    if type(source) is str:
        if table is not None and type(globals) is dict:
            source = table.code_for(str(globals.get("__name__", "")), source)
        else:  # released meanwhile (another thread's import): as dataclasses' own exec would
            source = _compile(source)
    builtins.exec(source, globals, locals)


def _lock(fd: int) -> bool:
    """An exclusive flock on `fd`, waited for up to LOCK_WAIT (a write is never worth a start)."""
    import fcntl

    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def _write(path: str, sections: dict[str, dict[str, types.CodeType]], *, whole: bool = False) -> bool:
    """Replace these modules' sections in the file, keeping the others (intact ones) as the file
    has them now, or none with `whole`. Atomic, and under a lock on the folder: the supervisor
    and the zygote write at about the same moment of a first start, and neither may drop the
    other's sections. False if it could not."""
    blobs: dict[str, bytes] = {module: marshal.dumps(texts) for module, texts in sections.items()}
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not _lock(lock):
            return False
        current = _File("" if whole else path)
        try:
            for module in current.index:
                kept = current.blob(module) if module not in blobs else None
                if kept is not None:
                    blobs[module] = kept
        finally:
            current.close()
        index: dict[str, tuple[int, int, int]] = {}
        offset = 0
        for module, blob in blobs.items():
            index[module] = (offset, len(blob), zlib.crc32(blob))
            offset += len(blob)
        head = marshal.dumps(index)
        sizes = len(head).to_bytes(4, "little") + zlib.crc32(head).to_bytes(4, "little")
        data = b"".join([_prefix(), sizes, head, *blobs.values()])
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
    the number of texts written and the modules that could not be imported, each with its error.
    The one place `common` names the roles' packages (by name, as a build step; no start runs it)."""
    import pkgutil

    release(write=False)
    where = path or cache_path()
    install(where, fresh=True)
    table = _table
    assert table is not None
    failed: list[str] = []

    def load(name: str) -> types.ModuleType | None:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # said in the list the caller prints; the others go on
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            return None

    try:
        for name in packages:
            package = load(name)
            if package is None:
                continue
            for info in pkgutil.walk_packages(package.__path__, f"{name}.", onerror=lambda _n: None):
                if info.name.rsplit(".", 1)[-1] != "__main__":  # a __main__ runs its program when imported
                    load(info.name)
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
