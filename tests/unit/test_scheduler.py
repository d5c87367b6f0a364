"""Tests of the supervisor's one scheduler for every timer (supervisor/scheduler.py), on a fake clock."""

from __future__ import annotations

import logging
import os

import pytest

from common.backoff import Backoff
from supervisor.scheduler import Poller, Retrying, Scheduler
from tests.fakes import FakeClock


def test_timers_run_when_due_in_deadline_order() -> None:
    """Nothing runs early; due timers run earliest first, each once."""
    clock = FakeClock()
    s = Scheduler(clock)
    ran: list[str] = []
    s.call_later("b", 2.0, lambda: ran.append("b"))
    s.call_later("a", 1.0, lambda: ran.append("a"))
    assert s.run_due() == 0 and ran == []
    clock.advance(2.5)
    assert s.run_due() == 2
    assert ran == ["a", "b"]
    assert s.run_due() == 0


def test_setting_a_key_again_replaces_its_deadline() -> None:
    """Re-arming a key moves it; the old deadline no longer fires."""
    clock = FakeClock()
    s = Scheduler(clock)
    ran: list[float] = []
    s.call_later("k", 1.0, lambda: ran.append(clock.now))
    s.call_later("k", 5.0, lambda: ran.append(clock.now))
    clock.advance(1.0)
    s.run_due()
    assert ran == []
    assert s.when("k") == clock.now + 4.0
    clock.advance(4.0)
    s.run_due()
    assert ran == [clock.now]


def test_cancel_forgets_a_timer() -> None:
    """A cancelled timer never runs and no longer counts as the next deadline."""
    clock = FakeClock()
    s = Scheduler(clock)
    s.call_later("k", 1.0, lambda: None)
    s.cancel("k")
    assert s.when("k") is None and s.next_deadline() is None
    assert s.wait_seconds(3.0) == 3.0


def test_wait_seconds_is_the_time_to_the_next_deadline_bounded() -> None:
    """The loop sleeps until the next deadline, never longer than asked, never negative."""
    clock = FakeClock()
    s = Scheduler(clock)
    s.call_later("k", 0.25, lambda: None)
    assert s.wait_seconds(1.0) == 0.25
    clock.advance(5)
    assert s.wait_seconds(1.0) == 0.0


def test_a_failing_timer_is_counted_and_the_others_still_run() -> None:
    """A timer that raises is logged and counted by key; the loop and later timers go on."""
    clock = FakeClock()
    errors: list[str] = []
    s = Scheduler(clock, on_error=errors.append)
    ran: list[str] = []

    def boom() -> None:
        raise OSError("disk full")

    s.call_later("bad", 0.0, boom)
    s.call_later("good", 0.0, lambda: ran.append("good"))
    assert s.run_due() == 2
    assert ran == ["good"] and errors == ["bad"]


def test_a_timer_that_rearms_itself_at_now_waits_for_the_next_run() -> None:
    """A callback re-arming its own key at the current time cannot spin inside one run."""
    clock = FakeClock()
    s = Scheduler(clock)
    count = 0

    def again() -> None:
        nonlocal count
        count += 1
        s.call_later("loop", 0.0, again)

    s.call_later("loop", 0.0, again)
    assert s.run_due() == 1
    assert s.run_due() == 1
    assert count == 2


def test_a_retried_step_backs_off_logs_each_error_once_and_clears_on_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Retrying: a failing step is retried after the backoff's delays (1, 2 s), the same error is
    logged once, a new one again; success clears the error, logs once and resets the backoff."""
    clock = FakeClock()
    timers = Scheduler(clock)
    retry = Retrying(
        timers, "write", Backoff(1.0, 10.0), "could not write: %s", "written again", catch=(OSError,)
    )
    errors = [OSError("disk full"), OSError("disk full"), OSError("read-only")]

    def step() -> None:
        if errors:
            raise errors.pop(0)

    def again() -> None:
        retry.attempt(step, again)

    with caplog.at_level(logging.INFO, logger="gpuvisor.supervisor"):
        assert not retry.attempt(step, again)
        assert retry.error == "disk full" and timers.when("write") == clock.now + 1.0
        clock.advance(1.0)
        timers.run_due()
        assert timers.when("write") == clock.now + 2.0
        clock.advance(2.0)
        timers.run_due()
        assert retry.error == "read-only"
        clock.advance(4.0)
        timers.run_due()
    assert retry.error == "" and timers.when("write") is None and retry.backoff.attempts == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["could not write: disk full", "could not write: read-only", "written again"]


def test_the_poller_wakes_for_what_it_watches_now_and_skips_what_is_not_there() -> None:
    """A pipe written to is ready; None and a negative fd (a socket not open yet, no zygote)
    are left out; when the watched set changes the new source is polled, the old one not."""
    first, second = os.pipe(), os.pipe()
    watched: list[object] = [first[0], None, -1]
    poller = Poller(lambda: tuple(watched))
    try:
        assert poller.poll(0.0) == []
        os.write(first[1], b"x")
        assert poller.poll(0.0) == [first[0]]
        watched[0] = second[0]
        assert poller.poll(0.0) == []  # the first pipe is still readable, but no longer watched
        os.write(second[1], b"x")
        assert poller.poll(0.0) == [second[0]]
    finally:
        for fd in (*first, *second):
            os.close(fd)
