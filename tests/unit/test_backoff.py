"""Tests of the one backoff every retry uses (common/backoff.py)."""

from __future__ import annotations

import random

import pytest

from common.backoff import Backoff


def test_delays_double_from_start_up_to_the_cap() -> None:
    """Without jitter the delays are start, 2*start, ... and never above the cap."""
    b = Backoff(0.5, 4.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_free_attempts_cost_nothing_then_the_doubling_starts() -> None:
    """The first `free` attempts have no delay; the next one waits `start`."""
    b = Backoff(0.25, 30.0, free=1)
    assert [b.next() for _ in range(4)] == [0.0, 0.25, 0.5, 1.0]


def test_reset_starts_over() -> None:
    """After reset() the next delay is the first one again, and attempts count from zero."""
    b = Backoff(1.0, 60.0)
    b.next()
    b.next()
    b.reset()
    assert b.attempts == 0 and b.next() == 1.0


def test_jitter_stays_between_the_lower_bound_and_the_step() -> None:
    """With jitter j, each delay lies in [(1 - j) * step, step]: never above the cap."""
    b = Backoff(1.0, 8.0, jitter=0.5, rng=random.Random(7))
    for step in (1.0, 2.0, 4.0, 8.0, 8.0, 8.0):
        delay = b.next()
        assert step * 0.5 <= delay <= step


def test_a_zero_start_retries_at_once_and_a_low_cap_wins() -> None:
    """start 0 means no delay ever; a cap below the start makes every delay the cap."""
    assert [Backoff(0.0, 30.0).next() for _ in range(3)] == [0.0, 0.0, 0.0]
    low = Backoff(60.0, 30.0)
    assert [low.next(), low.next()] == [30.0, 30.0]


def test_huge_attempt_numbers_stay_at_the_cap() -> None:
    """A retry loop that ran for days does not overflow: its delay is the cap."""
    b = Backoff(0.05, 5.0)
    assert b.step(10_000) == 5.0
    b.attempts = 1_000_000
    assert b.next() == 5.0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"start": -1.0, "cap": 1.0}, "start"),
        ({"start": 1.0, "cap": float("inf")}, "cap"),
        ({"start": 1.0, "cap": 2.0, "jitter": 1.0}, "jitter"),
        ({"start": 1.0, "cap": 2.0, "factor": 0.5}, "factor"),
        ({"start": 1.0, "cap": 2.0, "free": -1}, "free"),
    ],
)
def test_nonsense_settings_are_refused(kwargs: dict[str, float], words: str) -> None:
    """A backoff that could spin or never retry is refused at construction, naming the setting."""
    with pytest.raises(ValueError, match=words):
        Backoff(**kwargs)  # type: ignore[arg-type]
