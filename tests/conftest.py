"""The test tiers' markers, this session's own temp dir, and fixtures shared by several test
modules: the real-binding tier's fake libnvidia-ml (`fake_nvml_libdir`) and oldest binding, a fake
Kubernetes API server (`api`), a fake MPS control binary (`fake`), and a standalone worker's temp
dir (`env`) with the processes a test started (`procs`).

Each folder under tests/ is a tier and every test in it carries the tier's marker, so
`pytest -m unit` (or `process`, `conformance`, `packaging`, `chaos`, `benchmarks`, `gpu`) runs
one tier; docs/testing.md says what each needs and how long it takes.

Temp dirs: every session gets a base temp dir of its own (`pytest_configure`), made with `tempfile`
and removed when the session ends, unless `--basetemp` names one. pytest's default base,
`/tmp/pytest-of-<user>/pytest-N`, is shared by every session of a user, and with
`tmp_path_retention_policy = "none"` one session's exit deletes the others' dirs under it: two runs
side by side ended with hundreds of FileNotFoundErrors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from tests import fakenvml, mpsfake, nodes
from tests.harness import GPU, Env
from tests.helpers import short_tmpdir

if TYPE_CHECKING:
    from tests.kubeapi import RunningApiServer

TESTS = os.path.dirname(os.path.abspath(__file__))
TIERS = ("unit", "process", "conformance", "packaging", "chaos", "benchmarks", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, the folder it lives in."""
    for item in items:
        tier = os.path.relpath(str(item.path), TESTS).split(os.sep)[0]
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: a test lives in one of the tier folders {', '.join(TIERS)}"
            )
        item.add_marker(tier)


_OWN_BASETEMP = "_gpuvisor_own_basetemp"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A base temp dir of this session's own, unless --basetemp names one (see the docstring)."""
    if config.option.basetemp is None:
        path = tempfile.mkdtemp(prefix="gv-pytest-")
        config.option.basetemp = path
        setattr(config, _OWN_BASETEMP, path)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = getattr(config, _OWN_BASETEMP, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_nvml_libdir() -> Iterator[Path]:
    """A directory holding the project's fake libnvidia-ml.so.1 (tests/fakenvml), compiled once per
    session with the system C compiler. Skips, with the reason, only where none can be built."""
    reason = fakenvml.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with fakenvml.built() as path:
        yield path


@pytest.fixture(scope="session")
def oldest_binding() -> Iterator[str]:
    """A directory holding the oldest `pynvml` (nvidia-ml-py) pyproject.toml accepts, installed once
    per session with pip (the binding is one pure-Python module); put it first on PYTHONPATH."""
    version = fakenvml.binding_floor()
    path = tempfile.mkdtemp(prefix=f"gv-nvidia-ml-py-{version}-")
    try:
        yield fakenvml.install_binding(version, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[RunningApiServer]:
    """A local HTTPS endpoint that answers as the Kubernetes API server does (tests/kubeapi/;
    imported here, not at the top: it needs test-only packages the gpu tier's machine may lack)."""
    from tests.kubeapi import RunningApiServer

    server = RunningApiServer(tmp_path)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Path]:
    """A fake `nvidia-cuda-mps-control` (tests/mpsfake.py) in tmp_path/bin; afterwards every
    daemon it started is gone."""
    path = mpsfake.install(tmp_path)
    yield path
    mpsfake.kill_daemons(tmp_path)


@pytest.fixture
def env() -> Iterator[Env]:
    """A temp dir for a standalone worker (`tests.harness.start_worker`), holding dgx-h100's plan for GPU."""
    plan = plan_resources(nodes.dgx_h100(), config_from_data(None))[GPU]
    with short_tmpdir() as d:
        plan_path = os.path.join(d, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as fh:
            fh.write(plan.to_json())
        yield Env(d, plan_path, os.path.join(d, "worker.log"), os.path.join(d, "kubelet.sock"))


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test started (`start_worker` notes them); any still running is killed after it, by PID."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:  # only what this test started, by PID
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
