"""Golden label sets for every built-in simulator profile, sharing mode and MIG strategy.

The labels go the whole way `gpuvisor labels` takes them (settings from flags and a config file,
the simulator through the NVML adapter's `node_facts`, the rules), in-process. The expected sets
are written out by hand from the profiles (supervisor/sim/nvml/profiles/*.yaml) and GFD v0.20.0's
rules: `BASE` is each profile with no sharing and the `none` strategy, `SHARING` and `MIG` what a
sharing mode and a MIG strategy change, each value with the rule (GFD file:line) it follows.
Later entries overwrite earlier ones, as GFD merges its labelers (lm/mig-strategy.go:71-74:
full-GPU labels, then the MIG strategy's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.labels.daemon import Labeller
from supervisor.labels.rules import LabelError
from supervisor.labels.settings import load_label_settings
from tests.helpers import REPO

CUDA_550_54_15_12040 = {
    # lm/nvml.go:125-141 from the profiles' driver_version "550.54.15", cuda_driver_version 12040
    "nvidia.com/cuda.driver.major": "550",
    "nvidia.com/cuda.driver.minor": "54",
    "nvidia.com/cuda.driver.rev": "15",
    "nvidia.com/cuda.runtime.major": "12",  # resource/nvml-lib.go:28: 12040 / 1000
    "nvidia.com/cuda.runtime.minor": "4",  # nvml-lib.go:29: 12040 % 1000 / 10
    "nvidia.com/cuda.driver-version.major": "550",
    "nvidia.com/cuda.driver-version.minor": "54",
    "nvidia.com/cuda.driver-version.revision": "15",
    "nvidia.com/cuda.driver-version.full": "550.54.15",
    "nvidia.com/cuda.runtime-version.major": "12",
    "nvidia.com/cuda.runtime-version.minor": "4",
    "nvidia.com/cuda.runtime-version.full": "12.4",
}
COMMON = {
    **CUDA_550_54_15_12040,
    "nvidia.com/gpu.machine": "unknown",  # lm/machine-type.go:45: --machine-type-file "" -> unknown
    "nvidia.com/gpu.mode": "compute",  # lm/nvml.go:241: every GPU a 3D controller (the profiles' default pci_class)
    "nvidia.com/gpu.replicas": "1",  # lm/resource.go:214: no sharing entry for nvidia.com/gpu
    "nvidia.com/gpu.sharing-strategy": "none",  # lm/resource.go:162
    "nvidia.com/mps.capable": "false",  # lm/nvml.go:177-182: not MPS sharing
    "nvidia.com/vgpu.present": "false",  # lm/vgpu.go:47: a simulated node has no vGPU device
}
A100_80 = {
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",  # lm/resource.go:189: name "NVIDIA A100-SXM4-80GB" sanitised
    "nvidia.com/gpu.count": "8",  # lm/mig-strategy.go:134,144: 8 GPUs of that name
    "nvidia.com/gpu.memory": "81920",  # lm/resource.go:62: memory_mib 81920
    "nvidia.com/gpu.family": "ampere",  # lm/resource.go:303: compute capability 8.0
    "nvidia.com/gpu.compute.major": "8",
    "nvidia.com/gpu.compute.minor": "0",
    "nvidia.com/mig.capable": "true",  # lm/nvml.go:161: the A100 answers nvmlDeviceGetMigMode
}
BASE: dict[str, dict[str, str]] = {
    "dgx-h100": {
        **COMMON,
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",  # "NVIDIA H100 80GB HBM3", blanks -> "-"
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "81559",  # the profile's memory_mib
        "nvidia.com/gpu.family": "hopper",  # lm/resource.go:308: compute capability 9.0
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/mig.capable": "true",  # the H100 is MIG-capable
        # lm/imex.go:39: the profile's fabric (cluster 5b3ce1a2-..., clique 1) on every GPU
        "nvidia.com/gpu.clique": "5b3ce1a2-7d0e-4c4f-9a51-2f1d8e6c0b47.1",
    },
    "dgx-a100": {**COMMON, **A100_80},
    "pcie-l4": {
        **COMMON,
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.memory": "23034",
        "nvidia.com/gpu.family": "ada-lovelace",  # lm/resource.go:305: 8.9
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "9",
        "nvidia.com/mig.capable": "false",  # the L4 answers NotSupported to nvmlDeviceGetMigMode
    },
    # GPUs 0-3 MIG-enabled, 4-7 full: the full GPUs' labels overwrite the MIG-enabled ones of the
    # same model, and the count covers all eight (lm/mig-strategy.go:126-177).
    "mig-a100": {**COMMON, **A100_80},
}
PRODUCT = {p: BASE[p]["nvidia.com/gpu.product"] for p in BASE}

SHARING_CONFIG = {
    "none": "",
    "time-slicing": "timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}",
    "time-slicing-renamed": "timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 4}]}",
    "mps": "mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}",
}


def sharing_delta(profile: str, mode: str) -> dict[str, str]:
    """What a sharing mode changes in the full-GPU labels."""
    if mode == "none":
        return {}
    if mode == "time-slicing":
        return {
            "nvidia.com/gpu.replicas": "4",  # lm/resource.go:211: the entry's replicas
            "nvidia.com/gpu.sharing-strategy": "time-slicing",  # lm/resource.go:163-164: replicas > 1
            "nvidia.com/gpu.product": PRODUCT[profile] + "-SHARED",  # lm/resource.go:202: shared, not renamed
        }
    if mode == "time-slicing-renamed":
        return {
            "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "time-slicing",
            # renameByDefault: the resource is nvidia.com/gpu.shared, the product keeps its name
            # (api/config/v1/replicas.go:207-211, lm/resource.go:202 isRenamed)
        }
    return {
        "nvidia.com/gpu.replicas": "2",
        "nvidia.com/gpu.sharing-strategy": "mps",  # api/config/v1/sharing.go:37: MPS before time-slicing
        "nvidia.com/gpu.product": PRODUCT[profile] + "-SHARED",
        "nvidia.com/mps.capable": "true",  # lm/nvml.go:195-210: no MIG-enabled GPU
    }


MIG_A100_MIXED = {
    # lm/mig-strategy.go:266-297: one resource per profile on GPUs 0-3 (mig-a100.yaml), the count
    # over all GPUs, the attributes of its first device (lm/resource.go:76-108,
    # resource/nvml-mig-device.go:25-35); the simulator's A100 80GB catalogue gives the numbers.
}
for _name, _count, _mib, _sm, _slices, _ce, _dec, _jpeg, _ofa in (
    ("3g.40gb", 3, 40192, 42, 3, 3, 2, 0, 0),  # GPU 0: one, GPU 3: two
    ("2g.20gb", 4, 19968, 28, 2, 2, 1, 0, 0),  # GPU 0: one, GPU 1: three
    ("1g.10gb", 9, 9728, 14, 1, 1, 0, 0, 0),  # GPU 0: two, GPU 1: one, GPU 2: six
    ("1g.10gb.me", 1, 9728, 14, 1, 1, 1, 1, 1),  # GPU 2's 1g.10gb+me ("+" -> ".", nvml-mig-device.go:87)
):
    _key = f"nvidia.com/mig-{_name}"
    MIG_A100_MIXED.update({
        f"{_key}.product": f"NVIDIA-A100-SXM4-80GB-MIG-{_name}",  # lm/resource.go:103: model, "MIG", profile
        f"{_key}.count": str(_count),
        f"{_key}.replicas": "1",  # no sharing entry names a MIG resource
        f"{_key}.sharing-strategy": "none",
        f"{_key}.memory": str(_mib),
        f"{_key}.multiprocessors": str(_sm),
        f"{_key}.slices.gi": str(_slices),
        f"{_key}.slices.ci": str(_slices),  # one compute instance spans its GPU instance
        f"{_key}.engines.copy": str(_ce),
        f"{_key}.engines.decoder": str(_dec),
        f"{_key}.engines.encoder": "0",
        f"{_key}.engines.jpeg": str(_jpeg),
        f"{_key}.engines.ofa": str(_ofa),
    })  # fmt: skip


def mig_delta(profile: str, strategy: str) -> dict[str, str]:
    """What a MIG strategy adds to (or overwrites in) the labels above."""
    if strategy == "none":
        return {}  # lm/strategy.go:21: no mig.strategy label
    delta = {"nvidia.com/mig.strategy": strategy}  # lm/strategy.go:25
    if profile != "mig-a100":
        return delta  # no MIG-enabled GPU: mixed finds no MIG device, single is the none strategy (mig-strategy.go:189)
    if strategy == "mixed":
        return {**delta, **MIG_A100_MIXED}
    # single with MIG-enabled and full GPUs: the invalid labels (lm/mig-strategy.go:207-208, 244-264)
    return {
        **delta,
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-INVALID",  # no sharing: no -SHARED
        "nvidia.com/gpu.count": "0",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "",
        "nvidia.com/gpu.memory": "0",
    }


CASES = [(p, s, m) for p in BASE for s in SHARING_CONFIG for m in ("none", "single", "mixed")]


def compute(tmp_path: Path, profile: str, sharing: str, strategy: str) -> dict[str, str]:
    """The labels `gpuvisor labels` computes for `profile` (a built-in name or a description file, as
    --simulate takes), one of SHARING_CONFIG's configs (written to tmp_path) and a MIG strategy."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\n" + (f"sharing: {{{SHARING_CONFIG[sharing]}}}\n" if SHARING_CONFIG[sharing] else "")
    )
    flags = {
        "simulate": profile,
        "mig_strategy": strategy,
        "config_file": str(config),
        "no_timestamp": "true",
        "machine_type_file": "",
        "use_node_feature_api": "false",
        "output_file": str(tmp_path / "gfd"),
    }
    settings = load_label_settings(flags, {})
    labeller = Labeller(settings, lambda chosen: settings)
    labeller.apply(settings)
    return labeller.compute()


@pytest.mark.parametrize(("profile", "sharing", "strategy"), CASES)
def test_golden_labels(tmp_path: Path, profile: str, sharing: str, strategy: str) -> None:
    """The label set of a built-in profile under one sharing mode and MIG strategy is the golden one."""
    if profile == "mig-a100" and sharing == "mps":
        # lm/nvml.go:206-207: MPS sharing with a MIG-enabled GPU fails the whole labelling.
        with pytest.raises(LabelError, match="MPS sharing is not supported for mig devices"):
            compute(tmp_path, profile, sharing, strategy)
        return
    expected = {**BASE[profile], **sharing_delta(profile, sharing), **mig_delta(profile, strategy)}
    assert compute(tmp_path, profile, sharing, strategy) == expected


UNIFORM_MIG = (
    """
driver_version: "550.54.15"
gpus:
"""
    + "".join(
        f"""  - name: NVIDIA H100 80GB HBM3
    uuid: GPU-{i:08x}-0000-4000-8000-000000000000
    minor: {i}
    pci_bus_id: "0000:{0x18 + i:02x}:00.0"
    memory_mib: 81559
    compute_capability: [9, 0]
    mig: {{devices: [{{profile: 3g.40gb}}, {{profile: 3g.40gb}}]}}
"""
        for i in range(2)
    )
    + "topology: {default_ancestor: SYSTEM}\n"
)


def test_golden_single_strategy_on_a_uniform_mig_node(tmp_path: Path) -> None:
    """Two H100s, each split into two 3g.40gb: single overloads nvidia.com/gpu with the MIG devices."""
    node = tmp_path / "uniform.yaml"
    node.write_text(UNIFORM_MIG)
    out = compute(tmp_path, str(node), "none", "single")
    assert (
        {k: v for k, v in out.items() if k.startswith("nvidia.com/gpu.") or k.startswith("nvidia.com/mig")}
        == {
            "nvidia.com/mig.capable": "true",
            "nvidia.com/mig.strategy": "single",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb",  # lm/mig-strategy.go:228 named nvidia.com/gpu
            "nvidia.com/gpu.count": "4",  # four MIG devices
            "nvidia.com/gpu.replicas": "1",
            "nvidia.com/gpu.sharing-strategy": "none",
            "nvidia.com/gpu.memory": "40320",  # the simulator's H100 3g.40gb memory, over the GPU's
            "nvidia.com/gpu.multiprocessors": "60",
            "nvidia.com/gpu.slices.gi": "3",
            "nvidia.com/gpu.slices.ci": "3",
            "nvidia.com/gpu.engines.copy": "3",
            "nvidia.com/gpu.engines.decoder": "3",
            "nvidia.com/gpu.engines.encoder": "0",
            "nvidia.com/gpu.engines.jpeg": "3",
            "nvidia.com/gpu.engines.ofa": "0",
            # from the MIG-enabled GPUs' own labels underneath (no full GPU: replicas 0 there, overwritten)
            "nvidia.com/gpu.family": "hopper",
            "nvidia.com/gpu.compute.major": "9",
            "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/gpu.machine": "unknown",
            "nvidia.com/gpu.mode": "compute",
        }
    )


@pytest.mark.parametrize(
    ("profile", "strategy"),
    [("dgx-h100", "none"), ("dgx-a100", "none"), ("pcie-l4", "none"), ("mig-a100", "mixed")],
)
def test_documented_examples_are_current(tmp_path: Path, profile: str, strategy: str) -> None:
    """docs/node-labels.md's example output for each built-in profile is what `gpuvisor labels` writes for it."""
    page = (Path(REPO) / "docs" / "node-labels.md").read_text()
    block = page.split(f"<!-- labels-example:{profile} -->\n```text\n", 1)[1].split("```", 1)[0]
    shown = dict(line.split("=", 1) for line in block.splitlines())
    computed = compute(tmp_path, profile, "none", strategy)
    if profile != "dgx-h100":  # the page shows the CUDA lines once, with dgx-h100
        computed = {k: v for k, v in computed.items() if not k.startswith("nvidia.com/cuda.")}
    assert shown == computed
    assert block.splitlines() == sorted(block.splitlines())
