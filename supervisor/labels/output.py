"""The features.d file NFD reads: written atomically, and only when its content changes.

NFD's worker reads every file in `features.d` as `key=value` lines, so a reader must never see a
half-written file: the labels are written with the one atomic-write helper (`common.atomicfile`),
to a hidden temp file in the same directory (NFD skips hidden files, and a rename is atomic only within one file
system), created without following symlinks, given mode 0644 (as GFD's renameio write does),
fsynced and renamed over the target; the directory is fsynced after the rename so the new name
survives a crash. An unchanged label set is not written at all: no new
inode, no inotify event for NFD, no disk write every minute.

An empty path writes to standard output instead, as GFD does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TextIO

from common.atomicfile import write_atomic
from supervisor.labels.rules import render


class OutputError(Exception):
    """The labels could not be written: which file, and why."""


class LabelFile:
    """The features.d file at `path` ("" for stdout). Not thread-safe: one writer."""

    def __init__(self, path: str, stdout: TextIO | None = None) -> None:
        self.path = path
        self._stdout = stdout if stdout is not None else sys.stdout
        self._written: str | None = None  # what this object last wrote (or found in place)

    def write_if_changed(self, labels: Mapping[str, str]) -> bool:
        """Write the labels unless the file already holds exactly them; True when written."""
        text = render(labels)
        if text == self._written:
            return False
        if not self.path:
            self._stdout.write(text)
            self._stdout.flush()
            self._written = text
            return True
        if self._written is None and self._current() == text:
            self._written = text  # a restart with the same labels rewrites nothing
            return False
        self._replace(text)
        self._written = text
        return True

    def remove(self) -> bool:
        """Remove the file (GFD does on a clean stop, so NFD drops the labels); True when removed."""
        self._written = None
        if not self.path:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise OutputError(f"cannot remove the labels file {self.path}: {exc.strerror or exc}") from None
        return True

    def _current(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                return fh.read(1 << 20)
        except (OSError, UnicodeDecodeError):
            return None

    def _replace(self, text: str) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise OutputError(
                f"cannot write the labels file {self.path}: the directory {directory} does not exist "
                "(mount NFD's features.d directory there, or give --output-file)"
            )
        try:
            write_atomic(self.path, text, 0o644, sync_dir=True)
        except OSError as exc:
            raise OutputError(f"cannot write the labels file {self.path}: {exc.strerror or exc}") from None
