"""Logging setup shared by both process roles: one line per event, text or JSON.

Every line carries the process role and, where known, the resource, device and worker; those
come from `extra={...}` on the call or from the process-wide context set once at start (a
worker's resource), so call sites stay short.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_CONTEXT: dict[str, Any] = {}
_FIELDS = ("resource", "device", "worker", "xid", "action", "state", "trigger")


def set_context(**fields: Any) -> None:
    """Fields added to every record of this process (e.g. role and resource of a worker)."""
    _CONTEXT.update({k: v for k, v in fields.items() if v is not None})


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        extra = " ".join(
            f"{k}={v}" for k in _FIELDS if (v := getattr(record, k, None) or _CONTEXT.get(k)) is not None
        )
        role = _CONTEXT.get("role", "gpuvisor")
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname[0]} {role}: {record.getMessage()}"
        if extra:
            line += f" [{extra}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_CONTEXT)
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, sort_keys=True, default=str)


def setup(fmt: str = "text", level: str = "info", **context: Any) -> None:
    """Configure the root logger once for this process (stderr)."""
    set_context(**context)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
