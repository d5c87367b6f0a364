"""The node's ResourceSlices at the API server, kept in step by one thread: `SlicePublisher`.

The main loop says what the pool should show (`want`: the node, the health book's conditions,
or that the pool is withdrawn because the node runs as a device plugin) and never waits on the
API server. This thread does what the Go controller of k8s.io/dynamic-resource-allocation
(`resourceslice`) does for a kubelet plugin, for the one pool of this node:

- the slices are driver `gpu.nvidia.com`, pool and `spec.nodeName` the node's name, owned by the
  Node (an ownerReference with `controller: true`, so they go when the Node goes), created with
  `generateName: <node>-gpu.nvidia.com-`;
- a pass compares the node's slices of the driver with what `supervisor.dra.slices.build_slices` makes of the wanted state.
  Nothing differs: nothing is written. Anything differs (a MIG layout, health, a device held
  or released, a slice edited or deleted by someone else): the pool gets a new generation on
  every slice; slices of another pool or an older generation are deleted first (with the UID
  and resourceVersion as preconditions), then the slices are updated (optimistic concurrency)
  or created, and any left over deleted. The slices compared are listed (`fieldSelector`
  `spec.nodeName`, `spec.driver`) at the first pass, after a failure, after a change by someone
  else and at each resync; otherwise they are what the last list and this thread's own writes'
  answers left (as the Go controller reads its informer's cache and its own mutations): a health
  storm is updates only, no list per generation, and a stale view is a 409 Conflict, then a list;
- the kubelet deletes a node's slices when it starts (and a driver's 30 s after its plugin went):
  a `ListWatch` of the same selection sees every change, and a change this thread did not make
  (an object version it did not write, a deletion it did not do) starts a pass at once, so the
  pool is published again within one round trip; a full pass runs every `RESYNC_S` as well;
- device taints (KEP-5055, `gpu.nvidia.com/xid=<n>`, `gpu.nvidia.com/gpu-lost`, ...) mark
  unhealthy devices, and GPUs shared by memory (gpuvisor.dra.memorySharing, KEP-5075) allow
  multiple allocations, where the API server keeps those fields (`supervisor.dra.probe`: a
  dry-run create before the first slice that carries them, asked again at each resync). A server
  without DRADeviceTaints drops taints: unhealthy devices are left out instead (as NVIDIA's
  driver does); one without DRAConsumableCapacity drops the sharing: the GPUs are published
  whole, as without the setting, with a warning. Other differences between what was sent and
  what the server stored (its normalisations) are remembered, so a pass compares like with like
  and never rewrites for nothing;
- devices that containers of the device plugin still hold (a node switched from device-plugin
  mode: `supervisor.dra.held`) are left out, read from the kubelet on this thread (the call may
  block) at the first pass after the switch and every `HELD_POLL_S` while any is held.

Failures (the API server away, RBAC, the Node not there yet, an API server without
resource.k8s.io/v1) are logged once per distinct error, counted, shown in status, and retried
with capped backoff (a conflict or a slice gone meanwhile at once, a few times); nothing here
ever ends the thread, and the kubelet path never waits on it. `stop()` aborts the client.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from common.backoff import Backoff
from common.messages import Json
from common.model import Node
from supervisor.dra.held import describe, held_by_pods
from supervisor.dra.memshare import shared
from supervisor.dra.partitions import layout_for
from supervisor.dra.probe import FieldProbe, server_version
from supervisor.dra.slices import PoolWant, build_slices, slice_problems, unhealthy_devices
from supervisor.dra.sliceview import (
    PATH,
    _devices,
    _form,
    _generation,
    _meta,
    _partitioned,
    _pool,
    _tainted,
    node_slices,
)
from supervisor.kube.client import KubeClient
from supervisor.kube.errors import NO_ANSWER, ApiError, Stopped
from supervisor.kube.failing import Failing
from supervisor.kube.watch import ListWatch, quote
from supervisor.node.draplan import DRIVER
from supervisor.observe.allocations import AllocationsView

log = logging.getLogger("gpuvisor.dra")

RESYNC_S = 300.0
MIN_INTERVAL_S = 0.2  # between two passes that wrote (a health storm is a few generations a second)
HELD_POLL_S = 10.0
QUICK_RETRIES = 3  # a conflict or a slice deleted meanwhile: tried again at once, this many times
MAX_REMEMBERED = 256
TAINTS_KEPT = "the API server keeps device taints: unhealthy devices are published tainted"
TAINTS_DROPPED = ("the API server drops device taints (its DRADeviceTaints feature gate is off): unhealthy "
                  "devices are left out of the ResourceSlices instead")  # fmt: skip
PARTITIONS_KEPT = "the API server keeps shared counters: MIG-capable GPUs are published partitionable"
PARTITIONS_DROPPED = (
    "gpuvisor.dra.migOnDemand is set, but the API server drops sharedCounters and consumesCounters (its "
    "DRAPartitionableDevices feature gate is off; alpha in Kubernetes 1.34 and 1.35, beta in 1.36): the GPUs "
    "are published whole until it keeps them (asked again every 5 minutes)"
)
SHARING_KEPT = "the API server keeps consumable capacity: full GPUs are published shared by memory"
SHARING_DROPPED = (
    "gpuvisor.dra.memorySharing is set, but the API server drops allowMultipleAllocations and requestPolicy "
    "(its DRAConsumableCapacity feature gate is off; alpha in Kubernetes 1.34 and 1.35, beta in 1.36): the "
    "GPUs are published whole, each for one claim, until it keeps them (asked again every 5 minutes)"
)


class SlicePublisher:
    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        driver: str = DRIVER,
        allocations: Callable[[], AllocationsView] | None = None,
        on_count: Callable[[str, str], None] = lambda what, result: None,
        retry: Backoff | None = None,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.driver = driver
        self.allocations = allocations  # the kubelet's view of device-plugin allocations
        self.on_count = on_count  # (create|update|delete|probe|pass|watch:<event>, ok|failed|...)
        self.failing = Failing(retry or Backoff(1.0, 30.0, jitter=0.3))
        self.selector = f"spec.nodeName={node_name},spec.driver={driver}"
        self.watch = ListWatch(
            client,
            path=PATH,
            selector=self.selector,
            what=f"ResourceSlices of Node {node_name}",
            on_list=self._listed,
            on_event=self._changed,
            on_count=lambda event: on_count(f"watch:{event}", "ok"),
        )
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._want: PoolWant | None = None
        self._dirty = False
        self._next_resync = 0.0
        # What this thread wrote, to tell its own watch events from someone else's.
        self._written: deque[tuple[str, str]] = deque(maxlen=MAX_REMEMBERED)
        self._deleted: deque[str] = deque(maxlen=MAX_REMEMBERED)
        # Changes not known as this thread's when the watch saw them, (name, version; "" a deletion):
        # looked at again at the next pass, as a write's answer can come after its watch event.
        self._foreign: list[tuple[str, str]] = []
        self._forms: dict[str, str] = {}  # what was sent -> what the server stored, where they differ
        self._known: dict[str, dict[str, Any]] | None = None  # name -> slice: the last list + own writes
        self._owner_uid = ""
        self._held: dict[str, tuple[str, ...]] = {}
        self._held_read_at: float | None = None
        self._held_warned = False
        self._quick = 0
        self.probes = {  # does the API server keep these gated fields?
            "taints": FieldProbe("taints", _tainted, on_count=on_count, kept=TAINTS_KEPT, dropped=TAINTS_DROPPED),
            "sharing": FieldProbe("sharing", shared, on_count=on_count, kept=SHARING_KEPT, dropped=SHARING_DROPPED),
            "partitions": FieldProbe("partitions", _partitioned, on_count=on_count, kept=PARTITIONS_KEPT,
                                     dropped=PARTITIONS_DROPPED),
        }  # fmt: skip
        self.server_version: tuple[int, int] | None = None  # (major, minor): the slices' layout
        # The view for status and metrics.
        self.state = "starting"  # published, withdrawn, waiting, failing
        self.generation = 0
        self.slices = 0
        self.devices = 0
        self.writes = {"create": 0, "update": 0, "delete": 0}
        self.republished = 0
        self.passes = 0
        self.published_at: float | None = None

    # ------------------------------------------------------------------ from the main loop
    def want(self, want: PoolWant) -> None:
        with self._lock:
            if want == self._want:
                return
            if want.publish and not (self._want is not None and self._want.publish):
                self._held_read_at = None  # a (new) start of publishing: read the kubelet's view now
            self._want = want
            self._dirty = True
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="dra slices", daemon=True)
        self._thread.start()
        self.watch.start()

    def stop(self, join: float = 1.0) -> None:
        self.client.abort()
        self._wake.set()
        self.watch.stop(join)
        if self._thread is not None:
            self._thread.join(join)

    # ------------------------------------------------------------------ the watch's thread
    def _listed(self, items: list[dict[str, Any]]) -> None:
        self._poke()

    def _changed(self, kind: str, obj: dict[str, Any]) -> None:
        meta = _meta(obj)
        name, version = str(meta.get("name", "")), str(meta.get("resourceVersion", ""))
        with self._lock:
            if kind == "DELETED":
                if name in self._deleted:
                    return
            elif (name, version) in self._written:
                return
            self._foreign.append((name, "" if kind == "DELETED" else version))
            if kind == "DELETED":
                self._owner_uid = ""  # the Node may be gone and back (the garbage collector's doing)
        self._poke()

    def _poke(self) -> None:
        with self._lock:
            self._dirty = True
        self._wake.set()

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        while not self.client.stopped:
            self._wake.wait(max(0.0, self._due() - time.monotonic()))
            self._wake.clear()
            if self.client.stopped:
                break
            try:
                wrote = self.sync()
            except Stopped:
                break
            except ApiError as exc:
                self._known = None  # what failed may have left the view stale: list next time
                self._failed(exc)
                quick = (exc.conflict or exc.not_found) and self._quick < QUICK_RETRIES
                self._quick = self._quick + 1 if quick else 0
                pause = 0.0 if quick else self.failing.pause()
                self._poke()  # whatever failed is still to do
            except Exception as exc:  # a bug must not end the thread: count it, back off, go on
                log.exception("publishing the ResourceSlices of Node %s failed unexpectedly", self.node_name)
                self._known = None
                self._failed(ApiError("ResourceSlices", NO_ANSWER, type(exc).__name__, str(exc)))
                pause = self.failing.pause()
                self._poke()
            else:
                self._works()
                pause = MIN_INTERVAL_S if wrote else 0.0
            if self.client.stop_event.wait(pause):
                break

    def _due(self) -> float:
        with self._lock:
            if self._dirty:
                return 0.0
            due = self._next_resync
            if self._held and self._held_read_at is not None:
                due = min(due, self._held_read_at + HELD_POLL_S)
            return due

    def sync(self) -> bool:
        """One pass; whether it wrote anything. Raises ApiError or Stopped."""
        now = time.monotonic()
        with self._lock:
            want, self._dirty = self._want, False
            seen, self._foreign = self._foreign, []
            foreign = sum(1 for name, version in seen if not version or (name, version) not in self._written)
            resync = now >= self._next_resync
        if want is None:
            return False
        if foreign or resync:
            self._known = None
        self.passes += 1
        for probe in self.probes.values():
            if resync:
                probe.resync()  # ask again where dropped: the API server may have been upgraded
        if resync:
            self.server_version = None
        if not want.publish:
            wrote = self._withdraw()
        elif want.wait or want.node is None:
            self.state = "waiting"
            wrote = False
        else:
            wrote = self._publish(want, want.node, self._list())
            if wrote and foreign:
                self.republished += 1
                log.info(
                    "ResourceSlices of Node %s published again (generation %d) after %d change(s) by "
                    "someone else (the kubelet deletes a node's slices when it starts)",
                    self.node_name,
                    self.generation,
                    foreign,
                )
        self.on_count("pass", "wrote" if wrote else "unchanged")
        with self._lock:
            self._next_resync = time.monotonic() + RESYNC_S
        return wrote

    # ------------------------------------------------------------------ a pass's parts
    def _list(self) -> list[dict[str, Any]]:
        """The node's slices: listed when the view is unknown, else the view (copies, by name)."""
        if self._known is None:
            self._known = {
                str(_meta(o).get("name", "")): o
                for o in node_slices(self.client, self.node_name, self.driver)
            }
        return [copy.deepcopy(self._known[name]) for name in sorted(self._known)]

    def _withdraw(self) -> bool:
        """Delete every slice of this node and driver. A node that never published in this life
        only looks (a slice an earlier life left): an API server that does not serve the API, or
        RBAC without it (a chart in device-plugin mode), is then no failure to retry forever."""
        self._known = None  # a withdrawal always looks at the server
        try:
            existing = self._list()
        except ApiError as exc:
            if self.published_at is not None or not (exc.no_such_api or exc.forbidden):
                raise
            if self.state != "withdrawn":
                log.info("no ResourceSlices of Node %s to look for: %s", self.node_name, exc.describe())
            existing = []
        for obj in existing:
            self._delete(obj)
        if existing:
            log.info(
                "ResourceSlices of Node %s withdrawn (%d deleted): the node's GPUs are not served through DRA",
                self.node_name,
                len(existing),
            )
        self.state, self.slices, self.devices = "withdrawn", 0, 0
        return bool(existing)

    def _publish(self, want: PoolWant, node: Node, existing: list[dict[str, Any]]) -> bool:
        owner = self._owner()
        held = self._read_held(node)
        desired = self._desired(node, want, held, owner)
        ours = [o for o in existing if _pool(o).get("name") == self.node_name]
        others = [o for o in existing if _pool(o).get("name") != self.node_name]
        generation = max((_generation(o) for o in ours), default=0)
        current = [o for o in ours if _generation(o) == generation]
        stale = [o for o in ours if _generation(o) < generation]
        have = sorted(_form(o) for o in current)
        wanted = sorted(self._forms.get(f, f) for f in (_form(d) for d in desired))
        in_step = (
            not others
            and not stale
            and have == wanted
            and all(_pool(o).get("resourceSliceCount") == len(desired) for o in current)
            and all(self._owned(o, owner) for o in current)
        )
        if in_step:
            self._published(generation, len(current), desired)
            return False
        new = max(generation, self.generation) + 1
        # Devices the node no longer offers go first, even if the new slices cannot be written.
        for obj in others + stale:
            self._delete(obj)
        for i, obj in enumerate(desired):
            obj["spec"]["pool"]["generation"] = new
            if i < len(current):
                self._update(current[i], obj)
            else:
                self._create(obj)
        for obj in current[len(desired) :]:
            self._delete(obj)
        self.generation = new
        self._published(new, len(desired), desired)
        # Built without taints (the API server drops them): say which devices that left out, and why.
        unhealthy = unhealthy_devices(node, want.conditions, exclude=held) if self.taints is False else {}
        log.info(
            "ResourceSlices of Node %s: pool generation %d, %d slice(s), %d device(s)%s%s",
            self.node_name,
            new,
            len(desired),
            self.devices,
            f"; left out, held by device-plugin containers: {describe(held)}" if held else "",
            f"; left out, unhealthy (the API server drops device taints): {describe(unhealthy)}"
            if unhealthy
            else "",
        )
        return True

    def _published(self, generation: int, slices: int, desired: list[dict[str, Any]]) -> None:
        if self.state != "published":
            self.published_at = time.time()
        self.state, self.generation, self.slices = "published", generation, slices
        self.devices = sum(len(_devices(d)) for d in desired)

    def _desired(
        self, node: Node, want: PoolWant, held: Mapping[str, Any], owner: str
    ) -> list[dict[str, Any]]:
        def build() -> list[dict[str, Any]]:
            sharing = want.memory_sharing if self.probes["sharing"].state is not False else None
            partitioned = want.partitions and self.probes["partitions"].state is not False
            return build_slices(
                node, want.conditions, node_name=self.node_name, taints=self.taints is not False,
                driver=self.driver, exclude=held, memory_sharing=sharing,
                layout=layout_for(self._version()) if partitioned else "",
            )  # fmt: skip

        desired = build()
        for probe in self.probes.values():  # a gated field about to be written the first time: ask
            carrier = next((d for d in desired if probe.present(_devices(d))), None)
            asked = carrier is not None and probe.state is None
            if asked and not probe.ask(self.client, PATH, carrier or {}, self._owner_ref(owner)):
                desired = build()
        for obj in desired:
            obj["metadata"]["ownerReferences"] = [self._owner_ref(owner)]
            problems = slice_problems(obj)
            if problems:  # the API server would refuse it: say what, send nothing
                raise ApiError("build the ResourceSlices", NO_ANSWER, "Invalid", "; ".join(problems[:5]))
        return desired

    def _version(self) -> tuple[int, int]:
        """The API server's (major, minor), read once per resync (`/version`). Raises ApiError."""
        if self.server_version is None:
            self.server_version = server_version(self.client)
        return self.server_version

    @property
    def taints(self) -> bool | None:
        """Does the API server keep device taints? None: not asked yet."""
        return self.probes["taints"].state

    @taints.setter
    def taints(self, kept: bool | None) -> None:
        self.probes["taints"].state = kept

    def _owner(self) -> str:
        if not self._owner_uid:
            node = self.client.get(
                f"/api/v1/nodes/{quote(self.node_name)}",
                what=f"get Node {self.node_name} (the owner of its ResourceSlices)",
            )
            uid = _meta(node).get("uid") if isinstance(node, dict) else None
            if not isinstance(uid, str) or not uid:
                raise ApiError(f"get Node {self.node_name}", 200, "BadNode", "the Node has no UID")
            self._owner_uid = uid
        return self._owner_uid

    def _owner_ref(self, uid: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid, "controller": True}

    def _owned(self, obj: Mapping[str, Any], uid: str) -> bool:
        refs = _meta(obj).get("ownerReferences")
        return isinstance(refs, list) and refs == [self._owner_ref(uid)]

    def _read_held(self, node: Node) -> dict[str, tuple[str, ...]]:
        if self.allocations is None:
            return {}
        now = time.monotonic()
        if self._held_read_at is not None and (not self._held or now - self._held_read_at < HELD_POLL_S):
            return self._held
        view = self.allocations()
        self._held_read_at = now
        if not view.source and not self._held_warned:
            self._held_warned = True
            log.warning(
                "the kubelet's allocations cannot be read (%s): no device is held back from the ResourceSlices "
                "for device-plugin containers",
                "; ".join(view.warnings) or "no source",
            )
        held = held_by_pods(node, view.allocations)
        if held != self._held:
            if held:
                log.info(
                    "left out of the ResourceSlices, held by device-plugin containers: %s", describe(held)
                )
            else:
                log.info("no device is held by device-plugin containers any more: all are published")
        self._held = held
        return held

    # ------------------------------------------------------------------ writes
    def _create(self, obj: dict[str, Any]) -> None:
        answer = self._write("create", "POST", PATH, obj, f"create a ResourceSlice of Node {self.node_name}")
        self._took(obj, answer)

    def _update(self, current: dict[str, Any], want: dict[str, Any]) -> None:
        obj = copy.deepcopy(current)
        obj["spec"] = want["spec"]
        obj["metadata"]["ownerReferences"] = want["metadata"]["ownerReferences"]
        name = str(_meta(current).get("name", ""))
        answer = self._write("update", "PUT", f"{PATH}/{quote(name)}", obj, f"update ResourceSlice {name}")
        self._took(obj, answer)

    def _delete(self, obj: Mapping[str, Any]) -> None:
        meta = _meta(obj)
        name = str(meta.get("name", ""))
        with self._lock:
            self._deleted.append(name)
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
        }
        try:
            self._write("delete", "DELETE", f"{PATH}/{quote(name)}", body, f"delete ResourceSlice {name}")
        except ApiError as exc:
            if not exc.not_found:  # gone already (the kubelet's doing): that is what was wanted
                raise
        if self._known is not None:
            self._known.pop(name, None)

    def _write(self, verb: str, method: str, path: str, body: Any, what: str) -> Any:
        try:
            answer = self.client.request(method, path, what=what, body=body)
        except ApiError as exc:
            self.on_count(verb, exc.kind)
            raise
        self.writes[verb] += 1
        self.on_count(verb, "ok")
        return answer

    def _took(self, sent: Mapping[str, Any], answer: Any) -> None:
        """What the server stored for a create or update: remembered as this thread's own write;
        dropped taints, or any other difference, taken into account from now on."""
        if not isinstance(answer, dict):
            self._known = None  # what the server stored is not known: list next time
            return
        meta = _meta(answer)
        with self._lock:
            self._written.append((str(meta.get("name", "")), str(meta.get("resourceVersion", ""))))
        if self._known is not None:
            self._known[str(meta.get("name", ""))] = copy.deepcopy(answer)
        if _form(sent) == _form(answer):
            return
        if any([probe.took(_devices(sent), _devices(answer)) for probe in self.probes.values()]):
            self._poke()  # write the pool again without what the server drops
            return
        if len(self._forms) >= MAX_REMEMBERED:
            self._forms.clear()
        self._forms[_form(sent)] = _form(answer)

    # ------------------------------------------------------------------ failures and status
    def _failed(self, exc: ApiError) -> None:
        self.on_count("pass", "failed")
        self.state = "failing"
        text = exc.describe()
        if exc.no_such_api:
            text += " (this API server does not serve resource.k8s.io/v1: Kubernetes 1.34 or later is needed)"
        if self.failing.failed(text):
            log.warning(
                "the ResourceSlices of Node %s could not be published (retrying with backoff; the kubelet "
                "path is unaffected): %s",
                self.node_name,
                text,
            )

    def _works(self) -> None:
        lasted = self.failing.works()
        if lasted is not None:
            log.info("the ResourceSlices of Node %s are written again after %.0fs", self.node_name, lasted)
        self._quick = 0

    def status(self) -> dict[str, Json]:
        return {
            "state": self.state,
            "pool": self.node_name,
            "driver": self.driver,
            "generation": self.generation,
            "slices": self.slices,
            "devices": self.devices,
            "held_by_device_plugin": {name: list(pods) for name, pods in self._held.items()},
            "taints": self.probes["taints"].describe(),
            "memory_sharing": self.probes["sharing"].describe(),
            "partitions": self.probes["partitions"].describe(),
            "server_version": ".".join(map(str, self.server_version)) if self.server_version else None,
            "writes": dict(self.writes),
            "republished": self.republished,
            "passes": self.passes,
            **self.failing.status(),
            "published_at": self.published_at,
            "watch": self.watch.status(),
        }
