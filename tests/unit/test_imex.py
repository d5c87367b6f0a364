"""Tests of IMEX channel selection: a missing channel node is skipped with a warning, or fails the
worker's start when `imex.required` is set, as NVIDIA's internal/imex/imex.go GetChannels does."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from common.imex import ImexChannel, ImexChannelMissing, char_device_problem, select_channels
from tests import nodes
from worker.allocate import AllocationError, Allocator, DeviceSpec, Mount

CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"
BARE_CHANNEL0_EXISTS = os.path.exists(CHANNEL0)


def present(*paths: str) -> Callable[[str], str | None]:
    """A stand-in for the stat check: these paths are character devices, nothing else exists."""
    return lambda path: None if path in paths else f"{path} does not exist"


def test_missing_channel_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A configured channel whose node is missing under the dev root and at /dev is left out, with one warning naming it."""
    # internal/imex/imex.go:53-58: not required -> klog.Warningf("Ignoring requested IMEX channel ...") and continue.
    with caplog.at_level(logging.WARNING, logger="gpuvisor.worker"):
        assert select_channels([0], "/run/nvidia/driver", False, present()) == ()
    assert (
        "ignoring requested IMEX channel channel0: /run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0 does not exist"
        in caplog.text
    )


def test_missing_required_channel_raises() -> None:
    """With imex.required a missing channel is an error naming the channel and the paths looked at."""
    # internal/imex/imex.go:54-55: required -> "requested IMEX channel channel0 does not exist".
    with pytest.raises(
        ImexChannelMissing, match=r"^requested IMEX channel channel0 does not exist \(/drv/dev/nvidia-caps"
    ):
        select_channels([0], "/drv", True, present())


@pytest.mark.parametrize("where", ["/drv/dev/nvidia-caps-imex-channels/channel0", CHANNEL0])
def test_channel_found_under_dev_root_or_bare_path(where: str) -> None:
    """A channel node under the dev root, or at the bare /dev path, is injected (NVIDIA checks HostPath, then Path)."""
    assert select_channels([0], "/drv", True, present(where)) == (ImexChannel("0", CHANNEL0),)


def test_regular_file_is_not_a_channel(tmp_path: Path) -> None:
    """A regular file where the channel node should be does not count: it must be a character device."""
    node = tmp_path / "dev/nvidia-caps-imex-channels/channel0"
    node.parent.mkdir(parents=True)
    node.write_text("")
    assert char_device_problem(str(node)) == f"{node} is not a character device"
    if not BARE_CHANNEL0_EXISTS:
        assert select_channels([0], str(tmp_path), False) == ()


def test_real_character_device_is_a_channel(tmp_path: Path) -> None:
    """A real character device at <dev root>/dev/nvidia-caps-imex-channels/channel0 is found by the real stat."""
    node = tmp_path / "dev/nvidia-caps-imex-channels/channel0"
    node.parent.mkdir(parents=True)
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # the numbers of /dev/null
    except PermissionError:
        pytest.skip("creating a character device needs CAP_MKNOD")
    assert char_device_problem(str(node)) is None
    assert select_channels([0], str(tmp_path), True) == (ImexChannel("0", CHANNEL0),)


def test_allocate_leaves_out_a_missing_channel() -> None:
    """Without its node, channel 0 is in no env var, mount, device spec or CDI name of the Allocate answer."""
    for strategies in (("envvar", "volume-mounts"), ("cdi-cri",)):
        plan = nodes.imex_plan("/drv", required=False, strategies=strategies)
        response = Allocator(plan, exists=lambda p: False, imex_problem=present()).allocate(
            [plan.devices[0].id]
        )
        assert "NVIDIA_IMEX_CHANNELS" not in response.envs
        assert not any("imex" in m.container_path for m in response.mounts)
        assert not any("imex" in d.container_path for d in response.devices)
        assert not any("imex" in name for name in response.cdi_devices)


def test_allocate_injects_an_existing_channel() -> None:
    """With its node present, channel 0 is injected as NVIDIA does: env var, /dev/null mount, device spec under the dev root."""
    plan = nodes.imex_plan("/drv", required=True, strategies=("envvar", "volume-mounts"))
    response = Allocator(plan, exists=lambda p: False, imex_problem=present(CHANNEL0)).allocate(
        [plan.devices[0].id]
    )
    assert response.envs["NVIDIA_IMEX_CHANNELS"] == "0"
    assert Mount("/var/run/nvidia-container-devices/imex/0", "/dev/null") in response.mounts
    assert response.devices[-1] == DeviceSpec(CHANNEL0, "/drv" + CHANNEL0, "rw")


def test_required_channel_missing_after_a_plan_update_refuses_allocate() -> None:
    """A plan update in a running worker that requires a missing channel refuses Allocate, saying why."""
    plan = nodes.imex_plan("/drv", required=True)
    with pytest.raises(ImexChannelMissing):
        Allocator(plan, imex_problem=present())
    allocator = Allocator(plan, imex_problem=present(), strict_imex=False)
    with pytest.raises(
        AllocationError,
        match=r"^failed to get allocate response: requested IMEX channel channel0 does not exist",
    ):
        allocator.allocate([plan.devices[0].id])
