"""Record the hot set (worker/hotset.py): `python -m tests.benchmarks.hotrecord [--write | --out PATH] [--seconds S]`.

Runs the benchmark's two nodes (`node.one_resource()`, then the five-resource MIG node) with a
`sitecustomize` of this module's on the path of their processes. In the zygote it registers an
at-fork hook, so that each forked worker profiles the calls it makes (`sys.setprofile` and
`threading.setprofile`, from the fork on) for `--seconds`, and then writes the functions it ran:
each function object of a module the zygote had loaded whose code object ran, or whose code
defines one that ran (a closure or a comprehension made at run time), as `module:qualname`, the
names worker/hotset.py looks up; not a wrapper whose code others share (functools.wraps: which
of them ran is not known; the function it wraps is recorded when it runs). The
union over every worker is the hot set's functions. Its names are then read from those
functions' code, in this process: the names the code uses (`co_names`) and the constants that
are identifiers (keyword-argument names among them), which the compiler interns.

Prints what it found against the set in `worker/hotset.txt`; `--write` replaces that file,
`--out PATH` writes elsewhere. Regenerate the set after a change to what a worker runs at its
start: a stale set costs memory (bench_memory), never a failure.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import importlib
import os
import platform
import sys
import tempfile
import time
import types

from tests.benchmarks import node
from tests.harness import SimNode
from tests.helpers import checkout_path
from worker import hotset

OUT_ENV = "GVHOTRECORD_OUT"
SECONDS_ENV = "GVHOTRECORD_SECONDS"

# The zygote's sitecustomize. Only the zygote (its command line names worker.zygote) records.
HOOK = """
import os, sys
if os.environ.get("GVHOTRECORD_OUT") and "worker.zygote" in getattr(sys, "orig_argv", []):
    def _gv_record_in_child():
        import gc, threading, time, types
        ran = {}
        done = []
        loaded = set(sys.modules)  # the zygote's modules: a function of another is not to be found there
        def profile(frame, event, arg):
            if event == "call" and not done:
                ran[id(frame.f_code)] = frame.f_code
        def write():
            time.sleep(float(os.environ["GVHOTRECORD_SECONDS"]))
            done.append(True)  # every thread's profile does nothing from here on
            gc.unfreeze()  # the zygote's objects, frozen before the fork: get_objects lists them then
            functions = [f for f in gc.get_objects() if isinstance(f, types.FunctionType)]
            holders = {}
            for f in functions:
                holders[id(f.__code__)] = holders.get(id(f.__code__), 0) + 1
            found = set()
            for f in functions:
                if f.__module__ not in loaded:
                    continue
                if holders[id(f.__code__)] > 1 and id(f.__code__) in ran:
                    continue  # a wrapper's code (functools.wraps): which wrapper ran is not known
                name = f.__module__ + ":" + f.__qualname__
                stack = [f.__code__]
                while stack:
                    code = stack.pop()
                    if id(code) in ran:
                        found.add(name)
                        break
                    stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            path = os.path.join(os.environ["GVHOTRECORD_OUT"], f"{os.getpid()}.txt")
            with open(path + ".part", "w") as fh:
                fh.write("\\n".join(sorted(found)))
            os.rename(path + ".part", path)
        threading.Thread(target=write, daemon=True).start()  # before the profile: not profiled
        sys.setprofile(profile)
        threading.setprofile(profile)
    os.register_at_fork(after_in_child=_gv_record_in_child)
"""


def _run(sim: SimNode, resources: list[str], out: str, seconds: float) -> None:
    """Run one node until each of its workers has written what it ran."""
    before = len(glob.glob(os.path.join(out, "*.txt")))
    with sim:
        sim.wait_listed(resources, 60)
        deadline = time.monotonic() + seconds + 60
        while len(glob.glob(os.path.join(out, "*.txt"))) < before + len(resources):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not all write what they ran")
            time.sleep(0.1)


def record_functions(seconds: float) -> list[str]:
    """The functions the workers of the benchmark's nodes ran in their first `seconds`."""
    with tempfile.TemporaryDirectory(prefix="gvhot-") as tmp:
        hook = os.path.join(tmp, "hook")
        out = os.path.join(tmp, "out")
        os.mkdir(hook)
        os.mkdir(out)
        with open(os.path.join(hook, "sitecustomize.py"), "w") as fh:
            fh.write(HOOK)
        env = {"PYTHONPATH": checkout_path() + os.pathsep + hook, OUT_ENV: out, SECONDS_ENV: str(seconds)}
        one = node.one_resource()
        _run(SimNode(one.profile, env={**one.env, **env}), [node.GPU], out, seconds)
        five = node.five_resources()
        _run(
            SimNode(five.profile, args=node.MIG_ARGS, env={**five.env, **env}),
            node.MIG_RESOURCES,
            out,
            seconds,
        )
        found: set[str] = set()
        for path in glob.glob(os.path.join(out, "*.txt")):
            with open(path, "rb") as fh:  # bytes: an "ascii" text file would import a codec here
                found.update(line for line in fh.read().decode("ascii").splitlines() if line)
    return sorted(f for f in found if hotset.is_function(f))


@functools.cache
def _zygote_modules() -> None:
    """Import, once, the modules a zygote's preload imports."""
    from worker.zygote import PRELOAD

    for preloaded in PRELOAD:
        importlib.import_module(preloaded)


def _found(entry: str) -> list[types.FunctionType]:
    """The functions `entry` names, in this process, with the zygote's modules imported;
    `__main__` is the zygote's module (it runs as `python -m worker.zygote`)."""
    _zygote_modules()
    module_name, _, qualname = entry.partition(":")
    module = sys.modules.get("worker.zygote" if module_name == "__main__" else module_name)
    return hotset.functions_named(module, qualname) if module is not None else []


def resolvable(functions: list[str]) -> list[str]:
    """The entries of `functions` a zygote can find: not a module its preload does not import,
    nor a function made at run time (a named tuple's `__new__`), nor the recorder's own hook."""
    return [f for f in functions if _found(f)]


def names_of(functions: list[str]) -> list[str]:
    """The names the code of `functions` uses: each code object's `co_names`, and its constants
    (and tuples of them) that are identifiers, in the code objects it defines too."""
    names: set[str] = set()
    for entry in functions:
        for function in _found(entry):
            stack = [function.__code__]
            while stack:
                code = stack.pop()
                names.update(code.co_names)
                for const in code.co_consts:
                    if isinstance(const, types.CodeType):
                        stack.append(const)
                    elif isinstance(const, tuple):
                        names.update(c for c in const if isinstance(c, str))
                    elif isinstance(const, str):
                        names.add(const)
    return sorted(n for n in names if hotset.is_name(n))


def text(names: list[str], functions: list[str], seconds: float) -> str:
    """The hot set file for `names` and `functions`."""
    when = datetime.date.today().isoformat()
    lines = [
        hotset.HEADER,
        f"# Written by `python -m tests.benchmarks.hotrecord --write` on {when}, Python {platform.python_version()}:",
        f"# the functions the workers of the benchmark's nodes ran in their first {seconds:g} s, and the",
        "# names their code uses. Read by worker/hotset.py.",
        *(f"name {n}" for n in names),
        *(f"func {f}" for f in functions),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks.hotrecord", description=__doc__.split("\n")[0]
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help=f"replace {hotset.PATH}")
    where.add_argument("--out", help="write the set to this file")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each worker records (default 5)")
    args = parser.parse_args(argv)
    recorded = record_functions(args.seconds)
    functions = resolvable(recorded)
    names = names_of(functions)
    old_names, old_functions = set(hotset.NAMES), set(hotset.FUNCTIONS)
    print(f"functions: {len(functions)} ({len(recorded) - len(functions)} recorded that a zygote cannot find left out; "
          f"{len(set(functions) - old_functions)} not in the current set, "
          f"{len(old_functions - set(functions))} of it not found now)")  # fmt: skip
    print(f"names: {len(names)} ({len(set(names) - old_names)} new, {len(old_names - set(names))} gone)")
    path = hotset.PATH if args.write else args.out
    if path:
        data = text(names, functions, args.seconds)
        hotset.parse(data.encode("ascii"))  # what is written reads back
        with open(path, "w", encoding="ascii") as fh:
            fh.write(data)
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
