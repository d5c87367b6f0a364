"""The benchmark runner works end to end: a table, then a JSON document, exit 0 (smoke test)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import fakenvml
from tests.benchmarks.__main__ import load
from tests.benchmarks.common import Row, format_table, percentile
from tests.harness import child_env, run_python
from tests.helpers import REPO


def test_quick_preferred_run_prints_table_and_json(tmp_path: Path) -> None:
    """`python -m tests.benchmarks --quick --only bench_preferred` prints the table and the JSON and writes --json."""
    out_path = str(tmp_path / "bench.json")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks", "--quick", "--only", "bench_preferred",
         "--json", out_path],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    table, _, doc_text = proc.stdout.partition("\n{")
    assert table.splitlines()[0].split()[:3] == ["benchmark", "figure", "value"]
    assert "policy 8 GPUs p50" in table and "policy 16x64 p50" in table
    doc = json.loads("{" + doc_text)
    names = {row["name"] for row in doc["rows"] if row["bench"] == "bench_preferred"}
    assert {"policy 8 GPUs p50", "policy 16x64 max", "gRPC 8 GPUs p50"} <= names
    assert all(row["value"] is None or row["value"] >= 0 for row in doc["rows"])
    assert doc["machine"]["cpu_count"] >= 1 and doc["crashed"] == {}
    assert "no .pth import hooks" in doc["machine"]["interpreter"]  # rerun on a plain venv, or none needed
    with open(out_path, encoding="utf-8") as fh:
        assert json.load(fh)["rows"] == doc["rows"]


def test_unknown_benchmark_name_is_a_usage_error() -> None:
    """--only with a name not in the registry exits 2 naming it, without running anything."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks", "--only", "bench_nope"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "bench_nope" in proc.stderr


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([], 50, math.nan),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0], 100, 3.0),
        ([5.0, 1.0], 0, 1.0),
    ],
)
def test_percentile_interpolates_between_ranks(values: list[float], q: float, want: float) -> None:
    """percentile() interpolates linearly, handles one value and gives NaN for none."""
    got = percentile(values, q)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


def test_table_shows_missing_values_as_na() -> None:
    """A NaN figure prints as n/a and status lines (not available) follow the rows."""
    text = format_table(
        [("b", Row("x p50", math.nan, "ms", "< 5 ms", "why"))], [("bench_later", "not available")]
    )
    lines = text.splitlines()
    assert "n/a" in lines[2] and lines[2].endswith("why")
    assert lines[3].split() == ["bench_later", "not", "available"]


def test_missing_module_is_not_available() -> None:
    """A benchmark module that does not exist loads as None ("not available"); an existing one gives its run()."""
    assert load("bench_that_does_not_exist") is None
    assert callable(load("bench_preferred"))


def test_the_bare_plugin_registers_re_registers_and_cleans_up(tmp_path: Path) -> None:
    """The floor's bare plugin is a working plugin: it registers 8 healthy devices with the kubelet
    stand-in, registers again on a new socket after a kubelet restart, and removes its socket at
    SIGTERM (so its figures are those of a real, if minimal, device plugin)."""
    import signal

    from supervisor.sim.kubelet import KubeletStandin
    from tests.helpers import short_tmpdir, sockets_in

    with short_tmpdir("gvbare") as plugin_dir, KubeletStandin(plugin_dir) as kubelet:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.benchmarks.bareplugin", "--kubelet-socket", kubelet.socket_path],
            cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            assert kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, 30)
            first = kubelet.endpoint_socket("nvidia.com/gpu")
            kubelet.restart()
            assert kubelet.wait_for(
                lambda: (
                    kubelet.allocatable("nvidia.com/gpu") == 8
                    and kubelet.endpoint_socket("nvidia.com/gpu") != first
                ),
                30,
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
        assert sockets_in(plugin_dir) == ["kubelet.sock"]


def test_import_hooks_are_the_pth_files_that_run_code(tmp_path: Path) -> None:
    """A .pth line that begins with `import` runs at every start (an editable install's finder,
    setuptools' distutils hack); a plain path line does not, nor does any other file."""
    from tests.benchmarks.interpreter import import_hooks

    (tmp_path / "__editable__.x.pth").write_text(
        "import __editable___x_finder; __editable___x_finder.install()\n"
    )
    (tmp_path / "distutils-precedence.pth").write_text("import os; var = 'SETUPTOOLS_USE_DISTUTILS'\n")
    (tmp_path / "paths.pth").write_text("/opt/somewhere\n# import nothing: a comment\n")
    (tmp_path / "notes.txt").write_text("import os\n")
    found = [os.path.basename(p) for p in import_hooks([str(tmp_path)])]
    assert found == ["__editable__.x.pth", "distutils-precedence.pth"]


def test_the_plain_venv_sees_the_packages_and_runs_no_hook(tmp_path: Path) -> None:
    """The bare venv the runner reruns on imports gRPC, ZeroMQ and gpuvisor from the same
    packages, and starts without any .pth hook module (as the image's interpreter does)."""
    import site

    from tests.benchmarks.interpreter import plain_venv

    python = plain_venv(str(tmp_path / "venv"), site.getsitepackages())
    probe = (
        "import sys, grpc, zmq, supervisor.cli;"
        "print(sorted(m for m in sys.modules if m.startswith(('__editable__', '_distutils_hack'))))"
    )
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_workerpages_takes_every_step_of_a_forked_workers_start(tmp_path: Path) -> None:
    """`python -m tests.benchmarks.workerpages DIR` forks from a zygote as gpuvisor's, takes each
    step of a worker's start in order (the child fails unless its gRPC channel connects to the
    server it made) and reports the pages each added."""
    from tests.benchmarks.workerpages import STEPS

    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.workerpages", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert [s["step"] for s in found["steps"]] == list(STEPS)
    assert found["steps"][0]["dirty"] > 0  # a fork alone writes pages


def test_workerpages_says_why_its_child_failed(tmp_path: Path) -> None:
    """A step that fails in the forked child (here: a socket folder that does not exist) prints the
    child's traceback before it exits, and the command exits 1 saying the child failed."""
    failed = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.workerpages", str(tmp_path / "no" / "such" / "dir")],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env(),
    )  # fmt: skip
    assert (
        failed.returncode == 1 and "Traceback" in failed.stderr and "the forked child failed" in failed.stderr
    )


_PAGES_SCRIPT = """
import mmap, os, sys
N, PAGE = 512, 4096
private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
region = mmap.mmap(-1, 3 * N * PAGE, flags=private)
region[:] = b"\\x01" * (3 * N * PAGE)
pid = os.fork()
if pid == 0:
    for i in range(N):
        region[i * PAGE] = 1  # the same byte written back: identical
        region[(N + i) * PAGE] = 2  # one word changed: few words
        region[(2 * N + i) * PAGE:(2 * N + i + 1) * PAGE] = b"\\x03" * PAGE  # every word: more
    fresh = mmap.mmap(-1, N * PAGE, flags=private)
    for i in range(N):
        fresh[i * PAGE] = 4  # no page of the parent there: new
    print(os.getpid(), flush=True)
    sys.stdin.read()
    os._exit(0)
sys.stdin.read()
os.waitpid(pid, 0)
"""


def test_shared_pages_sorts_a_forked_childs_own_pages_by_what_it_wrote() -> None:
    """sharedpages.classify, on a child that wrote 2 MiB of each kind into its parent's pages
    (the same bytes back; one word; every word) and 2 MiB of fresh pages, finds at least 2 MiB of
    each kind, and less than 1 MiB more than that of any kind (the interpreter's own writes)."""
    from tests.benchmarks.sharedpages import KINDS, classify

    parent = subprocess.Popen(
        [sys.executable, "-c", _PAGES_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdin is not None
        child = int(parent.stdout.readline())
        try:
            os.close(os.open(f"/proc/{parent.pid}/mem", os.O_RDONLY))
        except PermissionError as exc:  # Yama ptrace_scope >= 2, or a sandbox without ptrace
            pytest.skip(f"another process's memory cannot be read here: {exc}")
        found = classify(parent.pid, child)
    finally:
        parent.communicate("", timeout=30)
    assert found is not None, "the parent's and child's memory could not be read"
    mib = 1 << 20
    assert set(found) == set(KINDS)
    for kind, size in found.items():
        assert 2 * mib <= size < 3 * mib, (kind, found)


def test_thread_names_counts_a_process_threads_by_their_kernel_name() -> None:
    """bench_memory.thread_names counts the threads of a process by the name the kernel keeps for
    each (as gRPC names its event engine's): three threads named alike count 3 under that name,
    and the process's other threads are counted under theirs."""
    import ctypes
    import threading

    from tests.benchmarks.bench_memory import thread_names

    libc = ctypes.CDLL(None, use_errno=True)
    named = threading.Barrier(4)
    done = threading.Event()

    def run() -> None:
        libc.prctl(15, b"gv_bench_probe", 0, 0, 0)  # PR_SET_NAME: this thread's comm
        named.wait(timeout=30)
        done.wait(timeout=30)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        named.wait(timeout=30)
        found = thread_names(os.getpid())
        tasks = len(os.listdir(f"/proc/{os.getpid()}/task"))
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)
    assert found["gv_bench_probe"] == 3
    assert sum(found.values()) == tasks >= 4


def test_real_gpu_probe_counts_the_nodes_gpus(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """`--real-gpu`'s probe (node.node_gpus) reads the GPU count, the first GPU's name and the
    driver's version from the libnvidia-ml the process loads: the fake library serving NVIDIA's
    h100 profile (dgx-h100 where those profiles are not here) gives 8 H100s."""
    from tests.benchmarks import node

    profile = "h100" if "h100" in fakenvml.mock_profiles() else "dgx-h100"
    fake = fakenvml.FakeNode(tmp_path, profile)
    count, what = node.node_gpus(fake.environ(fake_nvml_libdir))
    assert count == 8
    assert what.startswith("8 x NVIDIA H100") and "(driver " in what


def test_real_gpu_probe_says_nvmls_reason(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    """Where NVML cannot be initialised (the fake driver "not loaded"), the probe raises naming
    the flag and NVML's error, which the runner reports as that benchmark's crash."""
    from tests.benchmarks import node

    fake = fakenvml.FakeNode(tmp_path, "pcie-l4")
    fake.control.fail_init()
    with pytest.raises(
        RuntimeError, match=r"--real-gpu: this node's NVML could not be read: .*Driver Not Loaded"
    ):
        node.node_gpus(fake.environ(fake_nvml_libdir))


def test_real_gpu_flag_reaches_the_benchmarks_and_the_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`main(["--real-gpu", ...])` sets the environment variable that node.real_gpu() reads (and a
    rerun on the plain venv inherits) before any benchmark runs, and the JSON's
    `machine.real_gpu` says so; without the flag both say no."""
    from tests.benchmarks import __main__ as runner
    from tests.benchmarks import node

    seen: list[bool] = []

    def bench(quick: bool) -> list[Row]:
        seen.append(node.real_gpu())
        return []

    def fake_load(name: str) -> Any:
        return bench

    monkeypatch.setattr(runner, "load", fake_load)
    monkeypatch.setattr(runner, "compile_checkout", lambda: 0)
    monkeypatch.delenv(node.REAL_GPU_ENV, raising=False)
    out = tmp_path / "plain.json"
    assert runner.main(["--with-import-hooks", "--only", "bench_floors", "--json", str(out)]) == 0
    assert seen == [False] and json.loads(out.read_text())["machine"]["real_gpu"] is False
    out = tmp_path / "real.json"
    assert (
        runner.main(["--with-import-hooks", "--real-gpu", "--only", "bench_floors", "--json", str(out)]) == 0
    )
    assert seen == [False, True] and json.loads(out.read_text())["machine"]["real_gpu"] is True


_REFUSING_CC = """#!/bin/sh
echo "In file included from x.h:1," >&2
echo "control.c:245:10: error: made up for the test [-Werror=stringop-overflow=]" >&2
echo "cc1: all warnings being treated as errors" >&2
exit 1
"""


@pytest.mark.skipif(
    fakenvml.header_dir() is None, reason="NVIDIA's nvml.h (nvidia-nvml-dev) is not installed"
)
def test_a_fake_library_that_does_not_build_leaves_the_simulator_in_its_place(tmp_path: Path) -> None:
    """Where the compiler refuses the fake library (here a $CC that fails as GCC does under
    -Werror), the benchmark's nodes fall back to the simulator's profiles, and the note names the
    compiler's error line, not its last line, instead of crashing every benchmark."""
    cc = tmp_path / "cc"
    cc.write_text(_REFUSING_CC)
    cc.chmod(0o755)
    probe = "from tests.benchmarks import node; print(node.five_resources().what)"
    proc = run_python(probe, {**child_env(), "CC": str(cc)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "simulated mig-a100 --mig-strategy mixed (no fake libnvidia-ml: its build failed: "
        "control.c:245:10: error: made up for the test [-Werror=stringop-overflow=])"
    )


@pytest.mark.parametrize(
    ("words", "want"),
    [
        (
            "gcc failed (1):\na.c:1: warning: w\na.c:2:3: error: e\ncc1: all warnings being treated as errors",
            "a.c:2:3: error: e",
        ),
        ("/usr/bin/false failed (1):\n", "/usr/bin/false failed (1):"),
        ("", "no output"),
    ],
)
def test_build_error_line_is_the_first_error(words: str, want: str) -> None:
    """The reason a failed build gives is the compiler's first `error:` line, else its first line."""
    from tests.benchmarks.node import build_error_line

    assert build_error_line(words) == want
