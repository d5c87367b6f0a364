"""The CDI spec for the devices gpuvisor advertises (`cdi-annotations` / `cdi-cri` list strategies).

With a CDI list strategy, Allocate answers `k8s.device-plugin.nvidia.com/gpu=<id>` names and the
container runtime looks them up in a CDI spec file; this module writes that file. One CDI device
per device ID the workers hand out: the backing UUID (replica suffix dropped) under the uuid
strategy, `i` / `i:j` under the index strategy, so all replicas of a GPU collapse into one CDI
device. Each device's edits hold its device nodes (the GPU node, plus the GI and CI capability
nodes for a MIG device); the spec-wide edits hold what NVIDIA's plugin puts there: the control
nodes that exist under the dev root, the driver's files, env and hooks (common/driverfiles.py),
and `NVIDIA_VISIBLE_DEVICES=void`, which keeps a legacy-mode NVIDIA runtime hook from adding GPUs
of its own when the image sets `NVIDIA_VISIBLE_DEVICES=all` (as CUDA images do).

`--cdi-nvidia-ctk` delegates the whole file to `nvidia-ctk cdi generate` with the same vendor,
class and naming; its output is checked with the same validator and must name every device ID we
hand out, else we fall back to our own.

The file is written atomically (a temp file in the same directory, then rename), replaced on
reload, and deliberately never deleted: a container that restarts while gpuvisor is down still
needs its CDI devices to resolve. Supervisor and worker never import each other, so the two small
helpers shared in spirit with worker/allocate.py (the MIG minors parser and the dev-root join)
are written again here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from common.cdispec import spec_problems as spec_problems  # the rules, shared with the DRA worker
from common.devnodes import host_path, read_mig_minors
from common.driverfiles import (
    DriverFiles,
    cdi_version,
    common_edits,
    control_nodes,
    device_node,
    discover,
    readable_root,
)
from common.imex import IMEX_CLASS, ImexChannel, char_device_problem, select_channels
from common.model import AllocatableDevice, ResourcePlan
from supervisor.cdi.strategy import CDI_STRATEGIES, cdi_plans
from supervisor.cdi.strategy import CdiError as CdiError  # the spec's error, raised here too

log = logging.getLogger("gpuvisor.cdi")

CDI_VENDOR = "k8s.device-plugin.nvidia.com"
CDI_CLASS = "gpu"
# 0.5.0 is the first CDI version with `hostPath` on device nodes, which a dev root needs.
CDI_VERSION = "0.5.0"
FORMATS = ("json", "yaml")
MIG_CAPS_DIR = "/dev/nvidia-caps"
DEVICE_PERMISSIONS = "rw"
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"


# --- what the spec holds ------------------------------------------------------------------------


def cdi_device_id(device: AllocatableDevice, id_strategy: str) -> str:
    """The CDI device name Allocate uses for this device: exactly worker/allocate.py's list ID."""
    return device.index if id_strategy == "index" else device.uuid


def _node(container_path: str, dev_root: str) -> dict[str, Any]:
    """The node as the toolkit writes it where it is a device, else path, hostPath and `rw`."""
    found = device_node(container_path, dev_root)
    if found is not None:
        return found
    return {
        "path": container_path,
        "hostPath": host_path(dev_root, container_path),
        "permissions": DEVICE_PERMISSIONS,
    }


def plan_driver_files(plan: ResourcePlan, ctr_root: str = "") -> DriverFiles:
    """The driver's files for a plan's spec: read where this process sees the driver root
    (`ctr_root` when it is mounted there), host paths under the plan's driver root, the plan's
    hook binary."""
    settings = plan.allocate
    root = readable_root(settings.driver_root, ctr_root)
    files = discover(root, host_root=settings.driver_root, hook_path=settings.nvidia_ctk_path)
    if files.missing:
        log.warning("the CDI spec carries no driver files: %s", files.missing)
    return files


def build_spec(
    plans: Mapping[str, ResourcePlan],
    *,
    driver_files: DriverFiles | None = None,
    ctr_root: str = "",
    minors_reader: Callable[[str], dict[str, int]] = read_mig_minors,
) -> dict[str, Any]:
    """The CDI spec (as a dict) for every device of the plans that use a CDI list strategy:
    each device's nodes, and spec-wide the control nodes, the driver's files and hooks
    (common/driverfiles.py; `driver_files`, else found under the first plan's driver root) and
    `NVIDIA_VISIBLE_DEVICES=void`, as NVIDIA's plugin writes them.

    Raises CdiError when no plan needs CDI, or when a MIG device's capability minors cannot be
    found (a MIG device without its capability nodes would not work in the container).
    """
    wanted = cdi_plans(plans)
    if not wanted:
        raise CdiError("no resource uses a CDI device list strategy (cdi-annotations or cdi-cri)")
    dev_root = wanted[0].allocate.dev_root
    devices: dict[str, list[dict[str, Any]]] = {}
    minors: dict[str, dict[str, int]] = {}  # per minors-file path, read once
    for plan in sorted(wanted, key=lambda p: p.resource):
        settings = plan.allocate
        for device in plan.devices:
            if not device.uuid:
                continue  # a MIG placement not made yet (MIG on demand): its claim's spec names it once made
            name = cdi_device_id(device, settings.device_id_strategy)
            if name in devices:
                continue  # a replica of a device already listed: one CDI device per backing device
            nodes = [_node(f"/dev/nvidia{device.gpu_minor}", settings.dev_root)]
            if device.is_mig:
                path = settings.mig_minors_path
                if path not in minors:
                    try:
                        minors[path] = minors_reader(path)
                    except OSError as exc:
                        raise CdiError(
                            f"cannot build the CDI spec: MIG device {device.uuid} (index {device.index}) of "
                            f"{plan.resource} needs its capability device nodes, but the MIG minors file "
                            f"{path} cannot be read: {exc.strerror or exc}"
                        ) from None
                gpu = f"gpu{device.gpu_minor}"
                for key in (
                    f"{gpu}/gi{device.mig_gi}/access",
                    f"{gpu}/gi{device.mig_gi}/ci{device.mig_ci}/access",
                ):
                    minor = minors[path].get(key)
                    if minor is None:
                        raise CdiError(
                            f"cannot build the CDI spec: MIG device {device.uuid} (index {device.index}) of "
                            f"{plan.resource}: no entry {key!r} in the MIG minors file {path}"
                        )
                    nodes.append(_node(f"{MIG_CAPS_DIR}/nvidia-cap{minor}", settings.dev_root))
            devices[name] = nodes
    files = plan_driver_files(wanted[0], ctr_root) if driver_files is None else driver_files
    spec: dict[str, Any] = {
        "cdiVersion": CDI_VERSION,
        "kind": f"{CDI_VENDOR}/{CDI_CLASS}",
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": nodes}} for name, nodes in devices.items()
        ],
        "containerEdits": common_edits(files, control_nodes(dev_root), [VOID_ENV]),
    }
    spec["cdiVersion"] = cdi_version(spec)
    return spec


def build_imex_spec(
    plans: Mapping[str, ResourcePlan], problem: Callable[[str], str | None] = char_device_problem
) -> dict[str, Any] | None:
    """The `imex-channel` CDI spec NVIDIA writes beside the GPU one (internal/cdi/imex.go): one
    device per configured channel whose node exists (common.imex), named by its ID, with its node.
    None when no CDI plan has an IMEX channel: Allocate then names no imex-channel device."""
    wanted = cdi_plans(plans)
    channels: dict[str, ImexChannel] = {}
    for plan in wanted:
        settings = plan.allocate
        for channel in select_channels(settings.imex_channel_ids, settings.dev_root, False, problem):
            channels.setdefault(channel.id, channel)
    if not channels:
        return None
    dev_root = wanted[0].allocate.dev_root
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{CDI_VENDOR}/{IMEX_CLASS}",
        "devices": [
            # As NVIDIA's: path and host path only (the CDI default permissions).
            {
                "name": c.id,
                "containerEdits": {
                    "deviceNodes": [{"path": c.path, "hostPath": host_path(dev_root, c.path)}]
                },
            }
            for c in channels.values()
        ],
    }


def expected_device_names(plans: Mapping[str, ResourcePlan]) -> set[str]:
    """Every CDI device name the workers' Allocate responses can name."""
    names: set[str] = set()
    for plan in plans.values():
        if CDI_STRATEGIES.intersection(plan.allocate.device_list_strategies):
            names.update(cdi_device_id(d, plan.allocate.device_id_strategy) for d in plan.devices if d.uuid)
    return names


# --- validation -----------------------------------------------------------------------------------


def validate_spec(spec: object, source: str = "CDI spec") -> None:
    """Raise CdiError naming every rule `spec` breaks."""
    problems = spec_problems(spec)
    if problems:
        raise CdiError(f"invalid {source}: " + "; ".join(problems))


# --- files ----------------------------------------------------------------------------------------


def spec_basename(cdi_class: str = CDI_CLASS) -> str:
    return f"{CDI_VENDOR}-{cdi_class}"


def spec_path(spec_dir: str, fmt: str = "json", cdi_class: str = CDI_CLASS) -> str:
    """Where our spec of a class lives: `<dir>/k8s.device-plugin.nvidia.com-<class>.<json|yaml>`."""
    if fmt not in FORMATS:
        raise CdiError(f"unknown CDI spec format {fmt!r}: use json or yaml")
    return os.path.join(spec_dir, f"{spec_basename(cdi_class)}.{fmt}")


def render_spec(spec: Mapping[str, Any], fmt: str) -> str:
    if fmt == "yaml":
        import yaml  # only for the yaml format: JSON is the default

        return yaml.safe_dump(dict(spec), sort_keys=False, default_flow_style=False)
    return json.dumps(spec, indent=2) + "\n"


def _install(tmp: str, final: str, spec_dir: str, fmt: str, cdi_class: str) -> None:
    os.chmod(tmp, 0o644)
    os.replace(tmp, final)
    # Two files of one kind make the runtime refuse the kind: drop ours in the other format.
    for other in FORMATS:
        if other != fmt:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec_path(spec_dir, other, cdi_class))


def _temp_in(spec_dir: str, cdi_class: str) -> str:
    # A dot name: the CDI registry only reads *.json / *.yaml, so a half-written file is never loaded.
    fd, tmp = tempfile.mkstemp(prefix=f".{spec_basename(cdi_class)}.", suffix=".tmp", dir=spec_dir)
    os.close(fd)
    return tmp


def _make_dir(spec_dir: str) -> None:
    try:
        os.makedirs(spec_dir, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise CdiError(f"cannot create the CDI spec directory {spec_dir}: {exc.strerror or exc}") from None


def write_spec(spec: Mapping[str, Any], spec_dir: str, fmt: str = "json") -> str:
    """Validate and write `spec` atomically (temp file in the same dir, fsync, rename; mode 0644).

    Returns the path, named by the spec's class. A reader sees the old file or the new one, never
    a partial one.
    """
    validate_spec(spec)
    cdi_class = str(spec["kind"]).partition("/")[2] or CDI_CLASS
    final = spec_path(spec_dir, fmt, cdi_class)
    _make_dir(spec_dir)
    text = render_spec(spec, fmt)
    tmp = _temp_in(spec_dir, cdi_class)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        _install(tmp, final, spec_dir, fmt, cdi_class)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CdiError(f"cannot write the CDI spec {final}: {exc.strerror or exc}") from None
    return final


def load_spec_file(path: str) -> object:
    import yaml  # JSON is YAML: one reader for both formats (nvidia-ctk's output is checked with it)

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        return yaml.safe_load(text)  # JSON is YAML
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CdiError(f"cannot read the CDI spec {path}: {exc}") from None


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def generate_with_nvidia_ctk(
    ctk: str,
    spec_dir: str,
    *,
    id_strategy: str,
    driver_root: str,
    expected_names: Iterable[str],
    fmt: str = "json",
    runner: Runner = subprocess.run,
    timeout: float = 120.0,
) -> str:
    """Have `nvidia-ctk cdi generate` write the full spec (driver libraries, hooks) with our vendor,
    class and device naming; check it, then install it atomically. Returns the path.

    Raises CdiError when the tool fails, or when its output is invalid or lacks a device name
    that Allocate hands out.
    """
    final = spec_path(spec_dir, fmt)
    _make_dir(spec_dir)
    # nvidia-ctk may add the format's extension to an output name that lacks it, so give it a
    # proper name, in a private subdirectory of the spec dir: the CDI registry does not descend
    # into subdirectories (no half-written spec is ever loaded) and the rename stays on one
    # filesystem.
    try:
        work = tempfile.mkdtemp(prefix=".gpuvisor-cdi-", dir=spec_dir)
    except OSError as exc:
        raise CdiError(f"cannot write in the CDI spec directory {spec_dir}: {exc.strerror or exc}") from None
    tmp = os.path.join(work, os.path.basename(final))
    argv = [
        ctk, "cdi", "generate",
        f"--output={tmp}",
        f"--format={fmt}",
        f"--vendor={CDI_VENDOR}",
        f"--class={CDI_CLASS}",
        f"--device-name-strategy={'index' if id_strategy == 'index' else 'uuid'}",
        f"--driver-root={driver_root}",
    ]  # fmt: skip
    try:
        try:
            done = runner(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CdiError(f"{' '.join(argv[:3])} failed: {exc}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout or "").strip().splitlines()
            raise CdiError(
                f"{' '.join(argv[:3])} exited with status {done.returncode}: {detail[-1] if detail else 'no output'}"
            )
        spec = load_spec_file(tmp)
        validate_spec(spec, f"CDI spec from {ctk}")
        assert isinstance(spec, dict)  # validate_spec checked it
        if spec.get("kind") != f"{CDI_VENDOR}/{CDI_CLASS}":
            raise CdiError(
                f"the CDI spec from {ctk} has kind {spec.get('kind')!r}, not {CDI_VENDOR}/{CDI_CLASS}"
            )
        names = {d.get("name") for d in spec.get("devices", []) if isinstance(d, dict)}
        missing = sorted(set(expected_names) - names)
        if missing:
            raise CdiError(
                f"the CDI spec from {ctk} lacks device(s) {', '.join(missing)} that Allocate hands out"
            )
        try:
            _install(tmp, final, spec_dir, fmt, CDI_CLASS)
        except OSError as exc:
            raise CdiError(f"cannot write the CDI spec {final}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def find_nvidia_ctk(path: str) -> str | None:
    """The nvidia-ctk to run: `path` if it is an executable file, else `nvidia-ctk` on PATH, else None."""
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return shutil.which(os.path.basename(path) or "nvidia-ctk")


class CdiSpecWriter:
    """Keeps the spec file in step with the plans: call `sync(plans)` at start and on every reload.

    `use_nvidia_ctk` asks for delegation to `nvidia-ctk cdi generate`; when the tool is missing or
    its output does not do, the own spec is written and a log line says why.
    """

    def __init__(
        self,
        spec_dir: str,
        *,
        fmt: str = "json",
        use_nvidia_ctk: bool = False,
        runner: Runner = subprocess.run,
        ctr_root: str = "",
        minors_reader: Callable[[str], dict[str, int]] = read_mig_minors,
    ) -> None:
        if fmt not in FORMATS:
            raise CdiError(f"unknown CDI spec format {fmt!r}: use json or yaml")
        self.spec_dir = spec_dir
        self.fmt = fmt
        self.use_nvidia_ctk = use_nvidia_ctk
        self._runner = runner
        self._ctr_root = ctr_root  # where the driver root is mounted in this container
        self._minors_reader = minors_reader
        self.last_text: str | None = None  # what we last wrote ourselves (to skip identical rewrites)
        self.imex_text: str | None = None  # likewise for the imex-channel spec
        self.source = ""  # "gpuvisor" or "nvidia-ctk": who wrote the current file

    def sync(self, plans: Mapping[str, ResourcePlan]) -> str | None:
        """Write (or replace) the spec for these plans; None when no plan uses CDI (a file left by
        an earlier config stays: removing it could break containers that still name its devices).

        Raises CdiError when the spec cannot be built or written; the old file then stays.
        """
        wanted = cdi_plans(plans)
        if not wanted:
            return None
        self._sync_imex(plans)
        first = wanted[0]
        if self.use_nvidia_ctk:
            ctk = find_nvidia_ctk(first.allocate.nvidia_ctk_path)
            if ctk is None:
                log.warning(
                    "nvidia-ctk not found at %s nor on PATH: writing gpuvisor's own CDI spec",
                    first.allocate.nvidia_ctk_path,
                )
            else:
                try:
                    path = generate_with_nvidia_ctk(
                        ctk,
                        self.spec_dir,
                        id_strategy=first.allocate.device_id_strategy,
                        driver_root=first.allocate.driver_root,
                        expected_names=expected_device_names(plans),
                        fmt=self.fmt,
                        runner=self._runner,
                    )
                except CdiError as exc:
                    log.warning("%s; writing gpuvisor's own CDI spec instead", exc)
                else:
                    self.source, self.last_text = "nvidia-ctk", None
                    log.info("CDI spec written by %s: %s", ctk, path)
                    return path
        spec = build_spec(plans, ctr_root=self._ctr_root, minors_reader=self._minors_reader)
        path = spec_path(self.spec_dir, self.fmt)
        text = render_spec(spec, self.fmt)
        if text == self.last_text and self.source == "gpuvisor" and os.path.exists(path):
            return path
        write_spec(spec, self.spec_dir, self.fmt)
        self.source, self.last_text = "gpuvisor", text
        log.info("CDI spec written: %s (%d device(s))", path, len(spec["devices"]))
        return path

    def _sync_imex(self, plans: Mapping[str, ResourcePlan]) -> None:
        """The imex-channel spec, when a CDI plan injects IMEX channels (ours whatever writes the GPU one)."""
        spec = build_imex_spec(plans)
        if spec is None:
            return
        text = render_spec(spec, self.fmt)
        if text == self.imex_text and os.path.exists(spec_path(self.spec_dir, self.fmt, IMEX_CLASS)):
            return
        path = write_spec(spec, self.spec_dir, self.fmt)
        self.imex_text = text
        log.info("CDI spec written: %s (%d IMEX channel(s))", path, len(spec["devices"]))


def cdi_names(plans: Mapping[str, ResourcePlan]) -> Sequence[str]:
    """The qualified CDI names (`vendor/class=name`) of the plans' devices, sorted (for status output)."""
    return sorted(f"{CDI_VENDOR}/{CDI_CLASS}={n}" for n in expected_device_names(plans))
