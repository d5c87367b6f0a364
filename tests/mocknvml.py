"""NVIDIA's mock libnvidia-ml (`../shared/mocknvml`) for the tests that run the real binding.

The mock is a C shared library with the real NVML API, so the unmodified `nvidia-ml-py`
binding loads it with its ordinary dlopen of `libnvidia-ml.so.1` when its directory is on
`LD_LIBRARY_PATH`. Both the library path and the profile (`MOCK_NVML_CONFIG`) are read when the
process starts and the library loads: one profile per process, so tests run the binding in a
child process (`python -c ...`, `gpuvisor run`) with `environ(...)`.

The library is unpacked once per test session into a temp dir that the session removes.
"""

from __future__ import annotations

import lzma
import os
import shutil

from tests.helpers import REPO

LIB_NAME = "libnvidia-ml.so.550.163.01"
SONAME = "libnvidia-ml.so.1"
# Where the harness is: beside the checkout (../shared), or named by the environment.
MOCK_DIR = os.environ.get("GPUVISOR_MOCKNVML_DIR") or os.path.join(os.path.dirname(REPO), "shared", "mocknvml")
CONFIG_DIR = os.path.join(MOCK_DIR, "configs")


def skip_reason() -> str | None:
    """Why the mock tier cannot run here, or None when it can."""
    archive = os.path.join(MOCK_DIR, LIB_NAME + ".xz")
    if not os.path.isfile(archive):
        return f"NVIDIA's mock NVML is not here ({archive} is missing; set GPUVISOR_MOCKNVML_DIR)"
    return None


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
        with lzma.open(os.path.join(MOCK_DIR, LIB_NAME + ".xz")) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    link = os.path.join(dest, SONAME)
    if not os.path.lexists(link):
        os.symlink(LIB_NAME, link)
    return dest


def environ(
    libdir: str,
    profile: str | None = None,
    overrides: str | None = None,
    overrides_ttl: str = "100ms",
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """An environment whose processes load the mock with `profile` (None: the mock's default node).

    `overrides` names a YAML file that the mock re-reads every `overrides_ttl` and merges over the
    profile (fault injection at run time; see the mock's README). GPUVISOR_* and DP_* variables of
    the calling environment are left out, so a test sees only what it sets.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(("GPUVISOR_", "DP_", "MOCK_NVML_"))}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONPATH"] = REPO
    if profile is not None:
        env["MOCK_NVML_CONFIG"] = config_path(profile)
    if overrides is not None:
        env["MOCK_NVML_OVERRIDES"] = overrides
        env["MOCK_NVML_OVERRIDES_TTL"] = overrides_ttl
    return env
