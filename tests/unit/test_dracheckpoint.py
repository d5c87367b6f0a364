"""Tests of the DRA checkpoint's file (common/dracheckpoint.py): version 2 with its checksum and
boot ID, the upgrade from version 1, claims of another boot, and what is not trusted."""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import pytest

from common import dracheckpoint as checkpoint_module
from common.dracheckpoint import (
    CHECKPOINT_NAME,
    Checkpoint,
    PreparedClaim,
    PreparedDevice,
    UntrustedCheckpoint,
    current_boot_id,
    held_devices,
    read_claims,
)

BOOT = "5f1e7c1a-0000-4000-8000-000000000001"
LATER_BOOT = "5f1e7c1a-0000-4000-8000-000000000002"

CLAIMS = (
    PreparedClaim(
        "uid-1",
        "default",
        "c1",
        (PreparedDevice(("gpu",), "node-a", "gpu-0", ("k8s.device-plugin.nvidia.com/gpu=GPU-0",)),),
        1700000000.25,
    ),
    PreparedClaim(
        "uid-2",
        "team",
        "c2",
        (
            PreparedDevice(("a", "b"), "node-a", "gpu-1", ("x=1",), share_id="share-1"),
            PreparedDevice(("mon",), "node-a", "gpu-2", (), admin_access=True),
        ),
        1700000001.5,
    ),
)


def boot(value: str | None) -> checkpoint_module.BootIdSource:
    return lambda: value


def written(directory: Path, boot_id: str | None = BOOT) -> Checkpoint:
    cp = Checkpoint(str(directory), boot(boot_id))
    cp.put(CLAIMS)
    return cp


def on_disk(directory: Path) -> dict[str, Any]:
    with open(directory / CHECKPOINT_NAME, encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    return doc


def aside(directory: Path) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.startswith(f"{CHECKPOINT_NAME}.bad-"))


def crc_of(doc: dict[str, Any]) -> str:
    """The checksum worked out here from the format's words: CRC-32 of the sorted, spaceless JSON."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x}"


def test_version_2_round_trips_with_its_checksum_and_boot(tmp_path: Path) -> None:
    """Claims written are read back the same (shares and admin access too) by a new Checkpoint of
    the same boot; the file is version 2 with this boot's ID and a CRC-32 of its canonical JSON."""
    written(tmp_path)
    doc = on_disk(tmp_path)
    assert doc["version"] == 2 and doc["bootID"] == BOOT
    assert doc["checksum"] == crc_of(doc) and len(doc["checksum"]) == 8
    again = Checkpoint(str(tmp_path), boot(BOOT))
    again.load()
    assert [again.get(c.uid) for c in CLAIMS] == list(CLAIMS)
    assert read_claims(str(tmp_path / CHECKPOINT_NAME), boot(BOOT)) == {c.uid: c for c in CLAIMS}
    assert held_devices(str(tmp_path), boot(BOOT)) == {"gpu-0", "gpu-1", "gpu-2"}
    assert aside(tmp_path) == []


def test_the_checksum_is_of_the_data_not_of_the_layout(tmp_path: Path) -> None:
    """The same data laid out otherwise (indented, keys in another order) still verifies: the
    checksum is taken over the canonical JSON of what was read."""
    written(tmp_path)
    doc = on_disk(tmp_path)
    relaid = dict(reversed(list(doc.items())))
    (tmp_path / CHECKPOINT_NAME).write_text(json.dumps(relaid, indent=3))
    cp = Checkpoint(str(tmp_path), boot(BOOT))
    cp.load()
    assert len(cp) == 2 and aside(tmp_path) == []


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["claims"]["uid-1"]["devices"][0].update(device="gpu-7"),
        lambda d: d.update(bootID=LATER_BOOT),
        lambda d: d["claims"].pop("uid-2"),
        lambda d: d.update(checksum="0" * 8),
        lambda d: d.pop("checksum"),
    ],
    ids=["device", "boot", "claim-removed", "checksum", "no-checksum"],
)
def test_a_checksum_mismatch_is_moved_aside_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: Any
) -> None:
    """A version-2 file whose contents do not match its checksum (edited, or a field lost) is not
    trusted: the supervisor's read raises, the worker moves it aside with a log line that says
    why and starts empty."""
    written(tmp_path)
    doc = on_disk(tmp_path)
    edit(doc)
    (tmp_path / CHECKPOINT_NAME).write_text(json.dumps(doc))
    with pytest.raises(UntrustedCheckpoint, match="checksum mismatch"):
        held_devices(str(tmp_path), boot(BOOT))
    cp = Checkpoint(str(tmp_path), boot(BOOT))
    cp.load()
    assert len(cp) == 0 and not (tmp_path / CHECKPOINT_NAME).exists() and len(aside(tmp_path)) == 1
    assert "cannot be used (checksum mismatch" in caplog.text and "moved to" in caplog.text


def test_a_version_1_file_is_read_as_before_and_rewritten_as_version_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Today's format (version 1: no checksum, boot unknown) keeps its claims for the supervisor
    (which changes nothing on disk) and for the worker, whose load rewrites it as version 2
    stamped with this boot, and says so."""
    v1 = json.dumps({"version": 1, "claims": {c.uid: c.to_json() for c in CLAIMS}})
    (tmp_path / CHECKPOINT_NAME).write_text(v1)
    assert held_devices(str(tmp_path), boot(BOOT)) == {"gpu-0", "gpu-1", "gpu-2"}
    assert (tmp_path / CHECKPOINT_NAME).read_text() == v1
    cp = Checkpoint(str(tmp_path), boot(BOOT))
    with caplog.at_level(logging.INFO, "gpuvisor.worker"):
        cp.load()
    assert [cp.get(c.uid) for c in CLAIMS] == list(CLAIMS)
    doc = on_disk(tmp_path)
    assert (doc["version"], doc["bootID"], doc["checksum"]) == (2, BOOT, crc_of(doc))
    assert set(doc["claims"]) == {"uid-1", "uid-2"}
    assert "is of version 1" in caplog.text and "rewritten as version 2" in caplog.text
    assert aside(tmp_path) == []


def test_claims_of_another_boot_are_dropped_by_worker_and_supervisor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a reboot the claims written in the earlier boot hold nothing: the supervisor's
    held_devices is empty, and the worker's load drops them (an unprepare of one finds nothing to
    do), logs it and rewrites the file empty, of this boot."""
    written(tmp_path, BOOT)
    assert held_devices(str(tmp_path), boot(LATER_BOOT)) == frozenset()
    assert read_claims(str(tmp_path / CHECKPOINT_NAME), boot(LATER_BOOT)) == {}
    assert on_disk(tmp_path)["bootID"] == BOOT  # the supervisor's read changes nothing
    cp = Checkpoint(str(tmp_path), boot(LATER_BOOT))
    with caplog.at_level(logging.INFO, "gpuvisor.worker"):
        cp.load()
    assert len(cp) == 0 and cp.get("uid-1") is None and cp.holders("gpu-0") == []
    doc = on_disk(tmp_path)
    assert (doc["version"], doc["bootID"], doc["claims"]) == (2, LATER_BOOT, {})
    assert f"is of boot {BOOT}, this is boot {LATER_BOOT}: its 2 prepared claim(s)" in caplog.text


@pytest.mark.parametrize(
    ("written_in", "read_in"),
    [(BOOT, None), (None, BOOT), (None, None)],
    ids=["reader-unknown", "writer-unknown", "both-unknown"],
)
def test_an_unknown_boot_keeps_the_claims(
    tmp_path: Path, written_in: str | None, read_in: str | None
) -> None:
    """Where either boot ID is unknown (no /proc boot_id), no boot check is made: the claims are
    kept by both readers; a worker that cannot tell its boot leaves the file's own boot ID as it is."""
    written(tmp_path, written_in)
    assert held_devices(str(tmp_path), boot(read_in)) == {"gpu-0", "gpu-1", "gpu-2"}
    cp = Checkpoint(str(tmp_path), boot(read_in))
    cp.load()
    assert len(cp) == 2
    assert on_disk(tmp_path)["bootID"] == (read_in or written_in)


def test_a_missing_boot_id_file_is_unknown(tmp_path: Path) -> None:
    """The boot ID is the file's text, trimmed; a file that is missing, empty or not a short ASCII
    line gives None (unknown) instead of an error."""
    path = tmp_path / "boot_id"
    assert current_boot_id(str(path)) is None
    path.write_text(f"{BOOT}\n")
    assert current_boot_id(str(path)) == BOOT
    for content in (b"", b"\n", b"\xff\xfe\n", b"x" * 100):
        path.write_bytes(content)
        assert current_boot_id(str(path)) is None


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 3, "bootID": BOOT, "claims": {}},
        {"version": "2", "bootID": BOOT, "claims": {}},
        {"version": True, "claims": {}},
        {"claims": {}},
    ],
    ids=["newer", "string", "bool", "none"],
)
def test_an_unknown_version_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, doc: Any
) -> None:
    """A version this code does not know (a newer gpuvisor's, or none) is not read, even with a
    checksum that matches: the supervisor's read raises, the worker moves it aside and logs."""
    (tmp_path / CHECKPOINT_NAME).write_text(json.dumps({**doc, "checksum": crc_of(doc)}))
    with pytest.raises(UntrustedCheckpoint, match="not a gpuvisor checkpoint of version 1 or 2"):
        held_devices(str(tmp_path), boot(BOOT))
    cp = Checkpoint(str(tmp_path), boot(BOOT))
    cp.load()
    assert len(cp) == 0 and len(aside(tmp_path)) == 1 and "cannot be used" in caplog.text


def test_reading_stays_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version-2 file over MAX_CLAIMS claims or MAX_BYTES bytes is not trusted, checksum or not."""
    written(tmp_path)
    monkeypatch.setattr(checkpoint_module, "MAX_CLAIMS", 1)
    with pytest.raises(UntrustedCheckpoint, match="2 claims, at most 1"):
        held_devices(str(tmp_path), boot(BOOT))
    monkeypatch.setattr(checkpoint_module, "MAX_CLAIMS", 4096)
    monkeypatch.setattr(checkpoint_module, "MAX_BYTES", 100)
    with pytest.raises(UntrustedCheckpoint, match="over 100 bytes"):
        held_devices(str(tmp_path), boot(BOOT))


def test_a_time_that_cannot_be_written_back_is_not_trusted(tmp_path: Path) -> None:
    """A version-1 file whose preparedAt is NaN or infinite (JSON reads them, no writer of ours
    makes them) is moved aside, not kept until the rewrite fails on it."""
    for value in ("NaN", "Infinity", "1e999"):
        claim = json.dumps(CLAIMS[0].to_json()).replace("1700000000.25", value)
        (tmp_path / CHECKPOINT_NAME).write_text(f'{{"version": 1, "claims": {{"uid-1": {claim}}}}}')
        with pytest.raises(UntrustedCheckpoint, match="finite number"):
            held_devices(str(tmp_path), boot(BOOT))
