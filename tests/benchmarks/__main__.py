"""The benchmark runner: `python -m tests.benchmarks [--quick] [--json PATH] [--only NAME,...] [--real-gpu]
[--fleet-nodes N]`.

Runs every module in `BENCHES` (in order), prints one aligned table and then a JSON document
(rows plus machine info) to stdout, and writes the JSON to `--json PATH` too. First it compiles
the checkout's bytecode (`compileall`, into the __pycache__ folders git ignores) and the cache of
the code its dataclasses compile (`python -m common.methodcache`), as the container image's build
does: with PYTHONDONTWRITEBYTECODE set, every process started from a source checkout would
otherwise compile gpuvisor's modules again, about 300 ms that no node pays. Started from a development venv whose `.pth` files run code at start (an
editable install), it runs itself again on a bare venv over the same packages, so every figure is
taken on an interpreter like the image's (tests/benchmarks/interpreter.py; `--with-import-hooks`
keeps the one it was started with). A module that does not exist yet is listed as "not
available". The runner reports and does not judge: it exits 0 even when targets are missed, and
non-zero only when a benchmark crashed (named on stderr and in the JSON under "crashed").
On a GPU node, `--real-gpu` runs the one-resource figures (start, memory, idle CPU) on the node's
own libnvidia-ml and GPUs (tests/benchmarks/node.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.benchmarks import interpreter, node
from tests.benchmarks.common import Row, format_table, machine_info, row_dict

BENCHES = [
    "bench_floors",
    "bench_allocate",
    "bench_preferred",
    "bench_kubelet_restart",
    "bench_worker_kill",
    "bench_killstorm",
    "bench_streams",
    "bench_health",
    "bench_startup",
    "bench_memory",
    "bench_idle_cpu",
    "bench_realnvml",
    "bench_huge_config",
    "bench_kube",
    "bench_dra",
    "bench_fleet",
    "bench_migmaker",
]
PACKAGE = "tests.benchmarks"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks", description="Run gpuvisor's benchmarks.")
    p.add_argument("--quick", action="store_true", help="smaller runs: a smoke test of every benchmark")
    p.add_argument("--json", metavar="PATH", default="", help="also write the JSON document to PATH")
    p.add_argument(
        "--only", metavar="NAME,...", default="", help=f"run only these (of: {', '.join(BENCHES)})"
    )
    p.add_argument(
        "--with-import-hooks",
        action="store_true",
        help="measure on this interpreter as it is, .pth import hooks (an editable install) included",
    )
    p.add_argument(
        "--real-gpu",
        action="store_true",
        help="run the one-resource node on this node's own libnvidia-ml and GPUs (a GPU node), not the fake library",
    )
    p.add_argument(
        "--fleet-nodes",
        type=int,
        default=0,
        metavar="N",
        help="nodes in bench_fleet's fleet (default 50, 3 with --quick)",
    )
    args = p.parse_args(argv)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BENCHES]
        if unknown:
            p.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
        args.names = wanted
    else:
        args.names = list(BENCHES)
    return args


def load(name: str) -> Callable[[bool], list[Row]] | None:
    """The module's `run`, or None when the module does not exist (yet)."""
    qualified = f"{PACKAGE}.{name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name == qualified:
            return None
        raise
    run: Callable[[bool], list[Row]] = module.run
    return run


def compile_checkout() -> int:
    """Compile gpuvisor's modules (and the tests' helpers the benchmarks start) where they lie,
    and write the cache of the code their dataclasses compile (common/methodcache.py), in a
    fresh interpreter as the image's build step does."""
    import compileall
    import subprocess

    from tests.helpers import REPO

    ok = True
    for package in ("common", "supervisor", "worker", "tests"):
        ok = bool(compileall.compile_dir(os.path.join(REPO, package), quiet=1)) and ok
    cache = subprocess.run(
        [sys.executable, "-m", "common.methodcache"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if cache.returncode != 0:
        print(cache.stderr.strip(), file=sys.stderr)
    return 0 if ok and cache.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real_gpu:
        os.environ[node.REAL_GPU_ENV] = "1"  # read by tests/benchmarks/node.py, here and in the rerun
    if args.fleet_nodes:
        os.environ["GPUVISOR_BENCH_FLEET_NODES"] = str(args.fleet_nodes)  # read by bench_fleet.py
    if not args.with_import_hooks and os.environ.get(interpreter.PLAIN_ENV) != "1":
        import site

        if interpreter.import_hooks(site.getsitepackages()):
            from tests.helpers import REPO

            return interpreter.rerun_plain(sys.argv[1:] if argv is None else argv, REPO)
    if compile_checkout() != 0:
        print("warning: some modules did not compile; their processes compile them at start", file=sys.stderr)
    rows: list[tuple[str, Row]] = []
    statuses: list[tuple[str, str]] = []
    not_available: list[str] = []
    crashed: dict[str, str] = {}
    durations: dict[str, float] = {}
    for name in args.names:
        print(f"running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            run = load(name)
            if run is None:
                not_available.append(name)
                statuses.append((name, "not available"))
                continue
            result = run(args.quick)
            if not isinstance(result, list) or not all(isinstance(r, Row) for r in result):
                raise TypeError(f"run() returned {type(result).__name__}, not a list of Row")
            rows.extend((name, row) for row in result)
        except Exception as exc:
            crashed[name] = f"{type(exc).__name__}: {exc}"
            statuses.append((name, f"CRASHED: {type(exc).__name__}: {exc}"))
            print(f"benchmark {name} crashed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        finally:
            durations[name] = round(time.monotonic() - start, 2)
    document: dict[str, Any] = {
        "quick": args.quick,
        "machine": {**machine_info(), "interpreter": interpreter.describe(), "real_gpu": node.real_gpu()},
        "rows": [row_dict(bench, row) for bench, row in rows],
        "not_available": not_available,
        "crashed": crashed,
        "seconds": durations,
    }
    text = json.dumps(document, indent=2, allow_nan=False)
    print(format_table(rows, statuses))
    print()
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if crashed:
        print(f"crashed: {', '.join(sorted(crashed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
