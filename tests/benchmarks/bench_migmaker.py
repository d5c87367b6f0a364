"""MIG on demand's NVML side: how long `MigMaker.create` and `destroy` take on the NVML simulator.

In-process timing on a dgx-h100 simulated node, MIG mode already on (the steady state of a node
that makes and destroys MIG devices at prepare and unprepare): create makes 3g.40gb at placement 4
and its compute instance and reads the UUID (about 25 NVML calls, the profile table cached after
the first); destroy takes the compute and GPU instance away. Then the same with the simulator's
state file (`GPUVISOR_SIMULATE_STATE`: an atomic write with fsync at every MIG change), and
`instances()` (the MIG devices by index plus the GPU instance ids probed by id). What the
simulator costs is not what a GPU costs (NVIDIA measured O(1 s) for a GPU instance's destroy);
these figures say what gpuvisor's own code adds around the calls.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from supervisor.node.migmaker import MigMaker
from supervisor.sim.nvml import load_simulator
from tests.benchmarks.common import Row, Timer, p50


def _maker(state_file: Path | None) -> tuple[MigMaker, str]:
    sim = load_simulator("dgx-h100", state_file=state_file)
    sim.nvmlInit()
    maker = MigMaker(sim)
    gpu = sim.gpu_uuids()[0]
    maker.set_mig_mode(gpu, True)
    made = maker.create(gpu, 9, 4)  # warm-up: the profile table is read once per GPU
    maker.destroy(gpu, made.gi_id, made.ci_id)
    return maker, gpu


def _time(maker: MigMaker, gpu: str, rounds: int) -> tuple[Timer, Timer, Timer]:
    create, destroy, listing = Timer(), Timer(), Timer()
    for _ in range(rounds):
        with create:
            made = maker.create(gpu, 9, 4)
        with listing:
            maker.instances(gpu)
        with destroy:
            maker.destroy(gpu, made.gi_id, made.ci_id)
    return create, destroy, listing


def run(quick: bool) -> list[Row]:
    rounds = 10 if quick else 50
    create, destroy, listing = _time(*_maker(None), rounds)
    with tempfile.TemporaryDirectory(prefix="gvmig") as d:
        kept_create, kept_destroy, _ = _time(*_maker(Path(d) / "state.json"), rounds)
    note = f"{rounds} rounds, simulator, MIG on"
    return [
        Row("create p50", p50(create.ms()), "ms", "", note),
        Row("destroy p50", p50(destroy.ms()), "ms", "", note),
        Row("instances p50", p50(listing.ms()), "ms", "", "one instance on the GPU"),
        Row("create p50, state file", p50(kept_create.ms()), "ms", "", "2 atomic writes (GI, CI)"),
        Row("destroy p50, state file", p50(kept_destroy.ms()), "ms", "", "2 atomic writes (CI, GI)"),
    ]
