"""Directory watches on Linux inotify: the part of watchdog's API the file watches use.

`Observer().schedule(handler, directory)`, `start()`, `stop()`, `join()`; the handler's
`dispatch(event)` calls `on_any_event` and then `on_<event_type>`, and an event has watchdog's
`event_type`, `src_path`, `dest_path` and `is_directory`. Only what a watch of one directory
(not recursive) needs: entries created, deleted, moved (a rename inside the directory is one
"moved" event; moved in from elsewhere is "created", moved out is "deleted"), modified (content
or metadata) and closed after writing. Opens and reads are not asked of the kernel at all: the
kubelet reading its own dir must not wake anyone.

Why not watchdog itself: it cost the supervisor about 2 MB and 15 ms at start, and its observer
thread woke every second to look for a stop. Here one thread per observer sleeps in `select` on
the inotify descriptor and a pipe that `stop()` writes to; it wakes only for events, and for the
half second a rename's first half may wait for its second (as watchdog waits).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import struct
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("gpuvisor.inotify")

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
WATCHED = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
    | IN_DELETE_SELF | IN_MOVE_SELF
)  # fmt: skip
GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
MOVE_PAIR_S = 0.5  # a rename's "moved from" waits this long for its "moved to"
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name


@dataclass(frozen=True)
class FileSystemEvent:
    """One change in a watched directory (watchdog's event, as far as the watches read it)."""

    event_type: str  # "created", "deleted", "moved", "modified" or "closed"
    src_path: str
    dest_path: str = ""
    is_directory: bool = False


class FileSystemEventHandler:
    """Receives the events of a watch: override `on_any_event` or the `on_<event_type>` methods."""

    def dispatch(self, event: FileSystemEvent) -> None:
        self.on_any_event(event)
        getattr(self, f"on_{event.event_type}")(event)

    def on_any_event(self, event: FileSystemEvent) -> None:
        pass

    def on_created(self, event: FileSystemEvent) -> None:
        pass

    def on_deleted(self, event: FileSystemEvent) -> None:
        pass

    def on_moved(self, event: FileSystemEvent) -> None:
        pass

    def on_modified(self, event: FileSystemEvent) -> None:
        pass

    def on_closed(self, event: FileSystemEvent) -> None:
        pass


@dataclass
class _Raw:
    wd: int
    mask: int
    cookie: int
    name: str


def _events(data: bytes) -> list[_Raw]:
    out = []
    offset = 0
    while offset + _EVENT.size <= len(data):
        wd, mask, cookie, length = _EVENT.unpack_from(data, offset)
        start = offset + _EVENT.size
        name = data[start : start + length].split(b"\0", 1)[0]
        out.append(_Raw(wd, mask, cookie, os.fsdecode(name)))
        offset = start + length
    return out


class Observer:
    """One inotify instance and the thread that dispatches its events to the handlers."""

    def __init__(self) -> None:
        self.daemon = False
        self._scheduled: list[tuple[FileSystemEventHandler, str]] = []
        self._watches: dict[int, tuple[FileSystemEventHandler, str]] = {}
        self._fd = -1
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None
        # "moved from" halves waiting for their "moved to": cookie -> (when, wd, name, is_dir)
        self._moves: dict[int, tuple[float, int, str, bool]] = {}

    def schedule(self, handler: FileSystemEventHandler, path: str, recursive: bool = False) -> None:
        if recursive:
            raise ValueError("only one directory, not its subdirectories, can be watched")
        self._scheduled.append((handler, os.path.abspath(path)))

    def start(self) -> None:
        """Watch the scheduled directories and start dispatching; OSError when the kernel refuses
        (no such directory, the node's inotify limits)."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        try:
            for handler, path in self._scheduled:
                wd = int(libc.inotify_add_watch(fd, os.fsencode(path), WATCHED | IN_ONLYDIR))
                if wd < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
                self._watches[wd] = (handler, path)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="inotify", daemon=self.daemon)
        self._thread.start()

    def stop(self) -> None:
        if self._stop_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # a handler is stuck: its descriptors stay until it returns
            self._thread = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._stop_r = self._stop_w = -1

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            timeout = None
            if self._moves:
                oldest = min(when for when, _wd, _name, _d in self._moves.values())
                timeout = max(0.0, oldest + MOVE_PAIR_S - time.monotonic())
            ready, _, _ = select.select([self._fd, self._stop_r], [], [], timeout)
            if self._stop_r in ready:
                return
            if self._fd in ready:
                try:
                    data = os.read(self._fd, 65536)
                except BlockingIOError:
                    data = b""
                for raw in _events(data):
                    self._take(raw)
            self._expire_moves()

    def _take(self, raw: _Raw) -> None:
        if raw.mask & IN_Q_OVERFLOW:
            log.warning("inotify queue overflow: some file events were lost")
            return
        watch = self._watches.get(raw.wd)
        if watch is None:
            return
        handler, directory = watch
        if raw.mask & GONE:
            if raw.mask & IN_IGNORED or not raw.name:
                log.warning("%s is no longer watched (deleted or moved away)", directory)
                self._watches.pop(raw.wd, None)
            return
        path = os.path.join(directory, raw.name)
        is_dir = bool(raw.mask & IN_ISDIR)
        if raw.mask & IN_MOVED_FROM:
            self._moves[raw.cookie] = (time.monotonic(), raw.wd, raw.name, is_dir)
            return
        if raw.mask & IN_MOVED_TO:
            source = self._moves.pop(raw.cookie, None)
            if source is not None and source[1] in self._watches:
                src = os.path.join(self._watches[source[1]][1], source[2])
                self._dispatch(handler, FileSystemEvent("moved", src, path, is_dir))
            else:  # moved in from a directory we do not watch: it appeared
                self._dispatch(handler, FileSystemEvent("created", path, "", is_dir))
        elif raw.mask & IN_CREATE:
            self._dispatch(handler, FileSystemEvent("created", path, "", is_dir))
        elif raw.mask & IN_DELETE:
            self._dispatch(handler, FileSystemEvent("deleted", path, "", is_dir))
        elif raw.mask & (IN_MODIFY | IN_ATTRIB):
            self._dispatch(handler, FileSystemEvent("modified", path, "", is_dir))
        elif raw.mask & IN_CLOSE_WRITE:
            self._dispatch(handler, FileSystemEvent("closed", path, "", is_dir))

    def _expire_moves(self) -> None:
        """A rename whose other half never came moved the entry out of our directory: it is gone."""
        now = time.monotonic()
        for cookie, (when, wd, name, is_dir) in list(self._moves.items()):
            if now - when >= MOVE_PAIR_S:
                del self._moves[cookie]
                watch = self._watches.get(wd)
                if watch is not None:
                    self._dispatch(
                        watch[0], FileSystemEvent("deleted", os.path.join(watch[1], name), "", is_dir)
                    )

    @staticmethod
    def _dispatch(handler: FileSystemEventHandler, event: FileSystemEvent) -> None:
        try:
            handler.dispatch(event)
        except Exception:  # a handler's bug must not end the watch
            log.exception("a file-event handler failed on %s", event)
