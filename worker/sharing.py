"""What the zygote does once, before its first fork, so that its pages stay shared with its workers.

A page of the zygote stays shared with a worker until either process writes to it; then the
writer gets its own copy (4 KiB for one changed word). CPython writes reference counts into
every object it touches, which no code can avoid, but two more kinds of write can be moved
into the zygote, where they happen once instead of in every worker:

- **Allocator holes.** pymalloc puts a new small object (up to 512 bytes) into the first free
  block of a pool of its size class that already holds objects. In a forked worker those pools
  are the zygote's, so each new object copies a page that is otherwise the zygote's unchanged.
  `fill_allocator_holes` fills every such free block in the zygote with a filler object that
  is never touched again: a worker's new objects then go to fresh pools, many to a page, which
  are its own anyway. The free blocks are counted from `sys._debugmallocstats()` (CPython's own
  report, written to C's stderr; read here through a memfd); with another allocator
  (`PYTHONMALLOC=malloc`) the report has no pools and nothing is filled.
- **ABC caches.** `isinstance(x, collections.abc.Mapping)` (LogRecord runs it for every log
  call with one argument) adds `type(x)` to the caches of that ABC and, on a miss, of every
  registered subclass it walks: many objects, each on its own page. `warm_abc_caches` runs
  those checks for the builtin types once, so a worker finds the answers in the caches. Measured
  in a forked child, the first log line copied ~0.5 MB of zygote pages cold and ~0.2 MB warmed.

bench_memory (a further worker's USS, mean of five) measured 6.74 MB without either, 6.52 MB
with the fill, and 6.23-6.26 MB with both as committed; the zygote holds ~0.2 MB of filler.
(Giving every class its attribute-cache version tag here as well changed nothing measurable.)
"""

from __future__ import annotations

import abc
import os
import sys

FILL_MAX_BYTES = 8 << 20  # the most filler made, whatever the report says
REPORT_MAX_BYTES = 1 << 20
_FILLER: list[object] = []  # kept for the zygote's life: its pages are written once, here


def pool_free_blocks() -> dict[int, int] | None:
    """Free blocks in pymalloc's pools that hold objects, by block size (16 ... 512 bytes), read
    from `sys._debugmallocstats()`; None where the report cannot be had, {} where it has no pools."""
    try:
        fd = os.memfd_create("gpuvisor-mallocstats")
    except (AttributeError, OSError):
        return None
    try:
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
        size = os.lseek(fd, 0, os.SEEK_END)
        text = os.pread(fd, min(size, REPORT_MAX_BYTES), 0).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
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
