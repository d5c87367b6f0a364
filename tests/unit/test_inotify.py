"""supervisor/host/inotify.py: directory watches on real inotify in a temp dir (threads, no process)."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.host.inotify import MOVE_PAIR_S, FileSystemEvent, FileSystemEventHandler, Observer


class Recorder(FileSystemEventHandler):
    def __init__(self) -> None:
        self.events: queue.Queue[FileSystemEvent] = queue.Queue()
        self.specific: list[str] = []

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.events.put(event)

    def on_created(self, event: FileSystemEvent) -> None:
        self.specific.append("created")

    def next(self, timeout: float = 5.0) -> FileSystemEvent:
        return self.events.get(timeout=timeout)

    def quiet(self, seconds: float = 0.2) -> bool:
        try:
            self.events.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, Recorder, Observer]]:
    recorder = Recorder()
    observer = Observer()
    observer.daemon = True
    observer.schedule(recorder, str(tmp_path))
    observer.start()
    try:
        yield tmp_path, recorder, observer
    finally:
        observer.stop()
        observer.join(5)


def test_created_deleted_and_written_entries_are_reported_with_their_paths(
    watched: tuple[Path, Recorder, Observer],
) -> None:
    """A new file is "created" (dispatched to on_created too), a write "modified" then "closed",
    a removal "deleted"; each event names the entry's full path."""
    directory, rec, _ = watched
    path = directory / "kubelet.sock"
    path.write_bytes(b"x")
    assert rec.next() == FileSystemEvent("created", str(path))
    assert rec.next().event_type == "modified"
    assert rec.next() == FileSystemEvent("closed", str(path))
    assert rec.specific == ["created"]
    path.unlink()
    assert rec.next() == FileSystemEvent("deleted", str(path))


def test_a_rename_inside_the_directory_is_one_moved_event(watched: tuple[Path, Recorder, Observer]) -> None:
    """A ConfigMap's `..data_tmp` renamed over `..data` is one "moved" event with both paths."""
    directory, rec, _ = watched
    os.symlink("a", directory / "..data_tmp")
    assert rec.next().event_type == "created"
    os.rename(directory / "..data_tmp", directory / "..data")
    assert rec.next() == FileSystemEvent("moved", str(directory / "..data_tmp"), str(directory / "..data"))
    assert rec.quiet()


def test_moved_in_is_created_and_moved_out_is_deleted(
    watched: tuple[Path, Recorder, Observer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An entry renamed in from an unwatched directory appears ("created"); one renamed out is
    "deleted" once its other half has not come within MOVE_PAIR_S."""
    directory, rec, _ = watched
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "f").write_bytes(b"")
    os.rename(elsewhere / "f", directory / "f")
    assert rec.next() == FileSystemEvent("created", str(directory / "f"))
    t0 = time.monotonic()
    os.rename(directory / "f", elsewhere / "g")
    assert rec.next() == FileSystemEvent("deleted", str(directory / "f"))
    assert time.monotonic() - t0 >= MOVE_PAIR_S * 0.9


def test_reads_of_the_directory_wake_no_one(watched: tuple[Path, Recorder, Observer]) -> None:
    """Listing the directory or reading a file in it is no event (the kubelet reads its own dir)."""
    directory, rec, _ = watched
    (directory / "f").write_bytes(b"data")
    while not rec.quiet():
        pass
    os.listdir(directory)
    (directory / "f").read_bytes()
    assert rec.quiet(0.3)


def test_stop_wakes_the_thread_at_once(tmp_path: Path) -> None:
    """The thread sleeps until an event or stop(): stop() and join() return well under a second."""
    observer = Observer()
    observer.schedule(Recorder(), str(tmp_path))
    observer.start()
    t0 = time.monotonic()
    observer.stop()
    observer.join(5)
    assert time.monotonic() - t0 < 0.5


def test_a_directory_that_does_not_exist_fails_at_start(tmp_path: Path) -> None:
    """start() raises OSError (the watches log it and go on without that watch)."""
    observer = Observer()
    observer.schedule(Recorder(), str(tmp_path / "missing"))
    with pytest.raises(OSError):
        observer.start()


def test_a_failing_handler_does_not_end_the_watch(watched: tuple[Path, Recorder, Observer]) -> None:
    """An exception in one handler call is logged; the next event is still delivered."""
    directory, rec, _ = watched
    calls = 0
    original = rec.on_created

    def flaky(event: FileSystemEvent) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        original(event)

    rec.on_created = flaky  # type: ignore[method-assign]
    (directory / "a").mkdir()
    (directory / "b").mkdir()
    kinds = [rec.next(), rec.next()]
    assert [e.event_type for e in kinds] == ["created", "created"] and kinds[0].is_directory
    assert calls == 2 and rec.specific == ["created"]
