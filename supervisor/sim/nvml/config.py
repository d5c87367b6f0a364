"""Load and validate a simulator node description (YAML) into frozen spec objects.

The format is documented in `supervisor.sim.nvml` (the package docstring). Every problem found is
raised as a `SimulatorConfigError` naming the file, the key (a path such as
`gpus[2].mig.devices[0].profile`) and the reason, so a bad description never ends in a bare
traceback.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import yaml

from supervisor.node.facts import PCI_CLASS_3D
from supervisor.node.nvml import ARCHITECTURES as NVML_ARCHITECTURES
from supervisor.node.nvml import architecture_of
from supervisor.sim.nvml import mig, mockprofile, pcitree
from supervisor.sim.nvml.mig import MigProfile

GPU_UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)
MIG_UUID_RE = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)
BUS_ID_RE = re.compile(r"^([0-9a-fA-F]{4}|[0-9a-fA-F]{8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)

# nvmlGpuFabricState_t by the names the description uses.
FABRIC_STATES = {
    "not_supported": pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    "not_started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
    "in_progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    "completed": pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
}

# nvmlGpuTopologyLevel_t names, as `nvidia-smi topo` users know them.
ANCESTORS = {"INTERNAL": 0, "SINGLE": 10, "MULTIPLE": 20, "HOSTBRIDGE": 30, "NODE": 40, "SYSTEM": 50}
MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS in nvidia-ml-py 12/13
MAX_GPUS = 64  # a bound on what a description may ask for; nodes have 8 or 16

# PCI device ids (device << 16 | vendor 0x10DE) of the models the built-in profiles use.
_PCI_DEVICE_IDS = {
    "NVIDIA H100 80GB HBM3": 0x233010DE,
    "NVIDIA A100-SXM4-80GB": 0x20B210DE,
    "NVIDIA L4": 0x27B810DE,
}

# nvmlBrandType_t values (NVIDIA's nvml.h: NVML_BRAND_*) by the names a description uses.
BRANDS = {
    "unknown": 0, "quadro": 1, "tesla": 2, "nvs": 3, "grid": 4, "geforce": 5, "titan": 6,
    "nvidia_vapps": 7, "nvidia_vpc": 8, "nvidia_vcs": 9, "nvidia_vws": 10, "nvidia_cloud_gaming": 11,
    "quadro_rtx": 12, "nvidia_rtx": 13, "nvidia": 14,
}  # fmt: skip
# nvmlDeviceArchitecture_t values by the NVML adapter's names as a description writes them
# ("ada_lovelace", as NVIDIA's mock profiles spell Ada; "ada" for short): one table for both.
ARCHITECTURES = {name.lower().replace(" ", "_"): number for number, name in NVML_ARCHITECTURES.items()}
ARCHITECTURES["ada"] = ARCHITECTURES["ada_lovelace"]


def architecture_for(compute_capability: tuple[int, int]) -> int:
    """The NVML architecture of a compute capability, for descriptions that do not name one: the
    NVML adapter's own table for an NVML without the call (`architecture_of`), so the two cannot
    disagree; NVML_DEVICE_ARCH_UNKNOWN where it names none."""
    return ARCHITECTURES.get(architecture_of(compute_capability).lower().replace(" ", "_"), 0xFFFFFFFF)


class SimulatorConfigError(ValueError):
    """A node description is unusable: `file`, `key` and `reason` say where and why."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        super().__init__(f"{file}: {key}: {reason}")
        self.file = file
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class MigSpec:
    profile: str
    placement: int
    gi: int
    ci: int
    uuid: str


@dataclass(frozen=True)
class FabricSpec:
    """A GPU's NVLink fabric registration (`nvmlDeviceGetGpuFabricInfo`): the IMEX clique."""

    cluster_uuid: str  # canonical lower-case form
    clique_id: int
    state: int  # NVML_GPU_FABRIC_STATE_*
    status: int  # the NVML return code of the registration (0: success)


@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    uuid: str
    minor: int
    pci_bus_id: str  # canonical NVML form: 8-digit domain, upper-case hex
    memory_mib: int
    numa_node: int | None
    compute_capability: tuple[int, int]
    pci_device_id: int
    ecc_events: bool = True
    retired_pages: bool = True
    remapped_rows: bool = True
    mig_enabled: bool = False
    mig: tuple[MigSpec, ...] = ()
    pci_class: int = PCI_CLASS_3D  # compute mode, unless the description says otherwise
    fabric: FabricSpec | None = None
    brand: int = BRANDS["nvidia"]  # nvmlDeviceGetBrand
    architecture: int = 0xFFFFFFFF  # nvmlDeviceGetArchitecture
    mig_capable: bool = False  # nvmlDeviceGetMigMode answers (see `catalogue`)
    pci_subsystem_id: int = 0
    pcie_root: str = ""  # the root complex in the simulated sysfs (pcitree), "pci0000:00"
    addressing_mode: int | None = None  # nvmlDeviceGetAddressingMode; None: NotSupported

    @property
    def catalogue(self) -> dict[str, MigProfile] | None:
        """The GPU's MIG profiles, None when it is not MIG-capable."""
        return mig.catalogue_of(self.name, self.memory_mib) if self.mig_capable else None


@dataclass(frozen=True)
class NodeSpec:
    source: str
    name: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuSpec, ...]
    ancestors: dict[tuple[int, int], int] = field(default_factory=dict)  # (a, b), a < b
    nvlinks: dict[tuple[int, int], int] = field(default_factory=dict)  # direct GPU-GPU links
    switch_links: int = 0
    switch_gpus: tuple[int, ...] = ()
    switch_bus_ids: tuple[str, ...] = ()
    lost: frozenset[str] = frozenset()
    pending_retirement: frozenset[str] = frozenset()
    remapped_rows_pending: frozenset[str] = frozenset()
    nvml_version: str = ""  # nvmlSystemGetNVMLVersion; "" -> "<CUDA major>.<driver version>"

    @property
    def nvml_version_text(self) -> str:
        return self.nvml_version or f"{self.cuda_driver_version // 1000}.{self.driver_version}"


def canonical_bus_id(text: str) -> str | None:
    """NVML's `busId` form ("00000000:18:00.0") of a PCI address, or None if it is not one."""
    m = BUS_ID_RE.match(text.strip())
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):08X}:{bus.upper()}:{dev.upper()}.{fn}"


def derived_mig_uuid(gpu_uuid: str, generation: int, gi: int, ci: int, profile: str) -> str:
    """A MIG UUID that depends only on where the instance is, so runs are reproducible.

    `generation` counts layout changes of the GPU: re-creating an instance after a change gives
    a new UUID, as on real hardware, yet the same sequence of changes always gives the same ones.
    """
    digest = hashlib.sha256(f"{gpu_uuid}/{generation}/{gi}/{ci}/{profile}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class _Reader:
    """Typed accessors that raise SimulatorConfigError with the file and key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, reason: str) -> SimulatorConfigError:
        return SimulatorConfigError(self.source, key, reason)

    def mapping(self, value: Any, key: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise self.fail(
                f"{key}.{unknown[0]}" if key else unknown[0], f"unknown key (allowed: {sorted(allowed)})"
            )
        return value

    def required(self, raw: dict[str, Any], name: str, key: str) -> Any:
        if name not in raw or raw[name] is None:
            raise self.fail(f"{key}.{name}" if key else name, "required key is missing")
        return raw[name]

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, value: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def sequence(self, value: Any, key: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {type(value).__name__}")
        return value


def load_spec(path: str | Path, display_name: str | None = None) -> NodeSpec:
    """Read and validate one node description file."""
    source = display_name or str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SimulatorConfigError(source, "(file)", f"cannot read: {exc.strerror or exc}") from None
    return parse_spec(text, source)


def parse_spec(text: str, source: str) -> NodeSpec:
    """Validate a node description given as YAML text; `source` names it in errors."""
    r = _Reader(source)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "(yaml)"
        raise SimulatorConfigError(source, where, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        raise r.fail("(document)", "the description is empty")
    if mockprofile.is_mock_profile(raw):  # NVIDIA's mock format: the same node, in our terms
        raw = mockprofile.translate(raw, source, r.fail)
        r = _Reader(f"{source} (NVIDIA's mock format, translated)")
    top = r.mapping(
        raw,
        "",
        {
            "name", "description", "driver_version", "cuda_driver_version", "nvml_version", "gpus",
            "topology", "faults",
        },
    )  # fmt: skip
    name = r.string(top.get("name", Path(source).stem), "name")
    driver = r.string(str(r.required(top, "driver_version", "")), "driver_version")
    cuda = r.integer(top.get("cuda_driver_version", 12040), "cuda_driver_version", minimum=1000)
    nvml_raw = top.get("nvml_version")
    nvml_version = "" if nvml_raw is None else r.string(str(nvml_raw), "nvml_version")
    gpu_list = r.sequence(r.required(top, "gpus", ""), "gpus")
    if not gpu_list:
        raise r.fail("gpus", "at least one GPU is needed")
    if len(gpu_list) > MAX_GPUS:
        raise r.fail("gpus", f"at most {MAX_GPUS} GPUs, got {len(gpu_list)}")
    gpus = tuple(_parse_gpu(r, g, i) for i, g in enumerate(gpu_list))
    _check_unique(r, gpus)
    topo = _parse_topology(r, top.get("topology"), gpus)
    faults = _parse_faults(r, top.get("faults"), gpus)
    return NodeSpec(
        source=source,
        name=name,
        driver_version=driver,
        cuda_driver_version=cuda,
        gpus=gpus,
        ancestors=topo.ancestors,
        nvlinks=topo.nvlinks,
        switch_links=topo.switch_links,
        switch_gpus=topo.switch_gpus,
        switch_bus_ids=topo.switch_bus_ids,
        lost=faults["lost"],
        pending_retirement=faults["pending_retirement"],
        remapped_rows_pending=faults["remapped_rows_pending"],
        nvml_version=nvml_version,
    )


def _parse_gpu(r: _Reader, raw_any: Any, i: int) -> GpuSpec:
    key = f"gpus[{i}]"
    allowed = {
        "index", "name", "uuid", "minor", "pci_bus_id", "memory_mib", "numa_node",
        "compute_capability", "pci_device_id", "supports", "mig", "pci_class", "fabric",
        "brand", "architecture", "mig_capable", "pci_subsystem_id", "pcie_root", "addressing_mode",
    }  # fmt: skip
    raw = r.mapping(raw_any, key, allowed)
    if "index" in raw and r.integer(raw["index"], f"{key}.index") != i:
        raise r.fail(f"{key}.index", f"GPUs are listed in index order: expected {i}, got {raw['index']}")
    name = r.string(r.required(raw, "name", key), f"{key}.name")
    uuid = r.string(r.required(raw, "uuid", key), f"{key}.uuid")
    if not GPU_UUID_RE.match(uuid):
        raise r.fail(f"{key}.uuid", f"{uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    minor = r.integer(r.required(raw, "minor", key), f"{key}.minor", minimum=0)
    bus_raw = r.string(r.required(raw, "pci_bus_id", key), f"{key}.pci_bus_id")
    bus = canonical_bus_id(bus_raw)
    if bus is None:
        raise r.fail(f"{key}.pci_bus_id", f"{bus_raw!r} is not a PCI address like 00000000:18:00.0")
    memory = r.integer(r.required(raw, "memory_mib", key), f"{key}.memory_mib", minimum=1)
    numa_raw = raw.get("numa_node")
    numa = None if numa_raw is None else r.integer(numa_raw, f"{key}.numa_node", minimum=0)
    cc_raw = r.sequence(r.required(raw, "compute_capability", key), f"{key}.compute_capability")
    if len(cc_raw) != 2:
        raise r.fail(f"{key}.compute_capability", f"expected [major, minor], got {cc_raw!r}")
    cc = (
        r.integer(cc_raw[0], f"{key}.compute_capability[0]", 1),
        r.integer(cc_raw[1], f"{key}.compute_capability[1]", 0),
    )
    pci_dev = r.integer(
        raw.get("pci_device_id", _PCI_DEVICE_IDS.get(name, 0x000010DE)), f"{key}.pci_device_id", 0
    )
    sup = r.mapping(
        raw.get("supports", {}), f"{key}.supports", {"ecc_events", "retired_pages", "remapped_rows"}
    )
    support = {
        k: r.boolean(sup.get(k, True), f"{key}.supports.{k}")
        for k in ("ecc_events", "retired_pages", "remapped_rows")
    }
    mig_capable = r.boolean(raw.get("mig_capable", mig.catalogue_for(name) is not None), f"{key}.mig_capable")
    catalogue = mig.catalogue_of(name, memory) if mig_capable else None
    mig_enabled, mig_devices = _parse_mig(r, raw.get("mig"), key, name, "GPU-" + uuid[4:].lower(), catalogue)
    pci_class = r.integer(raw.get("pci_class", PCI_CLASS_3D), f"{key}.pci_class", 0)
    if pci_class > 0xFFFFFF:
        raise r.fail(f"{key}.pci_class", f"a PCI class is 24 bits (e.g. 0x030200), got {pci_class:#x}")
    pcie_root = r.string(raw.get("pcie_root", pcitree.default_pcie_root(bus)), f"{key}.pcie_root")
    if not pcitree.PCIE_ROOT_RE.fullmatch(pcie_root):
        raise r.fail(f"{key}.pcie_root", f"{pcie_root!r} is not a root complex like pci0000:00 (lower case)")
    mode = raw.get("addressing_mode")
    return GpuSpec(
        index=i,
        name=name,
        uuid="GPU-" + uuid[4:].lower(),
        minor=minor,
        pci_bus_id=bus,
        memory_mib=memory,
        numa_node=numa,
        compute_capability=cc,
        pci_device_id=pci_dev,
        mig_enabled=mig_enabled,
        mig=mig_devices,
        pci_class=pci_class,
        fabric=_parse_fabric(r, raw.get("fabric"), f"{key}.fabric"),
        brand=_named(r, raw.get("brand", "nvidia"), f"{key}.brand", BRANDS),
        architecture=(
            _named(r, raw["architecture"], f"{key}.architecture", ARCHITECTURES)
            if raw.get("architecture") is not None
            else architecture_for(cc)
        ),
        mig_capable=mig_capable,
        pci_subsystem_id=r.integer(raw.get("pci_subsystem_id", 0), f"{key}.pci_subsystem_id", 0),
        pcie_root=pcie_root,
        addressing_mode=None
        if mode is None
        else _named(r, mode, f"{key}.addressing_mode", pcitree.ADDRESSING_MODES),
        **support,
    )


def _named(r: _Reader, value: Any, key: str, table: dict[str, int]) -> int:
    """A value given by its name in `table` (case-insensitive)."""
    name = r.string(value, key).lower()
    if name not in table:
        raise r.fail(key, f"unknown value {value!r} (known: {sorted(table)})")
    return table[name]


def _parse_fabric(r: _Reader, raw_any: Any, key: str) -> FabricSpec | None:
    if raw_any is None:
        return None
    raw = r.mapping(raw_any, key, {"cluster_uuid", "clique_id", "state", "status"})
    cluster = r.string(r.required(raw, "cluster_uuid", key), f"{key}.cluster_uuid")
    if not UUID_RE.match(cluster):
        raise r.fail(
            f"{key}.cluster_uuid", f"{cluster!r} is not a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )
    clique = r.integer(r.required(raw, "clique_id", key), f"{key}.clique_id", 0)
    if clique > 0xFFFFFFFF:
        raise r.fail(f"{key}.clique_id", f"a clique id is 32 bits, got {clique}")
    state_name = r.string(raw.get("state", "completed"), f"{key}.state")
    if state_name not in FABRIC_STATES:
        raise r.fail(f"{key}.state", f"unknown fabric state {state_name!r} (known: {list(FABRIC_STATES)})")
    status = r.integer(raw.get("status", 0), f"{key}.status", 0)
    return FabricSpec(cluster.lower(), clique, FABRIC_STATES[state_name], status)


def _parse_mig(
    r: _Reader,
    raw_any: Any,
    gkey: str,
    gpu_name: str,
    gpu_uuid: str,
    catalogue: dict[str, mig.MigProfile] | None,
) -> tuple[bool, tuple[MigSpec, ...]]:
    key = f"{gkey}.mig"
    if raw_any is None:
        return False, ()
    raw = r.mapping(raw_any, key, {"enabled", "devices"})
    enabled = r.boolean(raw.get("enabled", True), f"{key}.enabled")
    dev_list = r.sequence(raw.get("devices", []), f"{key}.devices")
    if not enabled:
        if dev_list:
            raise r.fail(f"{key}.devices", "MIG devices listed but MIG is not enabled")
        return False, ()
    if catalogue is None:
        capable = ", ".join(sorted(mig.CATALOGUES))
        raise r.fail(
            f"{key}.enabled",
            f"{gpu_name!r} is not MIG-capable in the simulator (MIG-capable: {capable},"
            " or any GPU whose description says mig_capable: true)",
        )
    profiles: list[mig.MigProfile] = []
    given_starts: list[int | None] = []
    entries: list[dict[str, Any]] = []
    for j, d_any in enumerate(dev_list):
        dkey = f"{key}.devices[{j}]"
        d = r.mapping(d_any, dkey, {"profile", "placement", "gi", "ci", "uuid"})
        pname = r.string(r.required(d, "profile", dkey), f"{dkey}.profile")
        if pname not in catalogue:
            raise r.fail(
                f"{dkey}.profile", f"unknown profile {pname!r} for {gpu_name} (known: {sorted(catalogue)})"
            )
        profiles.append(catalogue[pname])
        start = d.get("placement")
        given_starts.append(None if start is None else r.integer(start, f"{dkey}.placement", 0))
        entries.append(d)
    if all(s is not None for s in given_starts):
        starts = [int(s or 0) for s in given_starts]
        why = mig.check_placements(profiles, starts)
        if why is not None:
            raise r.fail(f"{key}.devices", f"not a valid MIG layout for {gpu_name}: {why}")
    elif any(s is not None for s in given_starts):
        raise r.fail(f"{key}.devices", "give a placement for every MIG device or for none")
    else:
        placed = mig.place(profiles)
        if placed is None:
            layout = [p.name for p in profiles]
            raise r.fail(f"{key}.devices", f"not a valid MIG layout for {gpu_name}: {layout} does not fit")
        starts = placed
    out: list[MigSpec] = []
    seen_gi: set[int] = set()
    for j, (prof, start, d) in enumerate(zip(profiles, starts, entries, strict=True)):
        dkey = f"{key}.devices[{j}]"
        gi = r.integer(d.get("gi", mig.gi_id_for(prof, start)), f"{dkey}.gi", 0)
        ci = r.integer(d.get("ci", 0), f"{dkey}.ci", 0)
        if gi in seen_gi:
            raise r.fail(f"{dkey}.gi", f"GPU instance id {gi} is used twice on this GPU")
        seen_gi.add(gi)
        uuid = d.get("uuid")
        if uuid is None:
            uuid = derived_mig_uuid(gpu_uuid, 0, gi, ci, prof.name)
        uuid = r.string(uuid, f"{dkey}.uuid")
        if not MIG_UUID_RE.match(uuid):
            raise r.fail(
                f"{dkey}.uuid", f"{uuid!r} is not a MIG UUID (MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
            )
        out.append(MigSpec(profile=prof.name, placement=start, gi=gi, ci=ci, uuid="MIG-" + uuid[4:].lower()))
    return True, tuple(out)


def _check_unique(r: _Reader, gpus: tuple[GpuSpec, ...]) -> None:
    seen: dict[str, str] = {}
    for g in gpus:
        for what, value in (("uuid", g.uuid), ("minor", str(g.minor)), ("pci_bus_id", g.pci_bus_id)):
            tag = f"{what}={value}"
            if tag in seen:
                raise r.fail(f"gpus[{g.index}].{what}", f"{value} is also used by {seen[tag]}")
            seen[tag] = f"gpus[{g.index}]"
        for j, m in enumerate(g.mig):
            tag = f"uuid={m.uuid}"
            if tag in seen:
                raise r.fail(
                    f"gpus[{g.index}].mig.devices[{j}].uuid", f"{m.uuid} is also used by {seen[tag]}"
                )
            seen[tag] = f"gpus[{g.index}].mig.devices[{j}]"


def _pair(r: _Reader, raw: Any, key: str, n: int, third: str) -> tuple[int, int, Any]:
    items = r.sequence(raw, key)
    if len(items) != 3:
        raise r.fail(key, f"expected [gpu a, gpu b, {third}], got {items!r}")
    a = r.integer(items[0], f"{key}[0]", 0)
    b = r.integer(items[1], f"{key}[1]", 0)
    for pos, idx in ((0, a), (1, b)):
        if idx >= n:
            raise r.fail(f"{key}[{pos}]", f"no GPU with index {idx} (the node has {n})")
    if a == b:
        raise r.fail(key, "a pair needs two different GPUs")
    return min(a, b), max(a, b), items[2]


def _level(r: _Reader, value: Any, key: str) -> int:
    if not isinstance(value, str) or value.upper() not in ANCESTORS:
        raise r.fail(key, f"unknown topology level {value!r} (known: {list(ANCESTORS)})")
    return ANCESTORS[value.upper()]


@dataclass(frozen=True)
class _Topology:
    ancestors: dict[tuple[int, int], int]
    nvlinks: dict[tuple[int, int], int]
    switch_links: int
    switch_gpus: tuple[int, ...]
    switch_bus_ids: tuple[str, ...]


def _parse_topology(r: _Reader, raw_any: Any, gpus: tuple[GpuSpec, ...]) -> _Topology:
    n = len(gpus)
    raw = r.mapping(
        raw_any if raw_any is not None else {},
        "topology",
        {"default_ancestor", "ancestors", "nvlinks", "nvswitch"},
    )
    default = raw.get("default_ancestor")
    default_level = None if default is None else _level(r, default, "topology.default_ancestor")
    ancestors: dict[tuple[int, int], int] = {}
    for k, item in enumerate(r.sequence(raw.get("ancestors", []), "topology.ancestors")):
        key = f"topology.ancestors[{k}]"
        a, b, lvl = _pair(r, item, key, n, "level")
        if (a, b) in ancestors:
            raise r.fail(key, f"pair ({a}, {b}) is listed twice")
        ancestors[(a, b)] = _level(r, lvl, f"{key}[2]")
    for a in range(n):
        for b in range(a + 1, n):
            if (a, b) not in ancestors:
                if default_level is None:
                    raise r.fail(
                        "topology.ancestors", f"pair ({a}, {b}) is missing (or set topology.default_ancestor)"
                    )
                ancestors[(a, b)] = default_level
    nvlinks: dict[tuple[int, int], int] = {}
    per_gpu = [0] * n
    for k, item in enumerate(r.sequence(raw.get("nvlinks", []), "topology.nvlinks")):
        key = f"topology.nvlinks[{k}]"
        a, b, count_raw = _pair(r, item, key, n, "link count")
        if (a, b) in nvlinks:
            raise r.fail(key, f"pair ({a}, {b}) is listed twice")
        count = r.integer(count_raw, f"{key}[2]", 1)
        nvlinks[(a, b)] = count
        per_gpu[a] += count
        per_gpu[b] += count
    switch_links = 0
    switch_gpus: tuple[int, ...] = ()
    switch_bus: tuple[str, ...] = ()
    if raw.get("nvswitch") is not None:
        sw = r.mapping(raw["nvswitch"], "topology.nvswitch", {"links_per_gpu", "gpus", "bus_ids"})
        switch_links = r.integer(
            r.required(sw, "links_per_gpu", "topology.nvswitch"), "topology.nvswitch.links_per_gpu", 1
        )
        sg = r.sequence(sw.get("gpus", list(range(n))), "topology.nvswitch.gpus")
        switch_gpus = tuple(
            sorted({r.integer(g, f"topology.nvswitch.gpus[{i}]", 0) for i, g in enumerate(sg)})
        )
        for g in switch_gpus:
            if g >= n:
                raise r.fail("topology.nvswitch.gpus", f"no GPU with index {g} (the node has {n})")
            per_gpu[g] += switch_links
        bus_list = r.sequence(r.required(sw, "bus_ids", "topology.nvswitch"), "topology.nvswitch.bus_ids")
        if not bus_list:
            raise r.fail("topology.nvswitch.bus_ids", "at least one NVSwitch is needed")
        gpu_bus = {g.pci_bus_id for g in gpus}
        buses: list[str] = []
        for i, b_raw in enumerate(bus_list):
            bkey = f"topology.nvswitch.bus_ids[{i}]"
            bus = canonical_bus_id(r.string(b_raw, bkey))
            if bus is None or bus in gpu_bus or bus in buses:
                raise r.fail(
                    bkey, f"{b_raw!r} is not a PCI address distinct from the GPUs' and the other switches'"
                )
            buses.append(bus)
        switch_bus = tuple(buses)
    for g, count in enumerate(per_gpu):
        if count > MAX_NVLINKS:
            raise r.fail("topology", f"GPU {g} would have {count} NVLinks, NVML knows at most {MAX_NVLINKS}")
    return _Topology(ancestors, nvlinks, switch_links, switch_gpus, switch_bus)


def _parse_faults(r: _Reader, raw_any: Any, gpus: tuple[GpuSpec, ...]) -> dict[str, frozenset[str]]:
    kinds = ("lost", "pending_retirement", "remapped_rows_pending")
    raw = r.mapping(raw_any if raw_any is not None else {}, "faults", set(kinds))
    known = {g.uuid.lower(): g.uuid for g in gpus}
    out: dict[str, frozenset[str]] = {}
    for kind in kinds:
        uuids: set[str] = set()
        for i, u in enumerate(r.sequence(raw.get(kind, []), f"faults.{kind}")):
            text = r.string(u, f"faults.{kind}[{i}]")
            if text.lower() not in known:
                raise r.fail(f"faults.{kind}[{i}]", f"{text} is not the UUID of a GPU in this description")
            uuids.add(known[text.lower()])
        out[kind] = frozenset(uuids)
    return out
