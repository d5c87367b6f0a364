"""The CDI spec kept in step with the plans, and retried while it cannot be written.

With a CDI device-list strategy the spec must name every device a worker can hand out, so it is
written before the workers start and before they hear of a plan change. A spec that cannot be
written (a full or read-only spec dir) keeps the node not ready, is logged once per distinct
error, and is tried again with the backoff; writing it never raises into the loop. The writer
(and `spec`, its module) is made the first time a plan uses a CDI strategy: never, on a node with
NVIDIA's default `envvar` strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from common.backoff import Backoff
from common.messages import Json
from common.model import ResourcePlan
from supervisor.cdi.strategy import CdiError, cdi_plans
from supervisor.config import Config
from supervisor.scheduler import Retrying, Scheduler

if TYPE_CHECKING:
    from supervisor.cdi.spec import CdiSpecWriter

log = logging.getLogger("gpuvisor.supervisor")

CDI_SETTINGS = ("cdi_spec_dir", "cdi_spec_format", "cdi_nvidia_ctk", "driver_root_ctr_path")
RETRY_START_S = 1.0
RETRY_MAX_S = 30.0
TIMER = "cdi-retry"


def cdi_settings(config: Config) -> tuple[object, ...]:
    return tuple(getattr(config, n) for n in CDI_SETTINGS)


def make_writer(config: Config) -> CdiSpecWriter:
    from supervisor.cdi.spec import CdiSpecWriter

    return CdiSpecWriter(
        config.cdi_spec_dir,
        fmt=config.cdi_spec_format,
        use_nvidia_ctk=config.cdi_nvidia_ctk,
        ctr_root=config.driver_root_ctr_path,
    )


class CdiSync:
    def __init__(self, *, config: Config, timers: Scheduler) -> None:
        self.config = config
        self._writer: CdiSpecWriter | None = None  # made by the first plan that uses CDI
        self.settings = cdi_settings(config)
        self.plans: dict[str, ResourcePlan] = {}
        self.writing = Retrying(
            timers,
            TIMER,
            Backoff(RETRY_START_S, RETRY_MAX_S, jitter=0.2),
            "the CDI spec could not be written (not ready; retrying with backoff): %s",
            "the CDI spec is written again",
            catch=(CdiError, OSError),
        )

    @property
    def writer(self) -> CdiSpecWriter:
        """The spec writer for the running config's CDI settings (made, and its module loaded, on
        first use)."""
        if self._writer is None:
            self._writer = make_writer(self.config)
        return self._writer

    @writer.setter
    def writer(self, writer: CdiSpecWriter) -> None:
        self._writer = writer

    @property
    def error(self) -> str | None:
        """Why the spec is not written (the node is not ready), or None."""
        return self.writing.error or None

    def configure(self, config: Config) -> bool:
        """A reloaded config: a new writer if its CDI settings changed; True if they did."""
        settings = cdi_settings(config)
        if settings == self.settings:
            return False
        self.config, self.settings = config, settings
        if self._writer is not None:
            self._writer = make_writer(config)
        return True

    def sync(self, plans: Mapping[str, ResourcePlan]) -> bool:
        """Write the spec for `plans`; on failure the node is not ready and a retry is scheduled."""
        self.plans = dict(plans)
        if self._writer is None and not cdi_plans(self.plans):
            return True  # no plan uses CDI, and none did: nothing to write (the writer would say so)
        return self.writing.attempt(lambda: self.writer.sync(self.plans), lambda: self.sync(self.plans))

    def status(self) -> dict[str, Json]:
        source = self._writer.source if self._writer is not None else ""
        return {"spec_dir": self.config.cdi_spec_dir, "source": source, "error": self.error}
