"""Node labels: GPU Feature Discovery's labels (`nvidia.com/gpu.product`, ...) from gpuvisor.

`gpuvisor labels` is a drop-in for NVIDIA's `gpu-feature-discovery` v0.20.0: same flags, env
vars, config keys, label names and values, and both of its outputs (the features.d file NFD
reads, or an NFD NodeFeature object). The pieces, one job each:

- `rules`: the label rules, a pure function `compute_labels(facts, LabelConfig, ...)`;
- `host`: what is read from the node (NVML facts, machine type, vGPU scan), with GFD's fallbacks;
- `output`: `LabelFile`, the atomic, write-only-on-change features.d file;
- `nodefeature`: `NodeFeaturePublisher`, the NodeFeature object through the API-server layer;
- `settings`: the flags, env vars and file keys, declared once;
- `nodeconfig`: the named config the Node's label picks (`--config-file-srcdir`), kept current;
- `daemon`: the process loop (interval, SIGHUP reload, SIGTERM stop);
- `sync`: the labels inside `gpuvisor run` (`--labels-output-file`), rewritten as the plans change.

A process that already holds NVML (the supervisor) needs only the library part:
`facts_from_nvml(Nvml(module))` (supervisor.node.facts), then `compute_labels(...)` and `LabelFile(path).write_if_changed(...)`.

May import: `common/`, `supervisor.config`, `supervisor.node`, `supervisor.host`,
`supervisor.kube` (only when the NodeFeature output is used), and `supervisor.sim` only inside a
function, for `gpuvisor labels --simulate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.labels.output import LabelFile, OutputError
    from supervisor.labels.rules import (
        LabelConfig,
        LabelError,
        SharingView,
        VgpuDevice,
        compute_labels,
        render,
    )

# Loaded on first use (PEP 562), not with the package: `gpuvisor run` imports `sync`, which
# must not bring the labeller's rules (and GFD's facts) into a supervisor that writes no labels.
_LAZY = {
    "LabelFile": "output",
    "OutputError": "output",
    "LabelConfig": "rules",
    "LabelError": "rules",
    "SharingView": "rules",
    "VgpuDevice": "rules",
    "compute_labels": "rules",
    "render": "rules",
}

__all__ = [
    "LabelConfig",
    "LabelError",
    "LabelFile",
    "OutputError",
    "SharingView",
    "VgpuDevice",
    "compute_labels",
    "render",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
