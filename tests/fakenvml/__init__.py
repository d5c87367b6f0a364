"""The project's fake libnvidia-ml: build it, describe a node to it, fault it at run time.

The C sources beside this file (README.md says what they are) make a `libnvidia-ml.so.1` that the
unmodified `nvidia-ml-py` binding loads with its ordinary dlopen when its directory is first on
`LD_LIBRARY_PATH`. It is compiled from source by the tests (`build`), against NVIDIA's own `nvml.h`
from the `nvidia-nvml-dev` package, so every struct is laid out as the driver's.

- `node_text(spec)` is the flat node file the library reads at its first call (`FAKENVML_NODE`):
  the Python simulator's own answers for the node `spec` describes, recorded through the
  simulator's NVML functions, so the two doubles describe one node and cannot drift apart.
- `Control` appends fault commands to the control file (`FAKENVML_CONTROL`) while a process runs;
  its methods have the names and arguments of the simulator's fault injection.
- `FakeNode` puts both in a temp dir; `environ` makes the environment of a process that loads the
  library; `child_report` runs the NVML adapter in such a process; `real_node` a whole supervisor.
- `profiles()` names every node the tier covers: the simulator's built-in profiles and NVIDIA's
  mock NVML profiles in `../shared/mocknvml/configs` (read by the simulator's own loader).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml

from supervisor.node.facts import FabricInfo
from supervisor.node.nvml import text
from supervisor.sim.nvml import Simulator, list_profiles, load_simulator
from supervisor.sim.nvml.config import NodeSpec, load_spec
from tests.harness import SimNode
from tests.helpers import REPO

HERE = Path(__file__).resolve().parent
SONAME = "libnvidia-ml.so.1"
HEADER_PACKAGE = "nvidia-nvml-dev"
CFLAGS = [
    "-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-fvisibility=hidden",
    "-DNVML_NO_UNVERSIONED_FUNC_DEFS", f"-Wl,-soname,{SONAME}", "-Wl,--no-undefined",
]  # fmt: skip
# NVIDIA's mock NVML node profiles: beside the checkout (../shared), or named by the environment.
MOCK_DIR = Path(os.environ.get("GPUVISOR_MOCKNVML_DIR") or Path(REPO).parent / "shared" / "mocknvml")
MOCK_CONFIGS = MOCK_DIR / "configs"


# ------------------------------------------------------------------ building


class BuildError(RuntimeError):
    """The library did not compile: the compiler's own words."""


def sources() -> list[Path]:
    return sorted([*HERE.glob("*.c"), *HERE.glob("*.h")])


def header_dir() -> Path | None:
    """The directory of NVIDIA's nvml.h from the nvidia-nvml-dev package, None where it is missing."""
    try:
        files = importlib.metadata.files(HEADER_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "nvml.h":
            return Path(str(f.locate())).parent
    return None


def compiler() -> str | None:
    """The system C compiler: $CC, else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def skip_reason() -> str | None:
    """Why the library cannot be built here, or None when it can."""
    if compiler() is None:
        return "no C compiler to build the fake libnvidia-ml (cc, gcc or clang on PATH, or $CC)"
    if header_dir() is None:
        return f"NVIDIA's nvml.h is missing: install the test extras ({HEADER_PACKAGE})"
    return None


def source_hash() -> str:
    """What the library is built from: the sources, NVIDIA's header and the flags."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    headers = header_dir()
    for path in [*sources(), *([headers / "nvml.h"] if headers else [])]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build(dest: str | Path) -> Path:
    """Compile the library into `dest` (made if needed) as libnvidia-ml.so.1; returns `dest`."""
    cc, headers = compiler(), header_dir()
    if cc is None or headers is None:
        raise BuildError(skip_reason() or "cannot build")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / SONAME
    c_files = [str(p) for p in sources() if p.suffix == ".c"]
    proc = subprocess.run(
        [cc, *CFLAGS, f"-I{headers}", "-o", str(out), *c_files, "-lpthread"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BuildError(f"{cc} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return dest


@contextmanager
def built() -> Iterator[Path]:
    """A temp dir holding the library, built once for this block; removed after it. The name
    carries the source hash, so two runs of different sources side by side never share one."""
    path = tempfile.mkdtemp(prefix=f"gv-fakenvml-{source_hash()[:12]}-")
    try:
        yield build(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ the nodes


def mock_profiles() -> list[str]:
    """NVIDIA's mock profiles present (`a100`, `h100`, ...), from mock-nvml-config-<p>.yaml."""
    if not MOCK_CONFIGS.is_dir():
        return []
    names = (p.name for p in MOCK_CONFIGS.iterdir())
    return sorted(
        n[len("mock-nvml-config-") : -len(".yaml")]
        for n in names
        if re.fullmatch(r"mock-nvml-config-.+\.yaml", n)
    )


def profiles() -> list[str]:
    """Every node the tier covers: the simulator's built-ins, then NVIDIA's mock profiles."""
    return [*list_profiles(), *mock_profiles()]


def mock_config(profile: str) -> Path:
    return MOCK_CONFIGS / f"mock-nvml-config-{profile}.yaml"


def spec_for(profile: str | NodeSpec) -> NodeSpec:
    """The node a profile name (a built-in or NVIDIA's), a description file or a spec describes."""
    if isinstance(profile, NodeSpec):
        return profile
    if profile in list_profiles():
        return load_simulator(profile).spec
    if profile in mock_profiles():
        return load_spec(mock_config(profile))
    return load_spec(profile)


def _ignore(fn: Any, *args: Any) -> Any:
    """The simulator's answer, or None where it answers NotSupported (the library then answers so too)."""
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def _pci(info: Any) -> str:
    fields = (info.domain, info.bus, info.device, info.pciDeviceId, info.pciSubSystemId)
    return " ".join(str(int(f)) for f in fields) + f" {text(info.busId)} {text(info.busIdLegacy)}"


def node_text(profile: str | NodeSpec) -> str:
    """The library's node file for a node: the simulator's answers, recorded through its NVML
    functions (faults at start go in as such, after recording the node without them)."""
    spec = spec_for(profile)
    clean = dataclasses.replace(
        spec, lost=frozenset(), pending_retirement=frozenset(), remapped_rows_pending=frozenset()
    )
    sim = Simulator(clean)
    sim.nvmlInit()
    out = [
        "fakenvml 1",
        f"# {spec.name}: recorded from the simulator's answers for {spec.source}",
        f"driver {sim.nvmlSystemGetDriverVersion()}",
        f"nvml {sim.nvmlSystemGetNVMLVersion()}",
        f"cuda {sim.nvmlSystemGetCudaDriverVersion()}",
    ]
    count = sim.nvmlDeviceGetCount()
    handles = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    for i, h in enumerate(handles):
        out += _gpu_lines(sim, spec, i, h)
    for a in range(count):
        for b in range(a + 1, count):
            out.append(
                f"ancestor {a} {b} {int(sim.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))}"
            )
    return "\n".join(out) + "\n"


def _gpu_lines(sim: Simulator, spec: NodeSpec, i: int, h: Any) -> list[str]:
    gspec = spec.gpus[i]
    pci = sim.nvmlDeviceGetPciInfo_v3(h)
    ext = pynvml.nvmlPciInfoExt_v1_t()
    ext.version = pynvml.nvmlPciInfoExt_v1
    sim.nvmlDeviceGetPciInfoExt(h, ctypes.byref(ext))
    mem = sim.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    major, minor = sim.nvmlDeviceGetCudaComputeCapability(h)
    a = sim.nvmlDeviceGetAttributes_v2(h)
    out = [
        f"gpu {i}",
        f"uuid {sim.nvmlDeviceGetUUID(h)}",
        f"name {sim.nvmlDeviceGetName(h)}",
        f"brand {sim.nvmlDeviceGetBrand(h)}",
        f"arch {sim.nvmlDeviceGetArchitecture(h)}",
        f"minor {sim.nvmlDeviceGetMinorNumber(h)}",
        f"pci {pci.domain} {pci.bus} {pci.device} {pci.pciDeviceId} {pci.pciSubSystemId}"
        f" {ext.baseClass} {ext.subClass} {text(pci.busId)} {text(pci.busIdLegacy)}",
        f"memory {mem.total} {mem.reserved} {mem.free} {mem.used}",
        f"cc {major} {minor}",
        f"attrs {_attrs(a)}",
        f"events {sim.nvmlDeviceGetSupportedEventTypes(h)}",
        f"computemode {sim.nvmlDeviceGetComputeMode(h)}",
    ]
    numa = _ignore(sim.nvmlDeviceGetNumaNodeId, h)
    if numa is not None:
        out.append(f"numa {numa}")
    addressing = _ignore(sim.nvmlDeviceGetAddressingMode, h)
    if addressing is not None:
        out.append(f"addressing {addressing}")
    out.append(
        f"retired-pages-supported {int(_ignore(sim.nvmlDeviceGetRetiredPagesPendingStatus, h) is not None)}"
    )
    rows = _ignore(sim.nvmlDeviceGetRemappedRows, h)
    out.append(f"remapped-rows-supported {int(rows is not None)}")
    if rows is not None:
        out.append(f"rows {rows[0]} {rows[1]}")
    fabric = FabricInfo()
    if _ignore(sim.nvmlDeviceGetGpuFabricInfo, h, ctypes.byref(fabric)) is not None:
        uuid_hex = bytes(fabric.clusterUuid).hex()
        out.append(f"fabric {fabric.status} {fabric.cliqueId} {fabric.state} {uuid_hex}")
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        if _ignore(sim.nvmlDeviceGetNvLinkState, h, link) is None:
            break
        kind = sim.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
        remote = sim.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
        out.append(f"link {'gpu' if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU else 'switch'} {_pci(remote)}")
    out += _mig_lines(sim, gspec, h)
    faults = {
        "lost": spec.lost,
        "pending-retirement": spec.pending_retirement,
        "remapped-rows-pending": spec.remapped_rows_pending,
    }
    out += [f"fault {name}" for name, uuids in faults.items() if gspec.uuid in uuids]
    return out


def _attrs(a: Any) -> str:
    fields = (
        a.multiprocessorCount, a.sharedCopyEngineCount, a.sharedDecoderCount, a.sharedEncoderCount,
        a.sharedJpegCount, a.sharedOfaCount, a.gpuInstanceSliceCount, a.computeInstanceSliceCount,
        a.memorySizeMB,
    )  # fmt: skip
    return " ".join(str(int(f)) for f in fields)


def _mig_lines(sim: Simulator, gspec: Any, h: Any) -> list[str]:
    mode = _ignore(sim.nvmlDeviceGetMigMode, h)
    if mode is None:
        return ["mig 0 0 0"]
    enabled = int(mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE
    most = sim.nvmlDeviceGetMaxMigDeviceCount(h)
    out = [f"mig 1 {int(enabled)} {most}"]
    catalogue = gspec.catalogue or {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = _ignore(sim.nvmlDeviceGetGpuInstanceProfileInfo, h, enum, 2)
        if info is None:
            continue
        name = text(info.name)
        table = catalogue[name.removeprefix("MIG ")]  # placements are not an NVML answer of the simulator
        fields = (
            enum, info.id, info.isP2pSupported, info.sliceCount, info.instanceCount, info.multiprocessorCount,
            info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount,
            info.memorySizeMB, table.memory_slices,
        )  # fmt: skip
        starts = ",".join(str(s) for s in table.starts)
        out.append(f"giprofile {' '.join(str(int(f)) for f in fields)} {starts} {name}")
    for j in range(most if enabled else 0):
        try:
            mh = sim.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
        except pynvml.NVMLError_NotFound:
            continue
        gi = sim.nvmlDeviceGetGpuInstanceId(mh)
        info = sim.nvmlGpuInstanceGetInfo(sim.nvmlDeviceGetGpuInstanceById(h, gi))
        out.append(
            f"migdev {gi} {sim.nvmlDeviceGetComputeInstanceId(mh)} {info.profileId} {info.placement.start}"
            f" {info.placement.size} {_attrs(sim.nvmlDeviceGetAttributes_v2(mh))}"
            f" {sim.nvmlDeviceGetMemoryInfo(mh).total} {sim.nvmlDeviceGetUUID(mh)} {sim.nvmlDeviceGetName(mh)}"
        )
    return out


# ------------------------------------------------------------------ faults at run time


class Control:
    """The control file of a running library: each method appends one command, which the library
    reads at its next NVML call (an event wait blocked meanwhile wakes for it). Names and
    arguments are the simulator's fault injection (supervisor/sim/nvml/faults.py)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.write_bytes(b"")  # a new log: nothing for a process that starts now to replay

    def send(self, line: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode())  # one write: the library never reads half a line
        finally:
            os.close(fd)

    def inject_xid(
        self, uuid: str, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None
    ) -> None:
        ids = "" if gpu_instance is None else f" {gpu_instance} {compute_instance or 0}"
        self.send(f"xid {uuid} {int(xid)}{ids}")

    def inject_ecc(
        self,
        uuid: str,
        kind: str = "double",
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
    ) -> None:
        if kind not in ("single", "double"):
            raise ValueError(f"ECC kind must be 'single' or 'double', got {kind!r}")
        ids = "" if gpu_instance is None else f" {gpu_instance} {compute_instance or 0}"
        self.send(f"ecc {uuid} {kind}{ids}")

    def lose(self, uuid: str) -> None:
        self.send(f"lose {uuid}")

    def restore(self, uuid: str) -> None:
        self.send(f"restore {uuid}")

    def reset(self, uuid: str) -> None:
        self.send(f"reset {uuid}")

    def set_processes(self, uuid: str, count: int) -> None:
        """How many processes run on a GPU or MIG device (the simulator's `set_processes`)."""
        self.send(f"processes {uuid} {int(count)}")

    def set_pending_retirement(self, uuid: str, pending: bool = True) -> None:
        self.send(f"pending-retirement {uuid} {int(pending)}")

    def set_remapped_rows_pending(self, uuid: str, pending: bool = True) -> None:
        self.send(f"remapped-rows-pending {uuid} {int(pending)}")

    def set_row_remap_failure(self, uuid: str, failed: bool = True) -> None:
        self.send(f"row-remap-failure {uuid} {int(failed)}")

    def fail(self, function_name: str, error_code: int, count: int | None = None) -> None:
        """Make an NVML function fail with `error_code` (`count` times, or until cleared)."""
        self.send(f"fail {function_name} {int(error_code)}" + ("" if count is None else f" {int(count)}"))

    def fail_init(self, error_code: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED) -> None:
        """Every nvmlInit variant fails (by default: the driver is not loaded) until cleared."""
        for name in ("nvmlInitWithFlags", "nvmlInit_v2", "nvmlInit"):
            self.fail(name, error_code)

    def clear_failures(self, function_name: str | None = None) -> None:
        self.send("clear" + ("" if function_name is None else f" {function_name}"))


class FakeNode:
    """A node for the library in a directory: its node file and control file."""

    def __init__(self, directory: str | Path, profile: str | NodeSpec) -> None:
        self.spec = spec_for(profile)
        self.dir = Path(directory)
        self.node_file = self.dir / "node.fakenvml"
        self.node_file.write_text(node_text(self.spec))
        self.control = Control(self.dir / "control")

    def environ(self, libdir: str | Path, **kwargs: Any) -> dict[str, str]:
        return environ(libdir, self.node_file, self.control.path, **kwargs)

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.spec.gpus]


def environ(
    libdir: str | Path | None,
    node_file: str | Path | None = None,
    control: str | Path | None = None,
    base: dict[str, str] | None = None,
    pythonpath: Sequence[str] = (),
) -> dict[str, str]:
    """The environment of a process that loads the library in `libdir` (None: no library at all)
    over `node_file`, faulted through `control`. GPUVISOR_*, DP_* and FAKENVML_* variables of the
    calling environment are left out, so a test sees only what it sets; `pythonpath` goes before
    the checkout on PYTHONPATH (e.g. a directory holding an older `pynvml`), and what the calling
    environment's PYTHONPATH held comes after it (packages carried beside the checkout, as on a
    GPU machine)."""
    calling = os.environ if base is None else base
    env = {k: v for k, v in calling.items() if not k.startswith(("GPUVISOR_", "DP_", "FAKENVML_"))}
    if libdir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(libdir), env.get("LD_LIBRARY_PATH", "")) if p
        )
    inherited = [p for p in calling.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO]
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, REPO, *inherited])
    if node_file is not None:
        env["FAKENVML_NODE"] = str(node_file)
    if control is not None:
        env["FAKENVML_CONTROL"] = str(control)
    return env


def child_report(env: dict[str, str], *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run the adapter in a child process (`tests.fakenvml.child *args`) with `env`; returns its
    JSON report, with the child's stderr under "stderr"."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fakenvml.child", *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"adapter child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    report["stderr"] = proc.stderr
    return report


class NvmlFailure(Exception):
    """The binding raised NVMLError in the driver process: `code` is the NVML return code."""

    def __init__(self, expression: str, code: int) -> None:
        super().__init__(f"{expression} -> NVML error {code}")
        self.code = code


class Driver:
    """The real binding in a child process (`tests/fakenvml/driver.py`), called one expression at
    a time, so a test can fault the library between two calls of one process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakenvml.driver"], env=env, cwd=REPO, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.stderr = ""
        self._pending = ""

    def start(self, expression: str) -> None:
        """Send `expression` without waiting for its answer (`answer` reads it): to fault the
        library while the call is in flight, e.g. during a blocked event wait."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(expression.replace("\n", " ") + "\n")
        self.proc.stdin.flush()
        self._pending = expression

    def eval(self, expression: str, timeout: float = 30) -> Any:
        """The value of `expression` in the driver; NvmlFailure when NVML answered an error."""
        self.start(expression)
        return self.answer(timeout)

    def answer(self, timeout: float = 30) -> Any:
        """The answer to the expression last sent."""
        assert self.proc.stdout is not None
        expression = self._pending
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"the driver gave no answer to {expression!r}:\n{self.stderr[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        if "nvml" in answer:
            raise NvmlFailure(expression, int(answer["nvml"]))
        return answer["ok"]

    def code(self, expression: str | None = None, timeout: float = 30) -> int:
        """0 when `expression` succeeds, else the NVML return code it failed with; with no
        expression, the same for the one `start` sent."""
        try:
            if expression is None:
                self.answer(timeout)
            else:
                self.eval(expression, timeout)
        except NvmlFailure as exc:
            return exc.code
        return 0

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # only the driver this object started
                self.proc.wait(10)
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.stderr = self.proc.stderr.read()
            self.proc.stderr.close()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def real_node(env: dict[str, str], args: Sequence[str] = ()) -> SimNode:
    """A supervisor on real NVML (no --simulate) in the environment `env` (from `environ`)."""
    return SimNode(None, args=args, env=env)


# ------------------------------------------------------------------ the oldest binding

BINDING = "nvidia-ml-py"


def binding_floor() -> str:
    """The oldest nvidia-ml-py the project accepts: the `>=` bound in pyproject.toml."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    for dep in deps:
        match = re.fullmatch(rf"{re.escape(BINDING)}\s*>=\s*([0-9][0-9.]*)", dep.strip())
        if match:
            return match.group(1)
    raise LookupError(f"pyproject.toml has no '{BINDING}>=' dependency")


def install_binding(version: str, dest: str) -> str:
    """`pip install --no-deps --target dest nvidia-ml-py==version` (a single module, ~40 KB);
    returns `dest`, to go first on PYTHONPATH. Raises RuntimeError with pip's output on failure."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
         "--target", dest, f"{BINDING}=={version}"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if proc.returncode != 0 or not os.path.isfile(os.path.join(dest, "pynvml.py")):
        raise RuntimeError(f"pip could not install {BINDING}=={version}: {proc.stderr.strip()[-2000:]}")
    return dest
