"""What a config file holds now, cheap to compare.

The supervisor (a config file that changes) and the labeller (the named config a node label
chooses) act on a file event only when what they would read changed. This tells the two apart
with the standard library's zlib: no hashlib, whose import loads OpenSSL into a process that
has no other use for it (docs/performance.md). It is not a cryptographic digest and
needs not be one: the file is the operator's, not an adversary's, and an edit would have to keep
the size and both checksums to go unseen.
"""

from __future__ import annotations

import os
import zlib

from supervisor.config.limits import MAX_CONFIG_BYTES


def fingerprint(path: str) -> str:
    """Size and checksums of the file at `path` (through symlinks), of at most the bytes the
    config loader reads (MAX_CONFIG_BYTES, and one more to see it is too large). Raises OSError."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(MAX_CONFIG_BYTES + 1)
    return f"{size}:{len(data)}:{zlib.crc32(data):08x}:{zlib.adler32(data):08x}"
