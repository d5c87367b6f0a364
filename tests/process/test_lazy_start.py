"""A running `gpuvisor run` loads no module of a feature that is off, and its zygote starts first.

Every process of the tree runs with PYTHONPROFILEIMPORTTIME=1, so each module any of them
imports leaves a line (`import time: ... | <module>`) in the node's log, in the order it happened
(tests/unit/test_lazy_imports.py reads the same from the source).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
import pytest

from tests import fakenvml
from tests.fakenvml import FakeNode
from tests.harness import SimNode, get, metrics_url, run_python
from tests.helpers import short_tmpdir, wait_until

GPU = "nvidia.com/gpu"
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$", re.MULTILINE)
# Off in the node below (no config file asks for them), so never loaded by any of its processes.
OFF = (
    "supervisor.labels.rules",  # the labeller (--labels-output-file); GFD's facts are the simulator's too
    "supervisor.cdi.spec",  # CDI (a cdi-* device list strategy)
    "supervisor.mps.daemons",  # MPS sharing
    "supervisor.kube",  # the API-server layer (no cluster feature is on)
    "psutil",  # no earlier life to clean up after
)


def imported(log: str) -> set[str]:
    return set(IMPORTED.findall(log))


# What a scrape of /metrics must not load: prometheus_client and what it brings, OpenSSL, metadata.
NOT_FOR_A_SCRAPE = {"prometheus_client", "http.server", "_ssl", "importlib.metadata"}


def mapped_libraries(proc: psutil.Process) -> set[str]:
    """The file names of what `proc` has mapped (libraries, mostly)."""
    return {os.path.basename(m.path) for m in proc.memory_maps(grouped=True)}


def assert_no_openssl(proc: psutil.Process, mapped: set[str]) -> None:
    openssl = sorted(lib for lib in mapped if lib.startswith(("libssl", "libcrypto")))
    assert openssl == [], f"{' '.join(proc.cmdline()[:4])} maps {openssl}"


def test_features_that_are_off_are_never_loaded_and_a_scrape_loads_nothing_more() -> None:
    """With metrics on and the labeller, CDI and MPS off, no process of the tree imports their
    modules (nor psutil, nor the API-server layer); a scrape of /metrics answers without
    prometheus_client, http.server, ssl (the text format is gpuvisor's own) or importlib.metadata
    (the version is written in the source), before and after."""
    args = ["--metrics-address", "127.0.0.1:0"]
    with SimNode("dgx-h100", args=args, env={"PYTHONPROFILEIMPORTTIME": "1"}) as node:
        node.wait_listed([GPU], 60)
        url = metrics_url(node)
        before = imported(node.log())
        assert {"zmq", "grpc", "worker.server", "supervisor.main"} <= before  # the reading works
        assert sorted(m for m in OFF if m in before) == []
        assert not NOT_FOR_A_SCRAPE & before
        status, body = get(url + "/metrics")
        assert status == 200 and "gpuvisor_up 1.0" in body
        after = imported(node.log())
        assert not NOT_FOR_A_SCRAPE & after
        assert sorted(m for m in OFF if m in imported(node.log())) == []


def test_the_zygote_is_started_before_the_supervisors_imports_and_taken_by_it() -> None:
    """`gpuvisor run` starts the worker zygote first thing; the supervisor adopts that process
    (its log names the pid) and forks the worker from it: one zygote, the worker its child."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU], 60)
        found = re.search(
            r"worker zygote running \(pid (\d+), started before the supervisor's imports\)", node.log()
        )
        assert found is not None, node.log()[-3000:]
        zygotes = [p for p in node.workers() if "worker.zygote" in " ".join(p.cmdline())]
        assert [p.pid for p in zygotes] == [int(found[1])]
        worker = psutil.Process(node.worker_pid(GPU))
        assert worker.ppid() == zygotes[0].pid


def test_a_config_file_that_turns_the_zygote_off_leaves_no_zygote(tmp_path: Path) -> None:
    """`gpuvisor.zygote: false` in the config file (which the CLI cannot see before it reads the
    config): the zygote started early is stopped, and the worker is started by exec."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\ngpuvisor:\n  zygote: false\n")
    with SimNode("dgx-h100", args=["--config-file", str(config)]) as node:
        node.wait_listed([GPU], 60)
        assert wait_until(
            lambda: all("worker.zygote" not in " ".join(p.cmdline()) for p in node.workers()), 10
        )
        assert node.proc is not None
        assert psutil.Process(node.worker_pid(GPU)).ppid() == node.proc.pid


@pytest.mark.parametrize("zygote", [True, False], ids=["forked", "exec"])
def test_no_process_of_the_tree_loads_openssl(fake_nvml_libdir: Path, tmp_path: Path, zygote: bool) -> None:
    """A node with no cluster feature speaks no TLS: on the real binding, with a config file (which
    the supervisor fingerprints), no process of the tree (the supervisor, the zygote, a worker
    forked by it or, with the zygote off, exec'd) maps libssl or libcrypto or loads ssl's C part or
    hashlib. OpenSSL would cost each of them ~3.5 MB (issue 30's memory target)."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n" + ("" if zygote else "gpuvisor:\n  zygote: false\n"))
    with short_tmpdir() as base:
        env = {**FakeNode(base, "dgx-h100").environ(fake_nvml_libdir), "PYTHONPROFILEIMPORTTIME": "1"}
        with fakenvml.real_node(env, ["--config-file", str(config)]) as node:
            node.wait_listed([GPU], 60)
            assert node.proc is not None
            assert wait_until(lambda: len(node.workers()) == (2 if zygote else 1), 10), node.workers()
            tree = [psutil.Process(node.proc.pid), *node.workers()]
            assert "libnvidia-ml.so.1" in mapped_libraries(tree[0])  # the reading works
            for proc in tree:
                assert_no_openssl(proc, mapped_libraries(proc))
            modules = imported(node.log())
            assert {"grpc", "asyncio", "zmq", "supervisor.config.fingerprint"} <= modules
            # (`ssl` itself leaves a line of a few microseconds in the workers' log: the failed
            # attempt of asyncio that worker.process.leave_out_ssl makes fail; its C part never loads)
            assert sorted({"_ssl", "hashlib", "_hashlib"} & modules) == []


def test_workers_leave_openssl_out_on_any_node() -> None:
    """The same for the zygote and its worker on a simulated node, which needs no C compiler: each
    maps gRPC's library and neither maps libssl or libcrypto (asyncio's `import ssl`, which gRPC
    brings, fails there by design: worker.process.leave_out_ssl)."""
    with SimNode("dgx-h100") as node:
        node.wait_listed([GPU], 60)
        assert wait_until(lambda: len(node.workers()) == 2, 10), node.workers()
        for proc in node.workers():
            mapped = mapped_libraries(proc)
            assert any(lib.startswith("cygrpc") for lib in mapped)  # the reading works
            assert_no_openssl(proc, mapped)


def test_a_client_says_its_version_without_importlib_metadata() -> None:
    """Making a client (its user agent names gpuvisor's version) loads no `importlib.metadata`:
    the version comes from its caller, not from the package's metadata (~1 MB of imports)."""
    code = (
        "import sys\n"
        "from supervisor.kube.client import KubeClient\n"
        "from supervisor.kube.credentials import Credentials\n"
        "creds = Credentials('http', '127.0.0.1', 1, '', None, None, None, '', 'test')\n"
        "client = KubeClient(creds, component='supervisor', version='1.2.3')\n"
        "print(client.user_agent, 'importlib.metadata' in sys.modules)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    assert out[0] == "gpuvisor/1.2.3" and out[-2:] == ["supervisor", "False"], out
