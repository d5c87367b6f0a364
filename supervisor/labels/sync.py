"""GPU Feature Discovery's node labels, kept current by the supervisor itself (an extension).

With `--labels-output-file PATH` (off by default) the supervisor writes the labels that
`gpuvisor labels` (and NVIDIA's GFD) would write to PATH, NFD's features.d file, and rewrites it
as soon as what it advertises changes: after every plan it applies (the first one, a reload that
adds replicas, a MIG reconfiguration found by rediscovery), so labels never lag the resources by
GFD's sleep interval. The labels are computed by the labeller's own rules over the NVML the
supervisor already holds; the file is written atomically and only when its content changes. It
carries no `gfd.timestamp` (as `--no-timestamp`): a label that changed on every write would make
every write a change.

A failure (an NVML call, a full disk) is logged once per distinct error and retried with the
backoff; it never stops the supervisor. The labeller's modules (its rules, the host reads, GFD's
facts) are loaded by the first write: a supervisor without the file never loads them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from common.backoff import Backoff
from common.messages import Json
from supervisor.config import Config
from supervisor.scheduler import Retrying, Scheduler

if TYPE_CHECKING:
    from supervisor.labels.output import LabelFile

log = logging.getLogger("gpuvisor.supervisor")

TIMER = "labels-retry"


class NodeLabels:
    def __init__(self, *, nvml_module: Any, simulated: bool, timers: Scheduler) -> None:
        self.module = nvml_module
        self.simulated = simulated  # no sysfs of ours to read: machine type unknown, no vGPU
        self.file: LabelFile | None = None
        self.writes = 0
        self.writing = Retrying(
            timers,
            TIMER,
            Backoff(1.0, 60.0, jitter=0.2),
            "node labels could not be written (retrying with backoff): %s",
            "node labels are written again",
            describe=lambda exc: f"{type(exc).__name__}: {exc}",
        )

    def refresh(self, config: Config) -> None:
        """Compute the labels for `config` now and write them if they changed (retried on failure:
        NVML, a label rule, a full disk... never end the loop)."""
        path = config.labels_output_file
        if not path:
            self.file = None
            self.writing.timers.cancel(TIMER)
            return
        from supervisor.labels import LabelConfig, LabelFile, SharingView
        from supervisor.labels.host import DEFAULT_MACHINE_TYPE_FILE, SYSFS, label_node
        from supervisor.node.facts import facts_from_nvml
        from supervisor.node.nvml import Nvml

        if self.file is None or self.file.path != path:
            self.file = LabelFile(path)
        file = self.file

        def write() -> None:
            sysfs = None if self.simulated else SYSFS
            labels = label_node(
                facts_from_nvml(Nvml(self.module, sysfs)),
                LabelConfig(config.mig_strategy, SharingView.from_config(config.sharing)),
                machine_type_file="" if self.simulated else DEFAULT_MACHINE_TYPE_FILE,
                sysfs_root=sysfs,
                timestamp=None,
            )
            if file.write_if_changed(labels):
                self.writes += 1
                log.info("node labels written to %s (%d labels)", path, len(labels))

        self.writing.attempt(write, lambda: self.refresh(config))

    @property
    def error(self) -> str:
        return self.writing.error

    def status(self) -> dict[str, Json]:
        return {
            "file": self.file.path if self.file is not None else None,
            "writes": self.writes,
            "error": self.error or None,
        }
