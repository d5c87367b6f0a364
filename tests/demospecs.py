"""NVIDIA's DRA demo specs for GPUs, MIG, time-slicing and MPS, written again as test data.

Each `Demo` mirrors one file under `demo/specs/` of kubernetes-sigs/dra-driver-nvidia-gpu at tag
v0.4.1 (`file`): its ResourceClaims, ResourceClaimTemplates and DeviceClasses as resource.k8s.io
objects, and its pods reduced to what the kubelet and the resourceclaim controller read of them
(the pod's `spec.resourceClaims`: a claim by name or a template). A Deployment or Job becomes its
replicas (`replicas`, `parallelism`): pods `<name>-0` .. `<name>-<n-1>`, each with its own claims
from a template and the same claim where it names one. Only facts are kept: names, requests,
selectors, counts, constraints, opaque config; images, commands and tolerations are left out.

- `quickstart/v1/gpu-test{1..6}.yaml`, `gpu-test-mps.yaml`, and their `v1beta1/` twins (the same
  objects in resource.k8s.io/v1beta1: a request's fields without `exactly`); `quickstart/gpu-test7.yaml`
  and `gpu-test8.yaml` (v1beta1 only).
- `mig+mps/sharing-demo-*.yaml`: classic DRA (resource.k8s.io/v1alpha2 with GpuClaimParameters /
  MigDeviceClaimParameters), which no Kubernetes since 1.31 serves. Written here in v1 with what
  NVIDIA's v0.4.1 driver takes for the same meaning: the class `gpu.nvidia.com` or `mig.nvidia.com`,
  the profile as a CEL selector, the sharing as a GpuConfig / MigDeviceConfig
  (api/nvidia.com/resource/v1beta1). `sharing-demo-claims-1.yaml` / `-parameters-1.yaml` hold one
  of the same four claims (mig-mps-sharing) and are covered by it.
- `extended-resources/mig-1g-12gb.yaml`: its DeviceClass only (its pod asks by extended resource).
- The driver's own classes `gpu.nvidia.com` and `mig.nvidia.com`
  (deployments/helm/dra-driver-nvidia-gpu/templates/deviceclass-gpu.yaml, deviceclass-mig.yaml).

Left out: `imex/` and `quickstart/*/imex-test1.yaml` (ComputeDomains, IMEX channels),
`quickstart/*/gpu-test-vfio*.yaml` (class vfio.gpu.nvidia.com, VFIO passthrough),
`selectors/` (classic DRA GpuClaimParameters selectors on memory and compute capability, with no v1
form but Kubernetes' quantity and semver CEL libraries), `extended-resources/*` pods (a claim the
scheduler makes from an extended resource), and the mig-parted configs (`half-balanced` is the
simulated node's MIG layout instead, see `node_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

DRIVER = "gpu.nvidia.com"

# The driver's DeviceClasses (helm templates deviceclass-gpu.yaml, deviceclass-mig.yaml at v0.4.1),
# and the one of extended-resources/mig-1g-12gb.yaml. None of them carries `spec.config`.
CLASSES_YAML = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec:
  selectors:
  - cel: {expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}
  extendedResourceName: nvidia.com/gpu
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: mig.nvidia.com}
spec:
  selectors:
  - cel: {expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: mig-1g-12gb.gpu.nvidia.com}
spec:
  selectors:
  - cel:
      expression: >-
        device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig' &&
        device.attributes['gpu.nvidia.com'].profile == '1g.12gb'
  extendedResourceName: nvidia.com/mig-1g.12gb
"""


@dataclass(frozen=True)
class Pod:
    """A pod as the kubelet reads its claims: `claims` maps each `spec.resourceClaims[].name` to
    ("claim", <ResourceClaim name>) or ("template", <ResourceClaimTemplate name>)."""

    namespace: str
    name: str
    claims: tuple[tuple[str, tuple[str, str]], ...]


@dataclass(frozen=True)
class Demo:
    file: str  # under demo/specs/ at v0.4.1
    node: str  # the simulated node it needs: "a100" (8 full A100 40GB) or "a100-mig" (half-balanced)
    objects: tuple[dict[str, Any], ...]  # ResourceClaims, ResourceClaimTemplates (as NVIDIA wrote them)
    pods: tuple[Pod, ...]

    @property
    def id(self) -> str:
        return self.file.removesuffix(".yaml")

    def claims(self) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "ResourceClaim"}

    def templates(self) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "ResourceClaimTemplate"}


def classes() -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in yaml.safe_load_all(CLASSES_YAML)}


def _pods(namespace: str, name: str, count: int, **claims: tuple[str, str]) -> tuple[Pod, ...]:
    """`count` replicas (`name` itself when count is 0: a bare pod) with these pod claims."""
    refs = tuple((k.replace("_", "-"), v) for k, v in claims.items())
    if count == 0:
        return (Pod(namespace, name, refs),)
    return tuple(Pod(namespace, f"{name}-{i}", refs) for i in range(count))


def _objects(text: str) -> tuple[dict[str, Any], ...]:
    return tuple(yaml.safe_load_all(text))


# ------------------------------------------------------------------------------ quickstart (v1)
GPU_TEST1 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test1, name: single-gpu}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
"""

GPU_TEST2 = GPU_TEST1.replace("gpu-test1", "gpu-test2")

GPU_TEST3 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: gpu-test3, name: single-gpu}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu.nvidia.com}
"""

GPU_TEST4 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test4, name: mig-devices}
spec:
  spec:
    devices:
      requests:
      - name: mig-1g-5gb-0
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}]
      - name: mig-1g-5gb-1
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}]
      - name: mig-2g-10gb
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'"}}]
      - name: mig-3g-20gb
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'"}}]
      constraints:
      - {requests: [], matchAttribute: gpu.nvidia.com/parentUUID}
"""

MPS_50_10GI = """
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig: {defaultActiveThreadPercentage: 50, defaultPinnedDeviceMemoryLimit: 10Gi}
"""

GPU_TEST5 = (
    """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test5, name: multiple-gpus}
spec:
  spec:
    devices:
      requests:
      - name: ts-gpu
        exactly: {deviceClassName: gpu.nvidia.com}
      - name: mps-gpu
        exactly: {deviceClassName: gpu.nvidia.com}
      config:
      - requests: [ts-gpu]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: TimeSlicing
              timeSlicingConfig: {interval: Long}
      - requests: [mps-gpu]
        opaque:
          driver: gpu.nvidia.com"""
    + MPS_50_10GI
)

GPU_TEST6 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test6, name: a100}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          selectors:
          - cel:
              expression: |
                device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')
                &&
                (device.attributes['gpu.nvidia.com'].index == 0 ||
                device.attributes['gpu.nvidia.com'].index == 2 ||
                device.attributes['gpu.nvidia.com'].index == 4 ||
                device.attributes['gpu.nvidia.com'].index == 6)
      config:
      - requests: [gpu]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: TimeSlicing
              timeSlicingConfig: {interval: Long}
"""

GPU_TEST_MPS = (
    """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test-mps, name: shared-gpu}
spec:
  spec:
    devices:
      requests:
      - name: mps-gpu
        exactly: {deviceClassName: gpu.nvidia.com}
      config:
      - requests: [mps-gpu]
        opaque:
          driver: gpu.nvidia.com"""
    + MPS_50_10GI
)

# ------------------------------------------------------------------------------ quickstart (v1beta1 only)
GPU_TEST7 = """
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test7, name: single-gpu}
spec:
  spec:
    devices:
      requests:
      - {name: gpu, deviceClassName: gpu.nvidia.com}
"""

GPU_TEST8 = """
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test8, name: double-gpu}
spec:
  spec:
    devices:
      requests:
      - {name: gpu, deviceClassName: gpu.nvidia.com, count: 2}
"""

# ------------------------------------------------------------------------------ mig+mps (classic DRA, in v1)
SHARING_DEMO = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: sharing-demo, name: gpu-ts-sharing}
spec:
  devices:
    requests:
    - {name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}
    config:
    - opaque:
        driver: gpu.nvidia.com
        parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing: {strategy: TimeSlicing}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: sharing-demo, name: gpu-mps-sharing}
spec:
  devices:
    requests:
    - {name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}
    config:
    - opaque:
        driver: gpu.nvidia.com
        parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing: {strategy: MPS}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: sharing-demo, name: mig-ts-sharing}
spec:
  devices:
    requests:
    - name: mig
      exactly:
        deviceClassName: mig.nvidia.com
        selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}]
    config:
    - opaque:
        driver: gpu.nvidia.com
        parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: MigDeviceConfig, sharing: {strategy: TimeSlicing}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: sharing-demo, name: mig-mps-sharing}
spec:
  devices:
    requests:
    - name: mig
      exactly:
        deviceClassName: mig.nvidia.com
        selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}]
    config:
    - opaque:
        driver: gpu.nvidia.com
        parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: MigDeviceConfig, sharing: {strategy: MPS}}
"""


def _v1beta1(objects: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """The v1beta1/ twin of a v1/ quickstart file: the same objects in resource.k8s.io/v1beta1,
    where a request's `exactly` fields sit on the request itself."""
    for obj in objects:
        obj["apiVersion"] = "resource.k8s.io/v1beta1"
        spec = obj["spec"]["spec"] if obj["kind"] == "ResourceClaimTemplate" else obj["spec"]
        for request in spec["devices"]["requests"]:
            request.update(request.pop("exactly"))
    return objects


def _quickstart(prefix: str) -> list[Demo]:
    def o(text: str) -> tuple[dict[str, Any], ...]:
        objects = _objects(text)
        return _v1beta1(objects) if prefix.endswith("v1beta1") else objects

    return [
        Demo(f"{prefix}/gpu-test1.yaml", "a100", o(GPU_TEST1), (
            Pod("gpu-test1", "pod1", (("gpu", ("template", "single-gpu")),)),
            Pod("gpu-test1", "pod2", (("gpu", ("template", "single-gpu")),)),
        )),
        Demo(f"{prefix}/gpu-test2.yaml", "a100", o(GPU_TEST2),
             _pods("gpu-test2", "pod", 0, shared_gpu=("template", "single-gpu"))),
        Demo(f"{prefix}/gpu-test3.yaml", "a100", o(GPU_TEST3), (
            Pod("gpu-test3", "pod1", (("shared-gpu", ("claim", "single-gpu")),)),
            Pod("gpu-test3", "pod2", (("shared-gpu", ("claim", "single-gpu")),)),
        )),
        Demo(f"{prefix}/gpu-test4.yaml", "a100-mig", o(GPU_TEST4),
             _pods("gpu-test4", "pod", 4, mig_devices=("template", "mig-devices"))),
        Demo(f"{prefix}/gpu-test5.yaml", "a100", o(GPU_TEST5),
             _pods("gpu-test5", "pod0", 0, shared_gpus=("template", "multiple-gpus"))),
        Demo(f"{prefix}/gpu-test6.yaml", "a100", o(GPU_TEST6),
             _pods("gpu-test6", "pod", 4, a100=("template", "a100"))),
        Demo(f"{prefix}/gpu-test-mps.yaml", "a100", o(GPU_TEST_MPS),
             _pods("gpu-test-mps", "test-pod", 0, shared_gpu=("template", "shared-gpu"))),
    ]  # fmt: skip


DEMOS: tuple[Demo, ...] = (
    *_quickstart("quickstart/v1"),
    *_quickstart("quickstart/v1beta1"),
    Demo("quickstart/gpu-test7.yaml", "a100", _objects(GPU_TEST7), (
        Pod("gpu-test7", "gpu-pod", (("gpu0", ("template", "single-gpu")), ("gpu1", ("template", "single-gpu")))),
    )),
    Demo("quickstart/gpu-test8.yaml", "a100", _objects(GPU_TEST8),
         _pods("gpu-test8", "gpu-pod", 0, twogpus=("template", "double-gpu"))),
    Demo("mig+mps/sharing-demo-job.yaml", "a100-mig", _objects(SHARING_DEMO),
         _pods("sharing-demo", "sharing-demo-job", 4, gpu_ts_sharing=("claim", "gpu-ts-sharing"),
               gpu_mps_sharing=("claim", "gpu-mps-sharing"), mig_ts_sharing=("claim", "mig-ts-sharing"),
               mig_mps_sharing=("claim", "mig-mps-sharing"))),
)  # fmt: skip


# ------------------------------------------------------------------------------ the simulated nodes
def node_profile(mig: bool) -> str:
    """An NVML simulator node description (YAML): 8 x A100-SXM4-40GB, the quickstart's hardware.
    With `mig`, GPUs 0-3 in NVIDIA's `half-balanced` layout (quickstart/mig-parted-config.yaml:
    2 x 1g.5gb, 1 x 2g.10gb, 1 x 3g.20gb each) and 4-7 full GPUs; else all eight full GPUs."""
    gpus = []
    for i in range(8):
        gpu: dict[str, Any] = {
            "name": "NVIDIA A100-SXM4-40GB",
            "uuid": gpu_uuid(i),
            "minor": i,
            "pci_bus_id": f"00000000:{0x07 + 0x10 * i:02X}:00.0",
            "memory_mib": 40960,
            "numa_node": i // 4,
            "compute_capability": [8, 0],
            "mig_capable": True,
        }
        if mig and i < 4:
            layout = ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
            gpu["mig"] = {"enabled": True, "devices": [{"profile": p} for p in layout]}
        gpus.append(gpu)
    node = {
        "name": "demo-a100-half-balanced" if mig else "demo-a100",
        "driver_version": "550.54.15",
        "gpus": gpus,
        "topology": {"default_ancestor": "SYSTEM"},
    }
    return yaml.safe_dump(node, sort_keys=False)


def gpu_uuid(index: int) -> str:
    return f"GPU-a1000000-0000-4000-8000-{index:012d}"
