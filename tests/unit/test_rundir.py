"""Tests of the run dir part (supervisor/host/rundir.py): layout, atomic writes, and the one rule for
which sockets in the plugin dir gpuvisor removes."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.atomicfile import write_atomic
from common.socketnames import socket_name
from supervisor.host.rundir import (
    RunDir,
    RunDirError,
    RunDirInUse,
    RunDirTooLong,
    RunDirUntrusted,
    WorkerSockets,
)
from tests.helpers import short_tmpdir


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
    """A run dir whose control.sock path is over 107 bytes is refused, naming the limit, as a
    config error (the setting must change)."""
    with pytest.raises(RunDirError, match="at most 107 bytes") as info:
        RunDir(str(tmp_path / ("x" * 120))).check_socket_paths()
    assert info.value.config_error


def test_only_a_setting_that_cannot_work_is_a_config_error() -> None:
    """A run dir too long or not gpuvisor's alone is a config error (exit 78); one a live
    supervisor uses, or that cannot be made, is not."""
    assert RunDirTooLong.config_error and RunDirUntrusted.config_error
    assert not RunDirInUse.config_error and not RunDirError.config_error


def test_prepare_makes_a_private_run_dir_with_its_plans_dir(tmp_path: Path) -> None:
    """The run dir is 0700 and holds plans/; stale control and health sockets are gone."""
    rd = RunDir(str(tmp_path / "r"))
    os.makedirs(rd.path)
    dead_socket(Path(rd.control_path))
    rd.prepare()
    assert oct(os.stat(rd.path).st_mode & 0o777) == "0o700"
    assert os.path.isdir(rd.plans_dir) and not os.path.exists(rd.control_path)


def sockets(plugin_dir: Path, tmp: Path) -> WorkerSockets:
    return WorkerSockets(str(plugin_dir), str(tmp / "sockets.json"))


def test_only_sockets_with_a_recorded_tag_of_the_resource_are_removed(
    plugin_dir: Path, tmp_path: Path
) -> None:
    """Dead sockets of the recorded tag go; the same name shape with another tag, or of another
    resource, and foreign sockets stay."""
    for name in (
        "gpuvisor-gpu-a1b2c300.sock",
        "gpuvisor-gpu-ffffff00.sock",
        "gpuvisor-gpu.shared-a1b2c300.sock",
        "other.sock",
    ):
        dead_socket(plugin_dir / name)
    ws = sockets(plugin_dir, tmp_path)
    ws.add("nvidia.com/gpu", "a1b2c3")
    assert ws.sweep("nvidia.com/gpu", "a1b2c3") == ["gpuvisor-gpu-a1b2c300.sock"]
    assert sorted(os.listdir(plugin_dir)) == [
        "gpuvisor-gpu-ffffff00.sock",
        "gpuvisor-gpu.shared-a1b2c300.sock",
        "other.sock",
    ]
    assert ws.tags == {}


def test_a_directory_a_file_or_a_symlink_named_like_our_socket_is_never_touched(
    plugin_dir: Path, tmp_path: Path
) -> None:
    """Entries with a recorded name that are not sockets are never removed nor followed."""
    (plugin_dir / "gpuvisor-gpu-0badc000.sock").mkdir()
    (plugin_dir / "gpuvisor-gpu-0badc001.sock").write_text("a file")
    target = tmp_path / "elsewhere.sock"
    dead_socket(target)
    (plugin_dir / "gpuvisor-gpu-0badc002.sock").symlink_to(target)
    ws = sockets(plugin_dir, tmp_path)
    ws.add("nvidia.com/gpu", "0badc0")
    assert ws.sweep("nvidia.com/gpu", "0badc0") == []
    assert len(os.listdir(plugin_dir)) == 3 and target.exists()


def test_a_socket_someone_listens_on_stays_and_keeps_its_tag(plugin_dir: Path, tmp_path: Path) -> None:
    """A live server's socket is not ours to remove, whatever its name; its tag stays recorded."""
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(str(plugin_dir / "gpuvisor-gpu-11112200.sock"))
        live.listen(1)
        ws = sockets(plugin_dir, tmp_path)
        ws.add("nvidia.com/gpu", "111122")
        assert ws.sweep("nvidia.com/gpu") == []
        assert ws.tags == {"nvidia.com/gpu": ["111122"]}
    finally:
        live.close()


def test_the_record_lets_the_next_life_remove_what_this_one_left(plugin_dir: Path, tmp_path: Path) -> None:
    """Tags recorded by one supervisor are read by the next, which removes their dead sockets."""
    first = sockets(plugin_dir, tmp_path)
    first.add("nvidia.com/gpu", "abcdef")
    dead_socket(plugin_dir / "gpuvisor-gpu-abcdef03.sock")
    second = sockets(plugin_dir, tmp_path)
    second.load_earlier()
    assert second.sweep_all() == ["gpuvisor-gpu-abcdef03.sock"]
    assert json.loads((tmp_path / "sockets.json").read_text()) == {"tags": {}}


def test_a_dead_workers_sockets_go_and_the_log_names_them(
    plugin_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker gone: the dead sockets of its tag are removed and named in one line; a worker
    that left none says nothing."""
    dead_socket(plugin_dir / "gpuvisor-gpu-a1b2c300.sock")
    ws = sockets(plugin_dir, tmp_path)
    ws.add("nvidia.com/gpu", "a1b2c3")
    ws.add("nvidia.com/gpu", "d4e5f6")
    with caplog.at_level(logging.INFO, logger="gpuvisor.supervisor"):
        ws.worker_gone("nvidia.com/gpu", "a1b2c3")
        ws.worker_gone("nvidia.com/gpu", "d4e5f6")
    assert os.listdir(plugin_dir) == []
    assert [r.getMessage() for r in caplog.records] == [
        "removed the socket(s) a dead worker of nvidia.com/gpu left: gpuvisor-gpu-a1b2c300.sock"
    ]


def test_taking_over_an_earlier_life_removes_the_sockets_it_left(
    plugin_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At start the next life reads the record, finds no worker of it still running, removes the
    dead sockets its workers left and says which."""
    first = sockets(plugin_dir, tmp_path)
    first.add("nvidia.com/gpu", "abcdef")
    dead_socket(plugin_dir / "gpuvisor-gpu-abcdef03.sock")
    second = sockets(plugin_dir, tmp_path)
    with caplog.at_level(logging.INFO, logger="gpuvisor.supervisor"):
        second.take_over_earlier()
    assert os.listdir(plugin_dir) == [] and second.tags == {}
    assert "removed 1 stale socket(s) of an earlier run: gpuvisor-gpu-abcdef03.sock" in caplog.text


@pytest.mark.parametrize(
    "content", ["not json", '{"tags": {"r": ["../../x"]}}', '{"tags": []}', "x" * (2 << 20)]
)
def test_a_record_that_is_not_ours_is_ignored(plugin_dir: Path, tmp_path: Path, content: str) -> None:
    """A bad, foreign or oversized record removes nothing."""
    (tmp_path / "sockets.json").write_text(content)
    dead_socket(plugin_dir / "gpuvisor-gpu-abcdef03.sock")
    ws = sockets(plugin_dir, tmp_path)
    ws.load_earlier()
    assert ws.sweep_all() == [] and os.listdir(plugin_dir) == ["gpuvisor-gpu-abcdef03.sock"]


def test_a_socket_that_cannot_be_removed_keeps_its_tag_for_the_next_sweep(
    plugin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """unlink failing (a read-only plugin dir) is logged, not raised; the tag is kept, so a later
    sweep removes the socket once it can."""
    dead_socket(plugin_dir / "gpuvisor-gpu-a1b2c300.sock")
    ws = sockets(plugin_dir, tmp_path)
    ws.add("nvidia.com/gpu", "a1b2c3")
    real_unlink = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(30, "Read-only file system", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    assert ws.sweep("nvidia.com/gpu") == []
    assert ws.tags == {"nvidia.com/gpu": ["a1b2c3"]}
    assert "could not remove dead socket" in caplog.text and "Read-only file system" in caplog.text
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert ws.sweep("nvidia.com/gpu") == ["gpuvisor-gpu-a1b2c300.sock"] and ws.tags == {}


def test_a_record_that_cannot_be_written_never_stops_a_worker(plugin_dir: Path, tmp_path: Path) -> None:
    """The record write failing (no run dir) is remembered, not raised; memory keeps the tag."""
    ws = WorkerSockets(str(plugin_dir), str(tmp_path / "gone" / "sockets.json"))
    ws.add("nvidia.com/gpu", "abcdef")
    assert ws.tags == {"nvidia.com/gpu": ["abcdef"]} and "cannot write" in ws.save_error


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p.symlink_to(p.parent / "real", target_is_directory=True), "is a symlink"),
        (lambda p: p.write_text("x"), "not a directory"),
        (lambda p: (p.mkdir(), p.chmod(0o777)), "writable by its group or by everyone"),
        (lambda p: (p.mkdir(), p.chmod(0o720)), "writable by its group"),
    ],
)
def test_a_run_dir_another_user_could_steer_is_refused(tmp_path: Path, make: Any, words: str) -> None:
    """A symlink, a non-directory, or a group/world-writable run dir is refused with a clear error."""
    (tmp_path / "real").mkdir()
    run = tmp_path / "run"
    make(run)
    with pytest.raises(RunDirUntrusted, match=words):
        RunDir(str(run)).prepare()
    assert os.listdir(tmp_path / "real") == []


def test_a_run_dir_of_another_owner_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run dir not owned by this process's uid is refused (seen from another uid)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(run).st_uid + 1)
    with pytest.raises(RunDirUntrusted, match="belongs to uid"):
        RunDir(str(run)).prepare()


def test_an_own_readable_run_dir_is_taken_and_tightened(tmp_path: Path) -> None:
    """A run dir of ours that others may only read is used and made 0700."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    RunDir(str(run)).prepare()
    assert oct(run.stat().st_mode & 0o777) == "0o700"


def test_a_long_resource_name_cut_short_by_the_worker_is_still_recognised(tmp_path: Path) -> None:
    """The worker cuts a long name to fit a socket address; the sweep still knows its socket."""
    resource = "nvidia.com/" + "a" * 60 + ".shared"
    name = socket_name(resource, "abcdef", 0, "/var/lib/kubelet/device-plugins")
    assert len(("/var/lib/kubelet/device-plugins/" + name).encode()) == 107
    with short_tmpdir() as short:
        dead_socket(Path(short) / name)
        ws = sockets(Path(short), tmp_path)
        ws.add(resource, "abcdef")
        assert ws.sweep(resource, "abcdef") == [name]


def test_plans_are_written_all_or_none(tmp_path: Path) -> None:
    """When one plan cannot be written, none is: every file keeps the plan that was running, and
    no temp file is left (a worker restarting meanwhile never reads half of a refused reload)."""
    rd = RunDir(str(tmp_path / "r"))
    rd.prepare()
    rd.write_plans({"nvidia.com/gpu": "old-a", "nvidia.com/mig-1g.10gb": "old-b"})
    blocker = os.path.join(rd.plans_dir, f".gv-nvidia.com_mig-1g.10gb.json.{os.getpid()}.tmp")
    os.mkdir(blocker)  # the second temp file cannot be made
    with pytest.raises(OSError):
        rd.write_plans({"nvidia.com/gpu": "new-a", "nvidia.com/mig-1g.10gb": "new-b"})
    assert Path(rd.plan_path("nvidia.com/gpu")).read_text() == "old-a"
    assert Path(rd.plan_path("nvidia.com/mig-1g.10gb")).read_text() == "old-b"
    assert sorted(os.listdir(rd.plans_dir)) == sorted(
        ["nvidia.com_gpu.json", "nvidia.com_mig-1g.10gb.json", os.path.basename(blocker)]
    )
    os.rmdir(blocker)
    rd.write_plans({"nvidia.com/gpu": "new-a", "nvidia.com/mig-1g.10gb": "new-b"})
    assert Path(rd.plan_path("nvidia.com/mig-1g.10gb")).read_text() == "new-b"


def test_prepare_removes_temp_files_a_killed_supervisor_left(tmp_path: Path) -> None:
    """Temp files of an interrupted atomic write are removed at the next start; other files stay."""
    rd = RunDir(str(tmp_path / "r"))
    rd.prepare()
    for name in (".gv-nvidia.com_gpu.json.123.tmp", "nvidia.com_gpu.json", "notes.tmp"):
        Path(rd.plans_dir, name).write_text("x")
    rd.prepare()
    assert sorted(os.listdir(rd.plans_dir)) == ["notes.tmp", "nvidia.com_gpu.json"]


def test_the_node_label_is_kept_for_a_restart_and_anything_else_is_ignored(tmp_path: Path) -> None:
    """A label value written is read back by the next run; a missing, oversized or foreign record is None."""
    rundir = RunDir(str(tmp_path / "run"))
    rundir.prepare()
    assert rundir.recall_node_label() is None
    rundir.remember_node_label("ts4")
    assert RunDir(rundir.path).recall_node_label() == "ts4"
    rundir.remember_node_label("")
    assert rundir.recall_node_label() == ""
    for text in ("[1]", '{"label": 4}', "not json", '{"label": "' + "x" * 5000 + '"}'):
        Path(rundir.node_label_record).write_text(text)
        assert rundir.recall_node_label() is None, text
