"""The driver's files a CUDA container needs, found under the driver root by NVIDIA's rules.

The rules are those of NVIDIA's container toolkit v1.19.1 (the version NVIDIA's DRA driver
v0.4.1 and device plugin v0.20.0 build with; `nvcdi` in "nvml" mode):

- the driver version is the suffix of the first `libcuda.so.*.*` (else `libnvidia-ml.so.*.*`)
  in the library dirs below, links resolved (internal/lookup/root/root.go `inferVersion`; the
  toolkit asks NVML first, and NVML's version names the same file), and the driver's library
  dir (`NVIDIA_CTK_LIBCUDA_DIR`) is that file's directory;
- the libraries are every `*.so.<version>` in that dir and its `vdpau/` subdir, links resolved
  (pkg/nvcdi/driver-nvml.go `getVersionLibs`);
- the binaries are the first executable of each name in `$PATH` and the standard bin dirs under
  the root (`newDriverBinariesDiscoverer`, pkg/lookup/executable.go, path.go);
- the GSP firmware is `nvidia/<version>/gsp*.bin` under the firmware search dirs
  (`newDriverFirmwareDiscoverer`);
- the IPC sockets are the persistenced and fabric manager sockets under /run or /var/run, and
  /tmp/nvidia-mps (internal/discover/ipc.go; the toolkit's file locator takes files only, so an
  MPS pipe *directory* is never mounted there either);
- every file becomes a bind mount at its path below the root, read-only for files
  (`ro,nosuid,nodev,rbind,rprivate`, internal/discover/mounts.go), and without `ro` but with
  `noexec` for sockets;
- the createContainer hooks (internal/discover/symlinks.go, compat_libs.go, ldconfig.go,
  hooks.go): `create-symlinks` (libcuda.so, libGLX_indirect.so.0 and libnvidia-opticalflow.so
  links, and each library's SONAME and `.so` links where the host has them as links),
  `enable-cuda-compat --host-driver-version=<version>`, `update-ldcache --folder <dir>...`,
  `disable-device-node-modification`; only where the hook binary is present.

What gpuvisor leaves out: the graphics files (EGL/Vulkan/X11 configs and their links) and the
ld.so.cache fallback the toolkit uses when a library is in none of the standard dirs. Symlinks
are resolved inside the root (an absolute link target is taken below the root, as the runtime
that mounts the files sees them), where the toolkit's EvalSymlinks would leave the root.

Bounded: at most MAX_FILES matches per pattern, paths of at most MAX_PATH characters, at most
MAX_LINK_HOPS links followed per path, and an ELF file's SONAME read from at most MAX_ELF_READ
bytes. Both roles use this: the supervisor for the device plugin's node-wide CDI spec, the DRA
worker for each claim's.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.devnodes import CONTROL_DEVICES, host_path

log = logging.getLogger("gpuvisor.cdi")

MAX_FILES = 1024  # matches of one pattern (a driver has about 60 versioned libraries)
MAX_PATH = 4096  # PATH_MAX
MAX_LINK_HOPS = 40  # the kernel's own limit on links in one lookup
MAX_ELF_READ = 1 << 20  # bytes read from one library to find its SONAME

# pkg/lookup/library.go: NewLibraryLocator's default search paths, in order.
LIBRARY_DIRS = (
    "/",
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
)
# pkg/lookup/path.go: the dirs searched after $PATH's.
DEFAULT_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# pkg/nvcdi/driver-nvml.go: newDriverBinariesDiscoverer.
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
SOCKET_DIRS = ("/run", "/var/run")
SOCKETS = ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket")
MPS_PIPE_DIR = "/tmp/nvidia-mps"
FIRMWARE_CLASS_PATH = "/sys/module/firmware_class/parameters/path"
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_OPTIONS = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
# The hook binaries, the toolkit's default first (internal/discover/hooks.go).
HOOK_BINARIES = ("/usr/bin/nvidia-cdi-hook", "/usr/bin/nvidia-ctk")
HOOK_ENV = "NVIDIA_CTK_DEBUG=false"
LIBCUDA_DIR_ENV = "NVIDIA_CTK_LIBCUDA_DIR"


@dataclass(frozen=True)
class DriverFiles:
    """What was found: the version, the library dir (a path in the container), the CDI mounts,
    hooks and env of the spec-wide edits (JSON-ready), and why nothing was found ("" if found)."""

    version: str = ""
    lib_dir: str = ""
    mounts: tuple[dict[str, Any], ...] = ()
    hooks: tuple[dict[str, Any], ...] = ()
    env: tuple[str, ...] = ()
    missing: str = ""


# --- paths inside a root --------------------------------------------------------------------------


def _join(root: str, path: str) -> str:
    return host_path(root, path)


def resolve(root: str, path: str) -> str | None:
    """`path` (absolute, as the container sees it) with every link resolved inside `root`; None if
    it does not exist, loops, or passes the bounds."""
    parts = [p for p in path.split("/") if p]
    done = "/"
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            done = posixpath.dirname(done)
            continue
        candidate = posixpath.join(done, part)
        if len(candidate) > MAX_PATH:
            return None
        real = _join(root, candidate)
        try:
            mode = os.lstat(real).st_mode
        except OSError:
            return None
        if not stat.S_ISLNK(mode):
            done = candidate
            continue
        hops += 1
        if hops > MAX_LINK_HOPS:
            return None
        try:
            target = os.readlink(real)
        except OSError:
            return None
        if len(target) > MAX_PATH:
            return None
        if target.startswith("/"):
            done = "/"
        parts = [p for p in target.split("/") if p] + parts
    return done


def _glob(root: str, directory: str, pattern: str) -> list[str]:
    """Names in `<root><directory>` matching `pattern` (a glob without "/"), sorted as Go's Glob
    sorts them, at most MAX_FILES; container paths."""
    try:
        with os.scandir(_join(root, directory)) as entries:
            names = sorted(e.name for e in entries if fnmatch.fnmatchcase(e.name, pattern))
    except OSError:
        return []
    return [posixpath.join(directory, n) for n in names[:MAX_FILES]]


def _is_file(root: str, path: str) -> bool:
    try:
        return not stat.S_ISDIR(os.stat(_join(root, path)).st_mode)  # the toolkit's assertFile
    except OSError:
        return False


def _is_executable(root: str, path: str) -> bool:
    try:
        st = os.stat(_join(root, path))
    except OSError:
        return False
    return not stat.S_ISDIR(st.st_mode) and bool(st.st_mode & 0o111)


def _locate_libraries(root: str, dirs: Sequence[str], pattern: str) -> list[str]:
    """The toolkit's symlink locator: each match in each dir, links resolved, first seen kept."""
    found: list[str] = []
    for directory in dirs:
        for candidate in _glob(root, directory, pattern):
            if not _is_file(root, candidate):
                continue
            target = resolve(root, candidate)
            if target is not None and target not in found:
                found.append(target)
            if len(found) >= MAX_FILES:
                return found
    return found


# --- ELF SONAME ---------------------------------------------------------------------------------

_SHT_DYNAMIC = 6
_DT_SONAME = 14


def read_soname(path: str) -> str | None:
    """The DT_SONAME of an ELF shared object, as Go's elf.DynString reads it (the SHT_DYNAMIC
    section and the string table it links to); None when the file is no ELF or is malformed; the
    file's base name when it has no SONAME (as the toolkit's getSoname answers). Reads the header,
    the section headers and those two sections only, each bounded by MAX_ELF_READ."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return _soname(lambda size, at: os.pread(fd, min(size, MAX_ELF_READ), at), posixpath.basename(path))
    except (OSError, struct.error, IndexError, UnicodeDecodeError, ValueError):
        return None
    finally:
        os.close(fd)


def _soname(read: Callable[[int, int], bytes], basename: str) -> str | None:
    head = read(64, 0)
    if head[:4] != b"\x7fELF" or len(head) < 52:
        return None
    wide = head[4] == 2
    order = "<" if head[5] == 1 else ">"
    if wide:
        (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
        section, entry = order + "IIQQQQIIQQ", order + "qQ"
    else:
        (shoff,) = struct.unpack_from(order + "I", head, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x2E)
        section, entry = order + "IIIIIIIIII", order + "iI"
    if shnum > 4096 or shentsize < struct.calcsize(section):
        return None
    table = read(shnum * shentsize, shoff)
    headers = [struct.unpack_from(section, table, i * shentsize) for i in range(shnum)]
    dynamic = next((h for h in headers if h[1] == _SHT_DYNAMIC), None)
    if dynamic is None:
        return None
    data = read(dynamic[5], dynamic[4])
    strtab = headers[dynamic[6]]
    step = struct.calcsize(entry)
    for at in range(0, len(data) - step + 1, step):
        tag, value = struct.unpack_from(entry, data, at)
        if tag == 0:
            break
        if tag == _DT_SONAME:
            if value >= strtab[5]:
                return None
            text = read(min(strtab[5] - value, MAX_PATH), strtab[4] + value)
            return text[: text.index(b"\0")].decode()
    return basename


# --- the parts ---------------------------------------------------------------------------------


def _mount(host_root: str, path: str, options: Sequence[str]) -> dict[str, Any]:
    return {"hostPath": _join(host_root, path), "containerPath": path, "options": list(options)}


def _binaries(root: str, search_path: str) -> list[str]:
    dirs = [d for d in search_path.split(":") if d]
    dirs += [d for d in DEFAULT_PATH if d not in dirs]
    found: list[str] = []
    for name in BINARIES:
        for directory in dirs[:64]:
            if not directory.startswith("/"):
                continue
            candidate = posixpath.join(directory, name)
            if _is_executable(root, candidate):
                if candidate not in found:
                    found.append(candidate)
                break
    return found


def firmware_dirs(release: str, custom: str) -> list[str]:
    """The firmware search dirs (pkg/nvcdi/driver-nvml.go getFirmwareSearchPaths)."""
    standard = [
        posixpath.join("/lib/firmware/updates/", release),
        "/lib/firmware/updates/",
        posixpath.join("/lib/firmware/", release),
        "/lib/firmware/",
    ]
    return [custom, *standard] if custom else standard


def _read_custom_firmware_path() -> str:
    try:
        with open(FIRMWARE_CLASS_PATH, encoding="utf-8") as handle:
            return handle.read(MAX_PATH).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _sockets(root: str) -> list[str]:
    found: list[str] = []
    for name in SOCKETS:
        for directory in SOCKET_DIRS:
            candidate = directory + name
            if _is_file(root, candidate):
                found.append(candidate)
                break
    if _is_file(root, MPS_PIPE_DIR):  # the toolkit's file locator: a directory is never taken
        found.append(MPS_PIPE_DIR)
    return found


def _is_link(root: str, path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(_join(root, path)).st_mode)
    except OSError:
        return False


def _so_link(name: str) -> str:
    """`libfoo.so.1.2` -> `libfoo.so` (the toolkit's getSoLink); "" when no `.so` part."""
    while True:
        stem, ext = posixpath.splitext(name)
        if not ext:
            return ""
        if ext == ".so":
            return name
        name = stem


def _links(root: str, libraries: Sequence[str], version: str) -> list[str]:
    """The create-symlinks hook's `target::link` pairs for the libraries (symlinks.go)."""
    pattern = "." + (version or "*.*")
    links: list[str] = []

    def add(link: str) -> None:
        if link not in links:
            links.append(link)

    for path in libraries:
        directory, name = posixpath.split(path)
        if fnmatch.fnmatchcase(name, "libcuda.so" + pattern):
            add(f"libcuda.so.1::{posixpath.join(directory, 'libcuda.so')}")
        elif fnmatch.fnmatchcase(name, "libGLX_nvidia.so" + pattern):
            add(f"{name}::{posixpath.join(directory, 'libGLX_indirect.so.0')}")
        elif fnmatch.fnmatchcase(name, "libnvidia-opticalflow.so" + pattern):
            add(f"libnvidia-opticalflow.so.1::{posixpath.join(directory, 'libnvidia-opticalflow.so')}")
        if not fnmatch.fnmatchcase(name, "*" + pattern):
            continue
        soname = read_soname(_join(root, path))
        if soname is None:
            log.debug("no SONAME read from %s", _join(root, path))
            continue
        if soname != name and _is_link(root, posixpath.join(directory, soname)):
            add(f"{name}::{posixpath.join(directory, soname)}")
        target = soname or name
        so_link = _so_link(target)
        if so_link and so_link != target and _is_link(root, posixpath.join(directory, so_link)):
            add(f"{target}::{posixpath.join(directory, so_link)}")
    return links


def find_hook(root: str, configured: str) -> str | None:
    """The hook binary the spec names (a host path): the configured one, else the toolkit's
    default, else nvidia-ctk, whichever is an executable file, looked for under the driver root
    as this process reads it and at the path itself; None: no hooks."""
    for candidate in dict.fromkeys(p for p in (configured, *HOOK_BINARIES) if p.startswith("/")):
        if _is_executable(root, candidate) or _is_executable("/", candidate):
            return candidate
    return None


def hook(binary: str, name: str, *args: str) -> dict[str, Any]:
    """One createContainer hook as the toolkit writes it (`nvidia-ctk hook <name>` or
    `nvidia-cdi-hook <name>`)."""
    base = posixpath.basename(binary)
    fixed = [base, "hook"] if base == "nvidia-ctk" else [base]
    return {"hookName": "createContainer", "path": binary, "args": [*fixed, name, *args], "env": [HOOK_ENV]}


def _hooks(binary: str, libraries: Sequence[str], links: Sequence[str], version: str) -> list[dict[str, Any]]:
    hooks: list[dict[str, Any]] = []
    if links:
        hooks.append(hook(binary, "create-symlinks", *[a for link in links for a in ("--link", link)]))
    hooks.append(hook(binary, "enable-cuda-compat", f"--host-driver-version={version}"))
    folders = list(dict.fromkeys(posixpath.dirname(p) for p in libraries if _is_lib_name(p)))
    hooks.append(hook(binary, "update-ldcache", *[a for f in folders for a in ("--folder", f)]))
    hooks.append(hook(binary, "disable-device-node-modification"))
    return hooks


def _is_lib_name(path: str) -> bool:
    """ldconfig.go isLibName: `lib?*.so` or `lib?*.so.<...>`."""
    base = posixpath.basename(path)
    if not fnmatch.fnmatchcase(base, "lib?*.so*"):
        return False
    last = base.split(".so")[-1]
    return last == "" or last.startswith(".")


def readable_root(driver_root: str, ctr_root: str) -> str:
    """Where this process reads the driver root: `ctr_root` (NVIDIA's container driver root,
    `/driver-root`) when that is a directory, else the driver root itself (a process on the host)."""
    return ctr_root if ctr_root and os.path.isdir(ctr_root) else driver_root


def discover(
    root: str,
    *,
    version: str = "",
    host_root: str | None = None,
    hook_path: str = "",
    search_path: str | None = None,
    release: str | None = None,
    custom_firmware: Callable[[], str] = _read_custom_firmware_path,
) -> DriverFiles:
    """The driver's files under `root` (where this process reads the driver root), with host paths
    under `host_root` (the driver root as the container runtime sees it; default `root`).
    `version`: NVML's driver version, whose libcuda.so.<version> is then the one looked for (as
    the toolkit does); "" infers it from the first libcuda.so.*.* found."""
    host = root if host_root is None else host_root
    suffix, lib_path = version or "*.*", None
    for prefix in ("libcuda.so.", "libnvidia-ml.so."):
        located = _locate_libraries(root, LIBRARY_DIRS, prefix + suffix)
        if located:
            lib_path, version = located[0], posixpath.basename(located[0])[len(prefix) :]
            break
    if lib_path is None or not version:
        return DriverFiles(
            missing=f"no libcuda.so.{suffix} nor libnvidia-ml.so.{suffix} in the library dirs under {root}"
        )
    lib_dir = posixpath.dirname(lib_path)
    libraries = _locate_libraries(root, (lib_dir, posixpath.join(lib_dir, "vdpau")), "*.so." + version)
    mounts = [_mount(host, p, MOUNT_OPTIONS) for p in libraries]
    mounts += [_mount(host, p, IPC_OPTIONS) for p in _sockets(root)]
    rel = os.uname().release if release is None else release
    firmware: list[str] = []
    for directory in firmware_dirs(rel, custom_firmware()):
        for path in _glob(root, posixpath.join(directory, "nvidia", version), "gsp*.bin"):
            if _is_file(root, path) and path not in firmware:
                firmware.append(path)
    mounts += [_mount(host, p, MOUNT_OPTIONS) for p in firmware]
    binaries = _binaries(root, os.environ.get("PATH", "") if search_path is None else search_path)
    mounts += [_mount(host, p, MOUNT_OPTIONS) for p in binaries]
    binary = find_hook(root, hook_path)
    hooks = _hooks(binary, libraries, _links(root, libraries, version), version) if binary else []
    return DriverFiles(
        version=version,
        lib_dir=lib_dir,
        mounts=tuple(sort_mounts(mounts)),
        hooks=tuple(hooks),
        env=(f"{LIBCUDA_DIR_ENV}={lib_dir}",),
    )


def sort_mounts(mounts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """NVIDIA's order (pkg/nvcdi/transform/sorter.go): fewer path parts first, then by path;
    duplicates of a container path dropped."""
    unique = {m["containerPath"]: m for m in reversed(mounts)}
    return sorted(
        unique.values(), key=lambda m: (posixpath.normpath(m["containerPath"]).count("/"), m["containerPath"])
    )


# --- device nodes --------------------------------------------------------------------------------


def device_node(container_path: str, dev_root: str) -> dict[str, Any] | None:
    """A CDI device node for `container_path` under `dev_root`, as the toolkit writes one
    (internal/edits/device.go): a character device gets its major, minor, file mode and group
    from the node and permissions `rwm`; a path that exists but is no device (a simulated dev
    root) gets path, hostPath and `rw`, as gpuvisor wrote before; None when nothing is there."""
    real = host_path(dev_root, container_path)
    try:
        st = os.stat(real)
    except OSError:
        return None
    node: dict[str, Any] = {"path": container_path, "hostPath": real}
    if not stat.S_ISCHR(st.st_mode):
        node["permissions"] = "rw"
        return node
    node.update(major=os.major(st.st_rdev), minor=os.minor(st.st_rdev), permissions="rwm")
    mode = stat.S_IMODE(st.st_mode)
    if mode:
        node["fileMode"] = mode
    if st.st_gid:
        node["gid"] = st.st_gid
    return node


def additional_gids(nodes: Sequence[dict[str, Any]]) -> list[int]:
    """A node's group where the node is not world read-writable (device.go getAdditionalGIDs)."""
    gids: list[int] = []
    for node in nodes:
        gid, mode = node.get("gid"), node.get("fileMode")
        if gid and mode is not None and not (mode & 0o4 and mode & 0o2) and gid not in gids:
            gids.append(gid)
    return gids


def control_nodes(dev_root: str) -> list[dict[str, Any]]:
    """The control nodes present under the dev root, in NVIDIA's sorted order."""
    nodes = [n for p in CONTROL_DEVICES if (n := device_node(p, dev_root)) is not None]
    return sorted(nodes, key=lambda n: (n["path"].count("/"), n["path"]))


def common_edits(files: DriverFiles, nodes: Sequence[dict[str, Any]], env: Sequence[str]) -> dict[str, Any]:
    """The spec-wide containerEdits: control nodes, the driver's env then `env`, mounts, hooks."""
    edits: dict[str, Any] = {"env": [*files.env, *env]}
    if nodes:
        edits["deviceNodes"] = list(nodes)
    if files.mounts:
        edits["mounts"] = list(files.mounts)
    if files.hooks:
        edits["hooks"] = list(files.hooks)
    gids = additional_gids(nodes)
    if gids:
        edits["additionalGids"] = gids
    return edits


def cdi_version(spec: dict[str, Any]) -> str:
    """The smallest CDI version the spec needs: 0.7.0 with additionalGids, else 0.5.0 (hostPath)."""
    edits = [spec.get("containerEdits") or {}] + [
        d.get("containerEdits") or {} for d in spec.get("devices", [])
    ]
    return "0.7.0" if any(e.get("additionalGids") for e in edits) else "0.5.0"
