"""UUIDs as text, without the `uuid` module.

`import uuid` (`_uuid` and the module; the `platform` it also loads is loaded by ZeroMQ anyway)
adds to the start of each process that loads it, the supervisor's and the zygote's (a worker's
CDI annotation keys), for what is sixteen bytes in 8-4-4-4-12 lowercase hex.
These give the same text as `str(uuid.UUID(bytes=raw))` and `str(uuid.uuid4())` (the unit tests
hold them to the `uuid` module).
"""

from __future__ import annotations

import os


def uuid_text(raw: bytes) -> str:
    """`str(uuid.UUID(bytes=raw))`; ValueError unless `raw` is 16 bytes, as there."""
    if len(raw) != 16:
        raise ValueError(f"a UUID is 16 bytes, not {len(raw)}")
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def uuid4_text() -> str:
    """`str(uuid.uuid4())`: 122 random bits, version 4, RFC 4122's variant."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # variant 10xx
    return uuid_text(bytes(raw))
