"""Regenerate the committed message stubs of the kubelet's DRA-side APIs from their .proto files
(with the protoc helper of common/kubeletapi/generate.py).

Run from anywhere: `python -m common.draapi.generate [OUT_DIR]`. Only the message modules and
their type stubs are generated: the calls are wired by method path in `common.draapi.rpc`
(typed), so no untyped `_grpc` module is needed. tests/unit/test_draapi.py regenerates into a
temp dir and checks the committed files match byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.kubeletapi.generate import run_protoc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTOS = ("registration", "dra_v1", "dra_v1beta1", "health")
OUTPUTS = tuple(f"{name}_pb2{ext}" for name in PROTOS for ext in (".py", ".pyi"))


def generate(out_dir: Path) -> None:
    """Write <name>_pb2.py and <name>_pb2.pyi for every proto of this package under out_dir."""
    for name in PROTOS:
        run_protoc(f"common/draapi/{name}.proto", out_dir, grpc=False, mark_stub=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    generate(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
