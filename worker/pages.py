"""What the zygote does once, before its first fork, so that its pages stay shared with its workers.

A page of the zygote stays shared with a worker until either process writes to it; then the
writer gets its own copy (4 KiB for one changed word). CPython writes reference counts into
every object it touches, which no code can avoid, but two more kinds of write can be moved
into the zygote, where they happen once instead of in every worker:

- **Allocator holes.** pymalloc puts a new small object (up to 512 bytes) into the first free
  block of a pool of its size class that already holds objects. In a forked worker those pools
  are the zygote's, so each new object copies a page that is otherwise the zygote's unchanged.
  `fill_allocator_holes` fills every such free block in the zygote with a filler object that
  is never touched again: a worker's new objects then go mostly to pools the zygote never
  touched, many to a page, which are the worker's own memory from the start. The free blocks
  are counted from `sys._debugmallocstats()` (CPython's own report, written to C's stderr; read
  here through a memfd); with another allocator (`PYTHONMALLOC=malloc`) the report has no pools
  and nothing is filled.
- **malloc's free chunks.** Objects over 512 bytes (dict tables, big lists, a code object's
  bytes) and what the C libraries allocate from the main thread (libzmq, gRPC core, protobuf)
  come from glibc's malloc, which hands out a free chunk of the right size first: in a worker,
  a hole in the zygote's heap, so again a copied page. `fill_malloc_holes` takes every free
  chunk of glibc's main arena once (counted from `malloc_info(3)`, read through a memfd) and
  never frees it; a worker's allocations then come from the top of the heap, fresh pages. Without
  glibc's `malloc_info` (musl) nothing is filled.
- **ABC caches.** `isinstance(x, collections.abc.Mapping)` (LogRecord runs it for every log
  call with one argument) adds `type(x)` to the caches of that ABC and, on a miss, of every
  registered subclass it walks: many objects, each on its own page. `warm_abc_caches` runs
  those checks for the builtin types once, so a worker finds the answers in the caches.

What each step saves a worker, as bench_memory measures it, and what the filler costs the
zygote, are in docs/performance.md.
"""

from __future__ import annotations

import abc
import ctypes
import os
import re
import sys
from collections.abc import Callable

FILL_MAX_BYTES = 8 << 20  # the most each fill makes, whatever the reports say
REPORT_MAX_BYTES = 1 << 20
_FILLER: list[object] = []  # kept for the zygote's life: its pages are written once, here


def _captured(write: Callable[[int], None]) -> str | None:
    """What `write(fd)` writes to a fresh memfd (a C report, which only writes to a stream), read
    back and bounded; None without a memfd, or where writing or reading fails."""
    try:
        fd = os.memfd_create("gpuvisor-report")
    except (AttributeError, OSError):
        return None
    try:
        write(fd)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, min(size, REPORT_MAX_BYTES), 0).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _debugmallocstats_to(fd: int) -> None:
    """`sys._debugmallocstats()`, which writes to C's stderr, with fd 2 pointed at `fd` meanwhile."""
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
    finally:
        os.close(saved)


def pool_free_blocks() -> dict[int, int] | None:
    """Free blocks in pymalloc's pools that hold objects, by block size (16 ... 512 bytes), read
    from `sys._debugmallocstats()`; None where the report cannot be had, {} where it has no pools."""
    text = _captured(_debugmallocstats_to)
    if text is None:
        return None
    free: dict[int, int] = {}
    for line in text.splitlines():
        # class   size   num pools   blocks in use  avail blocks
        fields = line.split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            free[int(fields[1])] = int(fields[4])
    return free


def filler(size: int, count: int) -> list[object]:
    """`count` new objects that pymalloc puts into blocks of `size` bytes (a multiple of 16)."""
    if size <= 16:
        return [object() for _ in range(count)]  # 16 bytes
    if size <= 32:
        return list(range(1 << 20, (1 << 20) + count))  # one-digit ints, 28 bytes; not cached
    return [b"\0" * (size - 33) for _ in range(count)]  # a bytes object is 33 bytes + its length


def fill_allocator_holes() -> int:
    """Fill the free blocks of the pools that hold objects (see the module doc); returns the
    bytes of filler made. Three rounds: the report and the fill leave a few holes of their own."""
    made = 0
    for _ in range(3):
        free = pool_free_blocks()
        if not free:
            break
        for size, count in sorted(free.items()):
            count = min(count, (FILL_MAX_BYTES - made) // size)
            if count > 0:
                _FILLER.extend(filler(size, count))
                made += size * count
    return made


# glibc keeps up to 7 freed chunks per size up to 1040 bytes in a per-thread cache that
# malloc_info does not report; they are handed out before the bins' chunks.
TCACHE_COUNT = 7
TCACHE_MAX_CHUNK = 1040
_BIN = re.compile(r'<(?:size|unsorted) from="(\d+)" to="(\d+)" total="\d+" count="(\d+)"')
_FASTBIN_SPAN = 15  # a fastbin's row: from = its chunk size - 15, to = its chunk size


def malloc_free_chunks(report: str) -> list[tuple[int, int]]:
    """(chunk size, count) of each bin of glibc's main arena, the first `<heap>` of a
    malloc_info(3) report. A fastbin's row spans `size - 15` to `size`; any other bin's `from`
    is the size field of its smallest chunk, whose low three bits are flags."""
    main = report.split("</heap>", 1)[0]
    chunks = []
    for m in _BIN.finditer(main):
        low, high, count = int(m[1]), int(m[2]), int(m[3])
        chunks.append((high if high - low == _FASTBIN_SPAN else low & ~7, count))
    return chunks


def malloc_report() -> str | None:
    """This process's malloc_info(3) report; None without glibc's malloc_info or a memfd."""
    try:
        libc = ctypes.CDLL(None)
        malloc_info, fdopen, fclose = libc.malloc_info, libc.fdopen, libc.fclose
    except (AttributeError, OSError):
        return None
    malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    fdopen.restype = ctypes.c_void_p
    fclose.argtypes = [ctypes.c_void_p]

    def write(fd: int) -> None:
        copy = os.dup(fd)
        stream = fdopen(copy, b"w")
        if not stream:
            os.close(copy)
            raise OSError("fdopen failed")
        try:
            malloc_info(0, stream)
        finally:
            fclose(stream)  # flushes the report, closes `copy`

    return _captured(write)


def fill_malloc_holes() -> int:
    """Take every free chunk of glibc's main arena (see the module doc), and the thread cache's
    chunks of the same sizes; returns the bytes taken. The chunks are never freed: they are the
    zygote's for its life. Two rounds: the first report's own parsing frees a few chunks."""
    try:
        malloc = ctypes.CDLL(None).malloc
    except (AttributeError, OSError):
        return 0
    malloc.argtypes = [ctypes.c_size_t]
    malloc.restype = ctypes.c_void_p
    made = 0
    for rounds in range(2):
        report = malloc_report()
        chunks = malloc_free_chunks(report) if report is not None else []
        if not chunks:
            break
        for size, count in chunks:
            if size < 32:
                continue
            count += TCACHE_COUNT if rounds == 0 and size <= TCACHE_MAX_CHUNK else 0
            for _ in range(min(count, (FILL_MAX_BYTES - made) // size)):
                if malloc(size - 8):  # a request of size - 8 bytes takes a chunk of `size`
                    made += size
    return made


ABC_SAMPLES: tuple[object, ...] = (
    0, 0.5, True, "", b"", None, (), [], {}, set(), frozenset(), bytearray(), range(0),
)  # fmt: skip


def warm_abc_caches() -> None:
    """Ask every collections.abc ABC about each builtin type once (see the module doc)."""
    import collections.abc

    for value in vars(collections.abc).values():
        if isinstance(value, abc.ABCMeta):
            for sample in ABC_SAMPLES:
                isinstance(sample, value)
