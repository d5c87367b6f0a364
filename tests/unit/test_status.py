"""Tests of readiness, the status document (supervisor/observe/status.py) and its text (supervisor/cli.py), from fake parts' views."""

from __future__ import annotations

import pytest

from supervisor.cli import format_status
from supervisor.observe.status import Readiness, document, readiness
from supervisor.workers.lifecycle import WorkerHandle, WState
from tests.fakes import FakeProc

GPU = "nvidia.com/gpu"


def running(streams: int = 1) -> WorkerHandle:
    h = WorkerHandle(GPU, "/p.json", state=WState.RUNNING, proc=FakeProc(7), pid=7, registered=True)
    h.stats = {"gauge:streams": float(streams)}
    return h


def test_ready_when_nvml_is_up_and_every_worker_registered_and_streaming() -> None:
    """All parts fine: ready, and the reason says how many resources."""
    r = readiness(
        nvml_up=True, nvml_error="", planned=[GPU], workers={GPU: running()}, mps_not_ready="", cdi_error=None
    )
    assert r.ready and "1 resource(s)" in r.detail


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nvml_up": False, "nvml_error": "Library Not Found"}, "NVML is not up (Library Not Found)"),
        ({"workers": {GPU: running(streams=0)}}, "no ListAndWatch stream yet"),
        ({"mps_not_ready": "MPS control daemon not up: gpu: starting"}, "MPS control daemon not up"),
        ({"cdi_error": "read-only file system"}, "the CDI spec is not written: read-only file system"),
        ({"planned": []}, "no resources planned"),
    ],
)
def test_each_part_that_is_not_ready_says_why(kwargs: dict[str, object], words: str) -> None:
    """Readiness names the first part that holds the node back."""
    args: dict[str, object] = {
        "nvml_up": True, "nvml_error": "", "planned": [GPU], "workers": {GPU: running()}, "mps_not_ready": "", "cdi_error": None,
    }  # fmt: skip
    args.update(kwargs)
    r = readiness(**args)  # type: ignore[arg-type]
    assert not r.ready and words in r.detail


def test_first_plans_pending_are_named_when_nothing_is_planned() -> None:
    """At start, plans that cannot be written keep the node not ready, and status says why."""
    r = readiness(
        nvml_up=True,
        nvml_error="",
        planned=[],
        workers={},
        mps_not_ready="",
        cdi_error=None,
        pending_reload="cannot write /run/gpuvisor/plans: disk full",
    )
    assert not r.ready and "pending: cannot write" in r.detail


WAITING = "waiting (/var/lib/kubelet/device-plugins/kubelet.sock does not exist yet)"


def one_worker(handle: WorkerHandle) -> Readiness:
    """Readiness of a node whose one planned resource has this worker, every other part fine."""
    return readiness(
        nvml_up=True, nvml_error="", planned=[GPU], workers={GPU: handle}, mps_not_ready="", cdi_error=None
    )


def starting(registration: str, state: WState = WState.STARTING) -> WorkerHandle:
    h = WorkerHandle(GPU, "/p.json", state=state, proc=FakeProc(7), pid=7, registration=registration)
    h.reason = "spawning (pid 7)"
    return h


def test_readiness_says_where_a_starting_workers_registration_stands() -> None:
    """A worker STARTING because kubelet.sock is missing: /readyz's text says so, not only STARTING."""
    r = one_worker(starting(WAITING))
    assert not r.ready
    assert f"{GPU}: worker STARTING, registration {WAITING}" in r.detail


def test_readiness_names_the_registration_of_a_running_worker_that_lost_it() -> None:
    """A RUNNING worker registering again (a kubelet restart) says its registration's state and why."""
    h = running()
    h.registered, h.registration = False, "retrying (Register failed: UNAVAILABLE)"
    r = one_worker(h)
    assert f"{GPU}: not registered, registration retrying (Register failed: UNAVAILABLE)" in r.detail


def test_readiness_leaves_out_the_last_report_of_a_dead_worker() -> None:
    """A worker in BACKOFF has no registration now: its dead process's last report is not shown."""
    h = starting(WAITING, state=WState.BACKOFF)
    r = one_worker(h)
    assert r.detail == f"not ready: {GPU}: worker BACKOFF"


def test_status_table_says_where_a_starting_workers_registration_stands() -> None:
    """`gpuvisor status` (text) shows the registration's state and why beside STARTING, as --json does."""
    text = format_status({"pid": 1, "resources": {}, "workers": [starting(WAITING).view(0.0)]})
    assert f"  {GPU}: STARTING: spawning (pid 7); registration {WAITING}" in text.splitlines()
    h = running()
    h.registered, h.registration = False, "registering (kubelet.sock is there)"
    text = format_status({"pid": 1, "resources": {}, "workers": [h.view(0.0)]})
    assert f"  {GPU}: not registered; registration registering (kubelet.sock is there)" in text.splitlines()
    assert "registration" not in format_status({"pid": 1, "resources": {}, "workers": [running().view(0.0)]})


def test_document_refuses_a_key_claimed_twice() -> None:
    """Each part owns its keys; two parts writing one key is a bug caught at once."""
    assert document({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="'a'"):
        document({"a": 1}, {"a": 2})


def test_status_table_has_a_registration_column() -> None:
    """The table's REGISTRATION column: the registration's state word for a worker that is not
    registered (`waiting` while kubelet.sock is missing), `registered` for one that is."""
    text = format_status(
        {"pid": 1, "resources": {}, "workers": [starting(WAITING).view(0.0)], "metrics_url": None}
    )
    header = next(line for line in text.splitlines() if line.startswith("RESOURCE"))
    row = next(line for line in text.splitlines() if line.startswith(GPU))
    assert header.split()[:3] == ["RESOURCE", "STATE", "REGISTRATION"]
    assert row.split()[:3] == [GPU, "STARTING", "waiting"]
    ok = format_status({"pid": 1, "resources": {}, "workers": [running().view(0.0)]})
    assert next(line for line in ok.splitlines() if line.startswith(GPU)).split()[2] == "registered"
