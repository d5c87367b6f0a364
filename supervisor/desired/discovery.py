"""NVML for the supervisor: which module (the real binding or the simulator), bringing it up with
retries, and rediscovery that never shrinks the device list under a lost GPU.

Start-up order matters for NVIDIA #170 (a failed NVML must not look like a healthy plugin that
advertises nothing): with --fail-on-init-error (the default) an NVML failure ends the process
with exit status 3 and a text that says what to check; without it the supervisor runs not
ready and `NvmlSession.attempt()` is retried with the backoff until NVML answers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from common.backoff import Backoff
from common.exitcodes import EXIT_CONFIG_ERROR, EXIT_NVML_ERROR
from common.messages import Json
from common.model import Node
from supervisor.config import Config
from supervisor.node.nvml import Nvml, NvmlCallError

if TYPE_CHECKING:
    from supervisor.node.migmaker import MigMaker
    from supervisor.sim.nvml import Simulator

log = logging.getLogger("gpuvisor.supervisor")

HOST_SYSFS = "/sys"
NVML_RETRY_START_S = 1.0
NVML_RETRY_MAX_S = 60.0

# Test-only hook: with a simulated node, fail the first N nvmlInit calls with
# NVML_ERROR_LIBRARY_NOT_FOUND, as on a node without a driver. Ignored on real NVML.
SIM_FAIL_INIT_ENV = "GPUVISOR_SIM_FAIL_INIT"
# With a simulated node: the file its MIG layout is kept in across restarts (as a real driver's
# outlives the supervisor), restored from at start (supervisor.sim.nvml.state). Ignored on real NVML.
SIM_STATE_ENV = "GPUVISOR_SIMULATE_STATE"


class StartupError(Exception):
    """A failure at start that ends the process with a clear message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def open_nvml(config: Config, environ: Mapping[str, str]) -> tuple[Any, Simulator | None]:
    """The pynvml module to use (the real one, or the simulator) and the simulator or None."""
    if config.simulate:
        from supervisor.sim.nvml import load_simulator

        state_file = environ.get(SIM_STATE_ENV, "").strip() or None
        try:
            sim = load_simulator(config.simulate, state_file=state_file)
        except (ValueError, OSError) as exc:  # SimulatorConfigError is a ValueError naming file, key, why
            what = f"--simulate (with {SIM_STATE_ENV}={state_file})" if state_file else "--simulate"
            raise StartupError(f"config error: {what}: {exc}", EXIT_CONFIG_ERROR) from None
        fail_init = environ.get(SIM_FAIL_INIT_ENV, "").strip()
        if fail_init:
            import pynvml

            if not fail_init.isdigit() or int(fail_init) < 1:
                raise StartupError(
                    f"config error: env {SIM_FAIL_INIT_ENV}: {fail_init!r} is not a count >= 1",
                    EXIT_CONFIG_ERROR,
                )
            sim.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, count=int(fail_init))
        return sim, sim
    import pynvml

    return pynvml, None


def nvml_init_help(exc: BaseException) -> str:
    return (
        f"NVML could not be initialised ({exc}). Check that the NVIDIA driver is loaded "
        "(nvidia-smi works on the host), that libnvidia-ml.so.1 is on the library path "
        "(LD_LIBRARY_PATH, --driver-root), and, in a container, that the NVIDIA container runtime "
        "is the runtime of this pod (runtimeClassName: nvidia) so the driver is mounted in"
    )


def keep_vanished_gpus(old: Node | None, new: Node) -> tuple[Node, tuple[str, ...]]:
    """`new`, plus the GPUs of `old` that rediscovery no longer sees (and whose index is free).

    Discovery leaves a lost GPU out (it cannot be described). A rediscovery must not turn that
    into a shrinking device list: a lost GPU stays advertised, and the health pipeline (probes,
    XID 79) marks it Unhealthy and brings it back. Returns the node and the UUIDs kept.
    """
    if old is None:
        return new, ()
    uuids = {g.uuid for g in new.gpus}
    indexes = {g.index for g in new.gpus}
    kept = [g for g in old.gpus if g.uuid not in uuids and g.index not in indexes]
    if not kept:
        return new, ()
    kept_indexes = {g.index for g in kept}
    links = new.links + tuple(link for link in old.links if link.a in kept_indexes or link.b in kept_indexes)
    merged = dataclasses.replace(
        new,
        gpus=tuple(sorted(new.gpus + tuple(kept), key=lambda g: g.index)),
        links=tuple(sorted(links, key=lambda link: (link.a, link.b))),
    )
    return merged, tuple(g.uuid for g in kept)


class NvmlSession:
    """NVML's state as the supervisor sees it: up or not, why not, and the next try."""

    def __init__(
        self,
        config: Config,
        environ: Mapping[str, str] | None = None,
        on_error: Callable[[str, int], None] | None = None,
    ) -> None:
        self.module, self.simulator = open_nvml(config, dict(os.environ) if environ is None else environ)
        # One for the process's life: it remembers what it reported. A simulated node has no sysfs
        # of its own unless one is given (the simulator writes its PCIe tree: `write_sysfs`).
        sysfs = config.sysfs_root or (None if self.simulator is not None else HOST_SYSFS)
        self.nvml = Nvml(self.module, sysfs_root=sysfs)
        self.on_error = on_error or (lambda function, code: None)
        self.up = False
        self.error = ""
        self.attempts = 0
        self.backoff = Backoff(NVML_RETRY_START_S, NVML_RETRY_MAX_S)
        self.kept_gpus: tuple[str, ...] = ()
        # gpuvisor.dra.migOnDemand: discovery reads each MIG-capable GPU's options (the replanner
        # sets it from the config it plans with).
        self.mig_options = config.dra_mig_on_demand
        self._mig_maker: MigMaker | None = None

    def discover(self) -> Node:
        self.nvml.with_mig_options = self.mig_options
        return self.nvml.discover()

    def mig_maker(self) -> MigMaker | None:
        """NVML's MIG calls (MIG on demand, supervisor.dra.migs), while NVML is up."""
        if not self.up:
            return None
        if self._mig_maker is None:
            from supervisor.node.migmaker import MigMaker

            self._mig_maker = MigMaker(self.module)
        return self._mig_maker

    def attempt(self, fail_on_init_error: bool) -> tuple[Node | None, float]:
        """One try at NVML init and first discovery: (the node, 0) or (None, seconds to the next try).

        Raises StartupError when NVML fails and `fail_on_init_error` says to give up.
        """
        self.attempts += 1
        try:
            self.nvml.init()
            node = self.discover()
        except Exception as exc:  # any NVML failure at start: the message says what to check
            if isinstance(exc, NvmlCallError):
                self.on_error(exc.function, exc.code)
            text = nvml_init_help(exc)
            if fail_on_init_error:
                raise StartupError(text, EXIT_NVML_ERROR) from None
            delay = self.backoff.next()
            if self.attempts == 1:
                log.error("%s. Not ready; retrying with backoff (--fail-on-init-error=false)", text)
            else:
                log.warning(
                    "NVML still unavailable (attempt %d): %s; next try in %.0fs", self.attempts, exc, delay
                )
            self.error = str(exc)
            return None, delay
        if self.attempts > 1:
            log.info("NVML is up after %d attempts", self.attempts)
        self.up = True
        self.error = ""
        self.backoff.reset()
        return node, 0.0

    def rediscover(self, old: Node | None) -> Node:
        """The device set now, with lost GPUs kept (see keep_vanished_gpus). Raises on NVML trouble."""
        node, kept = keep_vanished_gpus(old, self.discover())
        if kept != self.kept_gpus:
            if kept:
                log.warning(
                    "rediscovery did not see GPU(s) %s; they stay advertised (health decides)",
                    ", ".join(kept),
                )
            self.kept_gpus = kept
        return node

    def status(self) -> dict[str, Json]:
        return {"up": self.up, "error": self.error, "attempts": self.attempts}
