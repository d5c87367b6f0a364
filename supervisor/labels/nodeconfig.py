"""Which named config `gpuvisor labels` runs: the one its Node's label names, kept current.

NVIDIA's chart gives GPU Feature Discovery the same config-manager as the plugin (an init container
and a sidecar that copy the labelled config and restart GFD). `gpuvisor labels` takes the same
inputs itself (`--config-file-srcdir`, `--node-label`, `--default-config`,
`--fallback-strategies`, `NODE_NAME`) and makes the same choice as `gpuvisor run`
(supervisor/config/named.py): so a node's sharing labels (`nvidia.com/gpu.replicas`, ...)
describe the config its device plugin runs.

`NodeConfig` keeps the Node in view with the API-server layer's `ObjectWatch` (list, then watch by
name, resourceVersion kept, a new list on 410, capped backoff) on a thread of its own and calls
`on_change()` when the label's value changes; the labeller's loop then calls `choose()` and
reloads when the choice, or the chosen file's text, differs from what it runs. Until the Node has
been read once, no config is chosen: the labeller waits, as GFD waits for its init container.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervisor.config.fingerprint import fingerprint
from supervisor.config.named import Choice, ChoiceError, choose_config
from supervisor.config.version import VERSION
from supervisor.kube.limiter import DEFAULT_BURST, DEFAULT_QPS, TokenBucket

if TYPE_CHECKING:
    from supervisor.kube.client import KubeClient
    from supervisor.kube.watch import ObjectWatch

log = logging.getLogger("gpuvisor.labels")


@dataclass(frozen=True)
class Chosen:
    """A choice and the text of its file when it was made: a reload is due when either changes."""

    choice: Choice
    digest: str

    @property
    def path(self) -> str:
        return self.choice.path


def _digest(path: str) -> str:
    if not path:
        return ""
    try:
        return fingerprint(path)
    except OSError as exc:
        raise ChoiceError(f"cannot read {path}: {exc.strerror or exc}") from None


class NodeConfig:
    def __init__(
        self,
        *,
        node_name: str,
        node_label: str,
        srcdir: str,
        default: str,
        fallbacks: tuple[str, ...],
        kubeconfig: str,
        environ: Mapping[str, str],
        on_change: Callable[[], None],
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        limiter: Callable[[], TokenBucket] | None = None,
    ) -> None:
        self.node_name = node_name
        self.node_label = node_label
        self.srcdir = srcdir
        self.default = default
        self.fallbacks = fallbacks
        self.kubeconfig = kubeconfig
        self.environ = environ
        self.on_change = on_change
        self.qps = qps  # --kube-api-qps / --kube-api-burst, as the NodeFeature output's client has
        self.burst = burst
        self.limiter = limiter  # the process's one bucket (the daemon's), else one of the client's own
        self.label: str | None = None  # None until the Node was read once
        self.seen = threading.Event()
        self._watch: ObjectWatch | None = None  # once started
        self._client: KubeClient | None = None

    def start(self) -> None:
        """Start watching the Node (raises ValueError or OSError when no credentials can be had)."""
        from supervisor.kube.client import KubeClient
        from supervisor.kube.credentials import load_credentials
        from supervisor.kube.watch import ObjectWatch

        self._client = KubeClient(
            load_credentials(self.kubeconfig, self.environ),
            component="labels",
            version=VERSION,
            qps=self.qps,
            burst=self.burst,
            limiter=self.limiter() if self.limiter is not None else None,
        )
        self._watch = ObjectWatch(
            self._client,
            path="/api/v1/nodes",
            name=self.node_name,
            what=f"Node {self.node_name}",
            on_object=self._on_node,
        )
        self._watch.start()

    def stop(self) -> None:
        """End the watch at once (its call in flight is aborted)."""
        if self._watch is not None:
            self._watch.stop(join=0.5)
        if self._client is not None:
            self._client.close()

    @property
    def watch_error(self) -> str:
        """The watch's last failure, "" when it works."""
        return self._watch.failing.error if self._watch is not None else ""

    def _on_node(self, node: dict[str, Any] | None) -> None:
        """The watch's thread: the Node as listed or changed (None: absent, which is no label)."""
        meta = node.get("metadata") if node is not None else None
        labels = meta.get("labels") if isinstance(meta, dict) else None
        value = str(labels.get(self.node_label, "")) if isinstance(labels, dict) else ""
        first = not self.seen.is_set()
        changed = value != self.label
        self.label = value
        self.seen.set()
        if first or changed:
            self.on_change()

    def choose(self) -> Chosen:
        """The config the label names now, by config-manager's rules. Raises ChoiceError."""
        choice = choose_config(self.srcdir, self.label or "", self.default, self.fallbacks)
        return Chosen(choice, _digest(choice.path))
