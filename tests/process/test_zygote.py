"""The worker zygote forks real workers on request and reports their exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import psutil
import pytest

from common.exitcodes import EXIT_CONFIG_ERROR
from common.workerargs import check_args
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from supervisor.sim.kubelet import KubeletStandin
from supervisor.workers.zygote import ForkedWorker, Zygote
from tests import nodes
from tests.harness import child_env, run_python
from tests.helpers import short_tmpdir, wait_until


def _plan_file(directory: str) -> str:
    plan = plan_resources(nodes.pcie_l4(), config_from_data(None))["nvidia.com/gpu"]
    path = os.path.join(directory, "plan.json")
    with open(path, "w") as fh:
        fh.write(plan.to_json())
    return path


def _worker_argv(directory: str, kubelet: KubeletStandin) -> list[str]:
    """A worker's arguments: nvidia.com/gpu of an L4 node, registering with `kubelet`."""
    return [
        "--resource",
        "nvidia.com/gpu",
        "--plan",
        _plan_file(directory),
        "--kubelet-socket",
        kubelet.socket_path,
    ]


def test_zygote_forks_a_worker_that_registers_and_reports_its_exit() -> None:
    """A forked worker serves, registers and shows its own command line (`--resource`); its exit status comes back through the zygote."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        zygote = Zygote()
        zygote.start()
        try:
            t0 = time.monotonic()
            pid = zygote.spawn(_worker_argv(d, kubelet))
            proc = ForkedWorker(pid, zygote)
            assert kubelet.wait_listed(["nvidia.com/gpu"], 30), "the forked worker did not register"
            print(f"zygote fork to registered and listed: {1000 * (time.monotonic() - t0):.1f} ms")
            assert proc.poll() is None
            import psutil

            cmd = [a for a in psutil.Process(pid).cmdline() if a]
            assert cmd[1:5] == ["-m", "worker", "--resource", "nvidia.com/gpu"], cmd
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: proc.poll() is not None, 15)
            assert proc.returncode == 0
        finally:
            zygote.stop()
        assert zygote.proc is None or zygote.proc.poll() is not None


def test_arguments_a_worker_refuses_fail_the_spawn_and_the_zygote_goes_on() -> None:
    """The supervisor parses a worker's arguments before it asks the zygote: arguments a worker
    would refuse fail that spawn with argparse's reason (OSError, so the spawner falls back to
    exec, which says why too), nothing is forked, and the same zygote forks the next worker."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        zygote = Zygote()
        zygote.start()
        try:
            assert zygote.proc is not None
            first = zygote.proc.pid
            with pytest.raises(OSError, match=r"arguments are not valid .*--socket-tag: 'XYZ'"):
                zygote.spawn(["--resource", "nvidia.com/gpu", "--plan", _plan_file(d), "--socket-tag", "XYZ"])
            assert zygote.proc.pid == first and zygote.proc.poll() is None
            assert psutil.Process(first).children() == []
            pid = zygote.spawn(_worker_argv(d, kubelet))
            assert zygote.proc.pid == first
            assert kubelet.wait_listed(["nvidia.com/gpu"], 30)
            proc = ForkedWorker(pid, zygote)
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: proc.poll() is not None, 15)
            assert proc.returncode == 0
        finally:
            zygote.stop()


def test_a_request_without_fields_for_this_zygote_is_refused_and_the_zygote_goes_on() -> None:
    """The zygote forks only with fields the supervisor parsed for it: a request whose fields are
    not a mapping, or carry another zygote's pid (the worker would take the wrong process for its
    parent), is answered with an error under its id and forks nothing; the zygote serves on."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        zygote = Zygote()
        zygote.start()
        try:
            assert zygote.proc is not None and zygote.sock is not None
            first = zygote.proc.pid
            argv = _worker_argv(d, kubelet)
            good = check_args([*argv, "--zygote-pid", str(first)])
            for rid, fields in ((901, ["not", "a", "mapping"]), (902, {**good, "zygote_pid": first + 1})):
                request = {"op": "spawn", "id": rid, "argv": argv, "args": fields}
                zygote.sock.sendall((json.dumps(request) + "\n").encode())

            def answered() -> bool:
                zygote.pump()
                return {901, 902} <= set(zygote._replies)

            assert wait_until(answered, 15)
            for rid, why in ((901, "bad request"), (902, f"zygote_pid is not {first}")):
                reply = zygote._replies.pop(rid)
                assert reply["op"] == "error" and why in str(reply["error"]), reply
            assert psutil.Process(first).children() == []
            pid = zygote.spawn(argv)
            assert zygote.proc.pid == first
            assert kubelet.wait_listed(["nvidia.com/gpu"], 30)
            proc = ForkedWorker(pid, zygote)
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: proc.poll() is not None, 15)
        finally:
            zygote.stop()


def test_killed_zygote_is_replaced_on_the_next_spawn() -> None:
    """When the zygote dies, the next spawn starts a new one instead of failing."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        zygote = Zygote()
        zygote.start()
        try:
            assert zygote.proc is not None
            first = zygote.proc.pid
            zygote.proc.kill()
            zygote.proc.wait()
            pid = zygote.spawn(_worker_argv(d, kubelet))
            assert zygote.proc is not None and zygote.proc.pid != first
            assert kubelet.wait_listed(["nvidia.com/gpu"], 30)
            proc = ForkedWorker(pid, zygote)
            proc.send_signal(signal.SIGKILL)
            assert wait_until(lambda: proc.poll() is not None, 15)
            assert proc.returncode == -signal.SIGKILL
        finally:
            zygote.stop()


def test_a_spawn_the_zygote_answers_too_late_is_killed() -> None:
    """A worker the zygote forks after the supervisor gave up on it (and started one by exec) is killed, never left serving."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        zygote = Zygote()
        zygote.start()
        try:
            assert zygote.proc is not None
            # Let it finish its imports first, then freeze it so the request waits.
            warm = zygote.spawn(_worker_argv(d, kubelet))
            ForkedWorker(warm, zygote).send_signal(signal.SIGKILL)
            os.kill(zygote.proc.pid, signal.SIGSTOP)
            try:
                zygote.spawn(
                    [
                        "--resource",
                        "nvidia.com/gpu",
                        "--plan",
                        _plan_file(d),
                        "--kubelet-socket",
                        kubelet.socket_path,
                    ]
                )
                raise AssertionError("spawn should have timed out")
            except OSError:
                pass
            os.kill(zygote.proc.pid, signal.SIGCONT)
            import psutil

            def late_child_gone() -> bool:
                zygote.pump()
                assert zygote.proc is not None
                kids: list[psutil.Process] = []
                for p in psutil.Process(zygote.proc.pid).children():
                    with contextlib.suppress(psutil.NoSuchProcess):  # reaped since it was listed
                        if p.status() != psutil.STATUS_ZOMBIE:
                            kids.append(p)
                return not kids and not zygote._abandoned

            assert wait_until(late_child_gone, 15)
        finally:
            zygote.stop()


_EARLY = """
import sys
import supervisor.__main__ as entry
from supervisor import launch

heavy = (
    "supervisor.cli", "supervisor.main", "supervisor.workers.zygote", "argparse", "logging", "json", "grpc", "zmq",
    "subprocess", "socket", "selectors",
)
real = launch.start_early_zygote


def recording(words, environ):
    early = real(words, environ)
    loaded = [m for m in heavy if m in sys.modules]  # what starting it took (zygoteproc's imports too)
    assert early is not None, "no zygote started"
    proc, sock = early
    # The spawn returns once exec has begun, before the kernel has set the new command line's
    # bounds (it reads empty for a moment): poll for it rather than read it once.
    import time

    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            cmdline = fh.read().split(b"\\0")
        if b"worker.zygote" in cmdline or time.monotonic() > deadline or proc.poll() is not None:
            break
        time.sleep(0.01)
    print(" ".join(loaded) or "-", b"worker.zygote" in cmdline, flush=True)
    proc.terminate()
    proc.wait(10)
    sock.close()
    raise SystemExit(0)  # the run itself is not this test's


launch.start_early_zygote = recording
sys.argv = ["gpuvisor", "run"]
entry.main()
"""


def test_the_entry_point_starts_the_zygote_before_the_cli_and_its_imports() -> None:
    """supervisor/__main__.py's main (the console script's entry) starts the zygote's process for
    `gpuvisor run` (`python -m worker.zygote`) having loaded neither the CLI nor the supervisor,
    nor argparse, logging, JSON, gRPC or ZeroMQ, nor `subprocess` and `socket` (posix_spawn and
    `_socket` start it): the zygote's imports begin before the supervisor's."""
    proc = run_python(_EARLY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["-", "True"], proc.stdout


_BROKEN_CLI = """
import os, sys
import supervisor.__main__ as entry

sys.modules["supervisor.cli"] = None  # a broken install: the CLI cannot be imported
sys.argv = ["gpuvisor", "run"]
try:
    entry.main()
except ImportError:
    pass
try:
    os.waitpid(-1, os.WNOHANG)
    print("a child is left")
except ChildProcessError:
    print("no child")
"""


def test_an_early_zygote_is_stopped_when_the_cli_cannot_be_imported() -> None:
    """The entry point started the zygote, then the CLI's import failed (a broken install, or
    Ctrl-C in that window): the zygote is stopped and reaped before the error goes on, not left
    to its parent-death signal."""
    proc = run_python(_BROKEN_CLI)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no child"


_REFUSED_CONFIG = """
import dataclasses, os
import supervisor.__main__ as entry
from supervisor import launch

started = []
real = launch.start_early_zygote


def recording(words, environ):
    early = real(words, environ)
    started.append(early is not None)
    return early


launch.start_early_zygote = recording
code = entry.main(["run", "--config-file", "/nonexistent/gpuvisor.yaml"])
try:
    os.waitpid(-1, os.WNOHANG)
    left = "child-left"
except ChildProcessError:
    left = "no-child"
print(started, code, left, "exec" in vars(dataclasses))
"""


def test_a_run_that_ends_before_the_supervisor_takes_the_zygote_leaves_no_zygote_and_no_cache() -> None:
    """`gpuvisor run` with a config file that cannot be read: the launch had started the zygote
    and installed the dataclass code cache, the supervisor never took either over, and the
    launch's exit ends and reaps the zygote and gives `dataclasses` its own exec back."""
    proc = run_python(_REFUSED_CONFIG)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[True]", str(EXIT_CONFIG_ERROR), "no-child", "False"], proc.stdout


_GARBAGE = """
import gc, io, json, os, socket, sys
from worker import zygote

zygote.leave_out_ssl()
real_freeze = gc.freeze


def looking(*args):  # what preload() would freeze: its garbage, seen by a collection here only
    fds = sorted(os.listdir("/proc/self/fd"))
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    gc.set_debug(0)
    finalized = [type(o).__name__ for o in gc.garbage if hasattr(type(o), "__del__")]
    held = [type(o).__name__ for o in gc.garbage if isinstance(o, (io.IOBase, socket.socket))]
    gc.garbage.clear()
    gc.collect()  # now freed for real: a descriptor only the garbage held would close here
    closed = sorted(set(fds) - set(os.listdir("/proc/self/fd")))
    print(json.dumps({"garbage": found, "files": held, "finalizers": finalized, "closed": closed}), flush=True)
    real_freeze(*args)


gc.freeze = looking
zygote.preload()
"""


def test_the_preloads_garbage_holds_no_file_or_socket() -> None:
    """The zygote freezes its imports' garbage instead of collecting it (a collection cost the
    start 6-9 ms). That garbage must hold nothing a collection would have released: no open
    file or socket, no descriptor at all (which every worker would inherit and never close),
    no object with a finalizer. And it stays a few hundred objects."""
    result = run_python(_GARBAGE)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["files"] == []
    assert seen["closed"] == []
    assert seen["finalizers"] == []
    assert 0 <= seen["garbage"] < 2000, seen


def _links(pid: int) -> dict[int, str]:
    """What each descriptor of `pid` points at (`pipe:[inode]`, `/dev/null`, ...)."""
    out: dict[int, str] = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


def test_the_zygote_inherits_no_descriptor_of_ours_but_its_socket() -> None:
    """The zygote is started with os.posix_spawn: it gets stdin from /dev/null, its end of the
    socketpair and our stdout and stderr, and no other descriptor the supervisor could pass on
    (one its own parent left it inheritable, here a pipe), as Popen(close_fds=True) did."""
    from supervisor.workers.zygoteproc import start_process, stop_process

    r, w = os.pipe()
    os.set_inheritable(r, True)
    os.set_inheritable(w, True)
    stdin = os.dup(0)
    os.dup2(r, 0)  # a stdin that is not /dev/null already (pytest's capture makes it so)
    try:
        proc, sock = start_process(dict(os.environ))
    finally:
        os.dup2(stdin, 0)
        os.close(stdin)
    try:

        def execd() -> bool:  # the new command line shows a moment after the exec began
            with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
                return b"worker.zygote" in fh.read().split(b"\0")

        assert wait_until(execd, 15)
        links = _links(proc.pid)
        ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (r, w)}
        assert not ours & set(links.values()), links
        assert links[0] == os.devnull
        fd = int(proc.args[proc.args.index("--fd") + 1])
        assert links[fd].startswith("socket:"), links
    finally:
        stop_process(proc, sock)
        os.close(r)
        os.close(w)
    assert proc.returncode is not None


_ARENAS = """
import ctypes, os, sys, tempfile, threading
libc = ctypes.CDLL(None)
if not hasattr(libc, "malloc_info"):
    print("no malloc_info"); sys.exit(0)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
started = threading.Barrier(7)
done = threading.Event()
def run():
    libc.free(libc.malloc(4096))  # this thread's first allocation: an arena of its own, if allowed
    started.wait(30)
    done.wait(30)
threads = [threading.Thread(target=run) for _ in range(6)]
for t in threads:
    t.start()
started.wait(30)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "info.xml").encode()
    fp = libc.fopen(path, b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(path).read().count("<heap nr="))
done.set()
for t in threads:
    t.join()
"""


def test_a_worker_process_environment_holds_glibc_to_two_malloc_arenas() -> None:
    """worker_environ's MALLOC_ARENA_MAX is honoured: a process started with it and running six
    threads that allocate has 2 malloc arenas (glibc's malloc_info), where the same process
    without it has one per thread and the main one, 7. Skips where libc has no malloc_info."""
    from supervisor.workers.zygoteproc import worker_environ

    plain = {k: v for k, v in child_env().items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    counts = {}
    for name, env in (("capped", worker_environ(plain)), ("plain", plain)):
        out = run_python(_ARENAS, env=env)
        assert out.returncode == 0, out.stderr
        if out.stdout.strip() == "no malloc_info":
            pytest.skip("this libc has no malloc_info (not glibc)")
        counts[name] = int(out.stdout)
    assert counts == {"capped": 2, "plain": 7}


def test_the_zygote_and_an_execd_worker_start_with_the_arena_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a worker starts carry MALLOC_ARENA_MAX=2 from worker_environ: the zygote process
    (its forked workers inherit its malloc settings) and a worker the spawner starts by exec."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)  # an operator's own would be kept
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    from supervisor.workers.spawner import WorkerSpawner
    from supervisor.workers.zygoteproc import start_process, stop_process

    def environ(pid: int) -> list[bytes]:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")

    proc, sock = start_process(dict(os.environ))
    try:
        assert wait_until(lambda: b"MALLOC_ARENA_MAX=2" in environ(proc.pid), 15)
    finally:
        stop_process(proc, sock)
    # A worker that cannot reach its kubelet socket retries, so it runs while it is read.
    with short_tmpdir() as d:
        worker = WorkerSpawner._exec(["--resource", "nvidia.com/gpu", "--plan", _plan_file(d),
                                      "--kubelet-socket", os.path.join(d, "kubelet.sock")], "secret")  # fmt: skip
        try:
            assert wait_until(lambda: b"MALLOC_ARENA_MAX=2" in environ(worker.pid), 15)
            assert worker.poll() is None
        finally:
            worker.send_signal(signal.SIGTERM)
            assert wait_until(lambda: worker.poll() is not None, 30)


def test_the_zygote_process_handle_answers_as_popen_does() -> None:
    """ZygoteProcess, the part of Popen the supervisor uses: poll() is None while it runs,
    wait(timeout) raises TimeoutError then, and after kill() wait() gives -SIGKILL, as poll()
    does from then on."""
    from supervisor.workers.zygoteproc import start_process

    proc, sock = start_process(dict(os.environ))
    try:
        assert proc.poll() is None
        with pytest.raises(TimeoutError):
            proc.wait(0.05)
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
        proc.terminate()  # a no-op on a process already reaped
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_unknown_interpreter_path_is_a_start_that_failed_not_a_crash() -> None:
    """With sys.executable empty (Python could not tell its own path), starting the zygote raises
    OSError, as a failed exec does, so the entry point goes on without an early zygote (the
    supervisor then starts workers by exec, saying so) instead of ending in a traceback."""
    code = (
        "import os, sys\n"
        "from supervisor.launch import start_early_zygote\n"
        "from supervisor.workers.zygoteproc import start_process\n"
        "sys.executable = ''\n"
        "try:\n"
        "    start_process(dict(os.environ))\n"
        "except OSError as exc:\n"
        "    print('OSError', exc)\n"
        "print(start_early_zygote(['run'], os.environ))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "OSError the Python interpreter's path is unknown (sys.executable is empty)",
        "None",
    ], proc.stdout
