"""The CLI's side of the control socket: one `Command` to a running supervisor, its `Reply`.

`gpuvisor status`, `gpuvisor sim ...` and the demo use it; the supervisor's side is
`supervisor.control.commands`. A supervisor that is not there, not ours to talk to or not
answering is a `CommandError` with a text that says which.
"""

from __future__ import annotations

import os
import time

from common.messages import Command, Json, MessageError, Reply, decode, encode
from supervisor.control.commands import CommandError
from supervisor.host.rundir import RunDir

__all__ = ["CommandError", "send_command"]


def send_command(run_dir: str, name: str, args: dict[str, Json], timeout: float = 5.0) -> dict[str, Json]:
    """Send one command to the supervisor of `run_dir`; raises CommandError with a clear text."""
    import zmq

    rundir = RunDir(run_dir)
    path = rundir.control_path
    if not os.path.exists(path):
        raise CommandError(
            f"no supervisor control socket at {path}: is `gpuvisor run --run-dir {run_dir}` running?"
        )
    if not os.access(path, os.R_OK | os.W_OK):
        raise CommandError(f"no permission to use {path}: run as the supervisor's user")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(rundir.control_endpoint)
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
