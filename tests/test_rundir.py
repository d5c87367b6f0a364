"""Tests of the run dir part (supervisor/rundir.py): layout, atomic writes, and the one rule for
which sockets in the plugin dir gpuvisor removes."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.rundir import RunDir, RunDirError, SocketSweeper, write_atomic


def dead_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays; nobody listens


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "p"
    d.mkdir()
    yield d


def test_write_atomic_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    """The target holds the new text, mode 0600, and no temp file is left beside it."""
    target = tmp_path / "plan.json"
    target.write_text("old")
    write_atomic(str(target), "new")
    assert target.read_text() == "new"
    assert oct(target.stat().st_mode & 0o777) == "0o600"
    assert os.listdir(tmp_path) == ["plan.json"]


def test_write_atomic_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    """A symlink at the target is replaced by a file; the file it pointed to is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "plan.json"
    link.symlink_to(victim)
    write_atomic(str(link), "plan")
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and link.read_text() == "plan"


def test_write_atomic_failure_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    """A write that cannot happen raises OSError and changes nothing."""
    missing = tmp_path / "gone" / "plan.json"
    with pytest.raises(OSError):
        write_atomic(str(missing), "x")
    assert os.listdir(tmp_path) == []


def test_run_dir_paths_that_cannot_be_unix_sockets_are_refused(tmp_path: Path) -> None:
    """A run dir whose control.sock path is over 107 bytes is refused, naming the limit."""
    with pytest.raises(RunDirError, match="at most 107 bytes"):
        RunDir(str(tmp_path / ("x" * 120))).check_socket_paths()


def test_prepare_makes_a_private_run_dir_with_its_plans_dir(tmp_path: Path) -> None:
    """The run dir is 0700 and holds plans/; stale control and health sockets are gone."""
    rd = RunDir(str(tmp_path / "r"))
    os.makedirs(rd.path)
    dead_socket(Path(rd.control_path))
    rd.prepare()
    assert oct(os.stat(rd.path).st_mode & 0o777) == "0o700"
    assert os.path.isdir(rd.plans_dir) and not os.path.exists(rd.control_path)


def test_sweeper_removes_only_dead_worker_sockets_of_the_resource(plugin_dir: Path) -> None:
    """Dead sockets named like the resource's workers go; other resources' and foreign ones stay."""
    for name in ("gpuvisor-gpu-0a1b2c3d.sock", "gpuvisor-gpu.shared-0a1b2c3d.sock", "other.sock"):
        dead_socket(plugin_dir / name)
    removed = SocketSweeper(str(plugin_dir)).sweep("nvidia.com/gpu")
    assert removed == ["gpuvisor-gpu-0a1b2c3d.sock"]
    assert sorted(os.listdir(plugin_dir)) == ["gpuvisor-gpu.shared-0a1b2c3d.sock", "other.sock"]


def test_sweeper_never_touches_a_directory_a_file_or_a_symlink(plugin_dir: Path) -> None:
    """Entries named like worker sockets that are not sockets are never removed (nor followed)."""
    (plugin_dir / "gpuvisor-gpu-0badc0de.sock").mkdir()
    (plugin_dir / "gpuvisor-gpu-1badc0de.sock").write_text("a file")
    target = plugin_dir / "elsewhere.sock"
    dead_socket(target)
    (plugin_dir / "gpuvisor-gpu-2badc0de.sock").symlink_to(target)
    assert SocketSweeper(str(plugin_dir)).sweep("nvidia.com/gpu") == []
    assert len(os.listdir(plugin_dir)) == 4


def test_sweeper_leaves_a_socket_someone_listens_on(plugin_dir: Path) -> None:
    """A live server's socket is not ours to remove, whatever its name."""
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(str(plugin_dir / "gpuvisor-gpu-11112222.sock"))
        live.listen(1)
        assert SocketSweeper(str(plugin_dir)).sweep() == []
    finally:
        live.close()


def test_sweeper_of_a_missing_dir_removes_nothing(tmp_path: Path) -> None:
    """No plugin dir (yet): nothing to do, no error."""
    assert SocketSweeper(str(tmp_path / "nope")).sweep() == []
