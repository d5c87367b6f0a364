"""The `gpuvisor labels` process: label the node, publish, sleep; SIGHUP reloads, SIGTERM stops.

It runs GFD v0.20.0's loop (cmd/gpu-feature-discovery/main.go): the config is loaded, the
timestamp taken once per load, then the labels are computed and written every sleep interval
until a signal. SIGHUP reloads the config (and takes a new timestamp); SIGTERM, SIGINT and SIGQUIT
end it with status 0, and then, like GFD, the features.d file is removed (not after --oneshot,
with an infinite interval, with stdout or with the NodeFeature API) so that NFD drops labels no
labeller keeps current.

With `--config-file-srcdir` the config is the one the Node's label names, by config-manager's
rules (supervisor/labels/nodeconfig.py): the first labelling waits until the Node has been read,
a new label (or a changed file) applies at once, and a label naming no config keeps the running one.

Where it differs from GFD, on purpose: a failure after the first labelling (NVML, the API
server, the disk) is logged, saying whether the last labels are still published, and retried at
the next interval, instead of exiting and taking the labels away; a reload keeps the old file until the new labels replace it;
a bad config at reload is refused (logged) and the running one stays; the features.d file is
rewritten only when the labels change; a failed NVML init is retried every interval with
--fail-on-init-error=false. Signal handlers only set a flag and wake the loop; a stop also
aborts an API call in flight, so SIGTERM ends the process at once even against a frozen server.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from supervisor.config import ConfigError
from supervisor.labels.host import SYSFS, NvmlUnavailable, label_node, read_node_facts
from supervisor.labels.nodefeature import NodeFeaturePublisher, PublishConfigError, PublishError
from supervisor.labels.output import LabelFile, OutputError
from supervisor.labels.rules import LabelError
from supervisor.labels.settings import LabelSettings, load_label_settings
from supervisor.node.nvml import NvmlCallError

if TYPE_CHECKING:
    from supervisor.kube.limiter import TokenBucket
    from supervisor.labels.nodeconfig import Chosen, NodeConfig

log = logging.getLogger("gpuvisor.labels")

EXIT_OK = 0
EXIT_LABEL_ERROR = 1  # GFD's status for any failure
MAX_WAIT_STEP_S = 3600.0

# What one labelling can fail with: each carries a one-line reason.
FAILURES = (LabelError, NvmlUnavailable, NvmlCallError, OutputError, PublishError)


class Labeller:
    """One `gpuvisor labels` run. `settings` is the first config (the CLI loaded it to set up logging)."""

    def __init__(
        self,
        settings: LabelSettings,
        reload: Callable[[str | None], LabelSettings],
        *,
        clock: Callable[[], float] = time.time,
        sysfs_root: str = SYSFS,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self._reload_settings = reload  # the settings again, with the named config chosen (or None)
        self._environ = environ if environ is not None else {}
        self._clock = clock
        self._host_sysfs = sysfs_root
        self._wake = threading.Event()
        self._stop_signal: int | None = None
        self._reload_requested = False
        self.module: Any = None  # pynvml, or the simulator of --simulate
        self.sysfs_root: str | None = None  # None for a simulated node: its GPUs are not in sysfs
        self.file: LabelFile | None = None
        self.publisher: NodeFeaturePublisher | None = None
        self.timestamp: int | None = None
        self.passes = 0
        # --config-file-srcdir: the config the Node's label names (supervisor/labels/nodeconfig.py)
        self.node_config: NodeConfig | None = None
        self.chosen: Chosen | None = None  # what runs now
        self._label_changed = False  # set from the watch's thread: choose again
        self._choice_error = ""  # the last reason no config could be chosen, said once
        self._bucket: TokenBucket | None = None  # the process's one API rate limiter, made at first use

    def limiter(self) -> TokenBucket:
        """The one token bucket of the labeller's API clients (the Node watch's, the NodeFeature
        output's): `--kube-api-qps`/`--kube-api-burst` bound the process, not each client."""
        if self._bucket is None:
            from supervisor.kube.limiter import TokenBucket

            self._bucket = TokenBucket(self.settings.kube_api_qps, self.settings.kube_api_burst)
        return self._bucket

    # ------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGHUP, self._on_reload)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, self._on_stop)

    def _on_reload(self, signum: int, frame: FrameType | None) -> None:
        self._reload_requested = True
        self._wake.set()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum
        self._wake.set()
        if self.publisher is not None:
            self.publisher.abort()  # an API call in flight (a frozen server) ends now

    def _on_label_change(self) -> None:
        self._label_changed = True
        self._wake.set()

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Label until stopped; the exit status."""
        if self.settings.config_file_srcdir:
            if not self.start_node_config():
                self.stop()
                return EXIT_OK
        else:
            self.apply(self.settings)
        while True:
            ok = self.label_once()
            if self._stop_signal is not None:  # stopped during the pass (its API call was cut short)
                self.stop()
                return EXIT_OK
            if not ok and self.passes == 1:
                return EXIT_LABEL_ERROR
            if self.settings.oneshot:
                return EXIT_OK if ok else EXIT_LABEL_ERROR
            self.wait()
            if self._stop_signal is not None:
                self.stop()
                return EXIT_OK
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            elif self.node_config is not None:
                self.follow_label()

    # ------------------------------------------------------------ the Node's label

    def start_node_config(self) -> bool:
        """Watch the Node, wait until its label is known and a config can be chosen, and apply it.
        False when stopped meanwhile. Raises ConfigError for a config that cannot run."""
        from supervisor.labels.nodeconfig import NodeConfig

        s = self.settings
        self.node_config = NodeConfig(
            node_name=s.node_name,
            node_label=s.node_label,
            srcdir=s.config_file_srcdir,
            default=s.default_config,
            fallbacks=s.fallback_strategies,
            kubeconfig=s.kubeconfig,
            environ=self._environ,
            on_change=self._on_label_change,
            qps=s.kube_api_qps,
            burst=s.kube_api_burst,
            limiter=self.limiter,
        )
        try:
            self.node_config.start()
        except (ValueError, OSError) as exc:
            raise ConfigError(
                "NODE_NAME", "", f"cannot read Node {s.node_name}'s label {s.node_label}: {exc}"
            ) from None
        log.info("the config is the one Node %s's label %s names (configs in %s)", s.node_name, s.node_label,
                 s.config_file_srcdir)  # fmt: skip
        said = ""
        while self.chosen is None:
            if self._stop_signal is not None:
                return False
            if self.node_config.seen.is_set():
                self._label_changed = False
                self.chosen = self._choose()
                if self.chosen is not None:
                    break
            elif self.node_config.watch_error and self.node_config.watch_error != said:
                said = self.node_config.watch_error
                log.warning("waiting for Node %s to be read: %s", s.node_name, said)
            self._wake.wait(min(self.settings.sleep_interval or 60.0, 60.0))
            self._wake.clear()
        self.apply(self._reload_settings(self.chosen.path))
        log.info("config applied: %s", self.chosen.choice.describe(s.node_label))
        return True

    def _choose(self) -> Chosen | None:
        """The config the label names, or None (the reason logged once) when none can be chosen."""
        from supervisor.config.named import ChoiceError

        assert self.node_config is not None
        try:
            chosen = self.node_config.choose()
        except ChoiceError as exc:
            if str(exc) != self._choice_error:
                self._choice_error = str(exc)
                what = (
                    f"keeping {self.chosen.choice.describe()}" if self.chosen else "nothing is labelled yet"
                )
                log.error("no config can be chosen (%s): %s", what, exc)
            return None
        self._choice_error = ""
        return chosen

    def follow_label(self) -> None:
        """A new label, or an interval gone by (the configs may have changed): reload if the choice,
        or its file, is not what runs. A config that cannot run is refused and the running one stays."""
        self._label_changed = False
        chosen = self._choose()
        if chosen is None or chosen == self.chosen:
            return
        try:
            self.apply(self._reload_settings(chosen.path))
        except (ConfigError, PublishConfigError, ValueError, OSError) as exc:
            log.error("%s refused, keeping the running config: %s", chosen.choice.describe(), exc)
            return
        self.chosen = chosen
        log.info("config applied: %s", chosen.choice.describe(self.settings.node_label))

    def wait(self) -> None:
        """Sleep for the interval (forever when infinite), or until a signal wakes the loop."""
        interval = self.settings.sleep_interval
        if interval is None:
            log.info("sleep interval is infinite: labelled once, waiting for a signal")
        deadline = None if interval is None else time.monotonic() + interval
        while self._stop_signal is None and not self._reload_requested and not self._label_changed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            # In steps: GFD's longest interval (2562047h47m16.854775807s) is past what
            # Event.wait takes (threading.TIMEOUT_MAX, about 292 years), which would raise.
            self._wake.wait(None if remaining is None else min(remaining, MAX_WAIT_STEP_S))
            self._wake.clear()

    def apply(self, settings: LabelSettings) -> None:
        """Take a (re)loaded config: NVML source, output, timestamp."""
        self.settings = settings
        self.module, self.sysfs_root = open_nvml_module(settings, self._host_sysfs)
        self.timestamp = None if settings.no_timestamp else int(self._clock())
        if settings.use_node_feature_api:
            self.file = None
            if self.publisher is not None:
                self.publisher.close()
            self.publisher = NodeFeaturePublisher(
                node_name=settings.node_name,
                namespace=settings.namespace,
                pod_name=settings.pod_name,
                kubeconfig=settings.kubeconfig,
                qps=settings.kube_api_qps,
                burst=settings.kube_api_burst,
                limiter=self.limiter,
            )
        else:
            if self.publisher is not None:
                self.publisher.close()
            self.publisher = None
            self.file = LabelFile(settings.output_file)

    def reload(self) -> None:
        """SIGHUP: re-read the config; a bad one is refused and the running one stays."""
        try:
            settings = self._reload_settings(self.chosen.path if self.chosen is not None else None)
            self.apply(settings)
        except (ConfigError, PublishConfigError, ValueError, OSError) as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            return
        log.info("config reloaded")

    def compute(self) -> dict[str, str]:
        """This node's labels now (raises one of FAILURES)."""
        s = self.settings
        facts = read_node_facts(self.module, self.sysfs_root, fail_on_init_error=s.fail_on_init_error)
        return label_node(
            facts,
            s.label_config,
            machine_type_file=s.machine_type_file,
            sysfs_root=self.sysfs_root,
            timestamp=self.timestamp,
        )

    def label_once(self) -> bool:
        """One labelling: compute and publish. False (with the reason logged) when it failed."""
        self.passes += 1
        try:
            labels = self.compute()
            if len(labels) <= 1:
                log.warning("no labels generated from any source")
            changed = self.publish(labels)
        except FAILURES as exc:
            if self._stop_signal is not None:
                return False  # a stop cut the call short: nothing failed
            if self.passes == 1 or self.settings.oneshot:
                log.error("labelling failed: %s", exc)
            else:
                log.error("labelling failed: %s (%s; next try in one interval)", exc, self._what_stays())
            return False
        if changed:
            log.info("labels written: %d", len(labels))
        else:
            log.debug("labels unchanged: %d", len(labels))
        return True

    def _what_stays(self) -> str:
        """What the node's labels are now, as far as known: said, never assumed."""
        if self.publisher is None:
            return "the last labels stay in place"  # the file is only ever replaced whole
        published = self.publisher.published
        if published is True:
            return "the NodeFeature object keeps the last labels"
        if published is False:
            return "no NodeFeature object is published until this is fixed"
        return "the NodeFeature object, if the API server still holds it, keeps the last labels"

    def publish(self, labels: Mapping[str, str]) -> bool:
        if self.publisher is not None:
            return self.publisher.publish(labels) != "unchanged"
        assert self.file is not None
        return self.file.write_if_changed(labels)

    def stop(self) -> None:
        """A clean stop: remove the features.d file where GFD does (main.go, run's deferred cleanup)."""
        s = self.settings
        log.info("received signal %s, shutting down", self._stop_signal)
        if self.node_config is not None:
            self.node_config.stop()
        if self.publisher is not None:
            self.publisher.close()
        if self.file is None or s.oneshot or s.sleep_interval is None or not s.output_file:
            return
        try:
            if self.file.remove():
                log.info("removed %s so that NFD drops the labels", s.output_file)
        except OutputError as exc:
            log.warning("%s", exc)


def open_nvml_module(settings: LabelSettings, host_sysfs: str) -> tuple[Any, str | None]:
    """The `pynvml` module to use and the sysfs root of its GPUs (None for a simulated node)."""
    if settings.simulate:
        from supervisor.sim.nvml import SimulatorConfigError, load_simulator

        try:
            return load_simulator(settings.simulate), None
        except (SimulatorConfigError, OSError) as exc:
            raise ConfigError("--simulate", "", str(exc)) from None
    import pynvml

    return pynvml, host_sysfs


def main(flags: Any, environ: Mapping[str, str]) -> int:
    """`gpuvisor labels`: load, set up logging, run. The exit status."""
    import sys

    from common import logs
    from supervisor.config import EXIT_CONFIG_ERROR

    try:
        settings = load_label_settings(flags, environ)
    except ConfigError as exc:
        print(f"gpuvisor labels: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    logs.setup(settings.log_format, settings.log_level, role="labels")
    for notice in settings.notices:
        log.warning("%s", notice)
    try:
        labeller = Labeller(
            settings, lambda chosen: load_label_settings(flags, environ, chosen), environ=environ
        )
        labeller.install_signal_handlers()
        return labeller.run()
    except (ConfigError, PublishConfigError) as exc:
        print(f"gpuvisor labels: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
