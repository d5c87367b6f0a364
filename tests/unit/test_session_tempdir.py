"""The test suite's own temp-dir rule (tests/conftest.py): each pytest session gets a base temp dir
of its own, so a session ending beside another cannot delete the other's files."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from tests import conftest


def fake_config(basetemp: str | None) -> Any:
    return SimpleNamespace(option=SimpleNamespace(basetemp=basetemp))


def test_each_session_gets_its_own_base_temp_dir_and_removes_it() -> None:
    """Two sessions side by side get two different fresh dirs; each session's end removes its own
    only (pytest's shared /tmp/pytest-of-<user> is not used)."""
    first, second = fake_config(None), fake_config(None)
    conftest.pytest_configure(first)
    conftest.pytest_configure(second)
    try:
        a, b = first.option.basetemp, second.option.basetemp
        assert a != b and os.path.isdir(a) and os.path.isdir(b)
        assert "pytest-of-" not in a
        conftest.pytest_unconfigure(first)
        assert not os.path.exists(a) and os.path.isdir(b)
    finally:
        conftest.pytest_unconfigure(first)
        conftest.pytest_unconfigure(second)
    assert not os.path.exists(second.option.basetemp)


def test_a_basetemp_given_on_the_command_line_is_left_alone(tmp_path: Any) -> None:
    """--basetemp DIR is the user's: not replaced, and not removed at the end."""
    given = tmp_path / "mine"
    given.mkdir()
    config = fake_config(str(given))
    conftest.pytest_configure(config)
    conftest.pytest_unconfigure(config)
    assert config.option.basetemp == str(given) and given.is_dir()
