"""The logs of a real supervisor and worker (common/logs.py): JSON lines, and nothing logged while idle."""

from __future__ import annotations

import json
import time

from tests.harness import SimNode
from tests.helpers import wait_until


def _settled(node: SimNode) -> bool:
    workers = node.command("status").get("workers", [])
    return bool(workers) and all(w["state"] == "RUNNING" for w in workers)


def test_json_run_logs_events_only_and_nothing_while_idle() -> None:
    """A real supervisor and worker with --log-format json: every line is JSON, worker lines carry
    resource and worker, and an idle node (heartbeats, beacons, status polls) adds no line."""
    with SimNode("pcie-l4", args=["--log-format", "json"]) as node:
        node.wait_listed(["nvidia.com/gpu"])
        assert wait_until(lambda: _settled(node), 30), node.log()[-3000:]
        # Let the start-up events finish: the log must hold still for a second.
        seen, since = node.log(), time.monotonic()

        def quiet_for_a_second() -> bool:
            nonlocal seen, since
            text = node.log()
            if text != seen:
                seen, since = text, time.monotonic()
            return time.monotonic() - since >= 1.0

        assert wait_until(quiet_for_a_second, 30), node.log()[-3000:]
        before = node.log()
        polls = 0

        def poll_and_check() -> bool:
            """One status poll, as a probe would; done early only if something got logged."""
            nonlocal polls
            node.command("status")
            polls += 1
            return node.log() != before

        # Idle for 3 s: three worker heartbeats, a health beacon, supervisor ticks, status polls.
        wait_until(poll_and_check, 3.0, interval=0.1)
        after = node.log()
    assert polls > 5
    added = after[len(before) :]
    assert added == "", f"lines logged while idle:\n{added}"
    docs = [json.loads(line) for line in after.splitlines()]
    worker_lines = [d for d in docs if d.get("role") == "worker"]
    assert worker_lines and all(
        d.get("resource") == "nvidia.com/gpu" and d.get("worker") for d in worker_lines
    )
    transitions = [d for d in docs if d.get("logger") == "gpuvisor.workers" and d.get("state") == "RUNNING"]
    assert transitions and all(d.get("resource") == "nvidia.com/gpu" and d.get("worker") for d in transitions)
