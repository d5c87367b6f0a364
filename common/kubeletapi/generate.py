"""Regenerate the committed protobuf/gRPC stubs from api.proto.

Run from anywhere: `python -m common.kubeletapi.generate [OUT_DIR]`. The stubs are committed so
that installing gpuvisor needs no code generator; tests/unit/test_kubeletapi.py regenerates them into a
temp dir and checks the result is byte-for-byte what is committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTO = "common/kubeletapi/api.proto"


# The generated type stubs use a bare `Mapping`, which `mypy --strict` rejects; the pyproject
# override covers only this package's stubs, so the other packages' stubs carry this first line.
MYPY_LINE = '# mypy: disable-error-code="type-arg"\n'


def run_protoc(proto: str, out_dir: Path, *, grpc: bool, mark_stub: bool = False) -> None:
    """protoc for one proto (a path relative to the repo root) into out_dir: messages and type
    stubs, plus the gRPC module when `grpc`; `mark_stub` puts MYPY_LINE atop the type stub."""
    from grpc_tools import protoc  # a test-only dependency: imported here, not at module load

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    if grpc:
        args.append(f"--grpc_python_out={out_dir}")
    if protoc.main([*args, str(ROOT / proto)]) != 0:
        raise RuntimeError(f"protoc failed for {proto}")
    if mark_stub:
        stub = out_dir / (proto.removesuffix(".proto") + "_pb2.pyi")
        stub.write_text(MYPY_LINE + stub.read_text(encoding="utf-8"), encoding="utf-8")


def generate(out_dir: Path) -> None:
    """Write api_pb2.py, api_pb2.pyi and api_pb2_grpc.py for api.proto under out_dir."""
    run_protoc(PROTO, out_dir, grpc=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    generate(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
