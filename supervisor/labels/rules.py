"""GPU Feature Discovery's label rules, as a pure function of the node's facts and the config.

`compute_labels` gives the label set NVIDIA's `gpu-feature-discovery` v0.20.0 computes in its
`internal/lm` package, rule for rule; each function below names the Go file it follows. Input is
plain data (`supervisor.node.facts.NodeFacts`, the machine type string, the vGPU scan), output a
dict, so `gpuvisor labels` and the supervisor can share it and the tests can pin every rule.

Where GFD's result depends on Go's random map order (several GPU models on one node, whose
`nvidia.com/gpu.*` labels overwrite each other), the order here is fixed: models in order of
their first GPU index, a later one overwriting an earlier one, MIG-enabled models before full
GPUs as in GFD (internal/lm/mig-strategy.go, newGPULabelers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.config import MIG_STRATEGIES, SharingConfig
from supervisor.node.facts import PCI_CLASS_3D, PCI_CLASS_VGA, GpuFacts, MigFacts, NodeFacts

PREFIX = "nvidia.com"
FULL_GPU = f"{PREFIX}/gpu"  # internal/lm/resource.go fullGPUResourceName


class LabelError(Exception):
    """GFD would fail here and write no labels (the message says why, in GFD's words where it has some)."""


@dataclass(frozen=True)
class SharingView:
    """The `sharing` section as GFD reads it (api/config/v1/sharing.go, replicas.go, config.go).

    GFD ignores `rename` and per-device `devices` (DisableResourceNamingInConfig): a shared
    resource is renamed exactly when `renameByDefault` is true. `replicas` holds each resource
    name's first entry in the active section, as `replicationInfo` finds it.
    """

    strategy: str = "none"  # "none" | "time-slicing" | "mps" (Sharing.SharingStrategy)
    rename_by_default: bool = False
    replicas: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, sharing: SharingConfig) -> SharingView:
        first: dict[str, int] = {}
        for entry in sharing.resources:
            first.setdefault(entry.name, entry.replicas)
        return cls(sharing.strategy, sharing.rename_by_default, first)


@dataclass(frozen=True)
class LabelConfig:
    """What of the config shapes the labels."""

    mig_strategy: str = "none"
    sharing: SharingView = field(default_factory=SharingView)


@dataclass(frozen=True)
class VgpuDevice:
    """A vGPU guest device and its host driver (internal/vgpu Info)."""

    host_driver_version: str
    host_driver_branch: str


def sanitise(text: str) -> str:
    """internal/lm/resource.go sanitise: keep [A-Za-z0-9-_. ], runs of blanks become one "-"."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def arch_family(major: int, minor: int) -> str:
    """internal/lm/resource.go getArchFamily."""
    families = {
        1: "tesla",
        2: "fermi",
        3: "kepler",
        5: "maxwell",
        6: "pascal",
        9: "hopper",
        10: "blackwell",
        12: "blackwell",
        13: "rubin",
    }
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return families.get(major, "undefined")


def mig_name(profile: str) -> str:
    """internal/resource/nvml-mig-device.go GetName: the profile with "+" turned into "."."""
    return profile.replace("+", ".")


class _Resource:
    """internal/lm/resource.go resourceLabeler: the labels of one resource name.

    `sharing` None is GFD's nil config (MIG-enabled GPUs under their model name): no sharing
    information and zero replicas.
    """

    def __init__(self, name: str, sharing: SharingView | None) -> None:
        self.name = name
        self.sharing = sharing

    def key(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def _replication(self) -> int | None:
        if self.sharing is None:
            return None
        return self.sharing.replicas.get(self.name)

    def replicas(self) -> int:
        if self.sharing is None:
            return 0
        found = self._replication()
        return found if found is not None and found > 0 else 1

    def shared(self) -> bool:
        found = self._replication()
        return found is not None and found > 1

    def product(self, *parts: str) -> str:
        kept = [sanitise(p) for p in parts if p]
        if not kept:
            return ""
        # A shared resource that keeps its name says so in the product; a renamed one does not.
        if self.shared() and not (self.sharing is not None and self.sharing.rename_by_default):
            kept.append("SHARED")
        return "-".join(kept)

    def base(self, count: int, *parts: str) -> dict[str, str]:
        replicas = self.replicas()
        strategy = self.sharing.strategy if self.sharing is not None and replicas > 1 else "none"
        return {
            self.key("product"): self.product(*parts),
            self.key("count"): str(count),
            self.key("replicas"): str(replicas),
            self.key("sharing-strategy"): strategy,
        }


def _full_gpu_labels(gpu: GpuFacts, count: int, sharing: SharingView | None) -> dict[str, str]:
    """NewGPUResourceLabeler (internal/lm/resource.go): product, count, replicas, memory, architecture."""
    rl = _Resource(FULL_GPU, sharing)
    labels = rl.base(count, gpu.name)
    if gpu.memory_mib != 0:
        labels[rl.key("memory")] = str(gpu.memory_mib)
    major, minor = gpu.compute_capability
    if major != 0:
        labels[rl.key("family")] = arch_family(major, minor)
        labels[rl.key("compute.major")] = str(major)
        labels[rl.key("compute.minor")] = str(minor)
    return labels


def _mig_resource_labels(
    name: str, parent: GpuFacts, mig: MigFacts, count: int, sharing: SharingView
) -> dict[str, str]:
    """NewMIGResourceLabeler (internal/lm/resource.go) with the MIG attributes (nvml-mig-device.go)."""
    rl = _Resource(name, sharing)
    labels = rl.base(count, parent.name, "MIG", mig_name(mig.profile))
    attributes = {
        "memory": mig.memory_mib,
        "multiprocessors": mig.multiprocessors,
        "slices.gi": mig.gi_slices,
        "slices.ci": mig.ci_slices,
        "engines.copy": mig.copy_engines,
        "engines.decoder": mig.decoders,
        "engines.encoder": mig.encoders,
        "engines.jpeg": mig.jpegs,
        "engines.ofa": mig.ofas,
    }
    labels.update({rl.key(k): str(v) for k, v in attributes.items()})
    return labels


def _gpu_labels(gpus: tuple[GpuFacts, ...], sharing: SharingView) -> dict[str, str]:
    """newGPULabelers (internal/lm/mig-strategy.go): one labeler per model, MIG-enabled ones first
    (without sharing), then full GPUs, which overwrite a MIG-enabled model of the same name. The
    count of a model covers all its GPUs, MIG-enabled or not."""
    counts: dict[str, int] = {}
    last: dict[
        tuple[bool, str], GpuFacts
    ] = {}  # the last GPU of each (MIG enabled, model), as GFD's map keeps
    for gpu in gpus:
        counts[gpu.name] = counts.get(gpu.name, 0) + 1
        last[(gpu.mig_enabled, gpu.name)] = gpu
    labels: dict[str, str] = {}
    for enabled in (True, False):
        for (is_enabled, name), gpu in last.items():
            if is_enabled == enabled:
                labels.update(_full_gpu_labels(gpu, counts[name], None if enabled else sharing))
    return labels


def _all_migs(gpus: tuple[GpuFacts, ...]) -> list[tuple[GpuFacts, MigFacts]]:
    return [(gpu, mig) for gpu in gpus if gpu.mig_enabled for mig in gpu.migs]


def _mig_resources(gpus: tuple[GpuFacts, ...]) -> dict[str, tuple[GpuFacts, MigFacts, int]]:
    """MIG devices by name (profile with "." for "+"): the first device of each and the count."""
    found: dict[str, tuple[GpuFacts, MigFacts, int]] = {}
    for gpu, mig in _all_migs(gpus):
        key = mig_name(mig.profile)
        first_gpu, first_mig, count = found.get(key, (gpu, mig, 0))
        found[key] = (first_gpu, first_mig, count + 1)
    return found


def _invalid_single(gpu: GpuFacts) -> dict[str, str]:
    """newInvalidMigStrategyLabeler (internal/lm/mig-strategy.go:244-266), whose reason GFD only logs."""
    rl = _Resource(FULL_GPU, None)
    return {
        rl.key("product"): rl.product(gpu.name, "MIG", "INVALID"),
        rl.key("count"): "0",
        rl.key("replicas"): "0",
        rl.key("sharing-strategy"): "",
        rl.key("memory"): "0",
    }


def invalid_single_reason(gpus: tuple[GpuFacts, ...]) -> str | None:
    """Why the node does not fit mig-strategy=single, or None (newMigStrategySingleLabeler)."""
    enabled = [g for g in gpus if g.mig_enabled]
    if not enabled:
        return None
    if any(not g.migs for g in enabled):
        return "at least one MIG device is enabled but empty"
    if len(enabled) != len(gpus):
        return "devices with MIG enabled and disable detected"
    if len(_mig_resources(gpus)) != 1:
        return "more than one MIG device type present on node"
    return None


def _mig_labels(gpus: tuple[GpuFacts, ...], config: LabelConfig) -> dict[str, str]:
    """newMigLabeler (internal/lm/mig-strategy.go): mig.strategy, then single or mixed."""
    strategy = config.mig_strategy
    labels = {f"{PREFIX}/mig.strategy": strategy}
    if strategy == "mixed":
        for name, (gpu, mig, count) in _mig_resources(gpus).items():
            labels.update(_mig_resource_labels(f"{PREFIX}/mig-{name}", gpu, mig, count, config.sharing))
        return labels
    enabled = [g for g in gpus if g.mig_enabled]
    if not enabled:  # no MIG-enabled GPU: the same as the none strategy
        return labels
    if invalid_single_reason(gpus) is not None:
        labels.update(_invalid_single(enabled[0]))
        return labels
    ((gpu, mig, count),) = _mig_resources(gpus).values()
    labels.update(_mig_resource_labels(FULL_GPU, gpu, mig, count, config.sharing))
    return labels


def _version_labels(facts: NodeFacts) -> dict[str, str]:
    """newVersionLabeler (internal/lm/nvml.go); the CUDA version as resource/nvml-lib.go splits it."""
    parts = facts.driver_version.split(".")
    if not 2 <= len(parts) <= 3:
        raise LabelError(
            f'error getting driver version: Version "{facts.driver_version}" does not match format "X.Y[.Z]"'
        )
    major, minor = parts[0], parts[1]
    rev = parts[2] if len(parts) > 2 else ""
    cuda_major, cuda_minor = facts.cuda_driver_version // 1000, facts.cuda_driver_version % 1000 // 10
    return {
        f"{PREFIX}/cuda.driver.major": major,
        f"{PREFIX}/cuda.driver.minor": minor,
        f"{PREFIX}/cuda.driver.rev": rev,
        f"{PREFIX}/cuda.runtime.major": str(cuda_major),
        f"{PREFIX}/cuda.runtime.minor": str(cuda_minor),
        f"{PREFIX}/cuda.driver-version.major": major,
        f"{PREFIX}/cuda.driver-version.minor": minor,
        f"{PREFIX}/cuda.driver-version.revision": rev,
        f"{PREFIX}/cuda.driver-version.full": facts.driver_version,
        f"{PREFIX}/cuda.runtime-version.major": str(cuda_major),
        f"{PREFIX}/cuda.runtime-version.minor": str(cuda_minor),
        f"{PREFIX}/cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
    }


def _mps_capable(gpus: tuple[GpuFacts, ...], sharing: SharingView) -> str:
    """newSharingLabeler / isMPSCapable (internal/lm/nvml.go)."""
    if sharing.strategy != "mps":
        return "false"
    if any(g.mig_enabled for g in gpus):
        raise LabelError(
            "error creating sharing labeler: failed to check MPS-capable: MPS sharing is not supported for mig devices"
        )
    return "true"


def gpu_mode(gpus: tuple[GpuFacts, ...]) -> str:
    """newGPUModeLabeler (internal/lm/nvml.go): one PCI class for every GPU, else "unknown"."""
    classes = {g.pci_class for g in gpus}
    if None in classes or len(classes) != 1:
        return "unknown"
    return {PCI_CLASS_VGA: "graphics", PCI_CLASS_3D: "compute"}.get(classes.pop() or 0, "unknown")


def clique(gpus: tuple[GpuFacts, ...]) -> str | None:
    """newImexLabeler / getFabricIDs (internal/lm/imex.go): one cluster and one clique, or none."""
    attached = [g.fabric for g in gpus if g.fabric is not None]
    clusters = {f.cluster_uuid for f in attached}
    cliques = {f.clique_id for f in attached}
    if len(clusters) != 1 or len(cliques) != 1:
        return None
    return f"{clusters.pop()}.{cliques.pop()}"


def _device_labels(facts: NodeFacts, config: LabelConfig, machine_type: str) -> dict[str, str]:
    """NewDeviceLabeler (internal/lm/nvml.go), in its merge order; nothing when there is no GPU."""
    gpus = facts.gpus
    if not gpus:
        return {}
    if config.mig_strategy not in MIG_STRATEGIES:
        raise LabelError(
            f"error creating resource labeler: failed to construct MIG resource labeler: unknown strategy: {config.mig_strategy}"
        )
    labels = {f"{PREFIX}/gpu.machine": sanitise(machine_type)}
    labels.update(_version_labels(facts))
    labels[f"{PREFIX}/mig.capable"] = "true" if any(g.mig_capable for g in gpus) else "false"
    labels[f"{PREFIX}/mps.capable"] = _mps_capable(gpus, config.sharing)
    labels.update(_gpu_labels(gpus, config.sharing))
    if config.mig_strategy != "none":
        labels.update(_mig_labels(gpus, config))
    labels[f"{PREFIX}/gpu.mode"] = gpu_mode(gpus)
    found = clique(gpus)
    if found is not None:
        labels[f"{PREFIX}/gpu.clique"] = found
    return labels


def compute_labels(
    facts: NodeFacts,
    config: LabelConfig,
    *,
    machine_type: str,
    vgpu: tuple[VgpuDevice, ...] | None,
    timestamp: int | None,
) -> dict[str, str]:
    """GFD's labels for this node: timestamp, then the device labels, then the vGPU ones.

    `machine_type` is the machine-type file's text ("unknown" when it could not be read, as in
    GFD); `vgpu` is the vGPU scan (None when the scan failed: GFD then writes no vGPU label);
    `timestamp` None is --no-timestamp. Raises LabelError where GFD would fail.
    """
    labels: dict[str, str] = {}
    if timestamp is not None:
        labels[f"{PREFIX}/gfd.timestamp"] = str(timestamp)
    labels.update(_device_labels(facts, config, machine_type))
    if vgpu is not None:  # vgpuLabeler (internal/lm/vgpu.go): the last device's driver wins
        labels[f"{PREFIX}/vgpu.present"] = "true" if vgpu else "false"
        for device in vgpu:
            labels[f"{PREFIX}/vgpu.host-driver-version"] = device.host_driver_version
            labels[f"{PREFIX}/vgpu.host-driver-branch"] = device.host_driver_branch
    return labels


def render(labels: Mapping[str, str]) -> str:
    """The features.d file: one `key=value` a line (GFD's toWriter), sorted so it is stable."""
    return "".join(f"{key}={labels[key]}\n" for key in sorted(labels))
