"""Which configured IMEX channels are injected: those whose device node exists.

NVIDIA v0.20.0 (`internal/imex/imex.go` GetChannels) looks for each configured channel's node,
`/dev/nvidia-caps-imex-channels/channel<N>`, when its plugins start: a channel whose node is
missing (or is not a character device) is skipped with a warning, unless `imex.required` is set,
in which case the start fails. It checks the node under its device root and at the bare path.
gpuvisor does the same when a worker builds its Allocate tables (at start and when its plan
changes), and when the supervisor writes the imex-channel CDI spec: under the dev root first,
then the bare path, so the DaemonSet's view of /dev and a host install both find it.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.devnodes import host_path

log = logging.getLogger("gpuvisor.imex")

IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_CLASS = "imex-channel"  # the CDI device class of the channels (`<vendor>/imex-channel=<id>`)


class ImexChannelMissing(Exception):
    """A required IMEX channel's device node does not exist: the worker cannot start."""


@dataclass(frozen=True)
class ImexChannel:
    id: str  # "0"
    path: str  # /dev/nvidia-caps-imex-channels/channel0, as the container sees it


def char_device_problem(path: str) -> str | None:
    """None when `path` is a character device, else why not (NVIDIA's Channel.exists)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror or exc}"
    if not stat.S_ISCHR(mode):
        return f"{path} is not a character device"
    return None


def select_channels(
    channel_ids: Sequence[int],
    dev_root: str,
    required: bool,
    problem: Callable[[str], str | None] = char_device_problem,
) -> tuple[ImexChannel, ...]:
    """The channels to inject; a missing one is skipped with a warning, or raises ImexChannelMissing if required."""
    channels: list[ImexChannel] = []
    for channel_id in channel_ids:
        name = f"channel{channel_id}"
        path = f"{IMEX_CHANNEL_DIR}/{name}"
        candidates = dict.fromkeys(
            (host_path(dev_root, path), path)
        )  # the dev root first, then the bare path
        problems = [p for p in (problem(c) for c in candidates) if p is not None]
        if len(problems) < len(candidates):
            channels.append(ImexChannel(str(channel_id), path))
            continue
        if required:
            raise ImexChannelMissing(f"requested IMEX channel {name} does not exist ({'; '.join(problems)})")
        log.warning("ignoring requested IMEX channel %s: %s", name, "; ".join(problems))
    return tuple(channels)
