"""Readiness and the status document, assembled from the parts' own views.

Readiness has one definition, behind /readyz, `gpuvisor status`, the `gpuvisor_ready` gauge
and systemd's STATUS=: NVML up, every planned resource's worker RUNNING, registered and
streaming, every MPS control daemon up, and the CDI spec written. The status document
(`gpuvisor status --json`) is the parts' small `status()` views side by side, under the keys
the CLI and scripts read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.messages import Json
from supervisor.httpserver import worker_readiness
from supervisor.workers import WorkerHandle


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str


def readiness(
    nvml_up: bool,
    nvml_error: str,
    planned: Iterable[str],
    workers: Mapping[str, WorkerHandle],
    mps_not_ready: str,
    cdi_error: str | None,
    pending_reload: str = "",
) -> Readiness:
    """Ready, and the one-line reason."""
    if not nvml_up:
        return Readiness(False, f"not ready: NVML is not up ({nvml_error or 'starting'})")
    ok, text = worker_readiness(planned, workers)
    if not ok:
        if pending_reload and not list(planned):
            text += f"; the first plans are pending: {pending_reload}"
        return Readiness(False, text)
    if mps_not_ready:
        return Readiness(False, f"not ready: {mps_not_ready}")
    if cdi_error is not None:
        return Readiness(False, f"not ready: the CDI spec is not written: {cdi_error}")
    return Readiness(True, text)


def workers_view(workers: Mapping[str, WorkerHandle], now: float) -> list[Json]:
    out: list[Json] = []
    for resource, h in sorted(workers.items()):
        out.append(
            {
                "resource": resource,
                "state": h.state.value,
                "pid": h.pid if h.proc is not None else None,
                "restarts": h.restarts,
                "restart_causes": dict(h.restart_causes),
                "last_exit": h.last_exit,
                "socket": h.socket_path,
                "registered": h.registered,
                "registered_since": h.registered_since or None,
                "streams": int(h.stats.get("gauge:streams", 0)),
                "registration": h.registration,
                "no_stream_reregistrations": int(h.stats.get("count:no_stream_reregistrations", 0)),
                "reason": h.reason,
                "next_retry_in": round(max(0.0, h.backoff_until - now), 2) if h.backoff_until > now else None,
            }
        )
    return out


def document(*sections: Mapping[str, Json]) -> dict[str, Json]:
    """The status document: the sections merged in order (each part owns its keys)."""
    out: dict[str, Json] = {}
    for section in sections:
        for key, value in section.items():
            if key in out:
                raise ValueError(f"status key {key!r} is claimed by two parts")
            out[key] = value
    return out
