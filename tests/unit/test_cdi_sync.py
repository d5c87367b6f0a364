"""Unit tests of the CDI spec's sync (supervisor/cdi/sync.py): written with the plans, retried
with backoff on the scheduler, a new writer only when its settings change."""

from __future__ import annotations

from collections.abc import Mapping

from common.model import ResourcePlan
from supervisor.cdi.spec import CdiError
from supervisor.cdi.sync import TIMER, CdiSync
from supervisor.scheduler import Scheduler
from tests.fakes import FakeClock, sim_config


class FlakyWriter:
    spec_dir = "/var/run/cdi"
    source = ""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, ...]] = []

    def sync(self, plans: Mapping[str, ResourcePlan]) -> str | None:
        self.calls.append(tuple(plans))
        if self.failures:
            self.failures -= 1
            raise CdiError("read-only file system")
        self.source = "gpuvisor"
        return "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"


def test_cdi_write_failure_is_not_ready_and_retried_with_backoff_until_it_works() -> None:
    """A spec that cannot be written is retried on the timer (growing delays) and clears once written."""
    clock = FakeClock()
    timers = Scheduler(clock)
    sync = CdiSync(config=sim_config(), timers=timers)
    writer = FlakyWriter(failures=2)
    sync.writer = writer  # type: ignore[assignment]
    assert not sync.sync({"r": None})  # type: ignore[dict-item]
    assert sync.error == "read-only file system"
    first = timers.when(TIMER)
    assert first is not None and 0.5 <= first - clock.now <= 1.0
    clock.advance(1.0)
    timers.run_due()
    second = timers.when(TIMER)
    assert second is not None and second - clock.now > first - (clock.now - 1.0) - 1e-9
    clock.advance(2.0)
    timers.run_due()
    assert sync.error is None and timers.when(TIMER) is None and len(writer.calls) == 3


def test_cdi_configure_makes_a_new_writer_only_when_its_settings_change() -> None:
    """A reload that leaves the CDI settings alone keeps the writer (and its last spec)."""
    sync = CdiSync(config=sim_config(), timers=Scheduler(FakeClock()))
    writer = sync.writer
    assert not sync.configure(sim_config())
    assert sync.writer is writer
    assert sync.configure(sim_config(CDI_SPEC_DIR="/elsewhere"))
    assert sync.writer.spec_dir == "/elsewhere"
