"""common/logs.py: one line per event in text or JSON, with resource/device/worker; silence when idle."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Iterator

import pytest

from common import logs


def record(
    msg: str, *args: object, exc: bool = False, fields: dict[str, object] | None = None
) -> logging.LogRecord:
    rec = logging.LogRecord("gpuvisor.test", logging.WARNING, __file__, 1, msg, args, None)
    if exc:
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            rec.exc_info = sys.exc_info()
    for key, value in (fields or {}).items():
        setattr(rec, key, value)
    return rec


@pytest.fixture
def context(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """A private process context, so tests do not leak fields into each other."""
    ctx: dict[str, object] = {}
    monkeypatch.setattr(logs, "_CONTEXT", ctx)
    yield ctx


def test_json_is_one_object_per_line_with_the_event_fields(context: dict[str, object]) -> None:
    """--log-format json: one parseable object per record, carrying resource, device and worker."""
    context.update(role="supervisor")
    line = logs.make_formatter("json").format(
        record(
            "health %s",
            "changed\nacross lines",
            exc=True,
            fields={"resource": "nvidia.com/gpu", "device": "GPU-a", "worker": 4242, "xid": 0},
        )
    )
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["msg"] == "health changed\nacross lines"
    assert (doc["resource"], doc["device"], doc["worker"], doc["xid"]) == ("nvidia.com/gpu", "GPU-a", 4242, 0)
    assert doc["role"] == "supervisor" and doc["level"] == "warning" and doc["pid"] == os.getpid()
    assert "ValueError" in doc["exc"]


@pytest.mark.parametrize(
    ("extra", "tail"),
    [
        ({"resource": "nvidia.com/gpu"}, " [resource=nvidia.com/gpu]"),
        (
            {"resource": "nvidia.com/gpu", "device": "GPU-a", "worker": 7},
            " [resource=nvidia.com/gpu device=GPU-a worker=7]",
        ),
        ({"xid": 0}, " [xid=0]"),
        ({"trigger": "kubelet restart"}, ' [trigger="kubelet restart"]'),
        ({}, ""),
    ],
)
def test_text_carries_the_fields_in_brackets(
    context: dict[str, object], extra: dict[str, object], tail: str
) -> None:
    """--log-format text: fields follow the message as [key=value ...]; spaced values are quoted."""
    line = logs.make_formatter("text").format(record("event", fields=extra))
    assert line.endswith(" W gpuvisor: event" + tail)


def test_context_fields_apply_unless_the_call_names_them(context: dict[str, object]) -> None:
    """The process context (a worker's resource) fills fields a call does not set itself."""
    context.update(role="worker", resource="nvidia.com/gpu", worker=99)
    fmt = logs.make_formatter("text")
    assert fmt.format(record("x")).endswith("worker: x [resource=nvidia.com/gpu worker=99]")
    assert fmt.format(record("x", fields={"resource": "nvidia.com/gpu.shared"})).endswith(
        "[resource=nvidia.com/gpu.shared worker=99]"
    )


def test_setup_gives_a_worker_its_pid_and_refuses_unknown_formats(
    context: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """setup(role="worker") adds worker=<pid>; an unknown format is a ValueError naming it."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        logs.setup("json", "info", role="worker", resource="nvidia.com/gpu")
        logging.getLogger("gpuvisor.test").info("hello")
        logging.getLogger("gpuvisor.test").debug("not shown")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["worker"] == os.getpid()
    with pytest.raises(ValueError, match="'yaml'"):
        logs.make_formatter("yaml")


def test_setup_keeps_what_is_in_place_and_changes_what_differs(
    context: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second setup with the same format and level (a worker forked from the zygote, which set
    up the default) keeps the root handler and leaves every logger's level cache alone; another
    format gets a new handler with its formatter, another level is set."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    child = logging.getLogger("gpuvisor.test.cache")
    try:
        logs.setup("text", "info", role="zygote")
        (first,) = root.handlers
        assert child.isEnabledFor(logging.INFO)  # cached now
        logs.setup("text", "info", role="worker", resource="nvidia.com/gpu")
        assert root.handlers == [first] and vars(child)["_cache"] == {logging.INFO: True}
        assert context["role"] == "worker" and context["resource"] == "nvidia.com/gpu"
        logs.setup("json", "debug", role="worker")
        (second,) = root.handlers
        assert second is not first and isinstance(second.formatter, logs.JsonFormatter)
        assert root.level == logging.DEBUG and vars(child)["_cache"] == {}
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
