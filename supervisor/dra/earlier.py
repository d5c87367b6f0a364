"""The DRA pool an earlier life published on this node, withdrawn before the device plugin offers
a device of it: `EarlierPool`.

A node that ran in DRA mode and starts again in device-plugin mode (a SIGTERM, a new config, a
rollback) would otherwise offer every GPU to the kubelet at once while its old ResourceSlices stay
at the API server until the kubelet wipes them (30 s after the DRA plugin went, on a real v1.34
node): for that time the scheduler could hand one GPU out through both APIs.

The evidence of an earlier DRA life is local and cheap, so a node that never ran DRA pays nothing
at its start: the DRA worker's own directory `<kubelet plugins dir>/gpu.nvidia.com/` (it holds the
worker's checkpoint and service socket; a host path, so it outlives the pod). Where it is there and
the node runs as a device plugin, planning waits (`pending()` is the reason, read by
`DraDrain.hold`) while one thread of this class lists the pool's slices
(`spec.nodeName`, `spec.driver`) and deletes each with its UID and resourceVersion as
preconditions. Planning goes on as soon as that is done, or once `BOUND_S` has passed:

- The bound: the API server away must not keep the node's GPUs from the kubelet for long. After
  `BOUND_S` the device plugin offers the GPUs and the thread keeps trying (capped backoff, each
  distinct error logged once, counted, in status) until the pool is gone. The trade-off: a longer
  bound keeps GPUs from the kubelet longer when the API server cannot be reached; a shorter one
  lengthens the window in which a scheduler that can reach the API server, while this node
  cannot, still sees the old slices (the kubelet's own wipe, 30 s after the DRA plugin went,
  closes it too). A scheduler needs the API server to schedule at all, so the window needs a
  partition between this node and a working control plane.
- A node that starts in DRA mode (a rolling update that keeps the mode) keeps its pool: `keep()`.
- With the pool gone and no claim left in the checkpoint, the directory's checkpoint and the
  directory itself are removed, so the next start in device-plugin mode has no evidence and asks
  the API server nothing. A checkpoint that still lists claims stays: its draining DRA worker
  needs it (supervisor/node/planning.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from common.backoff import Backoff
from common.messages import Json
from supervisor.node.draplan import DRIVER
from supervisor.scheduler import Scheduler

log = logging.getLogger("gpuvisor.dra")

BOUND_S = 10.0
TIMER = "dra-earlier-pool"
PATH = "/apis/resource.k8s.io/v1/resourceslices"
WAITING = "withdrawing the DRA pool an earlier life published (at most {bound:g} s)"


class EarlierPool:
    def __init__(
        self,
        *,
        node_name: str,
        plugins_dir: str,
        connect: Callable[[], Any],
        timers: Scheduler,
        post: Callable[[Callable[[], None]], None],
        on_done: Callable[[str], object],
        on_count: Callable[[str, str], None] = lambda what, result: None,
        bound_s: float = BOUND_S,
        retry: Backoff | None = None,
    ) -> None:
        self.node_name = node_name
        self.directory = os.path.join(plugins_dir, DRIVER)
        self.connect = connect  # -> a KubeClient (supervisor.kube), made on the thread
        self.timers = timers
        self.post = post  # runs a call on the main loop
        self.on_done = on_done  # the main loop: plan again (why)
        self.on_count = on_count
        self.bound_s = bound_s
        self.retry = retry or Backoff(0.5, 30.0, jitter=0.3)
        self.clock = timers.clock.monotonic
        self.state = "none"  # none | found | withdrawing | withdrawn | kept
        self.deadline: float | None = None
        self.deleted = 0
        self.error = ""
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None

    def look(self) -> None:
        """At start, before planning: is there evidence of an earlier DRA life on this node?"""
        if self.node_name and os.path.isdir(self.directory):
            self.state = "found"

    def keep(self) -> None:
        """The node plans DRA: the pool is this life's too, never withdrawn here (a withdrawal
        still trying, from a start in device-plugin mode, is stopped before its next delete)."""
        if self.state == "withdrawing":
            self._stop.set()
            client = self._client
            if client is not None:
                client.abort()
            self.timers.cancel(TIMER)
            log.info("the node runs in DRA mode again: the earlier pool's withdrawal is stopped")
            self.state = "kept"
        elif self.state == "found":
            log.info("the DRA pool of an earlier life is kept: the node runs in DRA mode again")
            self.state = "kept"

    def pending(self) -> str:
        """Why the device plugin must not offer anything yet ("" once it may). The first call in
        device-plugin mode starts the withdrawal."""
        if self.state == "found":
            self._begin()
        if self.state != "withdrawing" or self.deadline is None:
            return ""
        if self.clock() >= self.deadline:
            return ""
        return WAITING.format(bound=self.bound_s)

    def bound_passed(self) -> None:
        """The main loop's timer at the bound: plan without waiting any longer."""
        if self.state == "withdrawing":
            log.warning(
                "the DRA pool an earlier life published is not withdrawn after %g s (%s): the device "
                "plugin offers the GPUs now, and the pool is withdrawn as soon as the API server answers",
                self.bound_s,
                self.error or "no answer yet",
            )
            self.on_done("the wait for the earlier DRA pool's withdrawal ended")

    def _begin(self) -> None:
        self.state = "withdrawing"
        self.deadline = self.clock() + self.bound_s
        self.timers.call_later(TIMER, self.bound_s, self.bound_passed)
        log.info(
            "found %s of an earlier DRA life: its pool is withdrawn before the device plugin offers a "
            "GPU (waiting at most %g s)",
            self.directory,
            self.bound_s,
        )
        self._thread = threading.Thread(target=self._run, name="dra-earlier-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._withdraw()
            except Exception as exc:  # every failure is retried, each distinct one said once
                if self._stop.is_set():  # stopped, or kept by a node back in DRA mode
                    break
                text = str(exc) or type(exc).__name__
                self.failures += 1
                if text != self.error:
                    log.error("cannot withdraw the DRA pool of an earlier life (retrying): %s", text)
                self.error = text
                self.on_count("withdraw", "failed")
                if self._stop.wait(self.retry.next()):
                    break
                continue
            if self._stop.is_set():  # kept meanwhile: the pool and the evidence are this life's
                break
            self.on_count("withdraw", "ok")
            self.error = ""
            self._forget_evidence()
            self.post(self._finished)
            break
        self._close()

    def _withdraw(self) -> None:
        from supervisor.dra.sliceview import node_slices
        from supervisor.kube.errors import ApiError
        from supervisor.kube.watch import quote

        if self._client is None:
            self._client = self.connect()
        client = self._client
        for obj in node_slices(client, self.node_name, DRIVER):
            if self._stop.is_set():
                return
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
            body = {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
            }
            try:
                client.request(
                    "DELETE", f"{PATH}/{quote(name)}", what=f"delete ResourceSlice {name}", body=body
                )
            except ApiError as exc:
                if not exc.not_found:  # gone already: what was wanted
                    raise
            self.deleted += 1

    def _forget_evidence(self) -> None:
        """The pool is gone: without prepared claims, the checkpoint and the directory go too."""
        from common.dracheckpoint import CHECKPOINT_NAME, CheckpointError, read_claims

        path = os.path.join(self.directory, CHECKPOINT_NAME)
        try:
            if read_claims(path):
                return
        except (CheckpointError, ValueError, OSError):
            return  # unreadable: the DRA worker moves it aside itself; leave it to that
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(OSError):  # not empty (a socket, a file someone left): it stays
            os.rmdir(self.directory)

    def _finished(self) -> None:
        """The main loop: the pool is withdrawn."""
        if self.state == "kept":
            return
        was = self.state
        self.state = "withdrawn"
        log.info(
            "withdrew the DRA pool an earlier life published (%d ResourceSlice(s) deleted)", self.deleted
        )
        self.timers.cancel(TIMER)
        if was == "withdrawing" and self.deadline is not None and self.clock() < self.deadline:
            self.on_done("the DRA pool of an earlier life is withdrawn")

    def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        client = self._client
        if client is not None:
            client.abort()
        if self._thread is not None:
            self._thread.join(0.5)

    def status(self) -> dict[str, Json] | None:
        if self.state == "none":
            return None
        return {
            "state": self.state,
            "deleted": self.deleted,
            "failures": self.failures,
            "error": self.error or None,
        }
