"""The MPS control daemons of DRA claims as the DRA side wires them: made on first use.

`ClaimMpsWiring` is what supervisor/dra/side.py holds: it makes `ClaimDaemons`
(supervisor/mps/claims.py; loading it, the daemons' supervision and its thread) when the DRA
worker first asks for an MPS claim's daemon, or when the node plans DRA and the claims root
already holds daemons of an earlier life (to adopt them, or stop those of claims no longer
prepared). A DRA node without MPS claims never loads or runs any of it.

The claims root is `<mpsRoot>/dra` when --mps-root (MPS_ROOT) is set, else NVIDIA's
`<kubelet plugins dir>/gpu.nvidia.com/mps`; the binary, the driver root and NVML (the compute
mode) are those of the device-plugin MPS daemons (`MpsWiring`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.messages import Json
from common.mpsmessages import MpsClaimReply, MpsClaimRequest
from supervisor.mps.wiring import MpsWiring

if TYPE_CHECKING:
    from supervisor.mps.claims import ClaimDaemons

log = logging.getLogger("gpuvisor.mps")

DRIVER_DIR = "gpu.nvidia.com"  # the DRA driver's directory under the kubelet's plugins dir
CLAIMS_DIR = "dra"  # under the MPS root
START_TIMEOUT_S = 20.0  # the engine's own limit for a daemon to take its limits


def claims_root(mps_root: str, kubelet_plugins_dir: str) -> str:
    if mps_root:
        return os.path.join(mps_root, CLAIMS_DIR)
    return os.path.join(kubelet_plugins_dir, DRIVER_DIR, "mps")


class ClaimMpsWiring:
    def __init__(
        self,
        *,
        mps: MpsWiring,
        kubelet_plugins_dir: str,
        checkpoint_path: str,
        answer: Callable[[str, MpsClaimReply], None],
        on_counts: Callable[[int, int], None] = lambda up, down: None,
    ) -> None:
        self.mps = mps  # environ, NVML and the MPS settings of the config in force
        self.kubelet_plugins_dir = kubelet_plugins_dir
        self.checkpoint_path = checkpoint_path
        self.answer = answer  # from the claims' thread: (resource, reply) to the asking worker
        self.on_counts = on_counts
        self._daemons: ClaimDaemons | None = None

    @property
    def root(self) -> str:
        return claims_root(self.mps.config.mps_root, self.kubelet_plugins_dir)

    def _made(self) -> ClaimDaemons:
        if self._daemons is None:
            from supervisor.mps.claims import ClaimDaemons
            from supervisor.mps.daemons import MpsDaemons

            config = self.mps.config
            engine = MpsDaemons(
                lambda key, up, reason: None,  # ClaimDaemons reports its own counts
                binary=config.mps_control_binary,
                driver_root=config.driver_root,
                environ=self.mps.environ,
                nvml_module=self.mps.nvml_module,
                exclusive_process=self.mps.nvml_module is not None,  # NVIDIA's EXCLUSIVE_PROCESS
                start_timeout=START_TIMEOUT_S,
            )
            daemons = ClaimDaemons(
                claims_root=self.root,
                checkpoint_path=self.checkpoint_path,
                engine=engine,
                answer=self.answer,
                on_counts=self.on_counts,
            )
            daemons.load(time.time())
            daemons.start_thread()
            self._daemons = daemons
        return self._daemons

    def request(self, request: MpsClaimRequest) -> None:
        """A DRA worker's start or stop (main loop)."""
        self._made().request(request)

    def dra_planned(self) -> None:
        """The node plans DRA: daemons an earlier life left are adopted (or stopped) now."""
        if self._daemons is None and os.path.isdir(self.root):
            log.info("MPS claims root %s exists: supervising the daemons found there", self.root)
            self._made()

    def checkpoint_changed(self) -> None:
        if self._daemons is not None:
            self._daemons.checkpoint_changed()

    def status(self) -> Json:
        return None if self._daemons is None else dict(self._daemons.status())

    def close(self) -> None:
        """Stop supervising; the claims' daemons keep serving their containers."""
        if self._daemons is not None:
            self._daemons.shutdown()
