"""A simulated node's MIG layout kept in a state file (supervisor/sim/nvml/state.py): as a real
driver's MIG layout outlives the processes that made it, a simulator loaded with the file finds
what an earlier one made, and a file it cannot use is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from common.exitcodes import EXIT_CONFIG_ERROR
from supervisor.config import config_from_data
from supervisor.desired.discovery import SIM_STATE_ENV, StartupError, open_nvml
from supervisor.node.migmaker import MigMaker, MigMode
from supervisor.sim.nvml import SimulatorConfigError, load_simulator


def test_instances_made_and_destroyed_outlive_the_simulator(tmp_path: Path) -> None:
    """A second simulator on the same file has the first's instances (same ids, placement and UUID),
    MIG mode, and goes on numbering new UUIDs where the first stopped."""
    path = tmp_path / "state.json"
    first = load_simulator("dgx-h100", state_file=path)
    first.nvmlInit()
    gpu = first.gpu_uuids()[1]
    maker = MigMaker(first)
    kept = maker.create(gpu, 9, 4)
    gone = maker.create(gpu, 19, 0)
    maker.destroy(gpu, gone.gi_id, gone.ci_id)
    second = load_simulator("dgx-h100", state_file=path)
    second.nvmlInit()
    again = MigMaker(second)
    assert again.instances(gpu) == [kept]
    assert again.mig_mode(gpu) == MigMode(True, True)
    assert second.mig_uuids(1) == [kept.uuid]
    assert again.create(gpu, 19, 0).uuid not in (kept.uuid, gone.uuid)
    assert again.instances(second.gpu_uuids()[0]) == []  # the other GPUs as described


def test_a_pending_mig_mode_outlives_the_simulator(tmp_path: Path) -> None:
    """A mode change pending a reset (an A100's) is pending in the next simulator too, and a reset
    there makes it current."""
    path = tmp_path / "state.json"
    first = load_simulator("dgx-a100", state_file=path)
    first.nvmlInit()
    h = first.nvmlDeviceGetHandleByIndex(2)
    assert first.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    second = load_simulator("dgx-a100", state_file=path)
    second.nvmlInit()
    h2 = second.nvmlDeviceGetHandleByIndex(2)
    assert second.nvmlDeviceGetMigMode(h2) == [0, 1]
    second.reset(second.gpu_uuids()[2])
    third = load_simulator("dgx-a100", state_file=path)
    third.nvmlInit()
    assert third.nvmlDeviceGetMigMode(third.nvmlDeviceGetHandleByIndex(2)) == [1, 1]


def test_a_layout_change_by_fault_injection_is_kept(tmp_path: Path) -> None:
    """set_mig_layout (`gpuvisor sim mig`) is a MIG change like any: kept."""
    path = tmp_path / "state.json"
    first = load_simulator("mig-a100", state_file=path)
    uuids = first.set_mig_layout(0, ["7g.80gb"])
    assert load_simulator("mig-a100", state_file=path).mig_uuids(0) == uuids


def test_no_file_means_the_description_and_nothing_is_written_until_a_change(tmp_path: Path) -> None:
    """A missing file is a first start: the description's layout, and no file until MIG changes;
    the write leaves no temporary file beside it."""
    path = tmp_path / "state.json"
    sim = load_simulator("mig-a100", state_file=path)
    assert sim.mig_uuids(0) == load_simulator("mig-a100").mig_uuids(0)
    sim.nvmlInit()
    assert not path.exists()
    MigMaker(sim).destroy(sim.gpu_uuids()[0], 2, 0)
    assert path.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert json.loads(path.read_text())["format"] == "gpuvisor-sim-mig-state/v1"


def _saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    path = tmp_path / "state.json"
    sim = load_simulator("dgx-h100", state_file=path)
    sim.nvmlInit()
    MigMaker(sim).create(sim.gpu_uuids()[0], 9, 0)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(
    ("mangle", "key", "reason"),
    [
        (lambda d, g: "{not json", "(file)", "not JSON"),
        (lambda d, g: {"format": "other"}, "format", "not a simulator state file"),
        (lambda d, g: {**d, "gpus": {"GPU-00000000-0000-0000-0000-000000000000": d["gpus"][g]}}, "gpus[GPU-00000000", "no GPU with this UUID"),
        (lambda d, g: _set(d, g, "created", -1), "created", "expected int"),
        (lambda d, g: _set(d, g, "gpu_instances", [{"gi": 1, "profile": "9g.1gb", "start": 0}]), "profile", "unknown profile"),
        (lambda d, g: _set(d, g, "gpu_instances", [{"gi": 1, "profile": "4g.40gb", "start": 0}, {"gi": 2, "profile": "3g.40gb", "start": 0}]), "gpu_instances", "not a valid MIG layout"),
        (lambda d, g: _set(d, g, "gpu_instances", []), "mig_devices[0]", "no GPU instance 1"),
        (lambda d, g: _set(d, g, "mig_enabled", False), "gpus[GPU-", "MIG mode is off"),
    ],
)  # fmt: skip
def test_a_corrupt_file_is_a_clear_error(tmp_path: Path, mangle: object, key: str, reason: str) -> None:
    """A file that is not JSON, not this format, names an unknown GPU, a bad field, an unknown
    profile, an overlapping layout, a MIG device without its GPU instance, or instances with MIG
    off raises SimulatorConfigError naming the file, the key and why."""
    path, data = _saved(tmp_path)
    gpu = next(u for u, v in data["gpus"].items() if v["gpu_instances"])  # type: ignore[attr-defined]
    bad = mangle(data, gpu)  # type: ignore[operator]
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(SimulatorConfigError) as err:
        load_simulator("dgx-h100", state_file=path)
    assert err.value.file == str(path)
    assert key in err.value.key and reason in err.value.reason


def _set(data: dict[str, object], gpu: str, key: str, value: object) -> dict[str, object]:
    gpus = dict(data["gpus"])  # type: ignore[call-overload]
    gpus[gpu] = {**gpus[gpu], key: value}
    return {**data, "gpus": gpus}


def test_the_supervisor_takes_the_file_from_the_environment_and_refuses_a_corrupt_one(tmp_path: Path) -> None:
    """`gpuvisor run --simulate` with GPUVISOR_SIMULATE_STATE keeps the layout there; a corrupt file
    ends the start with a config error naming the variable and the file, not a traceback."""
    path = tmp_path / "state.json"
    config = config_from_data(
        {"version": "v1", "gpuvisor": {"simulate": "dgx-h100"}}, flags={}, source="test"
    )
    module, sim = open_nvml(config, {SIM_STATE_ENV: str(path)})
    assert sim is not None
    module.nvmlInit()
    MigMaker(module).create(sim.gpu_uuids()[0], 19, 0)
    assert path.exists()
    path.write_text("garbage")
    with pytest.raises(StartupError) as err:
        open_nvml(config, {SIM_STATE_ENV: str(path)})
    assert err.value.code == EXIT_CONFIG_ERROR
    assert SIM_STATE_ENV in str(err.value) and str(path) in str(err.value) and "not JSON" in str(err.value)
