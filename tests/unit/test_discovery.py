"""Unit tests of NVML bring-up and rediscovery (supervisor/desired/discovery.py) over the simulator."""

from __future__ import annotations

import pytest

from common.exitcodes import EXIT_NVML_ERROR
from supervisor.desired.discovery import NvmlSession, StartupError
from tests.fakes import sim_config


def test_nvml_link_retries_with_growing_delays_then_comes_up() -> None:
    """Without --fail-on-init-error, failed inits give growing retry delays, then the node."""
    link = NvmlSession(sim_config(), {"GPUVISOR_SIM_FAIL_INIT": "2"})
    node, delay1 = link.attempt(fail_on_init_error=False)
    assert node is None and delay1 == 1.0 and not link.up and "Not Found" in link.error
    node, delay2 = link.attempt(fail_on_init_error=False)
    assert node is None and delay2 == 2.0
    node, delay3 = link.attempt(fail_on_init_error=False)
    assert node is not None and len(node.gpus) == 4 and delay3 == 0.0
    assert link.status() == {"up": True, "error": "", "attempts": 3}


def test_nvml_link_gives_up_with_exit_3_when_told_to_fail_on_init_error() -> None:
    """With --fail-on-init-error the first failure ends the start, saying what to check."""
    link = NvmlSession(sim_config(), {"GPUVISOR_SIM_FAIL_INIT": "1"})
    with pytest.raises(StartupError, match="NVIDIA driver is loaded") as info:
        link.attempt(fail_on_init_error=True)
    assert info.value.code == EXIT_NVML_ERROR


def test_nvml_link_rediscovery_keeps_a_lost_gpu_listed() -> None:
    """A GPU that rediscovery no longer sees stays in the node, so its devices stay advertised."""
    link = NvmlSession(sim_config(), {})
    node, _ = link.attempt(fail_on_init_error=True)
    assert node is not None
    lost = node.gpus[1].uuid
    assert link.simulator is not None
    link.simulator.lose(lost)
    again = link.rediscover(node)
    assert lost in {g.uuid for g in again.gpus} and link.kept_gpus == (lost,)
