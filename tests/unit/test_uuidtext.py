"""common.uuidtext: the same text as the `uuid` module, without importing it."""

from __future__ import annotations

import os
import uuid

import pytest

from common.uuidtext import uuid4_text, uuid_text


def test_sixteen_bytes_read_as_the_uuid_module_writes_them() -> None:
    """uuid_text(raw) is str(uuid.UUID(bytes=raw)) for any 16 bytes, all-zero and all-ones too."""
    for raw in (bytes(16), b"\xff" * 16, bytes(range(16)), *(os.urandom(16) for _ in range(200))):
        assert uuid_text(raw) == str(uuid.UUID(bytes=raw))


@pytest.mark.parametrize("length", [0, 15, 17, 32])
def test_other_lengths_are_refused_as_the_uuid_module_refuses_them(length: int) -> None:
    """Not 16 bytes: ValueError, as uuid.UUID(bytes=...) raises (a bad NVML fabric UUID fails
    the same way as before)."""
    with pytest.raises(ValueError):
        uuid.UUID(bytes=b"\0" * length)
    with pytest.raises(ValueError, match="16 bytes"):
        uuid_text(b"\0" * length)


def test_a_random_uuid_is_version_4_of_rfc_4122s_variant_and_new_each_time() -> None:
    """uuid4_text parses as a version-4, RFC 4122 UUID, prints back unchanged, and 500 draws
    are 500 different values."""
    seen = set()
    for _ in range(500):
        text = uuid4_text()
        parsed = uuid.UUID(text)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == text
        seen.add(text)
    assert len(seen) == 500
