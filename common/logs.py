"""Logging setup shared by both process roles: one line per event, text or JSON.

Every line carries the process role and, where known, the resource, device and worker; those
come from `extra={...}` on the call or from the process-wide context set once at start (a
worker's resource and its own pid as `worker`), so call sites stay short.

- text: `2026-11-02T10:00:00.123Z I supervisor: message [resource=nvidia.com/gpu worker=4242]`
  (values with spaces are quoted, so the bracket stays machine-splittable);
- json: one object per line with `ts`, `level`, `logger`, `msg`, `role`, `pid` and the fields
  that are set. A multi-line message or traceback stays inside one JSON string, so a log
  shipper never sees half an event.

Log on change, not on every poll: nothing here rate-limits, the callers log events only (the
one place that summarises a burst is supervisor/health/eventlog.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

_CONTEXT: dict[str, Any] = {}
FIELDS = ("resource", "device", "worker", "xid", "ecc", "action", "count", "state", "trigger")
FORMATS = ("text", "json")


def set_context(**fields: Any) -> None:
    """Fields added to every record of this process (e.g. role and resource of a worker)."""
    _CONTEXT.update({k: v for k, v in fields.items() if v is not None})


def _field(record: logging.LogRecord, key: str) -> Any:
    value = getattr(record, key, None)
    return _CONTEXT.get(key) if value is None or value == "" else value


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() for c in text) or '"' in text) else text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        extra = " ".join(f"{k}={_text_value(v)}" for k in FIELDS if (v := _field(record, k)) is not None)
        role = _CONTEXT.get("role", "gpuvisor")
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname[0]} {role}: {record.getMessage()}"
        if extra:
            line += f" [{extra}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        doc.update(_CONTEXT)
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None and value != "":
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, sort_keys=True, default=str)


def make_formatter(fmt: str) -> logging.Formatter:
    """The formatter for `--log-format` ("text" or "json")."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")


def setup(fmt: str = "text", level: str = "info", **context: Any) -> None:
    """Configure the root logger once for this process (stderr).

    A worker (role="worker") gets its pid as the `worker` field unless one is given: the
    supervisor logs about a worker with the same field, so one filter finds both sides.
    """
    if context.get("role") == "worker" and context.get("worker") is None:
        context["worker"] = os.getpid()
    numeric = logging.getLevelName(level.upper())
    formatter = make_formatter(fmt)
    set_context(**context)
    root = logging.getLogger()
    # What is in place already stays (a worker forked from the zygote, which set up the default):
    # a new handler and a level change (which clears every logger's cache) would write to
    # objects the zygote shares with its workers, copying their pages into each one.
    current = root.handlers[0] if len(root.handlers) == 1 else None
    if not (
        type(current) is logging.StreamHandler
        and current.stream is sys.stderr
        and type(current.formatter) is type(formatter)
    ):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter)
        root.handlers[:] = [handler]
    wanted = numeric if isinstance(numeric, int) else logging.INFO
    if root.level != wanted:
        root.setLevel(wanted)
    if not isinstance(numeric, int):  # the config validates levels; a hand-run worker may not
        logging.getLogger("gpuvisor").warning("unknown log level %r: logging at info", level)
