"""The config file's fingerprint (supervisor/config/fingerprint.py): what decides whether a file
event is a change the supervisor or the labeller acts on."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import fingerprint as fp_module
from supervisor.config.fingerprint import fingerprint


def test_the_same_bytes_give_the_same_fingerprint_and_any_edit_another(tmp_path: Path) -> None:
    """Rewriting the same bytes (a `touch`, an atomic replace by a ConfigMap update) is no change;
    one byte changed in the middle, one appended, or the file emptied is."""
    path = tmp_path / "config.yaml"
    text = b"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    path.write_bytes(text)
    first = fingerprint(str(path))
    path.write_bytes(text)
    assert fingerprint(str(path)) == first
    seen = {first}
    for edited in (text.replace(b"replicas: 4", b"replicas: 5"), text + b"\n", b""):
        path.write_bytes(edited)
        seen.add(fingerprint(str(path)))
    assert len(seen) == 4


def test_a_file_over_the_limit_is_read_only_to_the_limit_and_still_seen_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_CONFIG_BYTES the loader refuses the file whatever it holds, so no more is read
    (a huge file costs no memory); its size still tells a change from none."""
    monkeypatch.setattr(fp_module, "MAX_CONFIG_BYTES", 16)
    path = tmp_path / "big.yaml"
    path.write_bytes(b"a" * 100)
    before = fingerprint(str(path))
    assert before.startswith("100:17:")
    path.write_bytes(b"a" * 101)
    assert fingerprint(str(path)) != before


def test_an_unreadable_file_raises_oserror(tmp_path: Path) -> None:
    """A missing file is an OSError for the caller to report (replan and the labeller do)."""
    with pytest.raises(OSError):
        fingerprint(str(tmp_path / "missing.yaml"))
