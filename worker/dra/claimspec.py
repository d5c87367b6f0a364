"""Each prepared claim's own CDI spec, as NVIDIA's DRA driver v0.4.1 writes one.

NVIDIA's kubelet plugin (cmd/gpu-kubelet-plugin/cdi.go, device_state.go) writes, before it
answers a claim, the transient spec `<cdi root>/k8s.gpu.nvidia.com-claim_<claim UID>.yaml`: kind
`k8s.gpu.nvidia.com/claim`, one CDI device per prepared device named `<claim UID>-<device>`
(`gpu-0`, or the MIG device's name) holding that device's nodes and the claim's sharing edits
(an MPS claim's pipe dir and limits), and spec-wide the edits common to every claim: the control
nodes, the driver's files and hooks, `NVIDIA_CTK_LIBCUDA_DIR` and `NVIDIA_VISIBLE_DEVICES=void`.
The answer names `k8s.gpu.nvidia.com/claim=<claim UID>-<device>`, so a container sees only its
own claim's spec; the file is removed at unprepare.

`ClaimSpecs.write` validates the spec (common/cdispec.py) and writes it atomically (the rename
makes it appear whole); the text is JSON, which is YAML, so the `.yaml` name NVIDIA uses reads
the same. The spec-wide edits are found once and kept five minutes (NVIDIA caches its common
edits that long), so a new claim does not walk the driver root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from common.atomicfile import write_atomic
from common.cdispec import spec_problems
from common.devnodes import host_path, read_mig_minors
from common.driverfiles import (
    cdi_version,
    common_edits,
    control_nodes,
    device_node,
    discover,
    readable_root,
)
from common.model import AllocatableDevice, ResourcePlan
from worker.dra.edits import ContainerEdits

log = logging.getLogger("gpuvisor.worker")

CLAIM_VENDOR = "k8s.gpu.nvidia.com"
CLAIM_CLASS = "claim"
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"
MIG_CAPS_DIR = "/dev/nvidia-caps"
COMMON_EDITS_TTL_S = 300.0  # NVIDIA's cache of its common edits (cdi.go GetCommonEditsCached)


class ClaimSpecError(Exception):
    """A claim's CDI spec cannot be built or written; the text says which and why."""


def spec_file(spec_dir: str, claim_uid: str) -> str:
    """`<dir>/k8s.gpu.nvidia.com-claim_<uid>.yaml` (the CDI package's GenerateTransientSpecName)."""
    return os.path.join(spec_dir, f"{CLAIM_VENDOR}-{CLAIM_CLASS}_{claim_uid.replace('/', '_')}.yaml")


def claim_device_id(claim_uid: str, device: str) -> str:
    """The CDI device ID a claim's device is answered with (cdi.go GetClaimDeviceName)."""
    return f"{CLAIM_VENDOR}/{CLAIM_CLASS}={claim_uid}-{device}"


class ClaimSpecs:
    """Writes and removes the claims' specs for one DRA plan; thread-safe."""

    def __init__(
        self,
        plan: ResourcePlan,
        spec_dir: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        minors_reader: Callable[[str], dict[str, int]] = read_mig_minors,
    ) -> None:
        self._plan = plan
        self.spec_dir = spec_dir
        self._clock = clock
        self._minors_reader = minors_reader
        self._lock = threading.Lock()
        self._common: dict[str, Any] | None = None
        self._common_at = 0.0

    def set_plan(self, plan: ResourcePlan) -> None:
        with self._lock:
            self._plan, self._common = plan, None

    def common(self) -> dict[str, Any]:
        """The spec-wide edits (control nodes, driver files and hooks, env), found again after the TTL."""
        with self._lock:
            now = self._clock()
            if self._common is None or now - self._common_at > COMMON_EDITS_TTL_S:
                settings, dra = self._plan.allocate, self._plan.dra
                root = readable_root(settings.driver_root, dra.driver_root_ctr_path if dra else "")
                files = discover(
                    root,
                    version=dra.driver_version if dra else "",
                    host_root=settings.driver_root,
                    hook_path=settings.nvidia_ctk_path,
                )
                if files.missing:
                    log.warning("the claims' CDI specs carry no driver files: %s", files.missing)
                self._common = common_edits(files, control_nodes(settings.dev_root), [VOID_ENV])
                self._common_at = now
            return self._common

    def _nodes(self, device: AllocatableDevice) -> list[dict[str, Any]]:
        settings = self._plan.allocate
        paths = [f"/dev/nvidia{device.gpu_minor}"]
        if device.is_mig:
            try:
                minors = self._minors_reader(settings.mig_minors_path)
            except OSError as exc:
                raise ClaimSpecError(
                    f"MIG device {device.id} needs its capability nodes, but the MIG minors file "
                    f"{settings.mig_minors_path} cannot be read: {exc.strerror or exc}"
                ) from None
            gpu = f"gpu{device.gpu_minor}"
            for key in (
                f"{gpu}/gi{device.mig_gi}/access",
                f"{gpu}/gi{device.mig_gi}/ci{device.mig_ci}/access",
            ):
                if key not in minors:
                    raise ClaimSpecError(
                        f"MIG device {device.id}: no entry {key!r} in the MIG minors file {settings.mig_minors_path}"
                    )
                paths.append(f"{MIG_CAPS_DIR}/nvidia-cap{minors[key]}")
        nodes = []
        for path in paths:
            node = device_node(path, settings.dev_root)
            nodes.append(
                node or {"path": path, "hostPath": host_path(settings.dev_root, path), "permissions": "rw"}
            )
        return nodes

    def build(
        self, claim_uid: str, devices: Sequence[tuple[AllocatableDevice, ContainerEdits]]
    ) -> dict[str, Any]:
        """The claim's spec: one CDI device per (device, its claim's sharing edits)."""
        entries = []
        for device, edits in devices:
            entry: dict[str, Any] = {"deviceNodes": self._nodes(device)}
            for key, value in edits.to_json().items():
                entry[key] = entry.get(key, []) + value
            entries.append({"name": f"{claim_uid}-{device.id}", "containerEdits": entry})
        spec: dict[str, Any] = {
            "cdiVersion": "0.5.0",
            "kind": f"{CLAIM_VENDOR}/{CLAIM_CLASS}",
            "devices": sorted(entries, key=lambda d: str(d["name"])),
            "containerEdits": self.common(),
        }
        spec["cdiVersion"] = cdi_version(spec)
        return spec

    def write(self, claim_uid: str, devices: Sequence[tuple[AllocatableDevice, ContainerEdits]]) -> str:
        """Build, check and write the claim's spec atomically; returns its path. Raises ClaimSpecError."""
        spec = self.build(claim_uid, devices)
        problems = spec_problems(spec)
        if problems:
            raise ClaimSpecError(f"the CDI spec for claim {claim_uid} is invalid: " + "; ".join(problems))
        path = spec_file(self.spec_dir, claim_uid)
        try:
            os.makedirs(self.spec_dir, mode=0o755, exist_ok=True)
            write_atomic(path, json.dumps(spec, indent=2) + "\n", 0o644, sync_dir=True)
        except OSError as exc:
            raise ClaimSpecError(f"cannot write the CDI spec {path}: {exc.strerror or exc}") from None
        return path

    def remove(self, claim_uid: str) -> None:
        """Remove the claim's spec (none is fine); an error is logged, never raised (NVIDIA's too)."""
        path = spec_file(self.spec_dir, claim_uid)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except OSError as exc:
            log.error("cannot remove the CDI spec %s of claim %s: %s", path, claim_uid, exc.strerror or exc)
