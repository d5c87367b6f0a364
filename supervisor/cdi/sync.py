"""The CDI spec kept in step with the plans, and retried while it cannot be written.

With a CDI device-list strategy the spec must name every device a worker can hand out, so it is
written before the workers start and before they hear of a plan change. A spec that cannot be
written (a full or read-only spec dir) keeps the node not ready, is logged once per distinct
error, and is tried again with the backoff; writing it never raises into the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from common.backoff import Backoff
from common.messages import Json
from common.model import ResourcePlan
from supervisor.cdi.spec import CdiError, CdiSpecWriter
from supervisor.config import Config
from supervisor.scheduler import Retrying, Scheduler

log = logging.getLogger("gpuvisor.supervisor")

CDI_SETTINGS = ("cdi_spec_dir", "cdi_spec_format", "cdi_nvidia_ctk")
RETRY_START_S = 1.0
RETRY_MAX_S = 30.0
TIMER = "cdi-retry"


def cdi_settings(config: Config) -> tuple[object, ...]:
    return tuple(getattr(config, n) for n in CDI_SETTINGS)


def make_writer(config: Config) -> CdiSpecWriter:
    return CdiSpecWriter(
        config.cdi_spec_dir, fmt=config.cdi_spec_format, use_nvidia_ctk=config.cdi_nvidia_ctk
    )


class CdiSync:
    def __init__(self, *, config: Config, timers: Scheduler) -> None:
        self.writer = make_writer(config)
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
    def error(self) -> str | None:
        """Why the spec is not written (the node is not ready), or None."""
        return self.writing.error or None

    def configure(self, config: Config) -> bool:
        """A reloaded config: a new writer if its CDI settings changed; True if they did."""
        settings = cdi_settings(config)
        if settings == self.settings:
            return False
        self.settings = settings
        self.writer = make_writer(config)
        return True

    def sync(self, plans: Mapping[str, ResourcePlan]) -> bool:
        """Write the spec for `plans`; on failure the node is not ready and a retry is scheduled."""
        self.plans = dict(plans)
        return self.writing.attempt(lambda: self.writer.sync(self.plans), lambda: self.sync(self.plans))

    def status(self) -> dict[str, Json]:
        return {"spec_dir": self.writer.spec_dir, "source": self.writer.source, "error": self.error}
