"""GPU Feature Discovery's label rules (supervisor.labels.rules), one rule per test, on hand-made facts.

Each expectation cites the GFD v0.20.0 source line it follows (k8s-device-plugin at tag v0.20.0,
`internal/lm/...`); `git -C <mirror> show v0.20.0:internal/lm/resource.go` shows them.
"""

from __future__ import annotations

import dataclasses

import pytest

from supervisor.config import config_from_data
from supervisor.labels.rules import (
    LabelConfig,
    LabelError,
    SharingView,
    VgpuDevice,
    arch_family,
    compute_labels,
    render,
    sanitise,
)
from supervisor.node.facts import PCI_CLASS_3D, PCI_CLASS_VGA, FabricClique, GpuFacts, MigFacts, NodeFacts

A100 = GpuFacts(
    0, "NVIDIA A100-SXM4-80GB", 81920, (8, 0), mig_capable=True, mig_enabled=False, pci_class=PCI_CLASS_3D
)
MIG_1G = MigFacts("1g.10gb", 9728, 14, 1, 1, 1, 0, 0, 0, 0)
MIG_1G_ME = MigFacts("1g.10gb+me", 9728, 14, 1, 1, 1, 1, 0, 1, 1)
MIG_3G = MigFacts("3g.40gb", 40192, 42, 3, 3, 3, 2, 0, 0, 0)


def gpus(*items: GpuFacts) -> NodeFacts:
    return NodeFacts("550.54.15", 12040, tuple(dataclasses.replace(g, index=i) for i, g in enumerate(items)))


def mig_gpu(*migs: MigFacts) -> GpuFacts:
    return dataclasses.replace(A100, mig_enabled=True, migs=migs)


def labels(facts: NodeFacts, config: LabelConfig | None = None, **kw: object) -> dict[str, str]:
    args: dict[str, object] = {"machine_type": "DGX A100", "vgpu": (), "timestamp": None}
    args.update(kw)
    return compute_labels(facts, config or LabelConfig(), **args)  # type: ignore[arg-type]


def sharing(text: str) -> SharingView:
    """A `sharing` section parsed by gpuvisor's loader, as `gpuvisor labels` reads it."""
    import yaml

    data = {"version": "v1", "sharing": yaml.safe_load(text)}
    return SharingView.from_config(config_from_data(data, flags={"mps_root": "/"}).sharing)


def test_full_gpu_labels() -> None:
    """Product, count, replicas, sharing strategy, memory, family and compute capability of 8 A100s."""
    out = labels(gpus(*[A100] * 8))
    assert (
        {k: out[k] for k in out if k.startswith("nvidia.com/gpu.") and k != "nvidia.com/gpu.machine"}
        == {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",  # resource.go:189 getProductName: sanitised, blanks -> "-"
            "nvidia.com/gpu.count": "8",  # mig-strategy.go:134 counts[name]++ per device
            "nvidia.com/gpu.replicas": "1",  # resource.go:208 getReplicas: config, no sharing entry -> 1
            "nvidia.com/gpu.sharing-strategy": "none",  # resource.go:162 replicas <= 1 -> none
            "nvidia.com/gpu.memory": "81920",  # resource.go:62 memory label when the size is known
            "nvidia.com/gpu.family": "ampere",  # resource.go:303 major 8, minor < 9
            "nvidia.com/gpu.compute.major": "8",  # resource.go:275
            "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/gpu.mode": "compute",  # nvml.go:241 one class, 0x0302 -> compute
        }
    )


def test_version_labels_new_and_deprecated() -> None:
    """Driver 550.54.15 and CUDA 12040 give both the new and the deprecated names (nvml.go:125-141)."""
    out = labels(gpus(A100))
    assert {k: v for k, v in out.items() if k.startswith("nvidia.com/cuda.")} == {
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.runtime.major": "12",  # nvml-lib.go:28 v / 1000
        "nvidia.com/cuda.runtime.minor": "4",  # nvml-lib.go:29 v % 1000 / 10
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
    }


def test_two_part_driver_version_has_an_empty_revision() -> None:
    """ "535.104" is X.Y: the revision labels are empty (nvml.go:115-118)."""
    out = labels(dataclasses.replace(gpus(A100), driver_version="535.104", cuda_driver_version=12020))
    assert out["nvidia.com/cuda.driver.rev"] == out["nvidia.com/cuda.driver-version.revision"] == ""
    assert out["nvidia.com/cuda.runtime-version.full"] == "12.2"


@pytest.mark.parametrize("version", ["550", "1.2.3.4", ""])
def test_bad_driver_version_fails_like_gfd(version: str) -> None:
    """A version that is not X.Y[.Z] fails the labelling with GFD's message (nvml.go:109-111)."""
    with pytest.raises(LabelError, match=r'does not match format "X.Y\[.Z\]"'):
        labels(dataclasses.replace(gpus(A100), driver_version=version))


@pytest.mark.parametrize(
    ("major", "minor", "family"),
    [(1, 3, "tesla"), (2, 0, "fermi"), (3, 5, "kepler"), (4, 0, "undefined"), (5, 2, "maxwell"), (6, 1, "pascal"),
     (7, 0, "volta"), (7, 5, "turing"), (8, 6, "ampere"), (8, 9, "ada-lovelace"), (9, 0, "hopper"),
     (10, 0, "blackwell"), (11, 0, "undefined"), (12, 0, "blackwell"), (13, 0, "rubin"), (14, 0, "undefined")],
)  # fmt: skip
def test_arch_family(major: int, minor: int, family: str) -> None:
    """getArchFamily's table, including the gaps that are "undefined" (resource.go:285-316)."""
    assert arch_family(major, minor) == family


def test_compute_capability_zero_gives_no_architecture_labels() -> None:
    """Major 0 leaves family and compute.* out (resource.go:269-271)."""
    out = labels(gpus(dataclasses.replace(A100, compute_capability=(0, 0))))
    assert not {
        "nvidia.com/gpu.family",
        "nvidia.com/gpu.compute.major",
        "nvidia.com/gpu.compute.minor",
    } & set(out)


def test_unknown_memory_leaves_the_memory_label_out() -> None:
    """NVML could not tell the memory size: no gpu.memory label, the rest as usual (resource.go:49-64)."""
    out = labels(gpus(dataclasses.replace(A100, memory_mib=0)))
    assert "nvidia.com/gpu.memory" not in out
    assert out["nvidia.com/gpu.count"] == "1"


@pytest.mark.parametrize(
    ("text", "clean"),
    [("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"), ("  DGX   A100 \t", "DGX-A100"),
     ("Tesla T4 (PCIe)/x", "Tesla-T4-PCIex"), ("a_b.c-d", "a_b.c-d"), ("Ünïcode box", "ncode-box"), ("", "")],
)  # fmt: skip
def test_sanitise(text: str, clean: str) -> None:
    """Only [A-Za-z0-9-_. ] survive and runs of blanks become one "-" (resource.go:318-326)."""
    assert sanitise(text) == clean


def test_machine_type_is_sanitised() -> None:
    """gpu.machine is the machine type file's text, sanitised (machine-type.go:37-39)."""
    assert (
        labels(gpus(A100), machine_type="ProLiant XL675d Gen10 Plus")["nvidia.com/gpu.machine"]
        == "ProLiant-XL675d-Gen10-Plus"
    )


def test_mig_capable_if_any_gpu_is() -> None:
    """mig.capable is true when one GPU answers the MIG mode query (nvml.go:159-168)."""
    l4 = GpuFacts(0, "NVIDIA L4", 23034, (8, 9), mig_capable=False, mig_enabled=False, pci_class=PCI_CLASS_3D)
    assert labels(gpus(l4, l4))["nvidia.com/mig.capable"] == "false"
    assert labels(gpus(l4, A100))["nvidia.com/mig.capable"] == "true"


def test_time_slicing_replicas_and_shared_product() -> None:
    """4 time-sliced replicas: replicas 4, strategy time-slicing, product with -SHARED (resource.go:160-206)."""
    out = labels(
        gpus(A100, A100), LabelConfig(sharing=sharing("timeSlicing: {resources: [{name: gpu, replicas: 4}]}"))
    )
    assert out["nvidia.com/gpu.replicas"] == "4"
    assert out["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert out["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"
    assert out["nvidia.com/gpu.count"] == "2"  # the count is of GPUs, not replicas
    assert out["nvidia.com/mps.capable"] == "false"  # nvml.go:177 only MPS sharing asks


def test_rename_by_default_drops_the_shared_suffix() -> None:
    """renameByDefault: the resource is nvidia.com/gpu.shared, so the product keeps its name (resource.go:202)."""
    view = sharing("timeSlicing: {renameByDefault: true, resources: [{name: gpu, replicas: 4}]}")
    out = labels(gpus(A100), LabelConfig(sharing=view))
    assert (out["nvidia.com/gpu.product"], out["nvidia.com/gpu.replicas"]) == ("NVIDIA-A100-SXM4-80GB", "4")
    assert "nvidia.com/gpu.shared.product" not in out  # labels stay under nvidia.com/gpu (resource.go:30)


def test_a_per_resource_rename_is_ignored_as_gfd_does() -> None:
    """rename without renameByDefault is dropped by DisableResourceNamingInConfig: -SHARED stays (config.go:80-94)."""
    view = sharing("timeSlicing: {resources: [{name: gpu, rename: gpu-ts, replicas: 2}]}")
    assert (
        labels(gpus(A100), LabelConfig(sharing=view))["nvidia.com/gpu.product"]
        == "NVIDIA-A100-SXM4-80GB-SHARED"
    )


def test_mps_sharing() -> None:
    """MPS: mps.capable true when no GPU has MIG enabled, strategy mps (nvml.go:176-211)."""
    out = labels(gpus(A100), LabelConfig(sharing=sharing("mps: {resources: [{name: gpu, replicas: 2}]}")))
    assert (out["nvidia.com/mps.capable"], out["nvidia.com/gpu.sharing-strategy"]) == ("true", "mps")
    assert out["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"


def test_mps_with_a_mig_enabled_gpu_fails() -> None:
    """MPS and a MIG-enabled GPU: GFD fails the labelling (nvml.go:206-207), whatever the MIG strategy."""
    config = LabelConfig(sharing=sharing("mps: {resources: [{name: gpu, replicas: 2}]}"))
    with pytest.raises(LabelError, match="MPS sharing is not supported for mig devices"):
        labels(gpus(A100, mig_gpu(MIG_1G)), config)


def test_mig_enabled_gpus_under_strategy_none() -> None:
    """Only MIG-enabled GPUs: labelled as their model without sharing, replicas 0 (resource.go:33-36, 208-210)."""
    view = sharing("timeSlicing: {resources: [{name: gpu, replicas: 4}]}")
    out = labels(gpus(mig_gpu(MIG_1G), mig_gpu(MIG_3G)), LabelConfig(sharing=view))
    assert out["nvidia.com/gpu.count"] == "2"
    assert out["nvidia.com/gpu.replicas"] == "0"
    assert out["nvidia.com/gpu.sharing-strategy"] == "none"
    assert out["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"  # no -SHARED: no sharing config
    assert "nvidia.com/mig.strategy" not in out  # strategy.go:21 none has no label


def test_full_gpus_override_mig_enabled_ones_of_the_same_model() -> None:
    """A model with MIG-enabled and full GPUs: the full-GPU labels win, the count covers all (mig-strategy.go:155-177)."""
    out = labels(gpus(mig_gpu(MIG_1G), A100, A100))
    assert (out["nvidia.com/gpu.count"], out["nvidia.com/gpu.replicas"]) == ("3", "1")


def test_mixed_strategy_labels_each_mig_profile() -> None:
    """mixed: nvidia.com/mig-<profile>.* per profile with its count and attributes; "+" becomes "." (mig-strategy.go:266-297)."""
    out = labels(
        gpus(mig_gpu(MIG_3G, MIG_1G, MIG_1G), mig_gpu(MIG_1G_ME), A100), LabelConfig(mig_strategy="mixed")
    )
    assert out["nvidia.com/mig.strategy"] == "mixed"
    expected = {
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",  # resource.go:103 model, "MIG", profile
        "nvidia.com/mig-1g.10gb.count": "2",
        "nvidia.com/mig-1g.10gb.replicas": "1",
        "nvidia.com/mig-1g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.10gb.memory": "9728",  # nvml-mig-device.go:26 attributes.MemorySizeMB
        "nvidia.com/mig-1g.10gb.multiprocessors": "14",
        "nvidia.com/mig-1g.10gb.slices.gi": "1",
        "nvidia.com/mig-1g.10gb.slices.ci": "1",
        "nvidia.com/mig-1g.10gb.engines.copy": "1",
        "nvidia.com/mig-1g.10gb.engines.decoder": "0",
        "nvidia.com/mig-1g.10gb.engines.encoder": "0",
        "nvidia.com/mig-1g.10gb.engines.jpeg": "0",
        "nvidia.com/mig-1g.10gb.engines.ofa": "0",
    }
    assert {k: out.get(k) for k in expected} == expected
    assert len([k for k in out if k.startswith("nvidia.com/mig-")]) == 3 * len(expected)  # three profiles
    assert (
        out["nvidia.com/mig-1g.10gb.me.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb.me"
    )  # nvml-mig-device.go:87
    assert out["nvidia.com/mig-1g.10gb.me.engines.ofa"] == "1"
    assert out["nvidia.com/mig-3g.40gb.count"] == "1"
    assert out["nvidia.com/gpu.count"] == "3"  # the full-GPU labels stay (mig-strategy.go:71-74)


def test_mixed_strategy_shares_a_mig_resource_named_in_the_config() -> None:
    """A time-slicing entry for nvidia.com/mig-1g.10gb shares that MIG resource (resource.go:240-250)."""
    view = sharing("timeSlicing: {resources: [{name: mig-1g.10gb, replicas: 3}]}")
    out = labels(gpus(mig_gpu(MIG_1G, MIG_3G)), LabelConfig(mig_strategy="mixed", sharing=view))
    assert out["nvidia.com/mig-1g.10gb.replicas"] == "3"
    assert out["nvidia.com/mig-1g.10gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"
    assert out["nvidia.com/mig-3g.40gb.replicas"] == "1"


def test_single_strategy_overloads_nvidia_com_gpu() -> None:
    """single with one profile everywhere: nvidia.com/gpu.* describes the MIG devices (mig-strategy.go:182-242)."""
    out = labels(gpus(mig_gpu(MIG_1G, MIG_1G), mig_gpu(MIG_1G)), LabelConfig(mig_strategy="single"))
    assert out["nvidia.com/mig.strategy"] == "single"
    assert out["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    assert out["nvidia.com/gpu.count"] == "3"
    assert out["nvidia.com/gpu.memory"] == "9728"  # the MIG device's, over the GPU's
    assert out["nvidia.com/gpu.multiprocessors"] == "14"
    assert out["nvidia.com/gpu.replicas"] == "1"
    assert out["nvidia.com/gpu.family"] == "ampere"  # from the full-GPU labels underneath


@pytest.mark.parametrize(
    "node",
    [
        gpus(mig_gpu(MIG_1G), mig_gpu()),  # mig-strategy.go:198 a MIG-enabled GPU with no MIG device
        gpus(mig_gpu(MIG_1G), A100),  # mig-strategy.go:207 MIG-enabled and disabled GPUs
        gpus(mig_gpu(MIG_1G, MIG_3G)),  # mig-strategy.go:237 more than one profile
    ],
)
def test_single_strategy_invalid_layouts(node: NodeFacts) -> None:
    """A node that does not fit single gets the -MIG-INVALID labels: count, replicas, memory 0, empty strategy."""
    out = labels(node, LabelConfig(mig_strategy="single"))
    assert {
        k: out[k]
        for k in ("product", "count", "replicas", "sharing-strategy", "memory")
        for k in [f"nvidia.com/gpu.{k}"]
    } == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-INVALID",  # mig-strategy.go:256
        "nvidia.com/gpu.count": "0",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "",  # mig-strategy.go:260 an empty value
        "nvidia.com/gpu.memory": "0",
    }


def test_single_strategy_without_mig_is_the_none_strategy_plus_its_label() -> None:
    """No MIG-enabled GPU under single: the full-GPU labels and mig.strategy=single (mig-strategy.go:189-191)."""
    plain = labels(gpus(A100, A100))
    single = labels(gpus(A100, A100), LabelConfig(mig_strategy="single"))
    assert single == {**plain, "nvidia.com/mig.strategy": "single"}


def test_several_models_resolve_deterministically() -> None:
    """Two models: GFD's order is Go's map order; here the later model (by first GPU index) wins, every time."""
    l4 = GpuFacts(0, "NVIDIA L4", 23034, (8, 9), mig_capable=False, mig_enabled=False, pci_class=PCI_CLASS_3D)
    out = labels(gpus(A100, l4, A100))
    assert (out["nvidia.com/gpu.product"], out["nvidia.com/gpu.count"]) == ("NVIDIA-L4", "1")
    assert labels(gpus(A100, l4, A100)) == out


@pytest.mark.parametrize(
    ("classes", "mode"),
    [((PCI_CLASS_3D,), "compute"), ((PCI_CLASS_VGA, PCI_CLASS_VGA), "graphics"), ((PCI_CLASS_VGA, PCI_CLASS_3D), "unknown"),
     ((PCI_CLASS_3D, None), "unknown"), ((None,), "unknown")],
)  # fmt: skip
def test_gpu_mode_from_pci_classes(classes: tuple[int | None, ...], mode: str) -> None:
    """gpu.mode: one class for all GPUs, VGA graphics, 3D compute; mixed or unreadable unknown (nvml.go:215-246)."""
    node = gpus(*[dataclasses.replace(A100, pci_class=c) for c in classes])
    assert labels(node)["nvidia.com/gpu.mode"] == mode


def test_clique_needs_one_cluster_and_one_clique() -> None:
    """gpu.clique is <cluster>.<clique> when every attached GPU agrees, else absent (imex.go:29-83)."""
    fab = FabricClique("7b968a6d-c8aa-45e1-9e07-e1e51be99c31", "1")
    attached = dataclasses.replace(A100, fabric=fab)
    assert labels(gpus(attached, A100))["nvidia.com/gpu.clique"] == "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"
    other = dataclasses.replace(A100, fabric=dataclasses.replace(fab, clique_id="2"))
    assert "nvidia.com/gpu.clique" not in labels(gpus(attached, other))  # imex.go:72 cliques non-unique
    assert "nvidia.com/gpu.clique" not in labels(gpus(A100))


def test_vgpu_labels() -> None:
    """vgpu.present, and the host driver of the last vGPU device (vgpu.go:46-56); none when the scan failed."""
    devices = (VgpuDevice("535.129", "r535_00"), VgpuDevice("550.54", "r550_00"))
    out = labels(gpus(A100), vgpu=devices)
    assert out["nvidia.com/vgpu.present"] == "true"
    assert (out["nvidia.com/vgpu.host-driver-version"], out["nvidia.com/vgpu.host-driver-branch"]) == (
        "550.54",
        "r550_00",
    )
    assert labels(gpus(A100))["nvidia.com/vgpu.present"] == "false"
    assert not any(k.startswith("nvidia.com/vgpu.") for k in labels(gpus(A100), vgpu=None))  # vgpu.go:42-44


def test_no_gpu_gives_only_timestamp_and_vgpu() -> None:
    """No device: no device label at all, not even machine or versions (nvml.go:49-51), timestamp and vGPU stay."""
    assert labels(NodeFacts(), timestamp=1700000000) == {
        "nvidia.com/gfd.timestamp": "1700000000",  # timestamp.go:34
        "nvidia.com/vgpu.present": "false",
    }


def test_timestamp_only_when_asked() -> None:
    """gfd.timestamp is the given time in seconds; None (--no-timestamp) leaves it out (timestamp.go:29-37)."""
    assert labels(gpus(A100), timestamp=1234)["nvidia.com/gfd.timestamp"] == "1234"
    assert "nvidia.com/gfd.timestamp" not in labels(gpus(A100))


def test_unknown_mig_strategy_fails() -> None:
    """A MIG strategy GFD does not know fails the labelling (mig-strategy.go:101-102)."""
    with pytest.raises(LabelError, match="unknown strategy: bogus"):
        labels(gpus(A100), LabelConfig(mig_strategy="bogus"))


def test_render_is_sorted_key_value_lines() -> None:
    """The file format: one key=value a line, sorted, newline-terminated (output.go:105-113, order aside)."""
    assert render({"b": "2", "a": "", "c.d": "x=y"}) == "a=\nb=2\nc.d=x=y\n"
