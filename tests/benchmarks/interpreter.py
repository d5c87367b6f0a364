"""The interpreter the benchmarks run gpuvisor on: the one the container image has.

The image installs gpuvisor from a wheel into a venv and then removes pip and setuptools, so its
interpreter runs no code at start beyond the standard library's `site`. A development venv
(`pip install -e '.[test]'`) does: setuptools' `distutils-precedence.pth` and the editable
install's finder are `.pth` files with `import` lines, which every interpreter started from that
venv runs. The finder imports pathlib, urllib.parse and ipaddress: about 0.6 MB of private memory
in the zygote (up to 1.9 MB in a process that imports less) and, with the hook, about 10 ms at
each interpreter start (`python -c pass`: 19 ms against 8 ms here), which no node pays.

So the runner, started from such a venv, makes a bare venv in a temporary folder
(`venv --without-pip`, about 40 ms) whose one `.pth` file names the development venv's
site-packages as plain paths (a plain path line runs nothing, and `site` does not look for
`.pth` files in the folders such a line adds), and runs itself again on it. Every process the
benchmarks start, the floors' included, then runs on that interpreter. `--with-import-hooks`
keeps the interpreter the runner was started with.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence

PLAIN_ENV = "GPUVISOR_BENCH_PLAIN_VENV"  # set in the rerun: it does not make another venv


def import_hooks(site_dirs: Iterable[str]) -> list[str]:
    """The `.pth` files in `site_dirs` that run code at start (a line that begins with `import`)."""
    found = []
    for folder in site_dirs:
        for path in sorted(glob.glob(os.path.join(folder, "*.pth"))):
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    lines = fh.read(1 << 16).splitlines()
            except OSError:
                continue
            if any(line.startswith(("import ", "import\t")) for line in lines):
                found.append(path)
    return found


def plain_venv(where: str, site_dirs: Sequence[str]) -> str:
    """Make a venv without pip in `where` that sees `site_dirs` as plain paths; its python's path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", where], check=True)
    python = os.path.join(where, "bin", "python")
    probe = [python, "-c", "import site; print(site.getsitepackages()[0])"]
    own_site = subprocess.run(probe, check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(own_site, "gpuvisor-bench-packages.pth"), "w", encoding="utf-8") as fh:
        fh.write("".join(f"{folder}\n" for folder in site_dirs))
    return python


def rerun_plain(argv: Sequence[str], repo: str) -> int:
    """Run `python -m tests.benchmarks argv` again on a plain venv over this interpreter's
    site-packages, in the caller's folder (a relative --json names the same file), with the
    checkout `repo` on PYTHONPATH; its exit status, 128 + N when a signal N ended it. The venv is
    removed afterwards."""
    import site

    with tempfile.TemporaryDirectory(prefix="gvbench-venv-") as where:
        python = plain_venv(os.path.join(where, "venv"), site.getsitepackages())
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, PLAIN_ENV: "1", "PYTHONPATH": path}
        code = subprocess.run([python, "-m", "tests.benchmarks", *argv], env=env, check=False).returncode
    return 128 - code if code < 0 else code


def describe() -> str:
    """What the machine section says of the interpreter the figures were taken on."""
    if os.environ.get(PLAIN_ENV) == "1":
        return "a bare venv over the development venv's packages: no .pth import hooks, as in the image"
    import site

    hooks = import_hooks(site.getsitepackages())
    if not hooks:
        return "as started: no .pth import hooks"
    return "as started, with .pth import hooks the image does not have: " + ", ".join(
        os.path.basename(h) for h in hooks
    )
