"""The DRA worker's gRPC services: DRAPlugin v1 and v1beta1, the health stream, and registration.

Protocol plumbing only: the answers come from `worker.dra.prepare.Preparer` and the worker's
health board (`worker.dra.health.response`). Both DRAPlugin versions carry the same messages in their own
packages (v1 adds `share_id`), so each is a thin translation to one `prepare` / `unprepare`.
A request that breaks the wire contract (a claim without its UID) gets that claim's error in the
response like any other, never a failed RPC: the kubelet ignores a whole response on an RPC
error and would retry the good claims with the bad.

Registration answers GetInfo with what the kubelet's plugin manager validates (type
`DRAPlugin`, the driver name, the service socket's path, the services in order of preference:
`v1.DRAPlugin`, `v1beta1.DRAPlugin`, then `v1alpha1.DRAResourceHealth`) and hears the outcome in
NotifyRegistrationStatus; a refusal is recorded with the kubelet's words and answered with an
error, as the kubeletplugin helper does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from common.draapi import (
    HEALTH_SERVICE,
    PLUGIN_TYPE,
    V1_SERVICE,
    V1BETA1_SERVICE,
    healthpb,
    regpb,
    v1,
    v1beta1,
)
from worker.dra.claims import ClaimRef
from worker.dra.figures import INTERNAL, INVALID_REQUEST, PREPARE_ERROR, UNPREPARE_ERROR, DraFigures
from worker.dra.health import RESEND_S, response
from worker.dra.prepare import Preparer, PrepareResult
from worker.healthboard import HealthBoard

log = logging.getLogger("gpuvisor.worker")

SUPPORTED_SERVICES = (V1_SERVICE, V1BETA1_SERVICE, HEALTH_SERVICE)
MAX_HEALTH_STREAMS = 3  # the kubelet holds one; a restarting kubelet may briefly hold two


def _refs(claims: Sequence[Any]) -> tuple[list[ClaimRef], dict[str, str]]:
    """The request's claims, and an error for each that lacks what the API requires."""
    refs: list[ClaimRef] = []
    bad: dict[str, str] = {}
    for claim in claims:
        ref = ClaimRef(str(claim.namespace), str(claim.name), str(claim.uid))
        if not (ref.namespace and ref.name and ref.uid):
            bad[ref.uid or f"{ref.namespace}/{ref.name}"] = (
                f"claim {ref}: namespace, name and uid are all required (uid {ref.uid!r})"
            )
            continue
        refs.append(ref)
    return refs, bad


class DraPluginService:
    """`DRAPlugin` in both versions, over one Preparer; `observe` times each call, `figures` each
    claim (worker.dra.figures: NVIDIA's per-claim request figures)."""

    def __init__(
        self,
        preparer: Preparer,
        observe: Callable[[str, float], None] = lambda m, s: None,
        figures: DraFigures | None = None,
    ) -> None:
        self.preparer = preparer
        self._observe = observe
        self.figures = figures if figures is not None else DraFigures("")
        self.v1 = _Version(self, v1, share_ids=True)
        self.v1beta1 = _Version(self, v1beta1, share_ids=False)

    def prepare(self, claims: Sequence[Any]) -> dict[str, PrepareResult]:
        start = time.perf_counter()
        began = self.figures.begin("prepare", len(claims))
        refs, bad = _refs(claims)
        failure = PREPARE_ERROR
        try:
            results = self.preparer.prepare(refs)
        except Exception as exc:  # a bug: every claim says so, the RPC and the worker live on
            log.exception("NodePrepareResources failed")
            failure = INTERNAL
            results = {ref.uid: PrepareResult(error=f"claim {ref}: internal error: {exc!r}") for ref in refs}
        results.update({uid: PrepareResult(error=text) for uid, text in bad.items()})
        errors = [INVALID_REQUEST if uid in bad else failure for uid, r in results.items() if r.error]
        self.figures.end("prepare", began, len(claims), len(results), errors)
        self._observe("NodePrepareResources", time.perf_counter() - start)
        return results

    def unprepare(self, claims: Sequence[Any]) -> dict[str, str]:
        start = time.perf_counter()
        began = self.figures.begin("unprepare", len(claims))
        refs, bad = _refs(claims)
        failure = UNPREPARE_ERROR
        try:
            errors = self.preparer.unprepare(refs)
        except Exception as exc:  # as for prepare: the kubelet retries the claims
            log.exception("NodeUnprepareResources failed")
            failure = INTERNAL
            errors = {ref.uid: f"claim {ref}: internal error: {exc!r}" for ref in refs}
        errors.update(bad)
        kinds = [INVALID_REQUEST if uid in bad else failure for uid, text in errors.items() if text]
        self.figures.end("unprepare", began, len(claims), len(errors), kinds)
        self._observe("NodeUnprepareResources", time.perf_counter() - start)
        return errors


class _Version:
    """One DRAPlugin version: its package's messages around the shared service."""

    def __init__(self, service: DraPluginService, pb: Any, *, share_ids: bool) -> None:
        self._service = service
        self._pb = pb
        self._share_ids = share_ids

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        pb = self._pb
        out = pb.NodePrepareResourcesResponse()
        for uid, result in self._service.prepare(request.claims).items():
            entry = out.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for device in result.devices:
                fields: dict[str, Any] = {
                    "request_names": list(device.requests),
                    "pool_name": device.pool,
                    "device_name": device.device,
                    "cdi_device_ids": list(device.cdi_device_ids),
                }
                if self._share_ids and device.share_id is not None:
                    fields["share_id"] = device.share_id
                entry.devices.append(pb.Device(**fields))
        return out

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        out = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in self._service.unprepare(request.claims).items():
            out.claims[uid].error = error
        return out


class HealthService:
    """`v1alpha1.DRAResourceHealth`: the whole list at once, then on every change and every
    RESEND_S, until the kubelet cancels or the worker stops."""

    def __init__(self, board: HealthBoard, clock: Callable[[], float] = time.time) -> None:
        self.board = board
        self._clock = clock
        self._lock = threading.Lock()
        self._streams = 0
        self.stopping = False
        self.on_streams_changed: Callable[[], None] = lambda: None

    @property
    def streams(self) -> int:
        with self._lock:
            return self._streams

    def stop(self) -> None:
        """End every stream now (the worker is stopping)."""

        def mark() -> None:
            self.stopping = True

        self.board.wake(mark)

    def NodeWatchResources(
        self, request: healthpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[healthpb.NodeWatchResourcesResponse]:
        with self._lock:
            admitted = self._streams < MAX_HEALTH_STREAMS
            if admitted:
                self._streams += 1
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_HEALTH_STREAMS} NodeWatchResources streams at a time",
            )
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            self.board.wake()

        def done() -> bool:
            return ended.is_set() or self.stopping

        if not context.add_callback(on_end):
            ended.set()
        self.on_streams_changed()
        try:
            version = self.board.version()
            yield response(self.board, self._clock())
            while not done() and context.is_active():
                changed = self.board.wait_change(version, RESEND_S, done)
                if done():
                    break
                if changed is not None:
                    version = changed
                yield response(self.board, self._clock())  # a change, or the periodic resend
        finally:
            with self._lock:
                self._streams -= 1
            self.on_streams_changed()


class RegistrationService:
    """The plugin watcher's side: who we are, and what the kubelet made of it."""

    def __init__(self, driver: str, endpoint: str, on_status: Callable[[bool, str], None]) -> None:
        self.info = regpb.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(SUPPORTED_SERVICES)
        )
        self._on_status = on_status

    def GetInfo(self, request: regpb.InfoRequest, context: grpc.ServicerContext) -> regpb.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(
        self, request: regpb.RegistrationStatus, context: grpc.ServicerContext
    ) -> regpb.RegistrationStatusResponse:
        self._on_status(bool(request.plugin_registered), str(request.error))
        if not request.plugin_registered:
            context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error}")
        return regpb.RegistrationStatusResponse()
