"""`EarlierPool`: the DRA pool an earlier life published, withdrawn before the device plugin offers
a GPU (supervisor/dra/earlier.py), with a fake API client, a fake clock and the real scheduler."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.backoff import Backoff
from supervisor.dra.earlier import BOUND_S, EarlierPool
from supervisor.kube.errors import NO_ANSWER, ApiError
from supervisor.node.draplan import DRIVER
from supervisor.scheduler import Scheduler
from tests.fakes import FakeClock
from tests.helpers import wait_until


def _slice(name: str, node: str = "n1", driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"},
        "spec": {"nodeName": node, "driver": driver},
    }


class FakeClient:
    """Answers the list with `items`; records every DELETE; `fail` > 0 makes that many calls fail."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.deleted: list[tuple[str, Any]] = []
        self.fail = 0
        self.closed = False

    def get(self, path: str, *, what: str, query: dict[str, str]) -> Any:
        if self.fail:
            self.fail -= 1
            raise ApiError(what, NO_ANSWER, "", "connection refused")
        return {"items": self.items}

    def request(self, method: str, path: str, *, what: str, body: Any) -> Any:
        self.deleted.append((path.rsplit("/", 1)[1], body["preconditions"]))
        return None

    def abort(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Loop:
    """The main loop's side: posted calls run when the test drains them."""

    def __init__(self) -> None:
        self.posted: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.done: list[str] = []

    def post(self, fn: Callable[[], None]) -> None:
        with self.lock:
            self.posted.append(fn)

    def drain(self) -> int:
        with self.lock:
            calls, self.posted = self.posted, []
        for fn in calls:
            fn()
        return len(calls)


def _pool(tmp_path: Path, client: FakeClient, loop: Loop, clock: FakeClock) -> EarlierPool:
    return EarlierPool(
        node_name="n1",
        plugins_dir=str(tmp_path),
        connect=lambda: client,
        timers=Scheduler(clock),
        post=loop.post,
        on_done=loop.done.append,
        retry=Backoff(0.01, 0.02),
    )


def test_no_evidence_of_an_earlier_dra_life_means_no_wait_and_no_request(tmp_path: Path) -> None:
    """Without the DRA worker's directory nothing is asked of the API server and nothing waits."""
    client, loop = FakeClient([_slice("a")]), Loop()
    pool = _pool(tmp_path, client, loop, FakeClock())
    pool.look()
    assert pool.pending() == "" and pool.status() is None
    assert client.deleted == []


def test_a_start_in_dra_mode_keeps_the_earlier_pool(tmp_path: Path) -> None:
    """The DRA worker's directory is there, but the node plans DRA again: the pool is kept."""
    (tmp_path / DRIVER).mkdir()
    client, loop = FakeClient([_slice("a")]), Loop()
    pool = _pool(tmp_path, client, loop, FakeClock())
    pool.look()
    pool.keep()
    assert pool.pending() == "" and pool.status() == {
        "state": "kept",
        "deleted": 0,
        "failures": 0,
        "error": None,
    }
    assert client.deleted == []


def test_the_pool_is_withdrawn_slice_by_slice_and_the_empty_evidence_goes(tmp_path: Path) -> None:
    """In device-plugin mode: planning waits (a reason) until every slice of this node's pool of
    gpu.nvidia.com is deleted with its UID and version as preconditions (another node's or driver's
    slice is left); then planning is told, and the empty checkpoint and directory are removed."""
    directory = tmp_path / DRIVER
    directory.mkdir()
    (directory / "checkpoint.json").write_text(json.dumps({"version": 1, "claims": {}}))
    items = [_slice("a"), _slice("b"), _slice("other", node="n2"), _slice("x", driver="x.example.com")]
    client, loop, clock = FakeClient(items), Loop(), FakeClock()
    pool = _pool(tmp_path, client, loop, clock)
    pool.look()
    assert "withdrawing the DRA pool" in pool.pending()
    assert wait_until(lambda: loop.drain() > 0, 10)
    assert client.deleted == [
        ("a", {"uid": "uid-a", "resourceVersion": "7"}),
        ("b", {"uid": "uid-b", "resourceVersion": "7"}),
    ]
    assert pool.pending() == "" and loop.done == ["the DRA pool of an earlier life is withdrawn"]
    assert not directory.exists() and client.closed


def test_a_checkpoint_with_claims_stays_for_its_draining_worker(tmp_path: Path) -> None:
    """The pool goes, but a checkpoint that still lists prepared claims is kept (its DRA worker
    drains and unprepares them)."""
    directory = tmp_path / DRIVER
    directory.mkdir()
    claim = {
        "namespace": "d",
        "name": "c",
        "devices": [{"requests": ["gpu"], "pool": "n1", "device": "gpu-0", "cdi_device_ids": []}],
    }
    (directory / "checkpoint.json").write_text(json.dumps({"version": 1, "claims": {"u1": claim}}))
    client, loop = FakeClient([_slice("a")]), Loop()
    pool = _pool(tmp_path, client, loop, FakeClock())
    pool.look()
    assert pool.pending()
    assert wait_until(lambda: loop.drain() > 0, 10)
    assert os.path.exists(directory / "checkpoint.json")


def test_the_api_server_away_delays_the_device_plugin_only_until_the_bound(tmp_path: Path) -> None:
    """The list fails: planning waits until the bound, then goes on (told once, with a reason) while
    the thread keeps trying; the first answer withdraws the pool without planning again."""
    (tmp_path / DRIVER).mkdir()
    client, loop, clock = FakeClient([_slice("a")]), Loop(), FakeClock()
    client.fail = 10**6
    pool = _pool(tmp_path, client, loop, clock)
    pool.look()
    assert pool.pending()
    assert wait_until(lambda: pool.failures >= 3, 10)
    clock.advance(BOUND_S - 0.1)
    assert pool.pending()
    clock.advance(0.2)
    assert pool.pending() == ""
    assert pool.timers.run_due() == 1
    assert loop.done == ["the wait for the earlier DRA pool's withdrawal ended"]
    status = pool.status()
    assert (
        status is not None
        and status["state"] == "withdrawing"
        and "connection refused" in str(status["error"])
    )
    client.fail = 0
    assert wait_until(lambda: loop.drain() > 0, 10)
    assert client.deleted and pool.status() == {
        "state": "withdrawn",
        "deleted": 1,
        "failures": pool.failures,
        "error": None,
    }
    assert loop.done == ["the wait for the earlier DRA pool's withdrawal ended"]
    pool.stop()


def test_a_node_back_in_dra_mode_stops_a_withdrawal_still_trying(tmp_path: Path) -> None:
    """The API server was away at a start in device-plugin mode; the node then plans DRA again:
    the withdrawal stops, nothing is deleted when the API server answers, the evidence stays."""
    directory = tmp_path / DRIVER
    directory.mkdir()
    (directory / "checkpoint.json").write_text(json.dumps({"version": 1, "claims": {}}))
    client, loop, clock = FakeClient([_slice("a")]), Loop(), FakeClock()
    client.fail = 10**6
    pool = _pool(tmp_path, client, loop, clock)
    pool.look()
    assert pool.pending()
    assert wait_until(lambda: pool.failures >= 1, 10)
    pool.keep()
    client.fail = 0
    assert pool.status() is not None and pool.status()["state"] == "kept"  # type: ignore[index]
    assert pool.pending() == ""
    pool.stop()
    assert pool._thread is not None and not pool._thread.is_alive()
    assert client.deleted == [] and directory.exists() and loop.drain() == 0
