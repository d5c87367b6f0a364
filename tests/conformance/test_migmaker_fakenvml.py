"""MIG on demand's maker (supervisor/node/migmaker.py) through both NVML doubles: the unmodified
`nvidia-ml-py` binding over the project's C libnvidia-ml in a child process, and the Python
simulator here. The same code runs on a GPU node over the real library; the ctypes handles,
structures and arrays are the binding's own in the child.

Each scenario is written once over (`nvml`: the binding or the simulator, `control`: the library's
control file or the simulator's fault injection) and returns a transcript of what MigMaker
answered (its MadeMigRecord, or MigError's kind, code and message); the scenario checks NVML's rules as
it goes (nvml.h and NVIDIA's DRA driver v25.12.0 nvlib.go createMigDevice/deleteMigDevice, as
tests/unit/test_migmaker.py cites them), and both backends' transcripts must be equal.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from supervisor.node import migplace
from supervisor.node.migmaker import MigError, MigMaker
from supervisor.sim.nvml import Simulator
from tests.conformance.test_mig_on_demand import A100_OFF, A100_ON, H100, L4, LAYOUT_UUID, UUIDS, node_spec
from tests.fakenvml import Control, FakeNode
from tests.helpers import REPO


class Appender(Control):
    """The control file of a library already running: appended to, never emptied."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)


def answer(fn: Callable[[], Any]) -> Any:
    """What a MigMaker call answered, as JSON: a MadeMigRecord's fields, a list of them, or the error."""
    try:
        value = fn()
    except MigError as exc:
        return {"error": exc.kind, "code": exc.code, "message": str(exc)}
    if isinstance(value, list):
        return [dataclasses.asdict(m) for m in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


def create_taken_busy_destroy(nvml: Any, control: Any) -> list[Any]:
    """On an idle H100 with MIG off: create turns MIG on and makes 3g.40gb at 4; 2g.20gb at 4 is
    taken, naming it; destroying it while processes run is busy; then it goes, twice."""
    maker, gpu, out = MigMaker(nvml), UUIDS[H100], []
    made = answer(lambda: maker.create(gpu, 9, 4))
    assert made["gi_id"] == 2 and made["placement_start"] == 4 and made["uuid"].startswith("MIG-")
    out.append(made)
    taken = answer(lambda: maker.create(gpu, 14, 4))
    assert taken["error"] == "taken" and "GPU instance 2 (3g.40gb" in taken["message"]
    out.append(taken)
    control.set_processes(made["uuid"], 1)
    busy = answer(lambda: maker.destroy(gpu, 2, 0))
    assert busy["error"] == "busy" and busy["code"] == pynvml.NVML_ERROR_IN_USE
    out.append(busy)
    control.set_processes(made["uuid"], 0)
    out.append(answer(lambda: maker.destroy(gpu, 2, 0)))
    out.append(answer(lambda: maker.destroy(gpu, 2, 0)))
    out.append(answer(lambda: maker.instances(gpu)))
    assert out[-1] == [] and out[-2] is None
    out.append(answer(lambda: maker.mig_mode(gpu)))
    assert out[-1] == [True, True]
    return out


def layout_and_placements(nvml: Any, control: Any) -> list[Any]:
    """An A100 with MIG on and a 3g.40gb laid out at 0: instances lists it; 4g.40gb (which can only
    start at 0) is taken by it; 3g.40gb at 4 is made; a placement the profile lacks is unsupported."""
    maker, gpu, out = MigMaker(nvml), UUIDS[A100_ON], []
    listed = answer(lambda: maker.instances(gpu))
    assert [(m["uuid"], m["placement_start"]) for m in listed] == [(LAYOUT_UUID, 0)]
    out.append(listed)
    taken = answer(lambda: maker.create(gpu, 5, 0))
    assert taken["error"] == "taken" and LAYOUT_UUID in taken["message"]
    out.append(taken)
    out.append(answer(lambda: maker.create(gpu, 9, 4)))
    assert out[-1]["gi_id"] == 2
    out.append(answer(lambda: maker.create(gpu, 9, 2)))
    assert out[-1]["error"] == "unsupported"
    out.append(answer(lambda: maker.instances(gpu)))
    assert [m["placement_start"] for m in out[-1]] == [0, 4]
    return out


def mig_mode_refusals(nvml: Any, control: Any) -> list[Any]:
    """An A100 with MIG off needs a reset (reset-required, the pending change set back); an H100
    in use cannot switch (busy, left off); an L4 has no MIG (unsupported)."""
    maker, out = MigMaker(nvml), []
    out.append(answer(lambda: maker.create(UUIDS[A100_OFF], 19, 0)))
    assert out[-1]["error"] == "reset-required" and out[-1]["code"] == pynvml.NVML_ERROR_RESET_REQUIRED
    out.append(answer(lambda: maker.mig_mode(UUIDS[A100_OFF])))
    assert out[-1] == [False, False]
    control.set_processes(UUIDS[H100], 1)
    out.append(answer(lambda: maker.create(UUIDS[H100], 19, 0)))
    assert out[-1]["error"] == "busy"
    out.append(answer(lambda: maker.mig_mode(UUIDS[H100])))
    assert out[-1] == [False, False]
    control.set_processes(UUIDS[H100], 0)
    out.append(answer(lambda: maker.create(UUIDS[L4], 19, 0)))
    assert out[-1]["error"] == "unsupported"
    return out


def cleanup_after_a_failure(nvml: Any, control: Any) -> list[Any]:
    """A compute instance that cannot be made leaves no GPU instance behind; the placement is
    then free for the next try."""
    maker, gpu, out = MigMaker(nvml), UUIDS[H100], []
    control.fail("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN, 1)
    out.append(answer(lambda: maker.create(gpu, 19, 3)))
    assert out[-1]["error"] == "nvml" and "what was made is destroyed" in out[-1]["message"]
    out.append(answer(lambda: maker.instances(gpu)))
    assert out[-1] == []
    out.append(answer(lambda: maker.create(gpu, 19, 3)))
    assert out[-1]["placement_start"] == 3
    return out


def options_of_every_gpu(nvml: Any, control: Any) -> list[Any]:
    """Every GPU's MIG options (supervisor/node/migplace.py): the A100s' and the H100's 25,
    whatever their MIG mode and layout, the L4's none."""
    out = [
        [dataclasses.asdict(o) for o in migplace.mig_options(nvml, nvml.nvmlDeviceGetHandleByIndex(i))]
        for i in range(int(nvml.nvmlDeviceGetCount()))
    ]
    assert [len(o) for o in out] == [25, 25, 25, 0]
    return out


SCENARIOS = [
    create_taken_busy_destroy,
    layout_and_placements,
    mig_mode_refusals,
    cleanup_after_a_failure,
    options_of_every_gpu,
]

CHILD = """
import json, os, sys
import pynvml
from tests.conformance import test_migmaker_fakenvml as t
pynvml.nvmlInit()
scenario = getattr(t, sys.argv[1])
print(json.dumps(scenario(pynvml, t.Appender(os.environ["FAKENVML_CONTROL"]))))
"""


def over_the_simulator(scenario: Callable[[Any, Any], list[Any]]) -> list[Any]:
    sim = Simulator(node_spec())
    sim.nvmlInit()
    return scenario(sim, sim)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_migmaker_over_the_simulator(scenario: Callable[[Any, Any], list[Any]]) -> None:
    """The scenario's rules hold over the Python simulator."""
    over_the_simulator(scenario)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_migmaker_over_the_real_binding_and_c_library(
    scenario: Callable[[Any, Any], list[Any]], fake_nvml_libdir: Path, tmp_path: Path
) -> None:
    """The scenario's rules hold through nvidia-ml-py over the C library (ctypes handles and
    arrays), and every answer, message included, is the simulator's."""
    node = FakeNode(tmp_path, node_spec())
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, scenario.__name__], env=node.environ(fake_nvml_libdir), cwd=REPO,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fakenvml:" not in proc.stderr, proc.stderr  # no control line was refused
    assert json.loads(proc.stdout) == over_the_simulator(scenario)
