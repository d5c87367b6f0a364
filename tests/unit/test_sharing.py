"""The zygote's filler objects land in the size class they are made for (worker/sharing.py)."""

from __future__ import annotations

import sys

import pytest

from worker.sharing import filler


@pytest.mark.parametrize("size", range(16, 513, 16))
def test_each_filler_object_takes_a_block_of_its_size_class(size: int) -> None:
    """filler(size) makes objects whose allocation lands in pymalloc's `size` class: above
    `size` - 16 and at most `size` bytes, so a fill of class N never spills into class N+1."""
    for obj in filler(size, 3):
        assert size - 16 < sys.getsizeof(obj) <= size, (size, type(obj), sys.getsizeof(obj))
