"""A simulated node in DRA mode for integration tests: `SimNode` plus the kubelet's DRA side.

Beside the device-plugin kubelet stand-in (kept: a mode switch moves a node between the two),
a `DraNode` has the DRA kubelet stand-in watching its registry dir, a claim store standing in for
the API server (the supervisor reads it through `--dra-claims-dir`), its own CDI spec dir, and
the supervisor started with `--node-name node-a` and those dirs. All in the node's short temp
dir, removed on close; only processes started here are signalled, by PID.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from supervisor.sim.drakubelet import ClaimStore, DraKubeletStandin
from tests.harness import SimNode
from tests.helpers import wait_until

DRIVER = "gpu.nvidia.com"
POOL = "node-a"


class DraNode(SimNode):
    def __init__(
        self,
        profile: str | None = "pcie-l4",
        args: Sequence[str] = ("--mode", "dra"),
        env: dict[str, str] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(profile, args=args, env=env, **kw)
        self.plugins_dir = os.path.join(self.base, "plugins")
        self.registry_dir = os.path.join(self.base, "reg")
        self.claims_dir = os.path.join(self.base, "claims")
        self.cdi_dir = os.path.join(self.base, "cdi")
        self.dra = DraKubeletStandin(self.registry_dir, scan_interval=0.02)
        self.claims = ClaimStore(self.claims_dir)

    def __enter__(self) -> DraNode:
        self.dra.start()
        super().__enter__()
        return self

    def supervisor_argv(self) -> list[str]:
        return [
            *super().supervisor_argv(),
            "--node-name", POOL,
            "--kubelet-plugins-dir", self.plugins_dir,
            "--kubelet-registry-dir", self.registry_dir,
            "--dra-claims-dir", self.claims_dir,
            "--cdi-spec-dir", self.cdi_dir,
        ]  # fmt: skip

    def close(self) -> None:
        self.dra.stop()
        super().close()

    # ---------------------------------------------------------------- queries
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.plugins_dir, DRIVER, "checkpoint.json")

    def prepared_uids(self) -> set[str]:
        """The claims in the DRA worker's checkpoint on disk."""
        try:
            with open(self.checkpoint_path, encoding="utf-8") as fh:
                return set(json.load(fh)["claims"])
        except FileNotFoundError:
            return set()

    def registrations(self) -> int:
        return sum(1 for n in self.dra.notifications if n.registered and n.name == DRIVER)

    def wait_registered(self, timeout: float = 30.0, more_than: int = 0) -> None:
        ok = self.dra.wait_for(
            lambda: self.registrations() > more_than and self.dra.registered(DRIVER), timeout
        )
        assert ok, f"{DRIVER} not registered with the DRA kubelet stand-in\n--- log:\n{self.log()[-6000:]}"

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        status: dict[str, Any] = {}

        def ready() -> bool:
            nonlocal status
            status = self.command("status")
            return bool(status["ready"])

        assert wait_until(ready, timeout), f"not ready: {status.get('ready_detail')}\n{self.log()[-4000:]}"
        return status

    def cdi_names(self) -> set[str]:
        """The qualified device names of the CDI spec the supervisor wrote."""
        with open(
            os.path.join(self.cdi_dir, "k8s.device-plugin.nvidia.com-gpu.json"), encoding="utf-8"
        ) as fh:
            spec = json.load(fh)
        return {f"{spec['kind']}={d['name']}" for d in spec["devices"]}

    def dra_worker_pid(self) -> int:
        return self.worker_pid(DRIVER)
