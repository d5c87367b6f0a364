"""What `gpuvisor run` and a worker load when they start: features that are off cost nothing.

Read from the source, not from a process: the modules a start imports are those its entry
modules import at module level (an `import` run when the module runs; not one inside a function,
nor under TYPE_CHECKING), and, in turn, theirs. A feature's module reached that way would be
loaded by every node whether the feature is on or not; each one below is loaded by the code that
turns it on, inside a function (the process tier checks the running processes:
tests/process/test_lazy_start.py).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Iterator

import pytest

from tests.helpers import REPO
from worker.zygote import PRELOAD

OURS = ("supervisor", "worker", "common")

# Loaded only when their feature is on, or when something asks for them.
SUPERVISOR_LAZY = {
    "prometheus_client": "never: /metrics is written by observe/exposition.py",
    "ssl": "the API-server layer's: loaded after the first registration, and only with a cluster feature",
    "hashlib": "OpenSSL's way in: the spawn secrets, their comparison and the config fingerprint do without it",
    "hmac": "hmac.compare_digest: the spawn secret is compared with _operator._compare_digest",
    "secrets": "a spawn secret is os.urandom(16).hex()",
    "http.server": "the HTTP endpoint answers its three pages itself (observe/http.py)",
    "yaml": "PyYAML: read with a config file, written with a YAML CDI spec",
    "psutil": "only when an earlier life left workers to end",
    "supervisor.kube": "the API-server layer: the cluster side loads it after the first registration",
    "supervisor.cluster.writer": "health on the Node: the cluster side's, after the first registration",
    "importlib.metadata": "never: the version is supervisor/config/version.py's, which the metadata is built from",
    "grpc": "gRPC is the workers' (and `gpuvisor status`'s), not the supervisor's",
    "google.protobuf": "the kubelet API's messages: the workers'",
    "common.kubeletapi": "the kubelet API: the workers' (kubelet.sock's name is in common.socketnames)",
    "supervisor.labels.rules": "the labeller: only with --labels-output-file",
    "supervisor.labels.host": "the labeller: only with --labels-output-file",
    "supervisor.labels.settings": "`gpuvisor labels`'s flags",
    "supervisor.node.facts": "GFD's facts: the labeller's",
    "supervisor.cdi.spec": "the CDI spec: only when a plan uses a CDI strategy",
    "supervisor.mps.daemons": "the MPS daemons: only when a plan shares with MPS",
    "supervisor.sim": "the simulator and the kubelet stand-in: only with --simulate",
}
WORKER_LAZY = {
    "prometheus_client": "the workers have no metrics endpoint",
    "ssl": "left out on purpose (worker.process.leave_out_ssl): no worker speaks TLS",
    "yaml": "a worker reads a JSON plan",
    "psutil": "no process inspection in a worker",
    "watchdog": "the file watches are the supervisor's",
    "secrets": "a socket tag is three bytes of os.urandom: secrets would load hmac and libcrypto",
    "supervisor": "the roles never import each other",
}


def _path(module: str) -> str | None:
    """The source of one of our modules (package or module), or None for anything else."""
    if module.split(".")[0] not in OURS:
        return None
    base = os.path.join(REPO, *module.split("."))
    for path in (os.path.join(base, "__init__.py"), base + ".py"):
        if os.path.isfile(path):
            return path
    return None


def _run_at_import(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run when the module runs: into `if`/`try`/`with`, not TYPE_CHECKING's."""
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        yield node
        if isinstance(node, ast.If | ast.Try | ast.With):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                yield from _run_at_import(block)


def _imported(module: str, path: str) -> set[str]:
    """Every module `module` imports when it runs (parents included: importing a.b runs a)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _run_at_import(tree.body):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [base]
            # `from package import submodule` runs the submodule too
            names += [f"{base}.{a.name}" for a in node.names if _path(f"{base}.{a.name}") is not None]
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return found


def loaded_at_start(entries: Iterable[str]) -> set[str]:
    """The modules a process loads by importing `entries`: theirs, and transitively ours'."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _path(module)
        if path is not None:
            todo.extend(_imported(module, path) - seen)
    return seen


def _hits(loaded: set[str], forbidden: str) -> list[str]:
    return sorted(m for m in loaded if m == forbidden or m.startswith(forbidden + "."))


SUPERVISOR_START = loaded_at_start(["supervisor.cli", "supervisor.main", "supervisor.node.nvml"])
# The zygote loads its PRELOAD list by name (importlib), which the reading cannot see: take it as given.
WORKER_START = loaded_at_start(["worker.zygote", *PRELOAD])


def test_the_reading_finds_what_a_start_does_load() -> None:
    """The reading is not empty-handed: the supervisor's start loads ZeroMQ, the NVML adapter and
    the loop; a worker's gRPC, ZeroMQ and the kubelet API (so an absence below means something)."""
    assert {"zmq", "supervisor.main", "supervisor.node.nvml", "supervisor.host.watches"} <= SUPERVISOR_START
    assert {"grpc", "zmq", "common.kubeletapi", "worker.server"} <= WORKER_START


@pytest.mark.parametrize(("module", "why"), sorted(SUPERVISOR_LAZY.items()))
def test_gpuvisor_run_does_not_load_at_start(module: str, why: str) -> None:
    """`gpuvisor run` starts without this module; it is loaded only where its feature needs it."""
    assert _hits(SUPERVISOR_START, module) == [], why


@pytest.mark.parametrize(("module", "why"), sorted(WORKER_LAZY.items()))
def test_a_worker_does_not_load(module: str, why: str) -> None:
    """A worker (and the zygote that forks it) starts without this module."""
    assert _hits(WORKER_START, module) == [], why
