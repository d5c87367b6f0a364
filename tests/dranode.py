"""A simulated node in DRA mode for integration tests: `SimNode` plus the kubelet's DRA side.

Beside the device-plugin kubelet stand-in (kept: a mode switch moves a node between the two),
a `DraNode` has the DRA kubelet stand-in watching its registry dir, its own CDI spec dir, and the
supervisor started with `--node-name node-a` (or `node_name`, for a fleet of nodes), those dirs
and `--sysfs-root` at the simulator's PCIe tree, written there. Claims come from a claim store
standing in for the API server (read through `--dra-claims-dir`), or, given the fake API server
(`api`), from it (a `KUBECONFIG` in `env` gives the supervisor credentials of its own, e.g. a
node's token): the supervisor then publishes the node's ResourceSlices there and fetches claims
from it, the DRA kubelet stand-in wipes the node's slices when it restarts, and the
device-plugin kubelet stand-in serves the pod-resources API. All in the node's short temp dir,
removed on close; only processes started here are signalled, by PID.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import yaml

from supervisor.kube.client import KubeClient
from supervisor.kube.credentials import load_credentials
from supervisor.sim.drakubelet import ClaimStore, DraKubeletStandin
from supervisor.sim.nvml import load_simulator
from tests.harness import SimNode
from tests.helpers import wait_until
from tests.kubeapi import RunningApiServer

DRIVER = "gpu.nvidia.com"
POOL = "node-a"


class DraNode(SimNode):
    def __init__(
        self,
        profile: str | None = "pcie-l4",
        args: Sequence[str] = ("--mode", "dra"),
        env: dict[str, str] | None = None,
        api: RunningApiServer | None = None,
        node_name: str = POOL,
        scan_interval: float = 0.02,
        **kw: Any,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.client: KubeClient | None = None
        if api is not None:
            env = {"KUBECONFIG": str(api.kubeconfig), **(env or {})}
            if node_name not in api.state.nodes:
                api.state.add_node(node_name)
            self.client = KubeClient(
                load_credentials(str(api.kubeconfig), {}), component="kubelet", version="test"
            )
        super().__init__(profile, args=args, env=env, **kw)
        self.plugins_dir = os.path.join(self.base, "plugins")
        self.registry_dir = os.path.join(self.base, "reg")
        self.claims_dir = os.path.join(self.base, "claims")
        self.cdi_dir = os.path.join(self.base, "cdi")
        self.pod_resources = os.path.join(self.base, "pr", "kubelet.sock")
        self.dra = DraKubeletStandin(
            self.registry_dir, scan_interval=scan_interval, api=self.client, node_name=node_name
        )
        self.claims = ClaimStore(self.claims_dir)
        # The simulated node's PCIe tree, so its slices carry the PCIe roots and NUMA nodes.
        self.sysfs = (
            str(load_simulator(profile).write_sysfs(os.path.join(self.base, "sys"))) if profile else ""
        )

    def __enter__(self) -> DraNode:
        self.dra.start()
        if self.api is not None:
            self.kubelet.serve_pod_resources(self.pod_resources)
        super().__enter__()
        return self

    def supervisor_argv(self) -> list[str]:
        return [
            *super().supervisor_argv(),
            "--node-name", self.node_name,
            "--kubelet-plugins-dir", self.plugins_dir,
            "--kubelet-registry-dir", self.registry_dir,
            *(["--dra-claims-dir", self.claims_dir] if self.api is None else []),
            "--pod-resources-socket", self.pod_resources,
            "--cdi-spec-dir", self.cdi_dir,
            *(["--sysfs-root", self.sysfs] if self.sysfs else []),
        ]  # fmt: skip

    def close(self) -> None:
        self.dra.stop()
        super().close()
        if self.client is not None:
            self.client.close()

    def claim(self, name: str, devices: Sequence[str], namespace: str = "default") -> tuple[str, str, str]:
        """An allocated claim, where this node's supervisor reads claims: (namespace, name, uid)."""
        if self.api is not None:
            return self.api.state.add_claim(namespace, name, self.node_name, list(devices))
        return self.claims.allocate(namespace, name, self.node_name, list(devices))

    def slices(self) -> list[dict[str, Any]]:
        assert self.api is not None
        return self.api.state.slices(self.node_name, DRIVER)

    def published(self) -> dict[str, list[dict[str, Any]]]:
        """Device name -> its taints, of the pool's newest generation as the API server has it."""
        slices = self.slices()
        newest = max((s["spec"]["pool"]["generation"] for s in slices), default=0)
        current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
        if not current or len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
            return {}
        return {d["name"]: d.get("taints", []) for s in current for d in s["spec"]["devices"]}

    def generation(self) -> int:
        return max((s["spec"]["pool"]["generation"] for s in self.slices()), default=0)

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

    def claim_spec_path(self, uid: str) -> str:
        """Where the DRA worker writes claim `uid`'s own CDI spec."""
        return os.path.join(self.cdi_dir, f"k8s.gpu.nvidia.com-claim_{uid}.yaml")

    def claim_spec(self, uid: str) -> dict[str, Any]:
        with open(self.claim_spec_path(uid), encoding="utf-8") as fh:
            spec: dict[str, Any] = yaml.safe_load(fh)  # the CDI registry reads it as YAML
        return spec

    def claim_cdi_names(self, uid: str) -> set[str]:
        """The qualified device names of claim `uid`'s own CDI spec."""
        spec = self.claim_spec(uid)
        return {f"{spec['kind']}={d['name']}" for d in spec["devices"]}

    def dra_worker_pid(self) -> int:
        return self.worker_pid(DRIVER)
