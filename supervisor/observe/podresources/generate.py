"""Regenerate the committed pod-resources message stubs from api.proto (with the protoc helper
of common/kubeletapi/generate.py, which generates the device-plugin API's).

Run from anywhere: `python -m supervisor.observe.podresources.generate [OUT_DIR]`. Only the
message module and its type stub are generated: the one call (List) is wired by method path in
`supervisor.observe.podresources` (typed), so no untyped `_grpc` module is needed.
tests/unit/test_allocations.py regenerates into a temp dir and checks the committed files match.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.kubeletapi.generate import run_protoc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
PROTO = "supervisor/observe/podresources/api.proto"
OUTPUTS = ("api_pb2.py", "api_pb2.pyi")


def generate(out_dir: Path) -> None:
    """Write api_pb2.py and api_pb2.pyi for the pod-resources api.proto under out_dir."""
    run_protoc(PROTO, out_dir, grpc=False, mark_stub=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    generate(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
