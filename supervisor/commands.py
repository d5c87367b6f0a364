"""Commands the supervisor answers on its control socket, and the client side the CLI uses.

`gpuvisor status` and `gpuvisor sim ...` are separate processes that send a `Command` to the
running supervisor's ROUTER (`<run dir>/control.sock`, mode 0600 in a 0700 dir: only the
supervisor's own user can talk to it) and print the `Reply`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from common.messages import Command, MessageError, Reply, decode, encode

if TYPE_CHECKING:
    from supervisor.main import Supervisor


class CommandError(Exception):
    """A command that cannot be carried out; its text goes back to the CLI."""


SIM_ACTIONS = ("xid", "ecc", "lose", "restore", "reset", "mig")


def run_command(sup: Supervisor, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Carry out one control command on the supervisor's main loop."""
    if name == "status":
        return sup.status()
    if name == "reload":
        ok = sup.reload("control command")
        return {"applied": ok, "plans": sorted(sup.plans)}
    if name == "rediscover":
        ok = sup.rediscover("control command")
        return {"applied": ok, "plans": sorted(sup.plans)}
    if name == "sim":
        return _sim(sup, args)
    raise CommandError(f"unknown command {name!r}")


def _sim(sup: Supervisor, args: dict[str, Any]) -> dict[str, Any]:
    sim = sup.simulator
    if sim is None:
        raise CommandError("this supervisor runs on real NVML, not a simulated node: fault injection is refused")
    action = str(args.get("action", ""))
    device = str(args.get("device", ""))
    try:
        if action == "xid":
            sim.inject_xid(device, int(args["xid"]), args.get("gpu_instance"), args.get("compute_instance"))
        elif action == "ecc":
            sim.inject_ecc(device, str(args.get("kind", "double")))
        elif action == "lose":
            sim.lose(device)
        elif action == "restore":
            sim.restore(device)
        elif action == "reset":
            sim.reset(device)
            # NVML sends no event for a reset: the supervisor learns of it from whoever reset the
            # GPU (here the simulator's command) and clears the until-reset conditions.
            sup.gpu_reset(device)
        elif action == "mig":
            layout = args.get("layout")
            sim.set_mig_layout(int(args["gpu"]), None if layout is None else list(layout))
            # Like a `nvidia-smi mig` run by an operator; the reload makes the change show at
            # once. `reload: false` leaves it to the periodic rediscovery (its tests use that).
            if args.get("reload", True):
                sup.reload("MIG layout changed")
        else:
            raise CommandError(f"unknown sim action {action!r} (one of {', '.join(SIM_ACTIONS)})")
    except CommandError:
        raise
    except (KeyError, ValueError, TypeError, LookupError) as exc:
        raise CommandError(f"sim {action}: {exc}") from None
    except Exception as exc:  # the simulator raises NVMLError for unknown devices and such
        raise CommandError(f"sim {action}: {type(exc).__name__}: {exc}") from None
    return {"action": action, "device": device}


def send_command(run_dir: str, name: str, args: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one command to the supervisor of `run_dir`; raises CommandError with a clear text."""
    import zmq

    path = os.path.join(run_dir, "control.sock")
    if not os.path.exists(path):
        raise CommandError(f"no supervisor control socket at {path}: is `gpuvisor run --run-dir {run_dir}` running?")
    if not os.access(path, os.R_OK | os.W_OK):
        raise CommandError(f"no permission to use {path}: run as the supervisor's user")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{path}")
        sock.send_multipart(encode(Command(name=name, args=args), seq=1))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise CommandError(f"the supervisor at {path} did not answer within {timeout:g}s")
            try:
                envelope = decode(sock.recv_multipart())
            except MessageError:
                continue
            reply = envelope.message
            if isinstance(reply, Reply):
                if not reply.ok:
                    raise CommandError(reply.error)
                return dict(reply.data)
    finally:
        sock.close(0)
