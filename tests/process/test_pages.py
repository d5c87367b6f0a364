"""What the zygote does before its first fork so its pages stay shared (worker/pages.py).

Each check runs in a fresh interpreter: the fill and the caches are process-wide state, and the
test process's own history (what it already asked of an ABC, its allocator's holes) would
decide the outcome instead of the code under test.
"""

from __future__ import annotations

import json
from typing import Any

from tests.harness import child_env, run_python

POOL_BYTES = 16384  # CPython 3.10+ pymalloc pools on 64-bit


def _run(code: str) -> tuple[dict[str, Any], str]:
    # pymalloc as on a node: the debug allocator's hooks would change every block's size
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONMALLOC", "PYTHONDEVMODE")}
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_the_fill_leaves_no_free_block_in_the_pools_that_held_objects() -> None:
    """With holes punched in many pools (every other object of 40,000 freed), the report shows
    thousands of free blocks; after fill_allocator_holes each size class has at most the free
    blocks of one pool (the fresh pool the fill itself opened last) and a few more, and nothing
    was printed."""
    found, stderr = _run(
        "import json\n"
        "from worker.pages import fill_allocator_holes, pool_free_blocks\n"
        "keep = [bytes(40) for _ in range(40000)]\n"
        "del keep[::2]\n"
        "before = pool_free_blocks()\n"
        "made = fill_allocator_holes()\n"
        "print(json.dumps({'before': before, 'after': pool_free_blocks(), 'made': made}))\n"
    )
    before = {int(k): v for k, v in found["before"].items()}
    after = {int(k): v for k, v in found["after"].items()}
    assert before[80] >= 20000, before  # bytes(40) is 73 bytes: the 80-byte class
    # One fresh pool per class, plus the few holes the last report's own parsing left.
    assert all(free <= POOL_BYTES // size + 64 for size, free in after.items()), after
    assert found["made"] >= 20000 * 80
    assert stderr == ""


def test_the_fill_is_bounded() -> None:
    """However many free blocks the report shows, the fill makes at most FILL_MAX_BYTES of filler."""
    found, _ = _run(
        "import json\n"
        "from worker import pages\n"
        "pages.FILL_MAX_BYTES = 64 * 1024\n"
        "keep = [bytes(40) for _ in range(40000)]\n"
        "del keep[::2]\n"
        "print(json.dumps({'made': pages.fill_allocator_holes()}))\n"
    )
    assert 0 < int(found["made"]) <= 64 * 1024


def test_without_pymalloc_nothing_is_filled() -> None:
    """With PYTHONMALLOC=malloc the report has no pools: the fill makes nothing and says nothing."""
    proc = run_python(
        "from worker.pages import fill_allocator_holes as f; print(f())",
        {**child_env(), "PYTHONMALLOC": "malloc"},
    )
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "0", "")


def test_warmed_abc_caches_answer_a_builtin_type_from_the_cache() -> None:
    """warm_abc_caches puts the builtin types into the ABCs' caches (Mapping's negative cache holds
    int, str, float and list; Sequence's positive cache holds list), which were empty of them before."""
    found, _ = _run(
        "import _abc, json, collections.abc as c\n"
        "from worker.pages import warm_abc_caches\n"
        "def cached(abc_class, positive):\n"
        "    _, cache, negative, _ = _abc._get_dump(abc_class)\n"
        "    refs = cache if positive else negative\n"
        "    return sorted(r().__name__ for r in refs if r() in (int, str, float, list))\n"
        "before = [cached(c.Mapping, False), cached(c.Sequence, True)]\n"
        "warm_abc_caches()\n"
        "print(json.dumps({'before': before, 'after': [cached(c.Mapping, False), cached(c.Sequence, True)]}))\n"
    )
    assert found["before"] == [[], []]
    assert found["after"] == [["float", "int", "list", "str"], ["list"]]


def test_the_malloc_fill_takes_the_main_arenas_free_chunks() -> None:
    """With 1,000 chunks of 208 bytes freed between live ones (so they cannot merge), glibc's
    report shows them in a bin; after fill_malloc_holes they are gone (at most 2 left: reading the
    report again allocates and frees, and whether a chunk of this size is among what it frees
    depends on the lengths of the interpreter's paths), and the fill says how many bytes it took."""
    found, stderr = _run(
        "import ctypes, json\n"
        "from worker.pages import fill_malloc_holes, malloc_free_chunks, malloc_report\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.malloc.argtypes = [ctypes.c_size_t]\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "chunks = [libc.malloc(200) for _ in range(2000)]\n"
        "for p in chunks[::2]:\n"
        "    libc.free(p)\n"
        "def free_208():\n"
        "    return sum(n for size, n in malloc_free_chunks(malloc_report()) if size == 208)\n"
        "before = free_208()\n"
        "made = fill_malloc_holes()\n"
        "print(json.dumps({'before': before, 'after': free_208(), 'made': made}))\n"
    )
    assert found["before"] >= 900, found
    assert found["after"] <= 2, found
    assert found["made"] >= 900 * 208
    assert stderr == ""
