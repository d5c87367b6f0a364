"""systemd `Type=notify` support over the NOTIFY_SOCKET datagram protocol, with no dependency.

systemd passes a unix datagram socket in NOTIFY_SOCKET: a path, or a name in the abstract
namespace written with a leading '@'. A notification is one datagram of newline-separated
`KEY=VALUE` lines. We send `READY=1` once every resource is registered, `STATUS=...` when the
one-line summary changes, `STOPPING=1` at shutdown, and `WATCHDOG=1` when the unit sets
WatchdogSec (systemd exports WATCHDOG_USEC, and WATCHDOG_PID naming the process it expects the
pings from: a child that inherited the variables must not ping for us).

The watchdog pings come from the supervisor's main loop (`ping_if_due(now)` on each tick) at
half the interval systemd asked for, so a wedged loop stops the pings and systemd restarts the
unit, which is the point of a watchdog. Without NOTIFY_SOCKET every call is a cheap no-op.
A send that fails (systemd gone, socket removed) is logged once and then given up on quietly:
notification is a courtesy to the service manager, never a reason to stop serving GPUs.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("gpuvisor.sdnotify")


class Notifier:
    """Talks to systemd if it asked us to (NOTIFY_SOCKET); otherwise does nothing."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self.pid = os.getpid() if pid is None else pid
        self.address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._interval = _watchdog_interval(env, self.pid) if self.address is not None else None
        self._next_ping = 0.0
        self._sock: socket.socket | None = None
        self._failed = False
        self._ready_sent = False
        self._status = ""

    @property
    def enabled(self) -> bool:
        return self.address is not None and not self._failed

    def watchdog_interval(self) -> float | None:
        """WatchdogSec in seconds when systemd expects pings from this process, else None."""
        return self._interval

    def notify(self, *lines: str) -> bool:
        """Send one datagram of `KEY=VALUE` lines; False when disabled or the send failed."""
        if self.address is None or self._failed or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8", errors="replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            self._failed = True
            log.warning(
                "systemd notification to %r failed (%s): no more notifications will be sent", self.shown, exc
            )
            self.close()
            return False
        return True

    @property
    def shown(self) -> str:
        if self.address is None:
            return ""
        return "@" + self.address[1:] if self.address.startswith("\0") else self.address

    def ready(self) -> bool:
        """READY=1, once."""
        if self._ready_sent:
            return False
        sent = self.notify("READY=1")
        self._ready_sent = sent
        return sent

    def status(self, text: str) -> bool:
        """STATUS=<one line> (newlines would start a new key: they become spaces)."""
        line = " ".join(text.split())
        self._status = line
        return self.notify(f"STATUS={line}")

    def update(self, ready: bool, status: str) -> None:
        """Per main-loop tick: READY=1 the first time `ready`, STATUS only when the text changed."""
        line = " ".join(status.split())
        if line != self._status:
            self.status(line)
        if ready and not self._ready_sent:
            self.ready()

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def ping_if_due(self, now: float) -> bool:
        """WATCHDOG=1 if the watchdog is on and half its interval passed since the last ping.

        `now` is a monotonic clock reading (the main loop's).
        """
        if self._interval is None or now < self._next_ping:
            return False
        self._next_ping = now + self._interval / 2
        return self.notify("WATCHDOG=1")

    def seconds_to_ping(self, now: float) -> float:
        """How long until the next WATCHDOG=1 is due (infinity with no watchdog)."""
        if self._interval is None:
            return float("inf")
        return max(0.0, self._next_ping - now)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _socket_address(value: str) -> str | None:
    """NOTIFY_SOCKET -> a sendto() address: '@name' is the abstract namespace ('\\0name')."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # systemd also knows vsock: addresses (VMs); they are not for a node agent: say so once.
    log.warning(
        "NOTIFY_SOCKET=%r is neither a path nor an abstract socket name: systemd notification is off", value
    )
    return None


def _watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    usec_text = env.get("WATCHDOG_USEC", "")
    if not usec_text:
        return None
    pid_text = env.get("WATCHDOG_PID", "")
    if pid_text:
        try:
            if int(pid_text) != pid:
                return None  # the pings are expected from another process (our parent, say)
        except ValueError:
            log.warning("WATCHDOG_PID=%r is not a number: watchdog pings are off", pid_text)
            return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number: watchdog pings are off", usec_text)
        return None
    if usec <= 0:
        return None
    return usec / 1_000_000
