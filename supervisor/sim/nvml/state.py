"""A simulated node's MIG layout kept in a file, as a real driver's outlives the processes using it.

A simulator given a state file (`load_simulator(profile, state_file=PATH)`; `gpuvisor run` takes
it from the environment variable `GPUVISOR_SIMULATE_STATE`) writes every MIG change made at run
time to it: the GPU and compute instances created and destroyed, MIG mode current and pending,
and the counters the UUIDs of new instances derive from. A simulator that starts with the file
present takes its MIG layout from it instead of the description's, so a supervisor killed after
creating an instance and started again finds the instance there, with the same UUID.

The file is JSON, written whole to a temporary file beside it and renamed over it (atomic on
POSIX), so a crash mid-write leaves the previous state. A file that cannot be read, is not this
format, names a GPU the description does not have, or holds a layout the GPU's MIG rules refuse
raises `SimulatorConfigError` naming the file, the key and why. What is not MIG (lost GPUs,
processes, pending retirements) is not kept: a restart of the driver's users does not keep it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.sim.nvml import mig
from supervisor.sim.nvml.config import MIG_UUID_RE, MigSpec, SimulatorConfigError

FORMAT = "gpuvisor-sim-mig-state/v1"
MAX_BYTES = 1 << 20  # a node of 64 GPUs with 7 instances each is a few tens of KiB


@dataclass(frozen=True)
class Restored:
    """One GPU's MIG state as the file holds it, checked against the node."""

    index: int  # the GPU's index in the node
    mig_enabled: bool
    mig_pending: bool
    created: int
    generation: int
    gpu_instances: dict[int, tuple[str, int]]  # GPU instance id -> (profile, first memory slice)
    mig_devices: tuple[MigSpec, ...]


def snapshot(gpus: list[Any]) -> dict[str, Any]:
    """The MIG part of the node's state (`base.GpuState` per GPU), as the file holds it."""
    out: dict[str, Any] = {}
    for state in gpus:
        out[state.spec.uuid] = {
            "mig_enabled": state.mig_enabled,
            "mig_pending": state.mig_pending,
            "created": state.created,
            "generation": state.mig_generation,
            "gpu_instances": [
                {"gi": gi, "profile": r.profile, "start": r.start} for gi, r in state.gis.items()
            ],
            "mig_devices": [
                {"gi": m.gi, "ci": m.ci, "profile": m.profile, "placement": m.placement, "uuid": m.uuid}
                for m in state.mig
            ],
        }
    return {"format": FORMAT, "gpus": out}


def write(path: Path, data: dict[str, Any]) -> None:
    """Write the state atomically: a temporary file in the same directory, then a rename."""
    text = json.dumps(data, sort_keys=True, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: Path) -> dict[str, Any] | None:
    """The file's contents, None where there is no file yet; SimulatorConfigError if unreadable."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SimulatorConfigError(name, "(file)", f"cannot read the simulator state file: {exc}") from None
    if len(raw) > MAX_BYTES:
        raise SimulatorConfigError(
            name, "(file)", f"larger than {MAX_BYTES} bytes: not a simulator state file"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SimulatorConfigError(
            name, "(file)", f"not JSON ({exc}): a corrupt simulator state file"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SimulatorConfigError(name, "format", f"not a simulator state file (expected format {FORMAT!r})")
    if not isinstance(data.get("gpus"), dict):
        raise SimulatorConfigError(name, "gpus", "expected a mapping of GPU UUID to its MIG state")
    return data


def _field(name: str, raw: dict[str, Any], key: str, where: str, kind: type) -> Any:
    value: Any = raw.get(key)
    if (
        not isinstance(value, kind)
        or isinstance(value, bool) != (kind is bool)
        or (isinstance(value, int) and value < 0)
    ):
        raise SimulatorConfigError(name, f"{where}.{key}", f"expected {kind.__name__}, got {value!r}")
    return value


def check(name: str, data: dict[str, Any], gpus: list[Any]) -> list[Restored]:
    """Check the file's MIG state against the node (`base.GpuState` per GPU): what to restore.

    Every GPU the file names must be one of the node's and MIG-capable; its GPU instances must be
    a valid layout of its profiles, and every MIG device must sit on one of them."""
    by_uuid = {g.spec.uuid: g for g in gpus}
    out: list[Restored] = []
    for uuid, raw in data["gpus"].items():
        where = f"gpus[{uuid}]"
        state = by_uuid.get(uuid)
        if state is None:
            raise SimulatorConfigError(name, where, "no GPU with this UUID in the node description")
        if not isinstance(raw, dict):
            raise SimulatorConfigError(name, where, "expected a mapping")
        cat = state.spec.catalogue
        if cat is None:
            raise SimulatorConfigError(
                name, where, f"{state.spec.name} is not MIG-capable in this description"
            )
        for key in ("mig_enabled", "mig_pending"):
            _field(name, raw, key, where, bool)
        for key in ("created", "generation"):
            _field(name, raw, key, where, int)
        gis: dict[int, tuple[str, int]] = {}
        for k, g in enumerate(_field(name, raw, "gpu_instances", where, list)):
            gkey = f"{where}.gpu_instances[{k}]"
            if not isinstance(g, dict):
                raise SimulatorConfigError(name, gkey, "expected a mapping")
            gi, prof, start = (
                _field(name, g, "gi", gkey, int), _field(name, g, "profile", gkey, str), _field(name, g, "start", gkey, int),
            )  # fmt: skip
            if prof not in cat:
                raise SimulatorConfigError(
                    name, f"{gkey}.profile", f"unknown profile {prof!r} for {state.spec.name}"
                )
            if gi in gis:
                raise SimulatorConfigError(name, f"{gkey}.gi", f"GPU instance {gi} is listed twice")
            gis[gi] = (prof, start)
        why = mig.check_placements([cat[p] for p, _ in gis.values()], [s for _, s in gis.values()])
        if why is not None:
            raise SimulatorConfigError(name, f"{where}.gpu_instances", f"not a valid MIG layout: {why}")
        devices = []
        for k, d in enumerate(_field(name, raw, "mig_devices", where, list)):
            dkey = f"{where}.mig_devices[{k}]"
            if not isinstance(d, dict):
                raise SimulatorConfigError(name, dkey, "expected a mapping")
            gi = _field(name, d, "gi", dkey, int)
            m = MigSpec(
                profile=_field(name, d, "profile", dkey, str), placement=_field(name, d, "placement", dkey, int),
                gi=gi, ci=_field(name, d, "ci", dkey, int), uuid=_field(name, d, "uuid", dkey, str),
            )  # fmt: skip
            if gis.get(gi) != (m.profile, m.placement):
                raise SimulatorConfigError(
                    name, dkey, f"no GPU instance {gi} of {m.profile} at {m.placement} under it"
                )
            if not MIG_UUID_RE.match(m.uuid):
                raise SimulatorConfigError(name, f"{dkey}.uuid", f"{m.uuid!r} is not a MIG UUID")
            devices.append(m)
        if (gis or devices) and not raw["mig_enabled"]:
            raise SimulatorConfigError(name, where, "instances listed but MIG mode is off")
        out.append(
            Restored(
                state.spec.index, raw["mig_enabled"], raw["mig_pending"], raw["created"], raw["generation"],
                gis, tuple(devices),
            )
        )  # fmt: skip
    return out
