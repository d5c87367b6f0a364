"""`gpuvisor run` takes the code its dataclasses compile from common/methodcache.py's file.

Each test gives its processes a bytecode cache of their own (PYTHONPYCACHEPREFIX in a temp dir),
so the file they read and write is the test's, not the checkout's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from common import methodcache
from tests.harness import SimNode, child_env, run_python
from tests.helpers import checkout_path, short_tmpdir, wait_until

GPU = "nvidia.com/gpu"
LINE = re.compile(r"dataclass code: (\d+) texts from (\S+), (\d+) compiled")


def _file_under(prefix: str) -> str:
    """Where the processes of a node with this PYTHONPYCACHEPREFIX keep the file."""
    proc = run_python(
        "from common import methodcache; print(methodcache.cache_path())",
        child_env({"PYTHONPYCACHEPREFIX": prefix}),
    )
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert path.startswith(prefix + os.sep), path
    return path


def test_a_start_writes_the_file_and_the_next_start_compiles_nothing() -> None:
    """A first `gpuvisor run` with no file compiles its dataclasses' code and writes it: the
    supervisor the sections of its modules, the zygote those of the worker's (worker.allocate,
    which only a worker imports). A second start takes every text from the file and compiles
    none (its debug line says so), and registers as before."""
    with short_tmpdir() as prefix:
        env = {"PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": ""}  # empty: bytecode is written
        path = _file_under(prefix)
        with SimNode("dgx-h100", args=["--log-level", "debug"], env=env) as node:
            node.wait_listed([GPU], 60)
            assert wait_until(lambda: "worker.allocate" in methodcache._File(path).index, 30), (
                "the zygote wrote no section"
            )
            first = LINE.search(node.log())
        assert first is not None, "no dataclass code line"
        assert int(first.group(3)) > 0 and first.group(2) == path
        sections = set(methodcache._File(path).index)
        assert {"supervisor.config.model", "common.messages", "worker.allocate"} <= sections, sorted(sections)
        with SimNode("dgx-h100", args=["--log-level", "debug"], env=env) as node:
            node.wait_listed([GPU], 60)
            second = LINE.search(node.log())
        assert second is not None and int(second.group(3)) == 0, second
        assert int(second.group(1)) == int(first.group(1)) + int(first.group(3))


def test_the_build_step_writes_every_module_and_a_start_then_compiles_nothing() -> None:
    """`python -m common.methodcache` (the image's and the installer's step) writes the texts of
    every module of the three packages; the supervisor's and the zygote's imports, made with
    the cache installed under PYTHONDONTWRITEBYTECODE as the image runs, then compile none."""
    with short_tmpdir() as prefix:
        env = child_env({"PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": "1"})
        step = subprocess.run(
            [sys.executable, "-m", "common.methodcache"],
            capture_output=True,
            text=True,
            cwd=prefix,
            env=env,
            timeout=120,
            check=False,
        )
        assert step.returncode == 0, step.stderr
        path = _file_under(prefix)
        assert f"texts written to {path}" in step.stdout
        code = (
            "from common import methodcache\n"
            "methodcache.install()\n"
            "import supervisor.cli, supervisor.main, worker.zygote\n"
            "from worker.zygote import PRELOAD\n"
            "import importlib\n"
            "for name in PRELOAD: importlib.import_module(name)\n"
            "print(*methodcache.release())\n"
        )
        proc = run_python(code, env)
        assert proc.returncode == 0, proc.stderr
        taken, compiled = map(int, proc.stdout.split())
        assert compiled == 0 and taken > 400, proc.stdout


def test_the_build_step_names_each_module_it_could_not_import_and_writes_the_rest() -> None:
    """write_all imports every module of the packages it is given: a package that is not there
    and a module that raises are each listed with their error, in order, the other modules' texts
    are still written, and a package's __main__ is not imported (it would run its program)."""
    with short_tmpdir() as where:
        package = os.path.join(where, "gvprobe")
        os.mkdir(package)
        files = {
            "__init__.py": "",
            "good.py": "from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int\n",
            "bad.py": "raise RuntimeError('boom')\n",
            "__main__.py": "raise SystemExit('the program ran')\n",
        }
        for name, text in files.items():
            with open(os.path.join(package, name), "w") as fh:
                fh.write(text)
        target = os.path.join(where, "cache.bin")
        env = child_env({"PYTHONPATH": os.pathsep.join([checkout_path(), where])})
        proc = run_python(
            "import json\n"
            "from common import methodcache\n"
            f"count, failed = methodcache.write_all(('gvprobe', 'gv_no_such_package'), path={target!r})\n"
            "print(json.dumps([count, failed]))\n",
            env,
        )
        assert proc.returncode == 0, proc.stderr
        count, failed = json.loads(proc.stdout)
        assert failed == [
            "gvprobe.bad: RuntimeError: boom",
            "gv_no_such_package: ModuleNotFoundError: No module named 'gv_no_such_package'",
        ]
        assert count > 0 and os.path.getsize(target) > 0
