"""Tests of readiness and the status document (supervisor/observe/status.py), from fake parts' views."""

from __future__ import annotations

import pytest

from supervisor.observe.status import document, readiness
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


def test_document_refuses_a_key_claimed_twice() -> None:
    """Each part owns its keys; two parts writing one key is a bug caught at once."""
    assert document({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="'a'"):
        document({"a": 1}, {"a": 2})
