"""The spawner takes the zygote `gpuvisor run` started early (supervisor/launch.py, entered by
supervisor/__main__.py's main however it is called), or stops it; one is started only for a run
that will use it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from supervisor.host.rundir import RunDir
from supervisor.launch import start_early_zygote
from supervisor.workers.spawner import WorkerSpawner
from supervisor.workers.zygote import Zygote
from tests.fakes import sim_config


class EarlyZygote:
    """A zygote already running (its process stands in as a pid), as cli.cmd_run hands it over."""

    def __init__(self) -> None:
        self.proc = SimpleNamespace(pid=4242)
        self.sock = None
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def spawner(tmp_path: Path, **env: str) -> WorkerSpawner:
    return WorkerSpawner(config=sim_config(**env), rundir=RunDir(str(tmp_path)), record_tag=lambda r, t: None)


def test_the_early_zygote_is_taken_and_no_second_one_is_started(tmp_path: Path) -> None:
    """With the zygote on, adopt() makes the early one the spawner's own, and start() keeps it
    (a second zygote would pay the imports the early start saved)."""
    s = spawner(tmp_path)
    early = EarlyZygote()
    s.adopt(early)  # type: ignore[arg-type]
    s.start()
    assert s.zygote is early  # type: ignore[comparison-overlap]
    assert not early.stopped


def test_the_early_zygote_is_stopped_when_the_config_turns_the_zygote_off(tmp_path: Path) -> None:
    """A config that says --zygote=false (a file or env the CLI could not see) stops the early
    zygote: workers start by exec, and no idle zygote is left holding memory."""
    s = spawner(tmp_path, GPUVISOR_ZYGOTE="false")
    early = EarlyZygote()
    s.adopt(early)  # type: ignore[arg-type]
    assert early.stopped and s.zygote is None


def test_a_zygote_already_started_by_the_spawner_is_kept_and_the_late_one_stopped(tmp_path: Path) -> None:
    """adopt() after the spawner's own zygote started (never in gpuvisor run) keeps the running one."""
    s = spawner(tmp_path)
    own = EarlyZygote()
    s.zygote = own  # type: ignore[assignment]
    late = EarlyZygote()
    s.adopt(late)  # type: ignore[arg-type]
    assert s.zygote is own  # type: ignore[comparison-overlap]
    assert late.stopped and not own.stopped


def test_a_fresh_zygote_handle_has_no_process() -> None:
    """The spawner's own handle starts nothing until start(): adopt() can tell it from an early one."""
    assert Zygote().proc is None


@pytest.mark.parametrize(
    ("words", "environ"),
    [
        (["status"], {}),
        ([], {}),
        (["labels", "--oneshot"], {}),
        (["run", "--help"], {}),
        (["run", "-h"], {}),
        (["run", "--version"], {}),
        (["run", "--zygote=false"], {}),
        (["run"], {"GPUVISOR_ZYGOTE": "false"}),
        (["run"], {"GPUVISOR_ZYGOTE": "0"}),
    ],
)
def test_no_early_zygote_for_a_command_that_will_not_use_one(
    words: list[str], environ: dict[str, str]
) -> None:
    """The zygote is started ahead of the CLI (by the entry point's launch) only for a `run`
    that will use it: another command, help, a version, or the zygote turned off on the command
    line or in the environment start no process (this tier refuses one)."""
    assert start_early_zygote(words, environ) is None


def test_the_console_script_is_the_entry_point_that_starts_the_zygote_first() -> None:
    """`gpuvisor` (pyproject's console script) runs supervisor/__main__.py's main, which starts the
    zygote before importing the CLI; not the CLI's main, which would start it ~26 ms later."""
    import tomllib

    from tests.helpers import REPO

    with open(f"{REPO}/pyproject.toml", "rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    assert scripts == {"gpuvisor": "supervisor.__main__:main"}
    import supervisor.__main__ as entry

    assert callable(entry.main)


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({"PATH": "/bin"}, "2"),
        ({"MALLOC_ARENA_MAX": "8"}, "8"),
        ({"MALLOC_ARENA_MAX": ""}, "2"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, None),
        ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, "2"),
    ],
)
def test_worker_processes_get_two_malloc_arenas_unless_the_operator_chose(
    environ: dict[str, str], want: str | None
) -> None:
    """worker_environ (the zygote's and an exec'd worker's environment) caps glibc's malloc
    arenas at 2 by MALLOC_ARENA_MAX, keeps the operator's own MALLOC_ARENA_MAX (an empty one is
    none), adds none where
    GLIBC_TUNABLES sets glibc.malloc.arena_max, and leaves every other variable as it was."""
    from supervisor.workers.zygoteproc import worker_environ

    env = worker_environ(environ)
    assert env.get("MALLOC_ARENA_MAX") == want
    assert {k: v for k, v in env.items() if k != "MALLOC_ARENA_MAX"} == {
        k: v for k, v in environ.items() if k != "MALLOC_ARENA_MAX"
    }
