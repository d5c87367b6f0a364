"""What the labeller reads from the host, with GFD's rules: machine type, vGPU scan, PCI class,
NVML facts and their failures; and the two small mechanisms it relies on: the features.d file
writer and the API rate limiter."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pynvml
import pytest

from supervisor.labels.host import (
    MAX_MACHINE_TYPE_BYTES,
    NvmlUnavailable,
    read_machine_type,
    read_node_facts,
    scan_vgpu,
    vendor_capability,
)
from supervisor.labels.output import LabelFile, OutputError
from supervisor.labels.rules import LabelConfig, LabelError, VgpuDevice, compute_labels
from supervisor.node.facts import PCI_CLASS_3D, PCI_CLASS_VGA, facts_from_nvml, read_pci_class, sysfs_pci_name
from supervisor.node.nvml import Nvml, NvmlCallError
from supervisor.sim.nvml import load_simulator
from tests.helpers import REPO

# --- machine type ------------------------------------------------------------------------------


def test_machine_type_is_the_trimmed_file_text(tmp_path: Path) -> None:
    """The DMI product name, whitespace trimmed (machine-type.go:52); no path or a bad one is "unknown"."""
    path = tmp_path / "product_name"
    path.write_bytes(b"  NVIDIA DGX H100\n")
    assert read_machine_type(str(path)) == "NVIDIA DGX H100"
    assert read_machine_type("") == "unknown"  # machine-type.go:45-47
    assert read_machine_type(str(tmp_path / "missing")) == "unknown"  # machine-type.go:33-35
    assert read_machine_type(str(tmp_path)) == "unknown"  # a directory


def test_machine_type_read_is_bounded(tmp_path: Path) -> None:
    """A huge or binary machine-type file is read up to a bound and never fails the labels."""
    path = tmp_path / "product_name"
    path.write_bytes(b"x" * (MAX_MACHINE_TYPE_BYTES * 4) + b"\xff\xfe")
    assert read_machine_type(str(path)) == "x" * MAX_MACHINE_TYPE_BYTES


# --- vGPU scan -----------------------------------------------------------------------------------


def pci_config(capability: bytes | None) -> bytes:
    """A 256-byte PCI configuration space with `capability` as its one (vendor-specific) capability."""
    config = bytearray(256)
    config[0:2] = b"\xde\x10"
    if capability is not None:
        config[0x06] = 0x10  # status: capability list present
        config[0x34] = 0x40  # first capability
        config[0x40 : 0x40 + len(capability)] = capability
    return bytes(config)


def vgpu_capability(records: bytes = b"") -> bytes:
    """id 0x09, next 0, length, "VF" at bytes 3-4, then records from byte 5; the record with id 0 holds
    10 bytes of driver version and 10 of branch after its id and length bytes."""
    body = b"\x56\x46" + records + b"\x00\x16" + b"550.54.15\x00" + b"r550_00\x00\x00\x00"
    return bytes([0x09, 0x00, 3 + len(body)]) + body


def sysfs_with(tmp_path: Path, devices: dict[str, tuple[str, bytes]]) -> Path:
    for name, (vendor, config) in devices.items():
        device = tmp_path / "bus/pci/devices" / name
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text("0x030200\n")
        (device / "config").write_bytes(config)
    return tmp_path


def test_vgpu_found_with_its_host_driver(tmp_path: Path) -> None:
    """An NVIDIA device whose vendor capability says "VF" is a vGPU; its record gives driver and branch (vgpu.go:117-150)."""
    root = sysfs_with(tmp_path, {
        "0000:00:1f.0": ("0x8086", b"\x86\x80" + bytes(254)),  # not NVIDIA: skipped (pciutil.go:96)
        "0000:3b:00.0": ("0x10de", pci_config(vgpu_capability())),
        "0000:3c:00.0": ("0x10de", pci_config(vgpu_capability(records=b"\x07\x03\xaa"))),  # one record to step over
        "0000:5e:00.0": ("0x10de", pci_config(None)),  # passthrough GPU: no capability list
    })  # fmt: skip
    assert scan_vgpu(str(root)) == (VgpuDevice("550.54.15", "r550_00"), VgpuDevice("550.54.15", "r550_00"))


def test_no_vgpu_and_unreadable_scans(tmp_path: Path) -> None:
    """No vGPU: an empty scan (present=false); a short config (no CAP_SYS_ADMIN) or no sysfs: no scan (no label)."""
    assert scan_vgpu(str(sysfs_with(tmp_path / "a", {"0000:3b:00.0": ("0x10de", pci_config(None))}))) == ()
    short = sysfs_with(tmp_path / "b", {"0000:3b:00.0": ("0x10de", pci_config(vgpu_capability())[:64])})
    assert scan_vgpu(str(short)) is None  # pciutil.go:127-129
    assert scan_vgpu(str(tmp_path / "missing")) is None  # pciutil.go:77-79
    assert scan_vgpu(None) == ()  # a simulated node


def test_vgpu_without_a_driver_record_fails_the_labels(tmp_path: Path) -> None:
    """A "VF" capability with no driver-version record fails the labelling, as GFD's GetInfo error does (vgpu.go:52-53)."""
    capability = bytes(
        [0x09, 0x00, 0x08, 0x56, 0x46, 0x00, 0x00, 0x00]
    )  # record 0 but too short for the fields
    with pytest.raises(LabelError, match="cannot find driver version record"):
        scan_vgpu(str(sysfs_with(tmp_path, {"0000:3b:00.0": ("0x10de", pci_config(capability))})))


def test_capability_walk_stops_on_a_loop() -> None:
    """A capability chain that points back at itself ends the walk instead of spinning (pciutil.go:143-146)."""
    config = bytearray(pci_config(None))
    config[0x06], config[0x34] = 0x10, 0x40
    config[0x40:0x43] = bytes([0x05, 0x40, 0x08])  # id 5, next -> itself
    assert vendor_capability(bytes(config)) is None


# --- PCI class from sysfs ------------------------------------------------------------------------


def test_sysfs_name_of_an_nvml_bus_id() -> None:
    """go-nvlib GetPCIBusID: lower case, the all-zero upper half of an 8-digit domain dropped."""
    assert sysfs_pci_name("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_pci_name("00010000:3B:00.0") == "00010000:3b:00.0"


def test_pci_class_read_as_gfd_reads_it(tmp_path: Path) -> None:
    """vendor 0x10de and class 0x030000 / 0x030200 are graphics / compute; anything else is unknown."""
    device = tmp_path / "bus/pci/devices/0000:18:00.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    for text, expected in (
        ("0x030000", PCI_CLASS_VGA),
        ("0x030200", PCI_CLASS_3D),
        ("0x068000", None),
        ("junk", None),
    ):
        (device / "class").write_text(text + "\n")
        assert read_pci_class(tmp_path, "00000000:18:00.0") == expected
    (device / "vendor").write_text("0x15b3\n")
    assert read_pci_class(tmp_path, "00000000:18:00.0") is None
    assert read_pci_class(tmp_path, "00000000:19:00.0") is None


def test_gpu_mode_from_host_sysfs(tmp_path: Path) -> None:
    """On a node with sysfs, gpu.mode follows the GPUs' PCI class there: all VGA -> graphics, one missing -> unknown."""
    sim = load_simulator("pcie-l4")
    for g in sim.spec.gpus:
        device = tmp_path / "bus/pci/devices" / sysfs_pci_name(g.pci_bus_id)
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x030000\n")

    def mode() -> str:
        facts = read_node_facts(sim, str(tmp_path), fail_on_init_error=True)
        return compute_labels(facts, LabelConfig(), machine_type="", vgpu=(), timestamp=None)[
            "nvidia.com/gpu.mode"
        ]

    assert mode() == "graphics"
    (tmp_path / "bus/pci/devices" / sysfs_pci_name(sim.spec.gpus[2].pci_bus_id) / "class").unlink()
    assert mode() == "unknown"


# --- NVML facts: GFD's failure rules ---------------------------------------------------------------


def facts_of(profile: str, fail: tuple[str, int] | None = None, **kw: bool) -> object:
    sim = load_simulator(profile)
    if fail is not None:
        sim.fail(*fail)
    return read_node_facts(sim, None, fail_on_init_error=kw.get("fail_on_init_error", True))


def test_memory_failure_only_drops_the_memory_label() -> None:
    """nvmlDeviceGetMemoryInfo failing is ignored, the memory label left out (resource.go:49-52, 61-64)."""
    facts = facts_of("dgx-a100", ("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN))
    labels = compute_labels(facts, LabelConfig(), machine_type="", vgpu=(), timestamp=None)  # type: ignore[arg-type]
    assert "nvidia.com/gpu.memory" not in labels and labels["nvidia.com/gpu.count"] == "8"


@pytest.mark.parametrize(
    "function",
    ["nvmlDeviceGetCount", "nvmlDeviceGetName", "nvmlDeviceGetCudaComputeCapability", "nvmlSystemGetDriverVersion",
     "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetMigMode", "nvmlDeviceGetGpuFabricInfo"],
)  # fmt: skip
def test_other_nvml_failures_fail_the_labels(function: str) -> None:
    """Any other NVML error fails the whole labelling, as it fails GFD's labelers (nvml.go, imex.go:50-51)."""
    with pytest.raises(NvmlCallError) as err:
        facts_of("dgx-h100", (function, pynvml.NVML_ERROR_UNKNOWN))
    assert err.value.function == function


def test_mig_mode_not_supported_is_not_mig_capable() -> None:
    """NotSupported from nvmlDeviceGetMigMode means not MIG-capable, not an error (go-nvlib IsMigCapable)."""
    facts = facts_of("dgx-a100", ("nvmlDeviceGetMigMode", pynvml.NVML_ERROR_NOT_SUPPORTED))
    assert not any(g.mig_capable for g in facts.gpus)  # type: ignore[attr-defined]


def test_a_lost_gpu_fails_the_labels_where_discovery_would_skip_it() -> None:
    """GFD fails on a GPU it cannot open (device.go:475-478); discovery leaves it out, labels do not."""
    sim = load_simulator("pcie-l4")
    sim.lose(sim.gpu_uuids()[1])
    with pytest.raises(NvmlCallError) as err:
        read_node_facts(sim, None, fail_on_init_error=True)
    assert err.value.gpu_lost


def test_fabric_not_completed_is_no_clique(tmp_path: Path) -> None:
    """A fabric registration still in progress (or failed) is not attached (go-nvlib IsFabricAttached)."""
    text = (Path(REPO) / "supervisor/sim/nvml/profiles/dgx-h100.yaml").read_text()
    for variant in ("state: in_progress", "status: 1"):
        node = tmp_path / f"{variant[:5]}.yaml"
        node.write_text(text.replace("clique_id: 1}", f"clique_id: 1, {variant}}}"))
        facts = read_node_facts(load_simulator(str(node)), None, fail_on_init_error=True)
        assert all(g.fabric is None for g in facts.gpus)


def test_init_failure_is_fatal_or_no_gpu() -> None:
    """nvmlInit failing: NvmlUnavailable with --fail-on-init-error, else a node with no GPU (factory.go:17-23)."""
    with pytest.raises(NvmlUnavailable, match="NVML could not be initialised"):
        facts_of("pcie-l4", ("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    facts = facts_of("pcie-l4", ("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), fail_on_init_error=False)
    assert facts.gpus == ()  # type: ignore[attr-defined]


def test_facts_leave_nvml_shut_down() -> None:
    """Each read is one nvmlInit ... nvmlShutdown, as each GFD run is (nvml.go:37-42)."""
    sim = load_simulator("mig-a100")
    read_node_facts(sim, None, fail_on_init_error=True)
    assert not sim.initialized and sim.call_count("nvmlShutdown") == 1


def test_facts_over_the_adapter_match_the_profile() -> None:
    """facts_from_nvml over mig-a100: names, memory, compute capability, MIG state and attributes per the profile."""
    nvml = Nvml(load_simulator("mig-a100"), sysfs_root=None)
    nvml.init()
    facts = facts_from_nvml(nvml)
    assert (facts.driver_version, facts.cuda_driver_version, len(facts.gpus)) == ("550.54.15", 12040, 8)
    assert [g.mig_enabled for g in facts.gpus] == [True] * 4 + [False] * 4
    assert [m.profile for m in facts.gpus[2].migs] == ["1g.10gb+me"] + ["1g.10gb"] * 6
    me = facts.gpus[2].migs[0]
    assert dataclasses.astuple(me)[1:] == (9728, 14, 1, 1, 1, 1, 0, 1, 1)


# --- the features.d file ---------------------------------------------------------------------------


def test_label_file_writes_only_on_change(tmp_path: Path) -> None:
    """write_if_changed: True and a new file on change, False and the same inode when unchanged."""
    path = tmp_path / "gfd"
    f = LabelFile(str(path))
    assert f.write_if_changed({"a": "1"}) is True
    inode = os.stat(path).st_ino
    assert f.write_if_changed({"a": "1"}) is False and os.stat(path).st_ino == inode
    assert f.write_if_changed({"a": "2"}) is True and path.read_text() == "a=2\n"
    again = LabelFile(str(path))  # a restarted labeller finds the same labels in place
    assert again.write_if_changed({"a": "2"}) is False
    assert os.listdir(tmp_path) == ["gfd"]


def test_label_file_errors_and_stdout(tmp_path: Path) -> None:
    """A missing directory is an OutputError naming it; "" writes to stdout; remove() deletes the file."""
    with pytest.raises(OutputError, match=f"the directory {tmp_path / 'nope'} does not exist"):
        LabelFile(str(tmp_path / "nope" / "gfd")).write_if_changed({"a": "1"})
    out = io.StringIO()
    stdout = LabelFile("", stdout=out)
    assert stdout.write_if_changed({"b": "2", "a": "1"}) and out.getvalue() == "a=1\nb=2\n"
    path = tmp_path / "gfd"
    f = LabelFile(str(path))
    f.write_if_changed({"a": "1"})
    assert f.remove() and not path.exists() and not f.remove()
