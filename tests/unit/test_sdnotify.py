"""supervisor/host/sdnotify.py: the NOTIFY_SOCKET protocol against real unix datagram sockets."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from supervisor.host.sdnotify import Notifier
from tests.helpers import short_tmpdir


class Listener:
    """A stand-in for systemd's notification socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(10)

    def recv(self) -> str:
        return self.sock.recv(4096).decode()

    def pending(self) -> list[str]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return out
        finally:
            self.sock.settimeout(10)


@pytest.fixture
def path_socket() -> Iterator[tuple[Listener, str]]:
    with short_tmpdir() as d:
        path = os.path.join(d, "notify")
        listener = Listener(path)
        try:
            yield listener, path
        finally:
            listener.sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    """No NOTIFY_SOCKET: disabled, nothing sent, no watchdog even when WATCHDOG_USEC is set."""
    n = Notifier({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    assert n.notify("READY=1") is False
    assert n.watchdog_interval() is None
    assert n.ping_if_due(0.0) is False


def test_ready_and_status_reach_a_path_socket(path_socket: tuple[Listener, str]) -> None:
    """READY=1 and STATUS= lines arrive as datagrams on a filesystem NOTIFY_SOCKET."""
    listener, path = path_socket
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.ready() is True
    assert listener.recv() == "READY=1"
    assert n.ready() is False  # once only
    n.status("3/3 resources\nregistered")
    assert listener.recv() == "STATUS=3/3 resources registered"
    n.notify("STOPPING=1", "STATUS=stopping")
    assert listener.recv() == "STOPPING=1\nSTATUS=stopping"
    n.close()


def test_abstract_namespace_socket() -> None:
    """'@name' addresses a socket in the abstract namespace."""
    name = f"gpuvisor-test-{uuid.uuid4().hex}"
    listener = Listener("\0" + name)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.notify("READY=1")
        assert listener.recv() == "READY=1"
        n.close()
    finally:
        listener.sock.close()


def test_update_sends_status_on_change_and_ready_once(path_socket: tuple[Listener, str]) -> None:
    """update(ready, status) per tick: STATUS only when the text changes, READY=1 the first time."""
    listener, path = path_socket
    n = Notifier({"NOTIFY_SOCKET": path})
    n.update(False, "waiting for: nvidia.com/gpu")
    n.update(False, "waiting for: nvidia.com/gpu")
    n.update(True, "ready: 1 resource")
    n.update(True, "ready: 1 resource")
    assert listener.recv() == "STATUS=waiting for: nvidia.com/gpu"
    assert listener.recv() == "STATUS=ready: 1 resource"
    assert listener.recv() == "READY=1"
    assert listener.pending() == []
    n.close()


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "2000000"}, 2.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "4242"}, 2.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(
    env: dict[str, str], interval: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """WATCHDOG_USEC gives the interval only when WATCHDOG_PID is absent or names this process."""
    caplog.set_level(logging.WARNING)
    n = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify", **env}, pid=4242)
    assert n.watchdog_interval() == interval


def test_watchdog_pings_at_half_the_interval(path_socket: tuple[Listener, str]) -> None:
    """ping_if_due sends WATCHDOG=1 at once, then every half interval of the loop's clock."""
    listener, path = path_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    sent = [n.ping_if_due(t) for t in (100.0, 100.5, 100.99, 101.0, 101.5, 102.0)]
    assert sent == [True, False, False, True, False, True]
    assert listener.pending() == ["WATCHDOG=1"] * 3
    n.close()


def test_seconds_to_ping_is_what_an_idle_loop_may_sleep(path_socket: tuple[Listener, str]) -> None:
    """The time to the next ping bounds the idle loop's wait (it sleeps up to 10 s otherwise), so
    a short WatchdogSec is still pinged at half its interval; no watchdog: no bound."""
    _listener, path = path_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.seconds_to_ping(100.0) == 0.0  # the first is due at once
    n.ping_if_due(100.0)
    assert n.seconds_to_ping(100.25) == pytest.approx(0.75)
    assert n.seconds_to_ping(102.0) == 0.0
    n.close()
    assert Notifier({"NOTIFY_SOCKET": path}).seconds_to_ping(0.0) == float("inf")


def test_a_failed_send_is_logged_once_and_then_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """A vanished notify socket gives one warning, then every call is a quiet no-op."""
    caplog.set_level(logging.WARNING, logger="gpuvisor.sdnotify")
    with short_tmpdir() as d:
        n = Notifier({"NOTIFY_SOCKET": os.path.join(d, "gone")})
        assert n.notify("READY=1") is False
        assert n.notify("STATUS=x") is False
        assert not n.enabled
    assert len(caplog.records) == 1 and "no more notifications" in caplog.records[0].getMessage()


def test_an_unusable_notify_socket_value_disables_notification(caplog: pytest.LogCaptureFixture) -> None:
    """A NOTIFY_SOCKET that is neither a path nor '@name' turns notification off with a warning."""
    caplog.set_level(logging.WARNING, logger="gpuvisor.sdnotify")
    n = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not n.enabled
    assert "vsock:2:1234" in caplog.text
