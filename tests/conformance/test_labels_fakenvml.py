"""`gpuvisor labels` over the real NVML binding and the fake libnvidia-ml, against GFD's own output.

`../shared/gfd-golden/` holds what GFD v0.20.0 wrote on NVIDIA's mock NVML for the a100 and h100
profiles and four configs, with the exact command line (its README). Here `gpuvisor labels` runs as
a child process with that command line over the project's fake library describing the same
profiles (read from `../shared/mocknvml/configs` by the simulator's loader); the file must hold the
same set of lines. For profiles without a golden, the expected lines come from GFD's rules and the
profile file (`expected_lines`, each line traced); the same derivation is checked against the a100
and h100 goldens first, so it is GFD's view.

One difference from NVIDIA's mock is deliberate: that mock answered nvmlDeviceGetMigMode on every
GPU, the L40S and T4 too, so GFD wrote `mig.capable=true` there; the fake library answers it only
where the profile gives the GPU MIG instances (`mig.max_gpu_instances` > 0), as those GPUs do.

The whole matrix runs as parallel child processes once per module (a few seconds).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import fakenvml
from tests.fakenvml import FakeNode
from tests.helpers import REPO, wait_until
from tests.labelsrun import labels_argv, labels_env, start_labels

GOLDEN_DIR = Path(os.environ.get("GPUVISOR_GFD_GOLDEN_DIR") or fakenvml.MOCK_DIR.parent / "gfd-golden")
# The configs of the golden README's table.
CONFIGS = {
    "none": None,
    "ts4": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    "mps2": "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
    "mig-mixed": "version: v1\nflags:\n  migStrategy: mixed\n",
}
PROCESS_TIMEOUT = 60.0


@dataclass(frozen=True)
class MockProfile:
    """What GFD reads from one mock profile (configs/mock-nvml-config-<name>.yaml, line numbers)."""

    driver: str  # system.driver_version (line 11)
    cuda: tuple[int, int]  # system.cuda_version_major / _minor (lines 14-15): nvmlSystemGetCudaDriverVersion
    product: str  # device_defaults.name (line 24), sanitised (lm/resource.go:318)
    memory_mib: int  # device_defaults.memory.total_bytes / 2^20
    compute: tuple[int, int]  # device_defaults.compute_capability
    family: str  # lm/resource.go:285 getArchFamily of `compute`
    count: int  # entries under devices:
    clique: str | None  # device_defaults.fabric: cluster_uuid "." clique_id (state auto -> completed)
    mig_capable: bool  # device_defaults.mig.max_gpu_instances > 0


PROFILES = {
    # name "NVIDIA A100-SXM4-40GB", 42949672960 bytes, 8.0, no fabric block (line 380: A100 predates it)
    "a100": MockProfile("550.163.01", (12, 4), "NVIDIA-A100-SXM4-40GB", 40960, (8, 0), "ampere", 8, None, True),
    # name "NVIDIA H100 80GB HBM3", 85899345920 bytes, 9.0, fabric lines 46-47
    "h100": MockProfile("550.163.01", (12, 4), "NVIDIA-H100-80GB-HBM3", 81920, (9, 0), "hopper", 8,
                        "00000000-0000-0000-0000-000000000001.0", True),
    # name "NVIDIA B200", 206158430208 bytes, 10.0, standalone: no fabric (line 385)
    "b200": MockProfile("560.35.03", (12, 6), "NVIDIA-B200", 196608, (10, 0), "blackwell", 8, None, True),
    # name "NVIDIA GB200", 206158430208 bytes, 10.0, fabric lines 46-47, CUDA 13.0
    "gb200": MockProfile("580.65.06", (13, 0), "NVIDIA-GB200", 196608, (10, 0), "blackwell", 8,
                         "00000000-0000-0000-0000-000000000001.0", True),
    # name "NVIDIA GB300 NVL" (the blank becomes "-"), 309237645312 bytes, 10.0, fabric lines 47-48
    "gb300": MockProfile("570.124.06", (12, 8), "NVIDIA-GB300-NVL", 294912, (10, 0), "blackwell", 8,
                         "00000000-0000-0000-0000-000000000001.0", True),
    # name "NVIDIA L40S", 51539607552 bytes, 8.9 (lm/resource.go:305: ada-lovelace), max_gpu_instances 0
    "l40s": MockProfile("550.163.01", (12, 4), "NVIDIA-L40S", 49152, (8, 9), "ada-lovelace", 8, None, False),
    # name "NVIDIA T4", 17179869184 bytes, 7.5 (lm/resource.go:300: turing), 4 devices, max_gpu_instances 0
    "t4": MockProfile("550.163.01", (12, 4), "NVIDIA-T4", 16384, (7, 5), "turing", 4, None, False),
}  # fmt: skip


def expected_lines(profile: MockProfile, config: str) -> set[str]:
    """GFD's lines for a mock profile and one of CONFIGS, by GFD's rules."""
    major, minor, rev = profile.driver.split(".")
    cuda = f"{profile.cuda[0]}.{profile.cuda[1]}"
    labels = {
        # lm/nvml.go:125-141: the driver version split, the CUDA version as nvml-lib.go:28-29 splits it
        "cuda.driver.major": major, "cuda.driver.minor": minor, "cuda.driver.rev": rev,
        "cuda.driver-version.major": major, "cuda.driver-version.minor": minor,
        "cuda.driver-version.revision": rev, "cuda.driver-version.full": profile.driver,
        "cuda.runtime.major": str(profile.cuda[0]), "cuda.runtime.minor": str(profile.cuda[1]),
        "cuda.runtime-version.major": str(profile.cuda[0]), "cuda.runtime-version.minor": str(profile.cuda[1]),
        "cuda.runtime-version.full": cuda,
        "gpu.compute.major": str(profile.compute[0]), "gpu.compute.minor": str(profile.compute[1]),
        "gpu.count": str(profile.count),  # lm/mig-strategy.go:144 one per device of the model
        "gpu.family": profile.family,
        "gpu.machine": "unknown",  # lm/machine-type.go:34-35: the machine-type file does not exist
        "gpu.memory": str(profile.memory_mib),
        # lm/nvml.go:217-219: no sysfs entry for the mock's bus ids on this host -> unknown
        "gpu.mode": "unknown",
        "gpu.product": profile.product,
        "gpu.replicas": "1",  # lm/resource.go:214
        "gpu.sharing-strategy": "none",
        # lm/nvml.go:161-168: true when nvmlDeviceGetMigMode answers (the module docstring says where)
        "mig.capable": "true" if profile.mig_capable else "false",
        "mps.capable": "false",  # lm/nvml.go:177: not MPS sharing
        "vgpu.present": "false",  # lm/vgpu.go:47: no NVIDIA PCI device in this host's sysfs
    }  # fmt: skip
    if profile.clique is not None:
        labels["gpu.clique"] = profile.clique  # lm/imex.go:38-40
    if config == "ts4":  # lm/resource.go:160-206: 4 replicas, time-slicing, -SHARED
        labels.update(
            {
                "gpu.replicas": "4",
                "gpu.sharing-strategy": "time-slicing",
                "gpu.product": profile.product + "-SHARED",
            }
        )
    elif config == "mps2":  # lm/nvml.go:189-191: no MIG-enabled GPU, MPS-capable
        labels.update(
            {
                "gpu.replicas": "2",
                "gpu.sharing-strategy": "mps",
                "gpu.product": profile.product + "-SHARED",
                "mps.capable": "true",
            }
        )
    elif config == "mig-mixed":  # lm/strategy.go:25; NVIDIA's profiles have no MIG device to label
        labels["mig.strategy"] = "mixed"
    return {f"nvidia.com/{k}={v}" for k, v in labels.items()}


def _host_has_nvidia_pci() -> bool:
    root = Path("/sys/bus/pci/devices")
    try:
        return any((d / "vendor").read_text().strip() == "0x10de" for d in root.iterdir())
    except OSError:
        return False


def _child_env(libdir: Path, fake: FakeNode) -> dict[str, str]:
    return fake.environ(libdir, base=labels_env())  # only what the golden command line sets


def _argv(config: Path | None, output: Path, machine_type: Path) -> list[str]:
    # The golden README's command line, word for word.
    args = [
        "--oneshot",
        "--no-timestamp",
        "--use-node-feature-api=false",
        "--machine-type-file",
        str(machine_type),
    ]
    if config is not None:
        args += ["--config-file", str(config)]
    return labels_argv(*args, "--output-file", str(output))


@pytest.fixture(scope="module")
def outputs(
    fake_nvml_libdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], tuple[int, str, str]]:
    """(profile, config) -> (exit status, output file text, stderr) for every profile and config."""
    if not fakenvml.mock_profiles():
        pytest.skip(
            f"NVIDIA's mock NVML profiles are not here ({fakenvml.MOCK_CONFIGS}; set GPUVISOR_MOCKNVML_DIR)"
        )
    if _host_has_nvidia_pci():
        pytest.skip("this host has NVIDIA PCI devices: the expected gpu.mode and vgpu.present assume none")
    base_dir = tmp_path_factory.mktemp("gfd")
    results: dict[tuple[str, str], tuple[int, str, str]] = {}
    jobs = []
    for profile in fakenvml.mock_profiles():
        base = base_dir / profile
        base.mkdir()
        fake = FakeNode(base, profile)
        for config, text in CONFIGS.items():
            work = base / config
            work.mkdir()
            config_path = None
            if text is not None:
                config_path = work / "config.yaml"
                config_path.write_text(text)
            argv = _argv(config_path, work / "gfd", work / "no-such-machine-type-file")
            jobs.append(((profile, config), work, argv, _child_env(fake_nvml_libdir, fake)))
    running: list[tuple[tuple[str, str], Path, subprocess.Popen[str]]] = []
    while jobs or running:
        while jobs and len(running) < 4:
            key, work, argv, env = jobs.pop(0)
            proc = subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            running.append((key, work, proc))
        key, work, proc = running.pop(0)
        try:
            _, err = proc.communicate(timeout=PROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        out = (work / "gfd").read_text() if (work / "gfd").exists() else ""
        results[key] = (proc.returncode, out, err)
    return results


CASES = [(p, c) for p in PROFILES for c in CONFIGS]


@pytest.mark.parametrize(("profile", "config"), CASES)
def test_labels_over_the_mock_match_gfd(
    outputs: dict[tuple[str, str], tuple[int, str, str]], profile: str, config: str
) -> None:
    """The golden command line over a mock profile writes GFD's set of lines (its own golden where there is one)."""
    status, text, err = outputs[(profile, config)]
    assert status == 0, err
    lines = set(text.splitlines())
    assert len(lines) == len(text.splitlines()), "a label is written twice"
    assert lines == expected_lines(PROFILES[profile], config)
    golden = GOLDEN_DIR / f"{profile}-{config}.labels"
    if golden.exists():
        assert lines == set(golden.read_text().splitlines())


def test_goldens_are_all_covered() -> None:
    """Every golden file GFD wrote is one of the cases above, and every mock profile has expectations."""
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"no GFD goldens at {GOLDEN_DIR}")
    names = {p.name for p in GOLDEN_DIR.glob("*.labels")}
    assert names and names <= {f"{p}-{c}.labels" for p, c in CASES}
    if fakenvml.MOCK_CONFIGS.is_dir():
        assert set(fakenvml.mock_profiles()) == set(PROFILES)


def test_a_lost_gpu_mid_run_keeps_the_last_labels(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """A GPU lost after the first labelling: the error is logged, the file stays, and it is labelled
    again once the GPU answers."""
    fake = FakeNode(tmp_path, "dgx-a100")
    out, log = tmp_path / "gfd", tmp_path / "log"
    env = fake.environ(fake_nvml_libdir, base=labels_env())
    proc = start_labels("--no-timestamp", "--use-node-feature-api=false", "--sleep-interval=1s", "--machine-type-file", "",
                        "--output-file", str(out), "--log-level", "debug", log=log, env=env)  # fmt: skip
    try:
        assert wait_until(out.exists, timeout=30)
        first = out.read_text()
        fake.control.lose(fake.uuids[3])
        assert wait_until(lambda: "labelling failed" in log.read_text(), timeout=30), log.read_text()
        assert "GPU is lost" in log.read_text() and out.read_text() == first
        fake.control.restore(fake.uuids[3])
        mark = log.read_text().count("labels unchanged")
        assert wait_until(lambda: log.read_text().count("labels unchanged") > mark, timeout=30), (
            log.read_text()
        )
        assert out.read_text() == first
    finally:
        proc.terminate()
        status = proc.wait(timeout=30)
    assert status == 0
    assert not out.exists()  # a clean stop removes the file, as GFD does
