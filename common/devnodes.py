"""Device-node facts both roles need: the control nodes, host paths under a root, MIG caps minors.

The worker puts these nodes into Allocate responses (`--pass-device-specs`) and the supervisor
into the CDI spec; one module keeps the two in step.
"""

from __future__ import annotations

import posixpath

# Control nodes passed beside the GPU nodes, in NVIDIA's order (those that exist on the node).
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def host_path(root: str, container_path: str) -> str:
    """Join a root onto an absolute container path the way Go's filepath.Join does ("/" adds nothing)."""
    joined = posixpath.normpath(f"{root or '/'}/{container_path}")
    # normpath keeps a leading "//" (POSIX allows it to mean something else); Go's Clean does not.
    return "/" + joined.lstrip("/") if joined.startswith("//") else joined


def read_mig_minors(path: str) -> dict[str, int]:
    """Parse the nvidia-caps minors file: lines like `gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`.

    Raises OSError when the file cannot be read; lines that are not `<name> <int>` are skipped
    (the file also holds `config` and `monitor` lines, and a later driver may add more kinds).
    """
    minors: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                minors[parts[0]] = int(parts[1])
    return minors
