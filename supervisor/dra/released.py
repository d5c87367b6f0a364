"""Device-plugin resources the kubelet let go of, removed from the Node's status: `ReleasedResources`.

Why: KEP-5004 lets a pod that asks for `nvidia.com/gpu` be served through DRA, but the 1.34
scheduler (`filterExtendedResources`, pkg/scheduler/framework/plugins/dynamicresources) does so
only where the resource is absent from the Node's allocatable, and the kubelet never removes a
device plugin's resource: when the plugin goes, the device manager reports its devices as capacity
with 0 allocatable for `endpointStopGracePeriod` (5 minutes), then forgets it and the node-status
setter writes 0 ("instead of removing the resource from the node status"), which the Node keeps.
On a node switched to DRA the pod stays Pending with `Insufficient nvidia.com/gpu`. Kubernetes
1.35 (kubernetes#133784) treats allocatable 0 as served by DRA; for 1.34 this part completes the
switch.

When the kubelet stops re-adding the key (read in its source, and kept by the stand-in,
supervisor/sim/kubelet.py): the node-status setter writes a device manager resource only while
the manager has it, and the manager has it while a plugin is registered or within the grace
period after its plugin went (and, after a kubelet restart, for a grace period per resource its
checkpoint registered). While it has it, its checkpoint (`kubelet_internal_checkpoint`,
`RegisteredDevices`) lists it; once it forgot it, the checkpoint no longer does and nothing of
the kubelet writes the key again. So a resource is removed only when all of these hold:

- gpuvisor itself would advertise it as a device plugin on this node (its device-plugin plans
  under the running config): never a resource of another plugin;
- no device-plugin worker of gpuvisor runs (the node runs in DRA mode);
- the kubelet's checkpoint does not list it: no plugin serves it and the grace period is over;
- the Node's `status.allocatable` (where present) is still "0", and `status.capacity` is "0" too
  (the kubelet writes a forgotten resource's 0 once; where that one update was lost the Node
  keeps the grace period's count, and then, the checkpoint proving the kubelet forgot it, that
  count as read): the JSON patch `test`s both values before it `remove`s them, so a resource the
  kubelet counts again in the meantime is left as it is (the server answers 422).

Where the checkpoint cannot be read (not mounted, not written yet) the third test is skipped and
a removal is verified after `VERIFY_S`, then at doubling intervals up to `VERIFY_MAX_S`, while
the kubelet writes the key back (counted as `readded`); it never fights the kubelet faster
than that. Waiting on the kubelet costs a read of its checkpoint every `CHECK_S` (for the grace
period and a margin, then once a minute), no API request; a resource the kubelet counts devices
of (another plugin serves it) is looked at doubling intervals up to a minute; with nothing to
remove the thread sleeps until the plans change or the kubelet restarts.
Every removal is logged and counted (`gpuvisor_dra_api_total{what="release"}`), and shown in
`gpuvisor status` (`cluster.dra.released`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common.backoff import Backoff
from common.messages import Json
from supervisor.dra.background import PassThread
from supervisor.kube.client import KubeClient
from supervisor.kube.errors import ApiError
from supervisor.kube.watch import quote
from supervisor.observe.allocations import registered_resources as kubelet_registered

log = logging.getLogger("gpuvisor.dra")

CHECK_S = 2.0  # while the kubelet still holds a resource: a read of its checkpoint this often
FAST_WAIT_S = 600.0  # ...for this long (the kubelet's 5-minute grace period and a margin)
WAIT_MAX_S = 60.0  # the longest pause while waiting on the kubelet
VERIFY_S = 60.0
VERIFY_MAX_S = 600.0
JSON_PATCH = "application/json-patch+json"


def _pointer(*parts: str) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


class ReleasedResources(PassThread):
    NAME = "dra-released"
    WHAT = "release"
    FAILED = "cannot tidy the Node's status of released device-plugin resources (retrying with backoff): %s"
    AGAIN = "the Node's status can be tidied again (after %.0f s)"

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        plugin_dir: str,
        on_count: Callable[[str, str], None] = lambda what, result: None,
        retry: Backoff | None = None,
        check_s: float = CHECK_S,
    ) -> None:
        super().__init__(client, on_count=on_count, retry=retry)
        self.node_name = node_name
        self.plugin_dir = plugin_dir  # the kubelet's device-plugins dir: its checkpoint
        self.check_s = check_s
        self._candidates: frozenset[str] = frozenset()
        self._device_plugin_running = True
        # The thread's own state (status reads it without the lock: plain values).
        self.state = "idle"
        self.removed: dict[str, str] = {}  # resource -> how it went ("removed", "absent")
        self.kubelet_holds: tuple[str, ...] = ()
        self.counted: tuple[str, ...] = ()  # the kubelet counts devices of these (capacity > 0)
        self.removals = 0
        self.readded = 0
        self._verify_s = VERIFY_S
        self._verifying: set[str] = set()  # removed without the kubelet's checkpoint to go by
        self._wait_streak = 0  # passes in a row that waited on the kubelet
        self._fresh = False  # set under the lock: start afresh at the next pass
        self.removed_view: tuple[str, ...] = ()  # what status shows of `removed`

    # ------------------------------------------------------------------ from the main loop
    def want(self, candidates: frozenset[str], device_plugin_running: bool) -> None:
        """The resources gpuvisor would advertise as a device plugin here, and whether any of its
        device-plugin workers runs (then nothing is touched)."""
        with self._lock:
            if (candidates, device_plugin_running) == (self._candidates, self._device_plugin_running):
                return
            self._candidates, self._device_plugin_running = candidates, device_plugin_running
            self._fresh = True  # a switch back and forth: what was removed may be there again
        self._wake.set()

    def kubelet_restarted(self) -> None:
        """The kubelet came back: it may write a resource of its checkpoint again; look again."""
        with self._lock:
            self._fresh = True
        self._wake.set()

    # ------------------------------------------------------------------ the thread
    def step(self) -> float | None:
        with self._lock:
            candidates, running, fresh = self._candidates, self._device_plugin_running, self._fresh
            self._fresh = False
        if fresh:  # only this thread touches what it found
            self.removed.clear()
            self._verifying.clear()
            self._verify_s = VERIFY_S
            self._wait_streak = 0
        if not candidates or running:
            self.state = "idle"
            return None
        return self._pass(candidates)

    def failed(self, exc: ApiError) -> None:
        self.state = "failing"

    def _pass(self, candidates: frozenset[str]) -> float | None:
        """One look; the seconds until the next, or None (nothing to do until told)."""
        registered = kubelet_registered(self.plugin_dir)
        holds = tuple(sorted(candidates & registered)) if registered is not None else ()
        self.kubelet_holds = holds
        for resource in holds:  # the kubelet has it again: it may write the key again
            self.removed.pop(resource, None)
        todo = sorted(candidates - set(holds) - set(self.removed))
        if not todo:
            self.state = "waiting for the kubelet" if holds else "idle"
            return self._waiting(gets=False) if holds else self._verify_later(registered)
        node = self.client.get(f"/api/v1/nodes/{quote(self.node_name)}", what=f"get Node {self.node_name}")
        status = node.get("status") if isinstance(node, dict) else None
        capacity = (status or {}).get("capacity") or {}
        allocatable = (status or {}).get("allocatable") or {}
        counted: list[str] = []
        for resource in todo:
            have, free = capacity.get(resource), allocatable.get(resource)
            if have is None and free is None:
                self.removed[resource] = "absent"
                self._verifying.discard(resource)
                continue
            if resource in self._verifying:
                self._verifying.discard(resource)
                self.readded += 1
                log.warning(
                    "the kubelet wrote %s back into Node %s's status after it was removed (its "
                    "checkpoint cannot be read to tell when it lets go): removed again, looked at "
                    "again in %.0f s",
                    resource,
                    self.node_name,
                    self._verify_s,
                )
            # The kubelet writes a forgotten resource's 0 once; where that update was lost the
            # Node can keep the grace period's count with allocatable 0. The checkpoint says the
            # kubelet forgot it, so that count is tested as read instead of 0.
            forgotten = registered is not None and isinstance(have, str) and free == "0"
            if free not in (None, "0") or (have != "0" and not forgotten):
                counted.append(resource)  # a plugin serves it, or the kubelet's grace period runs
                continue
            if self._remove(resource, have, free):
                self.removed[resource] = "removed"
            else:
                counted.append(resource)  # it changed since the GET: look again soon
        self.counted = tuple(counted)
        self.removed_view = tuple(sorted(r for r, how in self.removed.items() if how == "removed"))
        if counted or holds:
            self.state = "waiting for the kubelet"
            return self._waiting(gets=bool(counted))
        self.state = "idle"
        self._wait_streak = 0
        return self._verify_later(registered)

    def _waiting(self, *, gets: bool) -> float:
        """The pause while the kubelet still counts or holds a resource. A wait on its checkpoint
        (a file read) stays at `check_s` for the grace period and a margin, then slows down; one
        that reads the Node (no checkpoint to go by, or a plugin that serves the resource) doubles
        from `check_s` up to `WAIT_MAX_S`: a resource another plugin serves for good costs a
        request a minute, not one every few seconds."""
        self._wait_streak += 1
        if gets:
            return float(min(self.check_s * 2.0 ** min(self._wait_streak - 1, 16), WAIT_MAX_S))
        return self.check_s if self._wait_streak * self.check_s < FAST_WAIT_S else WAIT_MAX_S

    def _remove(self, resource: str, capacity: Any, allocatable: Any) -> bool:
        ops: list[dict[str, Any]] = []
        if capacity is not None:
            ops += [
                {"op": "test", "path": _pointer("status", "capacity", resource), "value": capacity},
                {"op": "remove", "path": _pointer("status", "capacity", resource)},
            ]
        if allocatable is not None:
            ops += [
                {"op": "test", "path": _pointer("status", "allocatable", resource), "value": "0"},
                {"op": "remove", "path": _pointer("status", "allocatable", resource)},
            ]
        try:
            self.client.request(
                "PATCH",
                f"/api/v1/nodes/{quote(self.node_name)}/status",
                what=f"remove {resource} from Node {self.node_name}'s status",
                body=ops,
                content_type=JSON_PATCH,
            )
        except ApiError as exc:
            if exc.status == 422:  # the kubelet counts it again (or took it away): look again later
                self.on_count("release", "changed")
                return False
            raise
        self.removals += 1
        self.on_count("release", "ok")
        log.info(
            "removed %s from Node %s's status (allocatable 0, the kubelet let go of the device plugin's "
            "resource): a scheduler of Kubernetes 1.34 serves the resource through DRA only where the "
            "Node lacks it",
            resource,
            self.node_name,
        )
        return True

    def _verify_later(self, registered: frozenset[str] | None) -> float | None:
        """All done. Without the kubelet's checkpoint to go by, look again later (doubling): the
        kubelet may still write a removed key back, and then it is counted and removed again."""
        if registered is not None:
            self._verifying.clear()
            return None
        removed = [r for r, how in self.removed.items() if how == "removed"]
        if not removed:
            return None
        for resource in removed:
            del self.removed[resource]  # the next pass sees whether it came back
            self._verifying.add(resource)
        pause, self._verify_s = self._verify_s, min(self._verify_s * 2, VERIFY_MAX_S)
        return pause

    def status(self) -> dict[str, Json]:
        removed: list[Json] = list(self.removed_view)
        holds: list[Json] = list(self.kubelet_holds)
        counted: list[Json] = list(self.counted)
        return {
            "state": self.state,
            "removed": removed,
            "kubelet_holds": holds,
            "counted_by_kubelet": counted,
            "removals": self.removals,
            "readded": self.readded,
            **self.failing.status(),
        }
