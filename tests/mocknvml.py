"""NVIDIA's mock libnvidia-ml (`../shared/mocknvml`) for the tests that run the real binding.

The mock is a C shared library with the real NVML API, so the unmodified `nvidia-ml-py`
binding loads it with its ordinary dlopen of `libnvidia-ml.so.1` when its directory is on
`LD_LIBRARY_PATH`. Both the library path and the profile (`MOCK_NVML_CONFIG`) are read when the
process starts and the library loads: one profile per process, so tests run the binding in a
child process (`python -c ...`, `gpuvisor run`) with `environ(...)`.

The library is unpacked once per test session into a temp dir that the session removes
(`unpacked`); `child_report` runs the adapter over it in a child, `real_node` a whole supervisor.

Beside that: what a profile file says the node is (`expected_node`, read straight from the YAML,
independently of the code under test), the sysfs tree the mock's own `render-pci-sysfs` would
make from it (`render_sysfs`), fault injection at run time (`write_overrides`, `overrides_file`),
and the oldest `nvidia-ml-py` the project accepts (`binding_floor`, `install_binding`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml

from tests.harness import SimNode
from tests.helpers import REPO

LIB_NAME = "libnvidia-ml.so.550.163.01"
SONAME = "libnvidia-ml.so.1"
# Where the harness is: beside the checkout (../shared), or named by the environment.
MOCK_DIR = os.environ.get("GPUVISOR_MOCKNVML_DIR") or os.path.join(
    os.path.dirname(REPO), "shared", "mocknvml"
)
CONFIG_DIR = os.path.join(MOCK_DIR, "configs")


def skip_reason() -> str | None:
    """Why the mock tier cannot run here, or None when it can."""
    archive = os.path.join(MOCK_DIR, LIB_NAME + ".xz")
    if not os.path.isfile(archive):
        return f"NVIDIA's mock NVML is not here ({archive} is missing; set GPUVISOR_MOCKNVML_DIR)"
    return None


def _have_lzma() -> bool:
    try:
        import lzma  # noqa: F401 - a Python built without liblzma has no lzma module
    except ImportError:
        return False
    return True


def profiles() -> list[str]:
    """The node profiles the mock ships: `a100`, `h100`, ... (from `mock-nvml-config-<p>.yaml`)."""
    names = []
    for entry in sorted(os.listdir(CONFIG_DIR)):
        if entry.startswith("mock-nvml-config-") and entry.endswith(".yaml"):
            names.append(entry[len("mock-nvml-config-") : -len(".yaml")])
    return names


def config_path(profile: str) -> str:
    path = os.path.join(CONFIG_DIR, f"mock-nvml-config-{profile}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no mock NVML profile {profile!r} (known: {', '.join(profiles())})")
    return path


def unpack(dest: str) -> str:
    """Unpack the library into `dest` (made if needed) with its soname link; returns `dest`."""
    os.makedirs(dest, exist_ok=True)
    target = os.path.join(dest, LIB_NAME)
    if not os.path.exists(target):
        tmp = target + ".part"
        archive = os.path.join(MOCK_DIR, LIB_NAME + ".xz")
        if _have_lzma():
            import lzma

            with lzma.open(archive) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        else:  # the xz tool (xz-utils, which .ci/run installs) does the same
            with open(tmp, "wb") as out:
                subprocess.run(["xz", "-dc", archive], stdout=out, check=True, timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    link = os.path.join(dest, SONAME)
    if not os.path.lexists(link):
        os.symlink(LIB_NAME, link)
    return dest


@contextmanager
def unpacked(prefix: str = "gv-mocknvml-") -> Iterator[str]:
    """A temp dir holding the unpacked library (see `unpack`), removed after the block.

    Made with `tempfile`, not pytest's tmp_path_factory: see tests/conftest.py for why."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield unpack(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def environ(
    libdir: str,
    profile: str | None = None,
    overrides: str | None = None,
    overrides_ttl: str = "100ms",
    base: dict[str, str] | None = None,
    pythonpath: Sequence[str] = (),
) -> dict[str, str]:
    """An environment whose processes load the mock with `profile` (None: the mock's default node).

    `overrides` names a YAML file that the mock re-reads every `overrides_ttl` and merges over the
    profile (fault injection at run time; see the mock's README). GPUVISOR_* and DP_* variables of
    the calling environment are left out, so a test sees only what it sets. `pythonpath` goes
    before the checkout on PYTHONPATH (e.g. a directory holding an older `pynvml`).
    """
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("GPUVISOR_", "DP_", "MOCK_NVML_"))
    }
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, REPO])
    if profile is not None:
        env["MOCK_NVML_CONFIG"] = config_path(profile)
    if overrides is not None:
        env["MOCK_NVML_OVERRIDES"] = overrides
        env["MOCK_NVML_OVERRIDES_TTL"] = overrides_ttl
    return env


def child_report(env: dict[str, str], *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run the adapter in a child process (`tests.mocknvml_child *args`) with `env`; returns its
    JSON report, with the child's stderr under "stderr"."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.mocknvml_child", *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"adapter child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    report["stderr"] = proc.stderr
    return report


def real_node(libdir: str, profile: str | None, args: Sequence[str] = (), **env: Any) -> SimNode:
    """A supervisor on real NVML (no --simulate): the mock in `libdir` with `profile`; `env` are
    `environ`'s keywords (overrides, pythonpath, ...)."""
    return SimNode(None, args=args, env=environ(libdir, profile, **env))


# ------------------------------------------------------------------ what a profile describes

MIB = 1024 * 1024


@dataclass(frozen=True)
class ExpectedGpu:
    index: int
    uuid: str
    bus_id: str  # as the profile writes it: "0000:07:00.0"
    numa_node: int | None
    name: str
    memory_mib: int
    minor: int
    compute_capability: tuple[int, int]


@dataclass(frozen=True)
class ExpectedNode:
    profile: str
    gpus: tuple[ExpectedGpu, ...]
    driver_version: str
    cuda_driver_version: int  # NVML's encoding: major * 1000 + minor * 10
    nvlinks_per_pair: int  # NVLinks between any two GPUs (all pairs alike in NVIDIA's profiles)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_profile(profile: str) -> dict[str, Any]:
    with open(config_path(profile), encoding="utf-8") as fh:
        data: dict[str, Any] = yaml.safe_load(fh)
    return data


def expected_node(profile: str) -> ExpectedNode:
    """The node as the profile file describes it, read with the mock's own rules: a device entry
    is merged over `device_defaults`; a device's NUMA node is its `pcie_topology` root complex's
    (the mock's `nvmlDeviceGetNumaNodeId` and its sysfs renderer agree); NVLinks exist only through
    the declared NVSwitches (`links_per_gpu` links per GPU, each reaching every peer), since none
    of NVIDIA's profiles lists per-device links (a profile that does is refused here, not guessed)."""
    data = load_profile(profile)
    system = data["system"]
    numa = {
        dev.lower(): int(rc["numa_node"])
        for rc in (data.get("pcie_topology") or {}).get("root_complexes", [])
        for dev in rc.get("devices", [])
    }
    gpus = []
    for entry in data["devices"]:
        dev = _merge(data.get("device_defaults") or {}, entry)
        if "nvlink" in entry or "nvlinks" in entry:
            raise ValueError(f"profile {profile}: per-device NVLinks are not modelled by this helper")
        bus_id = str(dev["pci"]["bus_id"])
        cc = dev["compute_capability"]
        gpus.append(
            ExpectedGpu(
                index=int(dev["index"]),
                uuid=str(dev["uuid"]),
                bus_id=bus_id,
                numa_node=numa.get(bus_id.lower()),
                name=str(dev["name"]),
                memory_mib=int(dev["memory"]["total_bytes"]) // MIB,
                minor=int(dev["minor_number"]),
                compute_capability=(int(cc["major"]), int(cc["minor"])),
            )
        )
    nvlink = data.get("nvlink") or {}
    per_pair = int(nvlink.get("links_per_gpu") or 0) if nvlink.get("switches") else 0
    return ExpectedNode(
        profile=profile,
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        driver_version=str(system["driver_version"]),
        cuda_driver_version=int(system["cuda_version_major"]) * 1000 + int(system["cuda_version_minor"]) * 10,
        nvlinks_per_pair=per_pair,
    )


def render_sysfs(profile: str, root: str) -> str:
    """Write `<root>/bus/pci/devices/<bdf>/numa_node` for every device of the profile's
    `pcie_topology`, as the mock's `render-pci-sysfs` does on a node; returns `root`."""
    for rc in (load_profile(profile).get("pcie_topology") or {}).get("root_complexes", []):
        for bdf in rc.get("devices", []):
            path = os.path.join(root, "bus", "pci", "devices", str(bdf).lower())
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "numa_node"), "w", encoding="utf-8") as fh:
                fh.write(f"{int(rc['numa_node'])}\n")
    return root


# ------------------------------------------------------------------ faults at run time


def write_overrides(path: str, devices: Mapping[int, Mapping[str, Any]] | None = None) -> None:
    """Replace the override file atomically (the mock re-reads it every TTL): `devices` maps a GPU
    index to what is merged over its profile entry, e.g. `{2: {"failure": {"mode": "lost"}}}`.
    None or {} clears every override."""
    doc: dict[str, Any] = {"version": 1}
    if devices:
        doc["devices"] = {str(index): dict(spec) for index, spec in devices.items()}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        yaml.safe_dump(doc, fh)
    os.replace(tmp, path)


def overrides_file(directory: str, devices: Mapping[int, Mapping[str, Any]] | None = None) -> str:
    """`<directory>/overrides.yaml`, written with `devices` (None: no fault); returns its path."""
    path = os.path.join(directory, "overrides.yaml")
    write_overrides(path, devices)
    return path


def xid_fault(xid: int) -> dict[str, Any]:
    """An XID delivered through the event set; the GPU stays addressable (NVIDIA's ecc_uncorrectable
    mode, whose uncorrectable error also shows as a failed row remapping)."""
    return {"failure": {"mode": "ecc_uncorrectable", "xid": {"code": xid}}}


LOST: dict[str, Any] = {"failure": {"mode": "lost"}}
FELL_OFF_BUS: dict[str, Any] = {"failure": {"mode": "fallen_off_bus", "xid": {"code": 79}}}


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
