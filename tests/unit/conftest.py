"""The unit tier's promise, enforced: a unit test starts no process.

Anything that would (subprocess, os.fork, os.forkpty, os.posix_spawn, os.system,
multiprocessing) fails the test with
the reason instead, so a test that needs a process is moved to tests/process/ rather than
slowing down `pytest -m unit` unseen.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("a unit test starts no process: a test that needs one belongs in tests/process/")


@pytest.fixture(autouse=True)
def no_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Process creation is refused for the test's duration."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    monkeypatch.setattr(os, "posix_spawnp", _refuse)
    monkeypatch.setattr(os, "system", _refuse)
    monkeypatch.setattr(os, "forkpty", _refuse)
    yield
