"""What a forked worker's own pages are, compared with its zygote's page for page.

A worker's USS is mostly pages it shared with the zygote until it wrote to them. For each page
of the worker's writable mappings that only the worker maps (pagemap's "exclusively mapped"
bit), the zygote's page at the same address is read too (`/proc/<pid>/mem`) and the pair is put
in one of four kinds:

- `new`: the zygote has no page there (thread stacks, new allocator arenas, a library's first
  data): memory made anew, not a copy;
- `identical`: the same bytes in both, written and put back (a reference count up and down);
- `few words`: 1 to 3 of the page's 512 words differ, mostly reference counts of objects the
  worker holds or uses;
- `more`: 4 words or more differ (objects made or changed in place, allocator lists, caches).

Reading another process's memory needs ptrace access to it: the benchmark is the zygote's
ancestor, which Linux's default (Yama scope 1) allows. Where it is refused, `classify` returns
None and the benchmark says so.
"""

from __future__ import annotations

import os
import struct

PAGE = 4096
WORD = 8
FEW_WORDS = 3
KINDS = ("new", "identical", "few words", "more")
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56
_MAX_MAPPING_PAGES = 1 << 20  # 4 GiB: only the first 4 GiB of a larger mapping are read (none here)


def _writable_mappings(pid: int) -> list[tuple[int, int]]:
    out = []
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) < 2 or "w" not in fields[1]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def _entries(pagemap: int, start: int, pages: int) -> tuple[int, ...]:
    data = os.pread(pagemap, 8 * pages, start // PAGE * 8)
    return struct.unpack(f"{len(data) // 8}Q", data)


def classify(zygote_pid: int, worker_pid: int) -> dict[str, int] | None:
    """Bytes of the worker's own pages by kind (KINDS); None where the memory cannot be read."""
    counts = dict.fromkeys(KINDS, 0)
    fds: list[int] = []
    try:
        for pid, name in (
            (worker_pid, "pagemap"),
            (zygote_pid, "pagemap"),
            (worker_pid, "mem"),
            (zygote_pid, "mem"),
        ):
            fds.append(os.open(f"/proc/{pid}/{name}", os.O_RDONLY))
        w_map, z_map, w_mem, z_mem = fds
        for start, end in _writable_mappings(worker_pid):
            pages = min((end - start) // PAGE, _MAX_MAPPING_PAGES)
            mine = _entries(w_map, start, pages)
            theirs = _entries(z_map, start, pages)  # an address the zygote has not mapped reads 0
            for i, entry in enumerate(mine):
                if not entry & _PRESENT or not entry & _EXCLUSIVE:
                    continue
                if i >= len(theirs) or not theirs[i] & _PRESENT:
                    counts["new"] += PAGE
                    continue
                address = start + i * PAGE
                try:
                    a = os.pread(w_mem, PAGE, address)
                    b = os.pread(z_mem, PAGE, address)
                except OSError:  # unmapped meanwhile: the worker is alive and changing
                    continue
                differ = sum(1 for j in range(0, PAGE, WORD) if a[j : j + WORD] != b[j : j + WORD])
                kind = "identical" if differ == 0 else "few words" if differ <= FEW_WORDS else "more"
                counts[kind] += PAGE
    except OSError:  # no ptrace access, or a process gone
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return counts
