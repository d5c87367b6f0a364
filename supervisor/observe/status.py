"""Readiness and the status document, assembled from the parts' own views.

Readiness has one definition, here, behind /readyz, `gpuvisor status`, the `gpuvisor_ready`
gauge and systemd's STATUS=: NVML up, every planned resource's worker RUNNING, registered and
streaming, every MPS control daemon up, and the CDI spec written. The main loop computes it
(`readiness`, reading the live worker handles) and hands the answer to the HTTP thread through
a `ReadinessCell`. The status document (`gpuvisor status --json`) is the parts' small `status()`
views side by side, under the keys the CLI and scripts read.

Workers are read through `WorkerState`, the four things readiness needs of a worker handle, so
this module sits below the workers package that owns the handles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from common.messages import Json

log = logging.getLogger("gpuvisor.supervisor")  # the loop's own lines: it publishes readiness


class WorkerState(Protocol):
    """What readiness reads of a worker (supervisor.workers.lifecycle.WorkerHandle has it)."""

    @property
    def state(self) -> Enum: ...

    @property
    def registered(self) -> bool: ...

    @property
    def stats(self) -> Mapping[str, float]: ...

    @property
    def registration(self) -> str: ...


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str


def readiness(
    *,
    nvml_up: bool,
    nvml_error: str,
    planned: Iterable[str],
    workers: Mapping[str, WorkerState],
    mps_not_ready: str,
    cdi_error: str | None,
    pending_reload: str = "",
    no_config: str = "",
    waiting: str = "",
) -> Readiness:
    """Ready, and the one-line reason."""
    if not nvml_up:
        return Readiness(False, f"not ready: NVML is not up ({nvml_error or 'starting'})")
    if waiting:  # the device plugin may offer nothing yet (an earlier DRA pool is being withdrawn)
        return Readiness(False, f"not ready: {waiting}")
    planned = sorted(planned)
    if no_config and not planned:
        return Readiness(False, f"not ready: no config chosen yet, waiting for the node label ({no_config})")
    ok, text = worker_readiness(planned, workers)
    if not ok:
        if pending_reload and not planned:
            text += f"; the first plans are pending: {pending_reload}"
        return Readiness(False, text)
    if mps_not_ready:
        return Readiness(False, f"not ready: {mps_not_ready}")
    if cdi_error is not None:
        return Readiness(False, f"not ready: the CDI spec is not written: {cdi_error}")
    return Readiness(True, text)


def worker_readiness(planned: Iterable[str], workers: Mapping[str, WorkerState]) -> tuple[bool, str]:
    """Ready when every planned resource's worker is RUNNING, registered and streaming.

    Streaming means the worker's last heartbeat counted an open ListAndWatch stream
    (`gauge:streams`). A worker not registered yet says where its registration stands (waiting
    for kubelet.sock, retrying after a refusal), as the worker last reported it.
    """
    planned = sorted(planned)
    if not planned:
        return False, "no resources planned (no GPUs found, or none left by the configuration)"
    missing: list[str] = []
    for resource in planned:
        handle = workers.get(resource)
        if handle is None:
            missing.append(f"{resource}: no worker")
        elif handle.state.value != "RUNNING":
            missing.append(f"{resource}: worker {handle.state.value}{_registration(handle)}")
        elif not handle.registered:
            missing.append(f"{resource}: not registered{_registration(handle)}")
        elif handle.stats.get("gauge:streams", 0.0) < 1:
            missing.append(f"{resource}: registered, no ListAndWatch stream yet")
    if missing:
        return False, "not ready: " + "; ".join(missing)
    return True, f"ready: {len(planned)} resource(s) registered and streaming"


def _registration(handle: WorkerState) -> str:
    """`, registration <state> (<why>)`: where a live worker that is not registered stands. Not
    for a dead one (BACKOFF, FATAL): its last report is not where the resource stands now."""
    live = handle.state.value in ("STARTING", "RUNNING")
    if not live or handle.registered or not handle.registration:
        return ""
    return f", registration {handle.registration}"


class ReadinessCell:
    """The latest readiness answer, set by the main loop and read by the HTTP thread.

    One tuple assignment is atomic in CPython, so no lock is needed; the HTTP thread never
    iterates the supervisor's live dicts. `publish` is the loop's one call per turn: it also
    tells the listeners (the ready gauge, systemd's STATUS=) and logs a flip, once.
    """

    def __init__(self, *listeners: Callable[[bool, str], None]) -> None:
        self._value: tuple[bool, str] = (False, "starting")
        self._listeners = listeners
        self._logged_ready = False

    def set(self, value: tuple[bool, str]) -> None:
        self._value = value

    def publish(self, answer: Readiness) -> None:
        """This turn's answer: kept for the HTTP thread, told to each listener, logged on a flip."""
        self.set((answer.ready, answer.detail))
        for listener in self._listeners:
            listener(answer.ready, answer.detail)
        if answer.ready != self._logged_ready:
            self._logged_ready = answer.ready
            state = "ready" if answer.ready else "not-ready"
            log.info("ready" if answer.ready else "not ready", extra={"state": state})

    def __call__(self) -> tuple[bool, str]:
        return self._value


def document(*sections: Mapping[str, Json]) -> dict[str, Json]:
    """The status document: the sections merged in order (each part owns its keys)."""
    out: dict[str, Json] = {}
    for section in sections:
        for key, value in section.items():
            if key in out:
                raise ValueError(f"status key {key!r} is claimed by two parts")
            out[key] = value
    return out
