"""ResourceClaims with NVIDIA's opaque configuration, as the API server serves them once the
scheduler allocated them: the claim's `spec.devices.config` and its classes' `spec.config` copied
into `status.allocation.devices.config`, class entries first, each with its `source` and the
requests it applies to (kubernetes pkg/scheduler/framework/plugins/dynamicresources, the
allocator's `allocationResult.Devices.Config`: per request, the class's config with `FromClass`,
then the claim's with `FromClaim`).

The demo claims are NVIDIA's quickstart specs (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1,
demo/specs/quickstart/v1 and v1beta1), written again here as the allocation would carry them.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DRIVER = "gpu.nvidia.com"
API = "resource.nvidia.com/v1beta1"


@dataclass(frozen=True)
class Request:
    name: str
    devices: Sequence[str]
    device_class: str = "gpu.nvidia.com"
    admin_access: bool = False
    subrequest: str = ""  # the firstAvailable entry the scheduler chose; "" for `exactly`
    share_id: str = ""  # a device shared through consumable capacity: each result's shareID


@dataclass(frozen=True)
class Config:
    parameters: Any
    requests: Sequence[str] = ()
    source: str = "FromClaim"
    driver: str = DRIVER

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source,
            "opaque": {"driver": self.driver, "parameters": self.parameters},
        }
        if self.requests:
            out["requests"] = list(self.requests)
        return out


@dataclass
class Claim:
    namespace: str
    name: str
    requests: Sequence[Request]
    configs: Sequence[Config] = ()
    uid: str = field(default_factory=lambda: str(uuidlib.uuid4()))

    def to_json(self, pool: str) -> dict[str, Any]:
        specs: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for r in self.requests:
            if r.subrequest:
                sub = {"name": r.subrequest, "deviceClassName": r.device_class, "count": len(r.devices)}
                specs.append({"name": r.name, "firstAvailable": [sub]})
            else:
                exactly: dict[str, Any] = {"deviceClassName": r.device_class, "count": len(r.devices)}
                if r.admin_access:
                    exactly["adminAccess"] = True
                specs.append({"name": r.name, "exactly": exactly})
            request = f"{r.name}/{r.subrequest}" if r.subrequest else r.name
            for d in r.devices:
                result: dict[str, Any] = {"request": request, "driver": DRIVER, "pool": pool, "device": d}
                if r.admin_access:
                    result["adminAccess"] = True
                if r.share_id:
                    result["shareID"] = r.share_id
                results.append(result)
        claim_configs = [c for c in self.configs if c.source == "FromClaim"]
        allocation: dict[str, Any] = {"results": results}
        ordered = [c for c in self.configs if c.source != "FromClaim"] + claim_configs
        if ordered:
            allocation["config"] = [c.to_json() for c in ordered]
        spec: dict[str, Any] = {"requests": specs}
        if claim_configs:
            spec["config"] = [
                {"requests": list(c.requests), "opaque": c.to_json()["opaque"]}
                if c.requests
                else {"opaque": c.to_json()["opaque"]}
                for c in claim_configs
            ]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid, "resourceVersion": "1"},
            "spec": {"devices": spec},
            "status": {
                "allocation": {
                    "devices": allocation,
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
                        ]
                    },
                }
            },
        }  # fmt: skip


def gpu_config(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"apiVersion": API, "kind": "GpuConfig", **extra}
    if sharing is not None:
        out["sharing"] = sharing
    return out


def mig_config(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"apiVersion": API, "kind": "MigDeviceConfig", **extra}
    if sharing is not None:
        out["sharing"] = sharing
    return out


def time_slicing(interval: str | None = "Long") -> dict[str, Any]:
    if interval is None:
        return {"strategy": "TimeSlicing"}
    return {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config} if config else {"strategy": "MPS"}


# --------------------------------------------------------------------------- NVIDIA's demo claims
def gpu_test1(devices: Sequence[str]) -> Claim:
    """v1/gpu-test1.yaml: one claim per pod of one `gpu.nvidia.com` GPU, no configuration."""
    return Claim("gpu-test1", "pod1-gpu", [Request("gpu", devices)])


def gpu_test6(devices: Sequence[str]) -> Claim:
    """v1/gpu-test6.yaml: request `gpu` with a GpuConfig, TimeSlicing, interval Long."""
    return Claim(
        "gpu-test6", "a100", [Request("gpu", devices)], [Config(gpu_config(time_slicing("Long")), ["gpu"])]
    )


def gpu_test5(ts_device: str, mps_device: str) -> Claim:
    """v1/gpu-test5.yaml: `ts-gpu` time-sliced (Long) and `mps-gpu` under MPS (50 %, 10Gi) in one claim."""
    return Claim(
        "gpu-test5",
        "multiple-gpus",
        [Request("ts-gpu", [ts_device]), Request("mps-gpu", [mps_device])],
        [
            Config(gpu_config(time_slicing("Long")), ["ts-gpu"]),
            Config(gpu_config(mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")), ["mps-gpu"]),
        ],
    )  # fmt: skip


def gpu_test_mps(device: str) -> Claim:
    """v1/gpu-test-mps.yaml (v1beta1 the same): `mps-gpu` under MPS, 50 % of the threads, 10Gi pinned."""
    sharing = mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")
    return Claim(
        "gpu-test-mps",
        "shared-gpu",
        [Request("mps-gpu", [device])],
        [Config(gpu_config(sharing), ["mps-gpu"])],
    )


def gpu_test4(migs: Sequence[str]) -> Claim:
    """v1/gpu-test4.yaml: four `mig.nvidia.com` requests on one GPU, no configuration."""
    names = ("mig-1g-5gb-0", "mig-1g-5gb-1", "mig-2g-10gb", "mig-3g-20gb")
    return Claim(
        "gpu-test4",
        "mig-devices",
        [Request(n, [d], "mig.nvidia.com") for n, d in zip(names, migs, strict=False)],
    )


def mig_mps(migs: Sequence[str]) -> Claim:
    """MIG devices under MPS: a MigDeviceConfig with the MPS strategy for all of the claim's requests
    (api/nvidia.com/resource/v1beta1 migconfig.go, sharing.go MigDeviceSharing)."""
    sharing = mps(defaultActiveThreadPercentage=25, defaultPerDevicePinnedMemoryLimit={"0": "1Gi"})
    return Claim(
        "mig-mps", "mig-mps", [Request("mig", migs, "mig.nvidia.com")], [Config(mig_config(sharing))]
    )


# --------------------------------------------------------------------------- GPUs shared by memory
def memory_share(namespace: str, name: str, device: str, memory: str, pool: str) -> dict[str, Any]:
    """A claim for `memory` of a GPU published shared by memory (gpuvisor.dra.memorySharing), as the
    scheduler leaves it allocated: the request's `capacity.requests.memory`, and a result with a
    `shareID` and `consumedCapacity.memory` (resource.k8s.io/v1 ExactDeviceRequest.Capacity,
    DeviceRequestAllocationResult.ShareID / ConsumedCapacity; kubernetes/api v0.34.0
    resource/v1/types.go:919, :1560-1580)."""
    exactly = {"deviceClassName": "gpu.nvidia.com", "count": 1, "capacity": {"requests": {"memory": memory}}}
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": pool,
        "device": device,
        "shareID": str(uuidlib.uuid4()),
        "consumedCapacity": {"memory": memory},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuidlib.uuid4()),
            "resourceVersion": "1",
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        "status": {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
                    ]
                },
            }
        },
    }
