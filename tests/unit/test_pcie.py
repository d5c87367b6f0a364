"""supervisor.node.pcie: a GPU's PCIe root complex and NUMA node read from a sysfs tree as NVIDIA's
DRA driver reads them (k8s.io/dynamic-resource-allocation deviceattribute/pci_linux.go,
`resolvePCIeRoot`; go-nvlib pkg/nvpci/nvpci.go, `numa_node` parsed with strconv.ParseInt), and the
simulator's PCIe tree (supervisor.sim.nvml.pcitree) that tests and simulated nodes read it from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.config import config_from_data
from supervisor.desired.discovery import NvmlSession
from supervisor.node.nvml import Nvml
from supervisor.node.pcie import nvlib_bus_id, pci_numa_node, pcie_root
from supervisor.sim.nvml import SimulatorConfigError, load_simulator
from supervisor.sim.nvml.config import parse_spec
from tests.fakenvml import MOCK_CONFIGS, spec_for

BUS = "0000:04:1f.0"


def device_link(sysfs: Path, bus: str, target: str) -> None:
    links = sysfs / "bus/pci/devices"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(target, links / bus)


def test_the_root_is_the_first_part_after_devices(tmp_path: Path) -> None:
    """/sys/bus/pci/devices/<id> -> ../../../devices/pci0000:00/<bridges>/<id>: the root is
    pci0000:00 however many bridges lie between (the target is taken relative to the link's dir)."""
    device_link(tmp_path, BUS, f"../../../devices/pci0000:00/0000:00:01.0/0000:02:00.0/{BUS}")
    assert pcie_root(tmp_path, BUS) == "pci0000:00"


@pytest.mark.parametrize(
    "target",
    [
        f"/sys/devices/pci0000:00/{BUS}",  # absolute: filepath.Join keeps it so, not under devices/pci
        f"../../../devices/platform/{BUS}",  # not under a PCIe root complex
        "../../../devices/pci0000:00/0000:04:1f.1",  # does not end with the bus id
        f"../../../../devices/pci0000:00/{BUS}",  # climbs out of the sysfs
    ],
)
def test_a_link_resolve_pcie_root_refuses_gives_no_root(tmp_path: Path, target: str) -> None:
    """What resolvePCIeRoot refuses (a target outside devices/pci..., another device's name) is no
    root, and no exception: the attribute is then left out, as NVIDIA leaves it out."""
    device_link(tmp_path, BUS, target)
    assert pcie_root(tmp_path, BUS) is None


def test_no_link_and_bad_bus_ids_give_no_root(tmp_path: Path) -> None:
    """A device with no link, or a bus id that is not lower-case extended BDF (verifyPCIBDFFormat),
    has no root."""
    assert pcie_root(tmp_path, BUS) is None
    device_link(tmp_path, "0000:04:1F.0", "../../../devices/pci0000:00/0000:04:1F.0")
    assert pcie_root(tmp_path, "0000:04:1F.0") is None
    assert pcie_root(tmp_path, "00000000:04:1f.0") is None


@pytest.mark.parametrize(
    ("text", "want"),
    [("1\n", 1), ("0", 0), ("-1\n", None), ("0x3", 3), ("junk", None), ("", None)],
)
def test_numa_node_is_parsed_as_nvpci_parses_it(tmp_path: Path, text: str, want: int | None) -> None:
    """numa_node is a signed integer (base prefixes allowed); -1 (no affinity), or what does not
    parse, gives no NUMA node."""
    device = tmp_path / "bus/pci/devices" / BUS
    device.mkdir(parents=True)
    (device / "numa_node").write_text(text)
    assert pci_numa_node(tmp_path, BUS) == want
    assert pci_numa_node(tmp_path, "0000:05:00.0") is None  # no such device


def test_nvlib_bus_id_is_go_nvlibs_form() -> None:
    """NVML's 8-digit domain is cut to 4 and the text lower-cased, as go-nvlib's GetPCIBusID does."""
    assert nvlib_bus_id("00000000:BD:00.0") == "0000:bd:00.0"
    assert nvlib_bus_id("00000009:01:00.0") == "0009:01:00.0"
    assert nvlib_bus_id("0000:bd:00.0") == "0000:bd:00.0"


def test_the_simulators_tree_is_read_back_by_discovery(tmp_path: Path) -> None:
    """write_sysfs lays each GPU under its root complex with its NUMA node; discovery over it reads
    back the description's roots (the default: the bus rounded down to 16) and NUMA nodes, and the
    links are relative, as Linux writes them."""
    sim = load_simulator("pcie-l4")
    root = sim.write_sysfs(tmp_path / "sys")
    link = root / "bus/pci/devices/0000:17:00.0"
    assert os.readlink(link) == "../../../devices/pci0000:10/0000:10:01.0/0000:17:00.0"
    assert (link / "vendor").read_text().strip() == "0x10de"
    nvml = Nvml(sim, sysfs_root=root)
    nvml.init()
    node = nvml.discover()
    assert [(g.pcie_root, g.pci_numa_node) for g in node.gpus] == [
        ("pci0000:10", 0),
        ("pci0000:10", 0),
        ("pci0000:b0", 1),
        ("pci0000:b0", 1),
    ]
    sim.write_sysfs(root)  # written again over itself: the same tree
    assert os.readlink(link) == "../../../devices/pci0000:10/0000:10:01.0/0000:17:00.0"


def test_a_description_names_roots_and_addressing_modes() -> None:
    """`pcie_root` and `addressing_mode` are read from a description; a root that is not
    pci<domain>:<bus> in lower case, or an unknown mode, is an error naming the key."""
    base = (
        "driver_version: '550.54.15'\ngpus:\n  - name: NVIDIA L4\n    uuid: GPU-b7593aaf-27db-5f98-81e3-3c1d6539ac02\n"
        "    minor: 0\n    pci_bus_id: '00000000:17:00.0'\n    memory_mib: 23034\n    compute_capability: [8, 9]\n"
    )
    spec = parse_spec(base + "    pcie_root: pci0000:16\n    addressing_mode: HMM\n", "t")
    assert (spec.gpus[0].pcie_root, spec.gpus[0].addressing_mode) == ("pci0000:16", 1)
    assert parse_spec(base, "t").gpus[0].addressing_mode is None
    with pytest.raises(SimulatorConfigError) as bad_root:
        parse_spec(base + "    pcie_root: PCI0000:16\n", "t")
    assert bad_root.value.key == "gpus[0].pcie_root"
    with pytest.raises(SimulatorConfigError) as bad_mode:
        parse_spec(base + "    addressing_mode: coherent\n", "t")
    assert bad_mode.value.key == "gpus[0].addressing_mode"


def test_nvidias_mock_profiles_give_their_root_complexes() -> None:
    """A mock NVML profile's `pcie_topology.root_complexes` id is each of its GPUs' root complex."""
    if not (MOCK_CONFIGS / "mock-nvml-config-gb200.yaml").is_file():
        pytest.skip("NVIDIA's mock profiles are read from ../shared")
    spec = spec_for("gb200")
    assert sorted({g.pcie_root for g in spec.gpus}) == [
        "pci0000:00",
        "pci0000:40",
        "pci0000:80",
        "pci0000:c0",
    ]


def test_the_sysfs_root_setting_reaches_discovery(tmp_path: Path) -> None:
    """--sysfs-root is the sysfs the supervisor's discovery reads; a simulated node without it reads
    none (never the host's /sys for its made-up bus ids), real NVML /sys."""

    def session(**gpuvisor: str) -> NvmlSession:
        config = config_from_data({"version": "v1", "gpuvisor": gpuvisor}, flags={}, source="test")
        return NvmlSession(config, environ={})

    assert session(simulate="pcie-l4", sysfsRoot=str(tmp_path)).nvml.sysfs == tmp_path
    assert session(simulate="pcie-l4").nvml.sysfs is None
    assert session().nvml.sysfs == Path("/sys")  # the real binding: nothing is called before init
