"""supervisor/launch.py's `Launch`: the dataclass code cache it installs for `gpuvisor run` is
released once, by the supervisor's start or else by the launch's exit, whatever the command did.
(Its zygote's start and end need a process: tests/process/test_zygote.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from common import methodcache
from supervisor.launch import Launch


def cache_installed() -> bool:
    return vars(dataclasses).get("exec") is methodcache._exec


@pytest.mark.parametrize(
    ("words", "installed"),
    [(["run", "--zygote=false"], True), (["status"], False), (["labels", "--oneshot"], False), ([], False)],
)
def test_the_cache_is_installed_for_run_only(words: list[str], installed: bool) -> None:
    """Inside the launch, `@dataclass` compiles through the cache for `gpuvisor run` only: the
    other commands import little of the supervisor, and a table held for them would be ~0.5 MB for
    nothing. With the zygote off, no zygote is started."""
    with Launch(words, {}) as launch:
        assert cache_installed() is installed
        assert launch.zygote is None
    assert not cache_installed()


def test_the_exit_releases_the_cache_when_the_command_raises() -> None:
    """A command that ends in an exception before the supervisor's start released the cache
    leaves `dataclasses` with its own exec and no table behind."""
    with pytest.raises(RuntimeError, match="the command failed"), Launch(["run", "--zygote=false"], {}):
        assert cache_installed()
        raise RuntimeError("the command failed")
    assert not cache_installed()
    assert methodcache._table is None


def test_imports_done_releases_the_cache_once() -> None:
    """`imports_done()` (the supervisor's start, once its modules are in) releases the cache at
    once; a second call, and the exit after it, find nothing to release."""
    with Launch(["run", "--zygote=false"], {}) as launch:
        launch.imports_done()
        assert not cache_installed()
        assert launch.imports_done() == (0, 0)
    assert not cache_installed()
