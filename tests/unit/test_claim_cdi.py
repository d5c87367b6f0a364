"""Tests of the driver's files in CDI specs and each DRA claim's own spec: discovery
(common/driverfiles.py) against a driver install laid out on disk (supervisor/sim/drivertree.py),
the node-wide spec's completeness, and worker/dra/claimspec.py with the Preparer.

NVIDIA's rules are read in nvidia-container-toolkit v1.19.1 (pkg/nvcdi/driver-nvml.go,
internal/discover/symlinks.go, hooks.go, ldconfig.go, ipc.go, mounts.go) and the DRA driver
v0.4.1 (cmd/gpu-kubelet-plugin/cdi.go, device_state.go)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from common import driverfiles
from common.cdispec import spec_problems
from common.dracheckpoint import Checkpoint, CheckpointError, PreparedClaim
from supervisor.cdi.spec import build_spec
from supervisor.sim.drivertree import VERSION, elf_shared_object, write_driver_tree
from tests.unit.test_dra_prepare import Setup
from worker.dra.claimspec import ClaimSpecs, claim_device_id, spec_file
from worker.dra.prepare import Preparer

LIB = "/usr/lib/x86_64-linux-gnu"
RO = ["ro", "nosuid", "nodev", "rbind", "rprivate"]


def tree(tmp_path: Path, **kw: Any) -> str:
    root = str(tmp_path / "driver")
    write_driver_tree(root, **kw)
    return root


def found(root: str, **kw: Any) -> driverfiles.DriverFiles:
    kw.setdefault("search_path", "/usr/bin")
    kw.setdefault("release", "6.8.0-test")
    kw.setdefault("custom_firmware", lambda: "")
    return driverfiles.discover(root, **kw)


def hook_args(files: driverfiles.DriverFiles, name: str) -> list[str]:
    return next(h["args"] for h in files.hooks if name in h["args"])


# --- discovery ---------------------------------------------------------------------------------


def test_discovery_finds_the_versioned_libraries_binaries_firmware_and_socket(tmp_path: Path) -> None:
    """Every *.so.<version> of libcuda's dir and its vdpau/ dir, the driver's binaries, the GSP
    firmware and the persistenced socket are mounted, host paths under the host root, with the
    toolkit's options; an unrelated library and the SONAME links themselves are not."""
    root = tree(tmp_path)
    files = found(root, host_root="/run/nvidia/driver")
    assert files.version == VERSION and files.lib_dir == LIB
    paths = {m["containerPath"]: m for m in files.mounts}
    assert f"{LIB}/libcuda.so.{VERSION}" in paths and f"{LIB}/vdpau/libvdpau_nvidia.so.{VERSION}" in paths
    assert not any(p.endswith((".so.1", ".so", "libz.so.1.2.13")) for p in paths)
    assert {"/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-persistenced"} <= set(
        paths
    )
    assert f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in paths
    assert paths[f"{LIB}/libcuda.so.{VERSION}"] == {
        "hostPath": f"/run/nvidia/driver{LIB}/libcuda.so.{VERSION}",
        "containerPath": f"{LIB}/libcuda.so.{VERSION}",
        "options": RO,
    }
    assert paths["/run/nvidia-persistenced/socket"]["options"] == [
        "nosuid",
        "nodev",
        "rbind",
        "rprivate",
        "noexec",
    ]
    assert files.env == (f"NVIDIA_CTK_LIBCUDA_DIR={LIB}",)
    depths = [(m["containerPath"].count("/"), m["containerPath"]) for m in files.mounts]
    assert depths == sorted(depths)  # NVIDIA's sorter


def test_soname_links_and_the_hooks_as_the_toolkit_writes_them(tmp_path: Path) -> None:
    """create-symlinks holds libcuda.so, libGLX_indirect.so.0 and each library's SONAME and .so
    links that exist as links on the host (none for a library whose SONAME is its name), then
    enable-cuda-compat, update-ldcache and disable-device-node-modification, through nvidia-ctk."""
    files = found(tree(tmp_path), hook_path="/usr/bin/nvidia-ctk")
    assert [h["args"][:3] for h in files.hooks] == [
        ["nvidia-ctk", "hook", "create-symlinks"],
        ["nvidia-ctk", "hook", "enable-cuda-compat"],
        ["nvidia-ctk", "hook", "update-ldcache"],
        ["nvidia-ctk", "hook", "disable-device-node-modification"],
    ]
    assert all(
        h["hookName"] == "createContainer" and h["env"] == ["NVIDIA_CTK_DEBUG=false"] for h in files.hooks
    )
    links = hook_args(files, "create-symlinks")[4::2]
    assert f"libcuda.so.{VERSION}::{LIB}/libcuda.so.1" in links
    assert f"libcuda.so.1::{LIB}/libcuda.so" in links
    assert f"libnvidia-nvvm.so.4::{LIB}/libnvidia-nvvm.so" in links
    assert f"libGLX_nvidia.so.{VERSION}::{LIB}/libGLX_indirect.so.0" in links
    assert not any(link.startswith("libnvidia-gpucomp") for link in links)
    assert not any("libcudadebugger.so::" in link or link.endswith("libcudadebugger.so") for link in links)
    assert hook_args(files, "enable-cuda-compat")[3:] == [f"--host-driver-version={VERSION}"]
    assert hook_args(files, "update-ldcache")[3:] == ["--folder", LIB, "--folder", f"{LIB}/vdpau"]


def test_no_hook_binary_means_no_hooks_and_nvidia_cdi_hook_is_called_by_its_own_name(tmp_path: Path) -> None:
    """Without a hook binary under the root the spec has no hooks (the mounts stay); with
    nvidia-cdi-hook the hooks are its subcommands."""
    assert found(tree(tmp_path / "a", hook=""), hook_path="/nonexistent/nvidia-ctk").hooks == ()
    files = found(tree(tmp_path / "b", hook="nvidia-cdi-hook"), hook_path="/usr/bin/nvidia-ctk")
    assert files.hooks[0]["path"] == "/usr/bin/nvidia-cdi-hook"
    assert files.hooks[0]["args"][:2] == ["nvidia-cdi-hook", "create-symlinks"]


def test_nvmls_version_picks_the_driver_and_a_root_without_one_finds_nothing(tmp_path: Path) -> None:
    """Given NVML's version, another version's libcuda leftover is not the driver; without a
    libcuda the answer names what is missing and carries no files."""
    root = tree(tmp_path)
    Path(root + LIB + "/libcuda.so.1.0").write_bytes(elf_shared_object("libcuda.so.1"))
    assert found(root).version == "1.0"  # inferred: the first libcuda.so.*.*, as the toolkit's fallback
    assert found(root, version=VERSION).version == VERSION
    empty = found(str(tmp_path / "nothing"))
    assert empty.mounts == () and empty.hooks == () and "libcuda.so" in empty.missing


def test_links_resolve_inside_the_root_and_loops_are_bounded(tmp_path: Path) -> None:
    """An absolute link target is read below the root, never on this machine's own /; a loop of
    links ends the lookup instead of hanging."""
    root = tmp_path / "r"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "opt").mkdir()
    (root / "opt/libcuda.so.1.2").write_bytes(elf_shared_object("libcuda.so.1"))
    os.symlink("/opt/libcuda.so.1.2", root / "usr/lib64/libcuda.so.1.2")
    assert driverfiles.resolve(str(root), "/usr/lib64/libcuda.so.1.2") == "/opt/libcuda.so.1.2"
    os.symlink("b", root / "opt/a")
    os.symlink("a", root / "opt/b")
    assert driverfiles.resolve(str(root), "/opt/a") is None


def test_soname_is_read_from_the_elf_dynamic_section(tmp_path: Path) -> None:
    """DT_SONAME from a shared object; None for a file that is no ELF or is cut short."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(elf_shared_object("libfoo.so.7"))
    assert driverfiles.read_soname(str(lib)) == "libfoo.so.7"
    lib.write_bytes(elf_shared_object("libfoo.so.7")[:100])
    assert driverfiles.read_soname(str(lib)) is None
    lib.write_text("not an ELF file")
    assert driverfiles.read_soname(str(lib)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_character_device_node_is_written_with_its_numbers(tmp_path: Path) -> None:
    """A control node that is a character device gets major, minor, file mode and `rwm` (the
    toolkit's DeviceFromPath); a group other than root with a mode not world read-writable adds
    the group to additionalGids (and the spec needs CDI 0.7.0)."""
    (tmp_path / "dev").mkdir()
    path = tmp_path / "dev/nvidiactl"
    os.mknod(path, stat.S_IFCHR | 0o660, os.makedev(195, 255))
    os.chmod(path, 0o660)  # whatever the umask
    os.chown(path, 0, 44)
    node = driverfiles.device_node("/dev/nvidiactl", str(tmp_path))
    assert node == {
        "path": "/dev/nvidiactl", "hostPath": str(path), "major": 195, "minor": 255,
        "permissions": "rwm", "fileMode": 0o660, "gid": 44,
    }  # fmt: skip
    edits = driverfiles.common_edits(driverfiles.DriverFiles(), [node], [])
    assert edits["additionalGids"] == [44]
    spec: dict[str, Any] = {
        "cdiVersion": "0.5.0",
        "kind": "a.b/c",
        "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}],
    }
    spec["containerEdits"] = edits
    assert any("0.7.0" in p for p in spec_problems(spec))
    spec["cdiVersion"] = driverfiles.cdi_version(spec)
    assert spec_problems(spec) == []


# --- the node-wide spec --------------------------------------------------------------------------


def test_the_node_wide_spec_carries_the_driver_files_and_hooks(tmp_path: Path) -> None:
    """The device plugin's spec (a DRA plan's devices too) has the driver's mounts, hooks and
    NVIDIA_CTK_LIBCUDA_DIR spec-wide, before NVIDIA_VISIBLE_DEVICES=void, and is valid."""
    s = Setup(tmp_path, driver_root=tree(tmp_path))
    spec = build_spec({s.plan.resource: s.plan})
    assert spec_problems(spec) == []
    edits = spec["containerEdits"]
    assert edits["env"] == [f"NVIDIA_CTK_LIBCUDA_DIR={LIB}", "NVIDIA_VISIBLE_DEVICES=void"]
    assert f"{LIB}/libcuda.so.{VERSION}" in {m["containerPath"] for m in edits["mounts"]}
    assert [h["args"][2] for h in edits["hooks"]] == [
        "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification",
    ]  # fmt: skip


# --- each claim's own spec -------------------------------------------------------------------------


class WatchedCheckpoint(Checkpoint):
    """The checkpoint, noting at each put whether each claim's spec was on disk by then."""

    def __init__(self, directory: str, spec_dir: str) -> None:
        super().__init__(directory)
        self.spec_dir = spec_dir
        self.seen: dict[str, bool] = {}
        self.fail = False

    def put(self, claims: Iterable[PreparedClaim]) -> None:
        claims = list(claims)
        for claim in claims:
            self.seen[claim.uid] = os.path.exists(spec_file(self.spec_dir, claim.uid))
        if self.fail:
            raise CheckpointError("disk full (test)")
        super().put(claims)


def claim_setup(tmp_path: Path) -> tuple[Setup, WatchedCheckpoint, Preparer, str]:
    s = Setup(tmp_path, driver_root=tree(tmp_path))
    assert s.plan.dra is not None
    spec_dir = str(tmp_path / "cdi")
    checkpoint = WatchedCheckpoint(s.plan.dra.plugin_dir, spec_dir)
    checkpoint.load()
    preparer = Preparer(s.plan, s.source, checkpoint, specs=ClaimSpecs(s.plan, spec_dir))
    return s, checkpoint, preparer, spec_dir


def test_a_claims_spec_is_written_before_it_is_recorded_and_removed_at_unprepare(tmp_path: Path) -> None:
    """The claim's spec is on disk when the claim reaches the checkpoint (so before the answer),
    named as NVIDIA names it, answered with its device IDs; unprepare removes it."""
    s, checkpoint, preparer, spec_dir = claim_setup(tmp_path)
    ref = s.claim("c1", "gpu-1")
    result = preparer.prepare([ref])[ref.uid]
    assert result.error == "" and checkpoint.seen == {ref.uid: True}
    path = os.path.join(spec_dir, f"k8s.gpu.nvidia.com-claim_{ref.uid}.yaml")
    assert result.devices[0].cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-1",)
    assert result.devices[0].cdi_device_ids == (claim_device_id(ref.uid, "gpu-1"),)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert preparer.unprepare([ref]) == {ref.uid: ""}
    assert not os.path.exists(path)


def test_two_claims_specs_are_disjoint(tmp_path: Path) -> None:
    """Two claims prepared in one call: two files, each naming only its own claim's devices."""
    s, _, preparer, spec_dir = claim_setup(tmp_path)
    a, b = s.claim("a", "gpu-0"), s.claim("b", "gpu-2", "gpu-3")
    preparer.prepare([a, b])
    names = {}
    for ref in (a, b):
        with open(spec_file(spec_dir, ref.uid), encoding="utf-8") as fh:
            spec = json.load(fh)
        assert spec_problems(spec) == [] and spec["kind"] == "k8s.gpu.nvidia.com/claim"
        names[ref.uid] = [d["name"] for d in spec["devices"]]
    assert names == {a.uid: [f"{a.uid}-gpu-0"], b.uid: [f"{b.uid}-gpu-2", f"{b.uid}-gpu-3"]}


def test_a_checkpoint_that_cannot_be_written_leaves_no_spec(tmp_path: Path) -> None:
    """A claim the checkpoint refuses is that claim's error, and its spec is removed again."""
    s, checkpoint, preparer, spec_dir = claim_setup(tmp_path)
    checkpoint.fail = True
    ref = s.claim("c1", "gpu-0")
    assert "disk full" in preparer.prepare([ref])[ref.uid].error
    assert checkpoint.seen == {ref.uid: True}
    assert not os.path.exists(spec_file(spec_dir, ref.uid))


def test_a_spec_dir_that_cannot_be_written_is_the_claims_error(tmp_path: Path) -> None:
    """A spec that cannot be written: the claim's error says where, nothing is recorded."""
    s = Setup(tmp_path, driver_root=tree(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert s.plan.dra is not None
    checkpoint = Checkpoint(s.plan.dra.plugin_dir)
    checkpoint.load()
    preparer = Preparer(s.plan, s.source, checkpoint, specs=ClaimSpecs(s.plan, str(blocker / "cdi")))
    ref = s.claim("c1", "gpu-0")
    assert "cannot write the CDI spec" in preparer.prepare([ref])[ref.uid].error
    assert len(checkpoint) == 0


def test_claims_recorded_with_the_node_specs_ids_keep_them(tmp_path: Path) -> None:
    """A claim prepared by a worker of before per-claim specs is answered again with the
    node-wide spec's IDs it was recorded with, and unprepares."""
    s, _, _, spec_dir = claim_setup(tmp_path)
    ref = s.claim("old", "gpu-0")
    old = s.preparer.prepare([ref])[ref.uid]  # no spec dir: the node-wide spec's IDs
    assert old.devices[0].cdi_device_ids[0].startswith("k8s.device-plugin.nvidia.com/gpu=")
    assert s.plan.dra is not None
    checkpoint = Checkpoint(s.plan.dra.plugin_dir)
    checkpoint.load()
    upgraded = Preparer(s.plan, s.source, checkpoint, specs=ClaimSpecs(s.plan, spec_dir))
    assert upgraded.prepare([ref])[ref.uid] == old
    assert not os.path.exists(spec_file(spec_dir, ref.uid))
    assert upgraded.unprepare([ref]) == {ref.uid: ""}
