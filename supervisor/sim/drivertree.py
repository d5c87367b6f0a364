"""A driver root as an NVIDIA driver install lays it out, for the simulator and the tests.

`write_driver_tree(root)` writes, under `root`: the driver's versioned libraries in
/usr/lib/x86_64-linux-gnu (each a small ELF shared object with its SONAME, beside the SONAME
link and, for the development libraries, the `.so` link, as the .run installer and the distro
packages leave them; two VDPAU libraries in its vdpau/ dir), the driver's binaries in /usr/bin
(executable), the GSP firmware in /lib/firmware/nvidia/<version>/, the persistenced socket's
file, and the toolkit's hook binary unless asked not to. Discovery (common/driverfiles.py) is
tested against these files, not against mocks. The ELF files hold only what a SONAME reader
needs: the ELF header, a .dynstr, a .dynamic with DT_SONAME and a .shstrtab.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

VERSION = "550.54.15"
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
# (file stem, SONAME version, has a .so development link): a part of a real driver's list.
LIBRARIES = (
    ("libcuda.so", "1", True),
    ("libnvidia-ml.so", "1", True),
    ("libnvidia-ptxjitcompiler.so", "1", True),
    ("libnvidia-nvvm.so", "4", True),
    ("libcudadebugger.so", "1", False),
    ("libnvidia-opencl.so", "1", False),
    ("libnvidia-cfg.so", "1", True),
    ("libnvidia-gpucomp.so", VERSION, False),  # a library whose SONAME is its own name
    ("libnvidia-opticalflow.so", "1", False),
    ("libGLX_nvidia.so", "0", False),
)
VDPAU = ("libvdpau_nvidia.so",)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")


@dataclass(frozen=True)
class DriverTree:
    root: str
    version: str
    hook: str  # the hook binary's path in the tree ("" when not written)


def elf_shared_object(soname: str) -> bytes:
    """A minimal little-endian ELF64 shared object whose dynamic section names `soname`."""
    dynstr = b"\0" + soname.encode() + b"\0"
    dynamic = struct.pack("<qQqQ", 14, 1, 0, 0)  # DT_SONAME at offset 1 of .dynstr, then DT_NULL
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    header_size = 64
    dynstr_at = header_size
    dynamic_at = dynstr_at + len(dynstr)
    dynamic_at += -dynamic_at % 8
    shstrtab_at = dynamic_at + len(dynamic)
    sections_at = shstrtab_at + len(shstrtab)
    sections_at += -sections_at % 8
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sections_at, 0, header_size, 0, 0, 64, 4, 3
    )  # ET_DYN, x86-64; 4 section headers, .shstrtab the 4th (index 3)
    sections = bytes(64)  # the null section
    sections += struct.pack("<IIQQQQIIQQ", 1, 3, 2, 0, dynstr_at, len(dynstr), 0, 0, 1, 0)  # SHT_STRTAB
    sections += struct.pack("<IIQQQQIIQQ", 9, 6, 3, 0, dynamic_at, len(dynamic), 1, 0, 8, 16)  # SHT_DYNAMIC
    sections += struct.pack("<IIQQQQIIQQ", 18, 3, 0, 0, shstrtab_at, len(shstrtab), 0, 0, 1, 0)
    out = bytearray(header)
    out += dynstr
    out += bytes(dynamic_at - len(out))
    out += dynamic + shstrtab
    out += bytes(sections_at - len(out))
    return bytes(out + sections)


def _write(path: str, data: bytes, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)


def _link(target: str, path: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


def write_driver_tree(root: str, version: str = VERSION, *, hook: str = "nvidia-ctk") -> DriverTree:
    """Write a driver install under `root` (see the module docstring); `hook`: which hook binary
    goes to /usr/bin ("nvidia-ctk", "nvidia-cdi-hook", or "" for none)."""
    lib_dir = root + LIB_DIR
    for stem, so_version, dev_link in LIBRARIES:
        name = f"{stem}.{version}"
        soname = name if so_version == version else f"{stem}.{so_version}"
        _write(os.path.join(lib_dir, name), elf_shared_object(soname), 0o755)
        if soname != name:
            _link(name, os.path.join(lib_dir, soname))
        if dev_link:
            _link(soname, os.path.join(lib_dir, stem))
    for stem in VDPAU:
        name = f"{stem}.{version}"
        _write(os.path.join(lib_dir, "vdpau", name), elf_shared_object(f"{stem}.1"), 0o755)
        _link(name, os.path.join(lib_dir, "vdpau", f"{stem}.1"))
    # Not the driver's: never mounted.
    _write(os.path.join(lib_dir, "libz.so.1.2.13"), elf_shared_object("libz.so.1"))
    for name in BINARIES:
        _write(f"{root}/usr/bin/{name}", b"#!/bin/sh\nexit 0\n", 0o755)
    for name in FIRMWARE:
        _write(f"{root}/lib/firmware/nvidia/{version}/{name}", b"GSP")
    _write(f"{root}/run/nvidia-persistenced/socket", b"")
    hook_path = ""
    if hook:
        hook_path = f"/usr/bin/{hook}"
        _write(root + hook_path, b"#!/bin/sh\nexit 0\n", 0o755)
    return DriverTree(root=root, version=version, hook=hook_path)
