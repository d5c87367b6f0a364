"""The zygote's fills (worker/pages.py): filler objects land in their size class; malloc_info is read right."""

from __future__ import annotations

import logging
import sys

import pytest

from worker.pages import filler, malloc_free_chunks


@pytest.mark.parametrize("size", range(16, 513, 16))
def test_each_filler_object_takes_a_block_of_its_size_class(size: int) -> None:
    """filler(size) makes objects whose allocation lands in pymalloc's `size` class: above
    `size` - 16 and at most `size` bytes, so a fill of class N never spills into class N+1."""
    for obj in filler(size, 3):
        assert size - 16 < sys.getsizeof(obj) <= size, (size, type(obj), sys.getsizeof(obj))


REPORT = """<malloc version="1">
<heap nr="0">
<sizes>
  <size from="17" to="32" total="64" count="2"/>
  <size from="49" to="64" total="192" count="3"/>
  <size from="33" to="33" total="462" count="14"/>
  <size from="209" to="209" total="1881" count="9"/>
  <size from="1041" to="1137" total="3315" count="3"/>
  <unsorted from="2785" to="2785" total="2785" count="1"/>
</sizes>
<total type="fast" count="0" size="0"/>
<total type="rest" count="27" size="8443"/>
</heap>
<heap nr="1">
<sizes>
  <size from="65" to="65" total="650" count="10"/>
</sizes>
</heap>
<total type="mmap" count="3" size="819200"/>
</malloc>
"""


def test_the_main_arenas_free_chunks_are_read_from_malloc_info() -> None:
    """malloc_free_chunks reads the bins of the first heap (glibc's main arena) only, the unsorted
    bin included: a fastbin's row (size - 15 to size) gives its size, any other bin's `from` its
    size with the flag bits (PREV_INUSE: 33 for a 32-byte chunk) cleared, a range its smallest."""
    assert malloc_free_chunks(REPORT) == [(32, 2), (64, 3), (32, 14), (208, 9), (1040, 3), (2784, 1)]


def test_a_report_without_bins_gives_no_chunks() -> None:
    """A report with no free chunk (or not glibc's at all) gives nothing to fill."""
    assert (
        malloc_free_chunks('<malloc version="1">\n<heap nr="0">\n<sizes>\n</sizes>\n</heap>\n</malloc>') == []
    )
    assert malloc_free_chunks("") == []


def test_a_failing_sharing_step_is_said_in_a_line_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """The zygote's sharing steps only save memory: one that raises is logged as one warning
    naming the step and the error, and preload goes on (the zygote never dies of it)."""
    from worker.zygote import _share

    def fill_something() -> None:
        raise OSError("no memfd here")

    with caplog.at_level(logging.WARNING, logger="gpuvisor.zygote"):
        _share(fill_something)
    assert [r.getMessage() for r in caplog.records] == [
        "skipped fill_something (OSError: no memfd here): workers share fewer of the zygote's pages"
    ]
