"""Every NVML health event explained in the log (supervisor/health/eventlog.py and the hub that
feeds it): one line per event with the GPU, the instance, the XID or ECC kind and the policy's
decision; bursts summarised at a capped rate; changes never held back. Driven on a fake clock."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from supervisor.health.book import ChangeBatch
from supervisor.health.eventlog import EventLog, HealthEvent
from supervisor.health.findings import Ecc, Unattributed, Xid
from supervisor.health.policy import EccKind, HealthPolicy
from tests import nodes
from tests.fakes import hub_with_book

GPU = "GPU-0001"
LOGGER = "gpuvisor.health"


def xid31(gi: int | None = None, ci: int | None = None) -> HealthEvent:
    return HealthEvent(
        GPU, gi, ci, "XID 31", "ignored as an application error (GPU memory page fault)", unhealthy=False
    )


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_an_event_is_one_line_with_gpu_instance_kind_and_decision(caplog: pytest.LogCaptureFixture) -> None:
    """The line names the GPU, the MIG instance, the XID and what the policy decided."""
    log = EventLog()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.record(xid31(gi=1, ci=0), 0, (), now=0.0)
    assert lines(caplog) == [
        f"health event: XID 31 on {GPU} GI 1 CI 0: ignored as an application error (GPU memory page fault)"
    ]
    assert caplog.records[0].levelno == logging.INFO and caplog.records[0].device == GPU  # type: ignore[attr-defined]


def test_a_burst_is_one_line_then_one_summary_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    """1,000 repeats within the window: the first is logged, the rest counted, and once the window
    has passed one line says how many; the next event after that is logged again."""
    log = EventLog(window=10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for i in range(1000):
            log.record(xid31(), 0, (), now=i * 0.005)
        log.flush(9.0)
        assert len(lines(caplog)) == 1
        log.flush(10.0)
        log.record(xid31(), 0, (), now=11.0)
    assert lines(caplog)[1:] == [
        f"health event: XID 31 on {GPU}: 999 more in the last 10s, ignored as an application error (GPU memory page fault)",
        f"health event: XID 31 on {GPU}: ignored as an application error (GPU memory page fault)",
    ]
    assert caplog.records[1].count == 999  # type: ignore[attr-defined]
    assert log.held == 999 and log.lines == 3


def test_a_change_of_health_is_never_held_back(caplog: pytest.LogCaptureFixture) -> None:
    """Within a window, an event that changes devices (say after a quick transient recovery) is
    logged anyway, with the devices it took out, as a warning."""
    event = HealthEvent(GPU, None, None, "XID 94", "Unhealthy, transient: ...", unhealthy=True)
    log = EventLog(window=10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.record(event, 2, ("nvidia.com/gpu",), now=0.0)
        log.record(event, 0, ("nvidia.com/gpu",), now=1.0)
        log.record(event, 2, ("nvidia.com/gpu",), now=2.0)
    assert lines(caplog) == [
        f"health event: XID 94 on {GPU}: Unhealthy, transient: ... -> 2 device(s) Unhealthy in nvidia.com/gpu",
        f"health event: XID 94 on {GPU}: Unhealthy, transient: ... -> 2 device(s) Unhealthy in nvidia.com/gpu",
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING} and log.held == 1


def test_distinct_kinds_past_the_bound_are_counted_together(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of distinct events (each its own kind) keeps the table bounded: past `max_keys` in
    one window they are counted, and one line says how many."""
    log = EventLog(window=10.0, max_keys=4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for xid in range(100):
            log.record(HealthEvent(GPU, None, None, f"XID {xid}", "ignored", unhealthy=False), 0, (), now=0.0)
        log.flush(10.0)
    assert len(lines(caplog)) == 4 + 1
    assert "96 more of other kinds in the last 10s" in lines(caplog)[-1]


@pytest.mark.parametrize(
    ("finding", "words", "level"),
    [
        (Xid(nodes.pcie_l4().gpus[0].uuid, 31), "XID 31 on GPU-", logging.INFO),
        (
            Xid(nodes.pcie_l4().gpus[0].uuid, 48),
            "Unhealthy until the GPU is reset -> 1 device(s) Unhealthy in nvidia.com/gpu",
            logging.WARNING,
        ),
        (
            Xid(nodes.pcie_l4().gpus[0].uuid, 94),
            "ignored, the GPU stays in service (contained ECC error): the application that hit it must "
            "restart; reset the GPU when convenient",
            logging.WARNING,
        ),
        (Ecc(nodes.pcie_l4().gpus[0].uuid, EccKind.SINGLE_BIT), "single-bit ECC error on GPU-", logging.INFO),
        (
            Ecc(nodes.pcie_l4().gpus[0].uuid, EccKind.DOUBLE_BIT),
            "double-bit ECC error on GPU-",
            logging.WARNING,
        ),
    ],
)
def test_the_hub_logs_each_event_once_with_the_policys_decision(
    finding: Xid | Ecc, words: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the hub, every XID and ECC event is exactly one line saying what was decided, the
    ignored ones too; the event is counted whatever the line."""
    hub, _clock, metrics = hub_with_book()
    with caplog.at_level(logging.INFO):
        hub.apply(finding)
    [record] = [r for r in caplog.records if r.getMessage().startswith("health")]
    assert words in record.getMessage() and record.levelno == level
    if isinstance(finding, Xid):
        count = metrics.registry.get_sample_value("gpuvisor_xid_events_total", {"xid": str(finding.xid)})
        assert count == 1.0


def test_an_ignored_xid_says_it_is_an_application_error_and_bursts_are_summarised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """XID 31 from a faulting kernel: one line naming it an application error; 500 more in a burst
    add no line until the hub's tick after the window, which summarises them; all 501 are counted."""
    hub, clock, metrics = hub_with_book()
    uuid = nodes.pcie_l4().gpus[1].uuid
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(501):
            hub.apply(Xid(uuid, 31))
        hub.tick()
        assert lines(caplog) == [
            f"health event: XID 31 on {uuid}: ignored as an application error (GPU memory page fault)"
        ]
        clock.advance(10.0)
        hub.tick()
    assert lines(caplog)[-1].startswith(f"health event: XID 31 on {uuid}: 500 more in the last 10s, ignored")
    assert metrics.registry.get_sample_value("gpuvisor_xid_events_total", {"xid": "31"}) == 501.0


@pytest.mark.parametrize(
    ("settings", "xid", "decision"),
    [
        ({}, 13, "ignored as an application error (graphics engine exception)"),
        ({"disable_env": "48"}, 48, "ignored: listed in DP_DISABLE_HEALTHCHECKS"),
        ({"disable_env": "94"}, 94, "ignored: listed in DP_DISABLE_HEALTHCHECKS"),
        ({"disable_env": "all"}, 48, "ignored: health checks are disabled (DP_DISABLE_HEALTHCHECKS)"),
        ({"disable_env": "all", "enable_env": "79"}, 48, "ignored: not in DP_ENABLE_HEALTHCHECKS"),
        ({"xid_actions": {"48": "ignore"}}, 48, "ignored by the config (gpuvisor.health.xids)"),
        (
            {},
            63,
            "ignored, the GPU stays in service (ECC page retirement or row remapping recorded): "
            "the retirement or remap takes effect at the next reset; reset the GPU when convenient",
        ),
        (
            {},
            92,
            "ignored, the GPU stays in service (high single-bit ECC error rate): the errors were "
            "corrected; contact NVIDIA support if the rate persists",
        ),
        (
            {},
            154,
            "ignored, the GPU stays in service (GPU recovery action changed): the XID it reports on "
            "carries its own action; nvidia-smi -q shows the recovery action",
        ),
        (
            {},
            109,
            "ignored, the GPU stays in service (context switch timeout): as NVIDIA's plugin does; "
            "the catalog advises a GPU reset (DP_ENABLE_HEALTHCHECKS=109 takes the GPU out until one)",
        ),
        ({"enable_env": "31"}, 31, "Unhealthy until the GPU is reset"),
        (
            {"quiet_seconds": 5, "xid_actions": {"63": "transient"}},
            63,
            "Unhealthy, transient: recovering after 5s without a new event and a passing probe",
        ),
        ({}, 999, "Unhealthy until the GPU is reset"),
    ],
)
def test_the_policy_says_why_an_xid_counts_or_not(
    settings: dict[str, object], xid: int, decision: str
) -> None:
    """The decision in words follows the same rules as the action: env vars, config, defaults."""
    args: dict[str, object] = {
        "disable_env": None,
        "enable_env": None,
        "xid_actions": {},
        "quiet_seconds": 60.0,
    }
    args.update(settings)
    policy = HealthPolicy.from_settings(**args)  # type: ignore[arg-type]
    assert policy.explain_xid(xid) == decision


def test_an_xid_kept_in_service_is_a_warning_with_its_advice_and_no_health_decision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """XID 94 through the hub: one warning with the catalog's advice, counted in
    gpuvisor_xid_events_total, no device changed and nothing for the listeners (the Node's
    condition and Events); a burst of repeats adds no line until its window's summary."""
    hub, clock, metrics = hub_with_book()
    told: list[str] = []
    hub.listeners.append(lambda _batch, line: told.append(line))
    uuid = nodes.pcie_l4().gpus[2].uuid
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(50):
            hub.apply(Xid(uuid, 94))
        clock.advance(10.0)
        hub.tick()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert records[0].getMessage().endswith("reset the GPU when convenient")
    assert records[1].getMessage().startswith(f"health event: XID 94 on {uuid}: 49 more in the last 10s")
    assert metrics.registry.get_sample_value("gpuvisor_xid_events_total", {"xid": "94"}) == 50.0
    assert told == [] and hub.conditions_view() == [] and hub.book is not None and hub.book.seq == 0


def test_an_event_naming_no_known_gpu_is_a_warning_and_a_burst_of_them_one_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An event NVML cannot tie to a GPU changes nothing but is worth a warning; 100 of them in a
    burst are one line and one summary, not 100 lines."""
    hub, clock, _metrics = hub_with_book()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(100):
            hub.apply(Unattributed(8, 31))
        clock.advance(10.0)
        hub.tick()
    assert lines(caplog) == [
        "health event: NVML event type 0x8 (data 31) on an unknown GPU: ignored: NVML named no GPU it can tell",
        "health event: NVML event type 0x8 (data 31) on an unknown GPU: 99 more in the last 10s, ignored: NVML named no GPU it can tell",
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING}
    assert not any(hasattr(r, "device") for r in caplog.records), "no GPU named: no device field"


def test_stopping_the_hub_summarises_the_counts_still_held(caplog: pytest.LogCaptureFixture) -> None:
    """A supervisor stopping in the middle of a burst still says how many events it held back:
    the count is not lost with the process."""
    hub, _clock, _metrics = hub_with_book()
    uuid = nodes.pcie_l4().gpus[0].uuid
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(40):
            hub.apply(Xid(uuid, 31))
        hub.stop()
    assert len(lines(caplog)) == 2
    assert lines(caplog)[1].startswith(f"health event: XID 31 on {uuid}: 39 more in the last 0s, ignored")


def test_the_workers_hear_of_a_change_before_its_line_is_logged() -> None:
    """The change batch is published before the event's line is written, so a slow log never
    delays the kubelet's view of an Unhealthy device."""
    hub, _clock, _metrics = hub_with_book()
    order: list[str] = []
    publish, record = hub.publish, hub.events.record

    def publishing(batch: ChangeBatch, *, line: str | None = None, decision: bool = True) -> None:
        order.append("publish")
        publish(batch, line=line, decision=decision)

    def logging_(*args: Any) -> None:
        order.append("log")
        record(*args)

    hub.publish = publishing  # type: ignore[method-assign]
    hub.events.record = logging_  # type: ignore[method-assign,assignment]
    hub.apply(Xid(nodes.pcie_l4().gpus[0].uuid, 48))
    assert order == ["publish", "log"]


def test_a_flush_forgets_exactly_the_windows_that_have_passed() -> None:
    """A flush forgets the windows that have passed and keeps the rest, in the order they opened
    (the order the flush reads them in, oldest first)."""
    log = EventLog(window=10.0)
    for i in range(6):
        log.record(HealthEvent(GPU, None, None, f"XID {i}", "ignored", unhealthy=False), 0, (), now=float(i))
    log.flush(12.5)  # the windows opened at 0, 1 and 2 have passed
    assert [key[3] for key in log._windows] == ["XID 3", "XID 4", "XID 5"]


def test_windows_follow_the_monotonic_clock_not_the_wall_clock(caplog: pytest.LogCaptureFixture) -> None:
    """The hub times its windows on the monotonic clock: a wall-clock step of an hour does not
    end a window early."""
    hub, clock, _metrics = hub_with_book()
    uuid = nodes.pcie_l4().gpus[0].uuid
    with caplog.at_level(logging.INFO, logger=LOGGER):
        hub.apply(Xid(uuid, 31))
        hub.apply(Xid(uuid, 31))
        clock.wall += 3600.0
        hub.tick()
        assert len(lines(caplog)) == 1
        clock.advance(10.0)
        hub.tick()
    assert len(lines(caplog)) == 2


def test_a_new_decision_for_the_same_event_gets_its_own_line(caplog: pytest.LogCaptureFixture) -> None:
    """After a policy reload inside a window, the same XID decided differently is logged with the
    new decision, not counted under the old one's summary."""
    log = EventLog(window=10.0)
    before = HealthEvent(GPU, None, None, "XID 94", "Unhealthy, transient: ...", unhealthy=True)
    after = HealthEvent(
        GPU, None, None, "XID 94", "ignored by the config (gpuvisor.health.xids)", unhealthy=False
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.record(before, 0, (), now=0.0)
        log.record(after, 0, (), now=1.0)
    assert lines(caplog)[-1] == f"health event: XID 94 on {GPU}: ignored by the config (gpuvisor.health.xids)"
