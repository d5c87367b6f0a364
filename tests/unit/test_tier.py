"""The unit tier's guard (tests/unit/conftest.py) holds: no way of starting a process gets through."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        lambda: os.fork(),
        lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ),
        lambda: os.system("true"),
        lambda: os.forkpty(),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    ],
    ids=[
        "subprocess",
        "fork",
        "posix_spawn",
        "system",
        "forkpty",
        "multiprocessing-spawn",
        "multiprocessing-fork",
    ],
)
def test_a_unit_test_cannot_start_a_process(start: object) -> None:
    """Each way of starting a process fails with the reason, so a process test cannot hide here."""
    with pytest.raises(AssertionError, match="belongs in tests/process/"):
        start()  # type: ignore[operator]
