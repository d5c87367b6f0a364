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
MYPY_LINE = '# mypy: disable-error-code="type-arg"\n'


def generate(out_dir: Path) -> None:
    """Write api_pb2.py and api_pb2.pyi for the pod-resources api.proto under out_dir."""
    run_protoc(PROTO, out_dir, grpc=False)
    # The generated type stub uses a bare `Mapping`, which `mypy --strict` rejects; the
    # pyproject override that silences this covers only the v1beta1 stubs, so the stub carries
    # its own inline setting.
    stub = out_dir / Path(PROTO).with_name("api_pb2.pyi")
    stub.write_text(MYPY_LINE + stub.read_text(encoding="utf-8"), encoding="utf-8")


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    generate(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
