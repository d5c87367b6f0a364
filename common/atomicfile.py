"""Atomic file writes, the one helper for them: a temp file beside the target, fsync'd, renamed.

A reader sees the old content or the new one, never half of either. The supervisor writes its
plans, its socket record, the labels file and the MPS markers with it (supervisor/host/rundir.py
re-exports it), and the DRA worker its checkpoint of prepared claims (common/dracheckpoint.py).
"""

from __future__ import annotations

import contextlib
import os

TEMP_PREFIX = ".gv-"  # temp files of atomic writes: `.gv-<name>.<pid>.tmp`


def stage_atomic(path: str, text: str | bytes, mode: int = 0o600) -> str:
    """Write `text` (UTF-8, or bytes as they are) to a temp file beside `path`, fsync'd; returns
    the temp file (rename it into place, or unlink it). Raises OSError, leaving no temp file.

    The temp file is created exclusively and never through a symlink; the rename replaces a
    symlink at `path` itself rather than writing where it points.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{os.path.basename(path)}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a crash of this very pid number
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask (as renameio's WriteFile does)
        with os.fdopen(fd, "wb") as fh:
            fh.write(text if isinstance(text, bytes) else text.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: str, text: str | bytes, mode: int = 0o600, *, sync_dir: bool = False) -> None:
    """Replace `path` with `text`: temp file beside it, fsync, rename. Raises OSError.

    With `sync_dir`, the directory is fsync'd after the rename too, so that the new name (not
    only the new content) survives a crash.
    """
    tmp = stage_atomic(path, text, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def remove_temp_files(directory: str) -> list[str]:
    """Temp files a killed supervisor left in `directory` (ours by name, regular files): removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if (
                entry.name.startswith(TEMP_PREFIX)
                and entry.name.endswith(".tmp")
                and entry.is_file(follow_symlinks=False)
            ):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed
