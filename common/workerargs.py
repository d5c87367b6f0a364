"""A worker's command line, in one place: what the supervisor's spawner writes and what a worker reads.

The supervisor builds a worker's arguments (supervisor/workers/spawner.py) and, when the zygote
forks the worker, parses them itself (`check_args`) and hands the zygote the parsed fields: the
zygote then forks with nothing left to do but make a `Namespace` of them. Parsing in the zygote
(argparse's parser built and run between two forks) would write to the zygote's pages at each
spawn, and every worker forked before that spawn would keep its own copy of each of them. An
exec'd worker parses the same arguments with the same parser (`parse_args`), which says what is
wrong with them the argparse way (usage, exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import NoReturn

from common.socketnames import is_tag

HEARTBEAT_S = 1.0  # a worker's default heartbeat interval, seconds


class WorkerArgsError(ValueError):
    """Arguments a worker would refuse (`check_args`), with argparse's reason."""


class _Refusing(argparse.ArgumentParser):
    """argparse's parser, raising its error instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise WorkerArgsError(message)


def socket_tag(text: str) -> str:
    if not is_tag(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not 6 lower-case hex digits")
    return text


def _parser(cls: type[argparse.ArgumentParser], add_help: bool) -> argparse.ArgumentParser:
    p = cls(prog="gpuvisor-worker", description="gpuvisor worker: serves one resource", add_help=add_help)
    p.add_argument("--resource", required=True, help="the resource this worker serves (shown in ps)")
    p.add_argument("--plan", required=True, help="the resource plan (JSON) written by the supervisor")
    p.add_argument("--kubelet-socket", default="/var/lib/kubelet/device-plugins/kubelet.sock")
    p.add_argument("--control", default="", help="the supervisor's control socket (ZeroMQ endpoint)")
    p.add_argument("--health", default="", help="the supervisor's health publisher (ZeroMQ endpoint)")
    p.add_argument("--supervisor-pid", type=int, default=0)
    p.add_argument(
        "--zygote-pid", type=int, default=0, help="set for a worker the zygote forked: a parent too"
    )
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    p.add_argument("--log-level", default="info")
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_S, help="seconds between heartbeats")
    p.add_argument(
        "--secret-fd",
        type=int,
        default=-1,
        help="an inherited pipe holding this spawn's secret (read once, closed)",
    )
    p.add_argument(
        "--socket-tag",
        type=socket_tag,
        default=None,
        help="6 hex digits in this process's socket names (the supervisor's record)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """A worker's own parse: argparse's usage and exit 2 on arguments it refuses."""
    return _parser(argparse.ArgumentParser, add_help=True).parse_args(argv)


def check_args(argv: list[str]) -> dict[str, object]:
    """The fields `parse_args(argv)` would give, as a JSON-ready dict (every value a str, int,
    float or None); raises WorkerArgsError, printing nothing, where a worker would refuse them
    (`-h` too: a worker asked for its help serves nothing)."""
    return dict(vars(_parser(_Refusing, add_help=False).parse_args(argv)))


# The fields of a parsed command line, one per option above (a unit test holds them equal).
FIELDS = frozenset(
    {
        "resource", "plan", "kubelet_socket", "control", "health", "supervisor_pid", "zygote_pid",
        "log_format", "log_level", "heartbeat_interval", "secret_fd", "socket_tag",
    }
)  # fmt: skip


def from_fields(fields: object) -> argparse.Namespace:
    """The Namespace of `check_args`'s fields (after a trip through JSON): what `parse_args` gives.
    Raises ValueError unless `fields` maps exactly the names in FIELDS."""
    if not isinstance(fields, Mapping) or set(fields) != FIELDS:
        names = sorted(map(str, fields)) if isinstance(fields, Mapping) else type(fields).__name__
        raise ValueError(f"not a worker's parsed arguments: {names}")
    return argparse.Namespace(**fields)
