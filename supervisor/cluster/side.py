"""The supervisor's side of the cluster: the node's config label, and GPU health on the Node.

Off unless asked for: `--config-file-srcdir` (the named configs; the Node's label picks one) or
`--node-health`. Even then nothing here touches the API server, and the API-server layer
(supervisor/kube: `ssl`, `http.client`) is not even imported, until the kubelet path is up: a
worker has registered with the kubelet, or the applied plans have nothing to register, or no
config can be chosen without the label. Registration never waits on the API server.

Once started, on threads of their own, never the main loop's:

- the label: an `ObjectWatch` of this Node (list, then watch by `metadata.name`, resourceVersion
  kept, a new list on 410 Gone, capped backoff). Each new value of the label (config-manager's
  rules: the first value seen, then each change; a deleted Node is an empty label) is posted to
  the main loop, where the replanner applies it through the same in-place reload as SIGHUP.
  While the API server is away the running config stays;
- health: a `NodeHealthWriter`. The health hub tells this part of each batch that changed a
  device (`health_changed`, on the main loop); it works out the condition the Node should show
  and the batch's Event and hands both to the writer. Events that happen before the start are
  kept (the last `MAX_EARLY_EVENTS`) and sent once it starts, with the condition as it is then.

Parts of higher layers join through `ClusterPart` (the DRA driver's ResourceSlices and claims,
supervisor/dra/side.py): each says whether it needs the API server now (`wanted`), and is started
with the client once the cluster side is up, or as soon as it becomes wanted after that (a node
switched to mode dra at run time); it is stopped with the cluster side.

A failure to start (a kubeconfig that cannot be read, a service account token not mounted yet)
is logged once per distinct error, shown in status, and retried with backoff; it never stops the
supervisor.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from common.backoff import Backoff
from common.messages import Json
from supervisor.cluster.health import NodeEvent, health_event, node_condition
from supervisor.config import Config
from supervisor.config.version import VERSION
from supervisor.health.book import ChangeBatch
from supervisor.health.hub import HealthHub
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Retrying, Scheduler

if TYPE_CHECKING:
    from supervisor.cluster.writer import NodeHealthWriter
    from supervisor.kube.client import KubeClient
    from supervisor.kube.limiter import TokenBucket
    from supervisor.kube.watch import ObjectWatch

log = logging.getLogger("gpuvisor.cluster")

TIMER = "cluster-start"
MAX_EARLY_EVENTS = 50


class ProcessLimiter:
    """The one token bucket of every API client of this process (`--kube-api-qps`,
    `--kube-api-burst`): the cluster side's client and the DRA side's own share it, so the
    process as a whole stays under the rate. Made at its first use: the API-server layer loads
    late (the module docstring)."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps = qps
        self.burst = burst
        self._bucket: TokenBucket | None = None

    def get(self) -> TokenBucket:
        if self._bucket is None:
            from supervisor.kube.limiter import TokenBucket

            self._bucket = TokenBucket(self.qps, self.burst)
        return self._bucket


def api_client(
    kubeconfig: str, environ: Mapping[str, str], metrics: Metrics, limiter: ProcessLimiter
) -> KubeClient:
    """A client of the API server: the kubeconfig, else the pod's service account, under the
    process's limiter. Loads the API-server layer (`ssl`, `http.client`): called only once a
    feature needs it."""
    from supervisor.kube.client import KubeClient
    from supervisor.kube.credentials import load_credentials

    return KubeClient(
        load_credentials(kubeconfig, environ),
        component="supervisor",
        version=VERSION,
        limiter=limiter.get(),
        on_request=metrics.api_request,
    )


class ClusterPart(Protocol):
    """A feature of a higher layer that talks to the API server through the cluster side's client."""

    @property
    def wanted(self) -> bool:
        """Does it need the API server now?"""
        ...

    def start(self, client: KubeClient) -> None:
        """The client is up (its threads start here; nothing may block)."""
        ...

    def stop(self) -> None:
        """The client is being aborted: end its threads' work now."""
        ...

    def status(self) -> dict[str, Json]: ...


class ClusterSide:
    def __init__(
        self,
        *,
        config: Config,
        environ: Mapping[str, str],
        hub: HealthHub,
        metrics: Metrics,
        timers: Scheduler,
        post: Callable[[Callable[[], None]], None],
        on_label: Callable[[str], object],
        parts: Mapping[str, ClusterPart] | None = None,
        limiter: ProcessLimiter | None = None,
    ) -> None:
        self.node = config.node_name
        self.limiter = limiter or ProcessLimiter(config.kube_api_qps, config.kube_api_burst)
        self.label_key = config.node_label
        self.watch_label = bool(config.config_file_srcdir)
        self.node_health = config.node_health
        self.kubeconfig = config.kubeconfig
        self.environ = environ
        self.hub = hub
        self.metrics = metrics
        self.timers = timers
        self.post = post  # runs a call on the main loop (the watch calls from its thread)
        self.on_label = on_label  # the replanner's, on the main loop
        self.starting = Retrying(
            timers,
            TIMER,
            Backoff(1.0, 60.0, jitter=0.2),
            "the cluster side cannot start (retrying with backoff; the kubelet path is unaffected): %s",
            "the cluster side started",
        )
        self.started_because = ""  # why it started; "" until then
        self.client: KubeClient | None = None
        self.watch: ObjectWatch | None = None
        self.writer: NodeHealthWriter | None = None
        self.parts = dict(parts or {})
        self.parts_started: set[str] = set()
        self.label: str | None = None  # the label's value as last seen, posted or not
        self._absent = False  # the Node was not there the last time the watch looked
        self._early: deque[NodeEvent] = deque(maxlen=MAX_EARLY_EVENTS)

    @property
    def wanted(self) -> bool:
        return self.watch_label or self.node_health or any(p.wanted for p in self.parts.values())

    @property
    def started(self) -> bool:
        return bool(self.started_because)

    # ------------------------------------------------------------------ start and stop
    def start_when(self, *, registered: bool, nothing_to_register: bool, awaiting_label: bool) -> None:
        """Start once the kubelet path is up (called every loop turn; cheap until then)."""
        if self.started:
            self._start_parts()
            return
        if not self.wanted or self.timers.when(TIMER) is not None:
            return
        if registered:
            self.start("a worker registered with the kubelet")
        elif nothing_to_register:
            self.start("the plans have no resource to register")
        elif awaiting_label:
            self.start("no config can be chosen without the node label")

    def start(self, why: str) -> None:
        self.starting.attempt(lambda: self._start(why), lambda: self.start(why))

    def _start(self, why: str) -> None:
        # The API-server layer is loaded here, and only here, in `gpuvisor run`.
        from supervisor.cluster.writer import NodeHealthWriter
        from supervisor.kube.watch import ObjectWatch

        self._stop_parts()  # what a failed earlier try started, if anything
        client = api_client(self.kubeconfig, self.environ, self.metrics, self.limiter)
        self.client = client
        if self.watch_label:
            self.watch = ObjectWatch(
                client,
                path="/api/v1/nodes",
                name=self.node,
                what=f"Node {self.node}",
                on_object=self._on_node,
                on_count=self.metrics.api_watch,
            )
            self.watch.start()
        if self.node_health:
            self.writer = NodeHealthWriter(client, node=self.node, on_count=self.metrics.node_health_write)
            self.writer.start()
            self._refresh_condition()
            while self._early:
                self.writer.event(self._early.popleft())
        self.started_because = why
        log.info(
            "cluster side started (%s) for Node %s with %s: %s",
            why,
            self.node,
            client.credentials.source,
            ", ".join(
                what
                for what, on in (
                    (f"config by the node label {self.label_key}", self.watch_label),
                    ("GPU health on the Node", self.node_health),
                    *((name, part.wanted) for name, part in self.parts.items()),
                )
                if on
            ),
        )
        self._start_parts()

    def _start_parts(self) -> None:
        """Each part that wants the API server and has not got it yet gets the client."""
        if self.client is None:
            return
        for name, part in self.parts.items():
            if name not in self.parts_started and part.wanted:
                self.parts_started.add(name)
                part.start(self.client)

    def stop(self) -> None:
        """End every API call now (a pod's grace period is short); threads are not waited for long."""
        self.timers.cancel(TIMER)
        self._stop_parts()

    def _stop_parts(self) -> None:
        if self.client is not None:
            self.client.abort()
        for name in sorted(self.parts_started):
            self.parts[name].stop()
        self.parts_started.clear()
        for part in (self.watch, self.writer):
            if part is not None:
                part.stop(join=0.5)
        if self.client is not None:
            self.client.close()
        self.client, self.watch, self.writer = None, None, None

    # ------------------------------------------------------------------ the label
    def _on_node(self, node: dict[str, Any] | None) -> None:
        """The watch's thread: the Node as listed or changed (None: deleted). Posts the label's
        value to the main loop when it is new, as config-manager's informer handlers do."""
        meta = node.get("metadata") if node is not None else None
        labels = meta.get("labels") if isinstance(meta, dict) else None
        value = str(labels.get(self.label_key, "")) if isinstance(labels, dict) else ""
        if node is None and not self._absent:
            log.warning(
                "Node %s is not in the API server (deleted, or NODE_NAME is not this node's name): "
                "it counts as a node without the label %s",
                self.node,
                self.label_key,
            )
        self._absent = node is None
        if value == self.label:
            return
        self.label = value
        self.post(lambda: self._take_label(value))

    def _take_label(self, value: str) -> None:
        self.on_label(value)

    # ------------------------------------------------------------------ health
    def health_changed(self, batch: ChangeBatch, line: str) -> None:
        """The health hub's listener (main loop): a batch changed devices; the Node follows."""
        if not self.node_health:
            return
        event = health_event(batch, line)
        if self.writer is None:
            self._early.append(event)
            return
        self._refresh_condition()
        self.writer.event(event)

    def _refresh_condition(self) -> None:
        if self.writer is None or self.hub.book is None:
            return
        book = self.hub.book
        unhealthy: dict[str, list[str]] = {}
        total = 0
        for resource in book.resources:
            _seq, devices = book.snapshot(resource)
            total += len(devices)
            unhealthy[resource] = [d.device_id for d in devices if not d.healthy]
        node = self.hub.node
        gpu_index = {g.uuid: g.index for g in node.gpus} if node is not None else {}
        self.writer.want(node_condition(unhealthy, total, book.conditions(), gpu_index))

    def plans_changed(self) -> None:
        """New plans (a reload): the device count in the condition's message follows."""
        if self.node_health:
            self._refresh_condition()

    # ------------------------------------------------------------------ views
    def status(self) -> dict[str, Json]:
        if not self.wanted:
            return {"enabled": False}
        out: dict[str, Json] = {
            "enabled": True,
            "node": self.node,
            "started": self.started,
            "started_because": self.started_because or None,
            "error": self.starting.error or None,
        }
        if self.watch_label:
            out["label"] = {
                "key": self.label_key,
                "value": self.label,
                "watch": self.watch.status() if self.watch is not None else None,
            }
        if self.node_health:
            out["node_health"] = (
                self.writer.status() if self.writer is not None else {"events_waiting": len(self._early)}
            )
        for name, part in self.parts.items():
            out[name] = part.status() if name in self.parts_started else None
        if self.client is not None:
            out["api_requests"] = self.client.requests
        return out
