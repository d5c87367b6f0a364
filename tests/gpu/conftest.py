"""What the gpu tier needs of the machine, each found or skipped with the reason.

- `driver`: an NVIDIA driver and at least one GPU, as the driver's own tool reports them
  (`nvidia-smi --query-gpu`, independent of gpuvisor's NVML adapter, so discovery is checked
  against a second source). Skips where NVML cannot be initialised or nvidia-smi is missing.
- `cuda`: a way to run a CUDA program: CuPy in this Python (its kernel cache in a temp dir, not
  in $HOME), else `nvcc` to build two tiny programs in a temp dir. Skips where neither is there.
- `mps_control`: the driver's `nvidia-cuda-mps-control`. Skips where it is not on PATH.

Nothing here changes a GPU's settings (no MIG mode, compute mode, clocks or reset): the tier only
reads, runs CUDA programs as any user would, starts an MPS control daemon of its own in a temp
dir, which the supervisor quits when it stops, and (test_gpu_mig, only on a GPU whose MIG mode is
already enabled) creates one MIG instance and destroys it again.
"""

from __future__ import annotations

import csv
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import short_tmpdir

FIELDS = "index,uuid,name,memory.total,mig.mode.current,compute_cap,driver_version"

# A kernel that writes to an address no allocation holds: the MMU faults, the driver reports
# XID 31 (an application error) and the program gets cudaErrorIllegalAddress. The GPU is fine.
FAULT_KERNEL = r"""extern "C" __global__ void poke(int *out) { *(volatile int *)0x10 = 1; out[0] = 1; }"""
CLIENT_SUM = 499500  # sum(range(1000)), computed on the GPU by the client program

CUPY_FAULT = f"""
import cupy
kernel = cupy.RawKernel(r'''{FAULT_KERNEL}''', "poke")
out = cupy.zeros(1, dtype=cupy.int32)
kernel((1,), (1,), (out,))
cupy.cuda.Device().synchronize()
"""
CUPY_CLIENT = "import cupy; print(int(cupy.arange(1000).sum()))"

NVCC_FAULT = (
    "#include <cstdio>\n"
    + FAULT_KERNEL.replace('extern "C" ', "")
    + """
int main() {
    int *out; cudaMalloc(&out, sizeof(int));
    poke<<<1, 1>>>(out);
    cudaError_t e = cudaDeviceSynchronize();
    printf("%s\\n", cudaGetErrorString(e));
    return e == cudaSuccess ? 0 : 3;
}
"""
)
NVCC_CLIENT = """#include <cstdio>
__global__ void sum(long long *out) { long long s = 0; for (int i = 0; i < 1000; i++) s += i; *out = s; }
int main() {
    long long *d, h = 0; cudaMalloc(&d, sizeof(h));
    sum<<<1, 1>>>(d);
    if (cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) return 3;
    printf("%lld\\n", h);
    return 0;
}
"""


@dataclass(frozen=True)
class DriverGpu:
    """One GPU as nvidia-smi reports it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    mig_enabled: bool | None  # None: the GPU cannot do MIG ("[N/A]")
    compute_capability: tuple[int, int]
    driver_version: str


@dataclass(frozen=True)
class Cuda:
    """Runs the tier's two CUDA programs: one that faults, one that computes a sum."""

    fault_argv: tuple[str, ...]
    client_argv: tuple[str, ...]
    how: str
    env: tuple[tuple[str, str], ...] = ()  # set for every run (CuPy's kernel cache in a temp dir)

    def run(
        self, argv: tuple[str, ...], env: Mapping[str, str], timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            env={**env, **dict(self.env)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture(scope="session")
def driver() -> list[DriverGpu]:
    """Every GPU the driver reports; skips without a driver, a GPU or nvidia-smi."""
    import pynvml

    # The test's own fake libnvidia-ml (tests/fakenvml) must never stand in for the driver here:
    # once loaded into this process, its soname would answer pynvml's dlopen.
    with open("/proc/self/maps", encoding="utf-8") as fh:
        fake = [line.split()[-1] for line in fh if "gv-fakenvml-" in line]
    assert not fake, f"the fake libnvidia-ml is loaded into the test process: {fake[0]}"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver here: nvmlInit failed: {exc}")
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip("the NVIDIA driver reports no GPU")
    finally:
        pynvml.nvmlShutdown()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not on PATH: nothing to check discovery against")
    out = subprocess.run(
        [smi, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    gpus = []
    for row in csv.reader(out.strip().splitlines(), skipinitialspace=True):
        index, uuid, name, memory, mig, cap, version = (field.strip() for field in row)
        major, minor = cap.split(".")
        gpus.append(
            DriverGpu(
                index=int(index),
                uuid=uuid,
                name=name,
                memory_mib=int(memory),
                mig_enabled=None if mig.startswith("[") else mig == "Enabled",
                compute_capability=(int(major), int(minor)),
                driver_version=version,
            )
        )
    return gpus


@pytest.fixture(scope="session")
def cuda() -> Iterator[Cuda]:
    """The tier's CUDA programs, through CuPy if this Python has it, else built with nvcc."""
    if importlib.util.find_spec("cupy") is not None:
        with short_tmpdir("gvcupy") as cache:  # CuPy caches compiled kernels: not in $HOME
            yield Cuda(
                (sys.executable, "-c", CUPY_FAULT),
                (sys.executable, "-c", CUPY_CLIENT),
                "cupy",
                env=(("CUPY_CACHE_DIR", cache),),
            )
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("neither CuPy nor nvcc is here: no way to run a CUDA program")
    with short_tmpdir("gvcuda") as tmp:
        programs = []
        for name, source in (("fault", NVCC_FAULT), ("client", NVCC_CLIENT)):
            (Path(tmp) / f"{name}.cu").write_text(source)
            subprocess.run(
                [nvcc, "-o", f"{tmp}/{name}", f"{tmp}/{name}.cu"],
                check=True,
                capture_output=True,
                timeout=300,
            )
            programs.append((f"{tmp}/{name}",))
        yield Cuda(programs[0], programs[1], "nvcc")


@pytest.fixture(scope="session")
def mps_control() -> str:
    """The driver's MPS control binary; skips where it is not on PATH."""
    path = shutil.which("nvidia-cuda-mps-control")
    if path is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    return path
