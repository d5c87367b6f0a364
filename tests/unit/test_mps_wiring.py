"""Unit tests of the MPS wiring (supervisor/mps/wiring.py): daemon reports become health
conditions, and a replaced daemon supervisor's late reports are dropped."""

from __future__ import annotations

from supervisor.config import config_from_data
from supervisor.mps.wiring import MpsWiring
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.fakes import hub_with_book, sim_config

GPU = "nvidia.com/gpu"


def test_mps_wiring_drops_a_replaced_daemon_supervisors_late_reports() -> None:
    """A report posted by daemons a reload replaced never clears the successor's condition."""
    hub, _clock, _m = hub_with_book()
    posted: list[object] = []
    config = sim_config(MPS_ROOT="/run/nvidia/mps")
    wiring = MpsWiring(config=config, environ={}, nvml_module=None, hub=hub, post=posted.append)
    plan = plan_resources(
        nodes.pcie_l4(),
        config_from_data(
            {
                "version": "v1",
                "flags": {"mpsRoot": "/run/nvidia/mps"},
                "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}},
            }
        ),
    )
    wiring.plans = dict(plan)
    hub.mark_external({d.gpu_uuid for d in plan[GPU].devices}, f"mps:{GPU}", "not up")
    wiring._on_change(GPU, True, "up", generation=wiring.generation - 1)  # an old instance's report
    assert f"mps:{GPU}" in hub.external_holders()
    wiring.adopt(sim_config(MPS_ROOT="/run/nvidia/mps", GPUVISOR_MPS_CONTROL="/opt/mps-control"))
    assert wiring.generation == 2 and not wiring.started
