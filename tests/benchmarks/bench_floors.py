"""The floors of this run (`floors`): what a bare interpreter and a bare gRPC plugin cost here.

Listed first so that the table shows them before the figures read beside them; the benchmarks
that use them share this one measurement (`floors.measure`).
"""

from __future__ import annotations

from tests.benchmarks import floors
from tests.benchmarks.common import Row


def run(quick: bool) -> list[Row]:
    return floors.rows(floors.measure(quick))
