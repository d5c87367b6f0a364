"""The NVML simulator: a stand-in for the `pynvml` module, driven by a node description.

`load_simulator("dgx-h100")` (or a path to a YAML file) returns a `Simulator` that the NVML
adapter (`supervisor.node.nvml.Nvml`) uses exactly as it uses the real `pynvml` module, plus fault
injection: `inject_xid`, `inject_ecc`, `lose`, `restore`, `reset`, `set_pending_retirement`,
`set_remapped_rows_pending`, `set_row_remap_failure`, `set_mig_layout`, `set_processes`,
`create_instance`/`mig_instances`, to make a MIG device by hand (through `supervisor.node.migmaker`),
`fail`/`clear_failures`. MIG on demand (`nvmlDeviceCreateGpuInstanceWithPlacement`, ...,
`nvmlDeviceSetMigMode`) follows NVML's rules and codes (`migcreate`).

Its modules: `core` (the `Simulator` object), `base` (handles, per-GPU state, the decorator every
NVML function wears), `devices`, `migfuncs`, `migcreate` and `events` (the NVML functions by
area; `migcreate`: creating and destroying MIG instances, MIG mode changes), `faults`
(fault injection), `mig` (MIG profile catalogues and placement), `state` (the MIG layout kept in a
file across restarts: `load_simulator(profile, state_file=PATH)`), `config` (loading and checking
a node description), `pcitree` (the node's PCIe tree written out as a sysfs directory:
`Simulator.write_sysfs(root)`, then `Nvml(sim, sysfs_root=root)` or `--sysfs-root`), `mockprofile` (NVIDIA's mock NVML profiles read as descriptions) and
`profiles` (the built-in descriptions, as package data).

The same descriptions drive the project's fake libnvidia-ml (`tests/fakenvml/`), so the real
`nvidia-ml-py` binding can run over the very node the simulator describes. A node profile of
NVIDIA's mock NVML (`mock-nvml-config-<p>.yaml`, recognised by its `system` and `device_defaults`
sections) is accepted wherever a description is, translated as `mockprofile` says.

Built-in profiles (`list_profiles()`): `dgx-h100`, `dgx-a100`, `pcie-l4`, `mig-a100`, `gh200`
(a coherent-memory node: NVML reports ATS addressing), stored as
YAML files in `supervisor/sim/nvml/profiles/`.

Node description format (YAML; unknown keys are errors, so typos are caught)::

    name: my-node                    # optional, defaults to the file name
    description: free text           # optional
    driver_version: "550.54.15"      # nvmlSystemGetDriverVersion
    cuda_driver_version: 12040       # nvmlSystemGetCudaDriverVersion (optional, 12040)
    nvml_version: "12.550.54.15"     # nvmlSystemGetNVMLVersion (optional, "<CUDA major>.<driver>")
    gpus:                            # in index order
      - name: NVIDIA A100-SXM4-80GB  # nvmlDeviceGetName; MIG needs a known MIG-capable model
        uuid: GPU-3c1a1f4e-8f7d-4b5e-9a2c-1d2e3f405061
        minor: 0                     # /dev/nvidia<minor>
        pci_bus_id: "00000000:07:00.0"
        memory_mib: 81920
        numa_node: 0                 # or null: nvmlDeviceGetNumaNodeId raises NotSupported
        compute_capability: [8, 0]
        pci_device_id: 0x20B210DE    # optional
        pci_subsystem_id: 0x147E10DE # optional, 0
        brand: nvidia                # optional: nvmlBrandType_t by name (nvidia, tesla, geforce, ...)
        architecture: ampere         # optional: by name; derived from compute_capability by default
        mig_capable: true            # optional: true for models with a MIG table (mig.py); a model
                                     # without one gets profiles derived from its memory
        pci_class: 0x030200          # optional: 0x030200 3D controller (compute mode, the default) or
                                     # 0x030000 VGA controller (graphics mode); nvmlDeviceGetPciInfoExt
        pcie_root: pci0000:00        # optional: its PCIe root complex in the simulated sysfs (pcitree);
                                     # default: its domain and its bus rounded down to 16 (pci0000:00)
        addressing_mode: ats         # optional: nvmlDeviceGetAddressingMode (none | hmm | ats), as on
                                     # coherent-memory systems; absent: NotSupported
        fabric:                      # optional: NVLink fabric registration (IMEX), nvmlDeviceGetGpuFabricInfo;
          cluster_uuid: 7b968a6d-c8aa-45e1-9e07-e1e51be99c31   # absent: NotSupported, as on PCIe GPUs
          clique_id: 1
          state: completed           # not_started | in_progress | completed (default)
          status: 0                  # NVML return code of the registration (default 0: success)
        supports:                    # optional, all true by default
          ecc_events: true           # SBE/DBE events registrable
          retired_pages: true        # nvmlDeviceGetRetiredPagesPendingStatus answers
          remapped_rows: true        # nvmlDeviceGetRemappedRows answers
        mig:                         # optional
          enabled: true
          devices:                   # in MIG device index order
            - profile: 3g.40gb
              placement: 4           # first memory slice; optional (then all are computed)
              gi: 2                  # optional, derived from the placement
              ci: 0                  # optional, 0
              uuid: MIG-...          # optional, derived deterministically
    topology:
      default_ancestor: SYSTEM       # optional: level for pairs not listed below
      ancestors:                     # [a, b, INTERNAL|SINGLE|MULTIPLE|HOSTBRIDGE|NODE|SYSTEM]
        - [0, 1, SINGLE]             # every pair unless default_ancestor is set
      nvlinks:                       # direct GPU-to-GPU links: [a, b, count]
        - [0, 1, 4]
      nvswitch:                      # optional: GPUs wired to NVSwitches
        links_per_gpu: 18
        gpus: [0, 1, 2, 3]           # optional, all GPUs
        bus_ids: ["00000000:C5:00.0"]  # the switches' PCI addresses
    faults:                          # optional state at start, by GPU UUID
      lost: []
      pending_retirement: []
      remapped_rows_pending: []

A bad description raises `SimulatorConfigError` with `.file`, `.key` and `.reason`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from supervisor.sim.nvml.base import SimDeviceHandle, SimEventData, SimEventSet
from supervisor.sim.nvml.config import NodeSpec, SimulatorConfigError, load_spec, parse_spec
from supervisor.sim.nvml.core import Simulator

__all__ = [
    "NodeSpec",
    "SimDeviceHandle",
    "SimEventData",
    "SimEventSet",
    "Simulator",
    "SimulatorConfigError",
    "list_profiles",
    "load_simulator",
]

_PROFILES_PACKAGE = "supervisor.sim.nvml.profiles"


def list_profiles() -> list[str]:
    """Names of the built-in node profiles."""
    root = resources.files(_PROFILES_PACKAGE)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_simulator(profile_or_path: str, state_file: str | Path | None = None) -> Simulator:
    """A fresh simulator for a built-in profile name or a path to a node description; with a
    `state_file`, its MIG layout is kept there and restored from it (`state`)."""
    sim = _load(profile_or_path)
    if state_file is not None:
        sim.keep_state(state_file)
    return sim


def _load(profile_or_path: str) -> Simulator:
    if profile_or_path in list_profiles():
        resource = resources.files(_PROFILES_PACKAGE).joinpath(f"{profile_or_path}.yaml")
        return Simulator(parse_spec(resource.read_text(encoding="utf-8"), f"profile {profile_or_path}"))
    path = Path(profile_or_path)
    if not path.exists() and path.suffix == "" and "/" not in profile_or_path:
        raise SimulatorConfigError(
            profile_or_path,
            "(profile)",
            f"no such built-in profile (known: {', '.join(list_profiles())}) and no such file",
        )
    return Simulator(load_spec(path))
