"""The shape the code must keep (issue: supervisor shape): small modules, a small loop class, no
import cycles, and the process roles kept apart."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from tests.helpers import REPO

PACKAGES = ("supervisor", "worker", "common")
MAX_MODULE_LINES = 600
MAX_LOOP_CLASS_LINES = 400


def modules() -> Iterator[tuple[str, str]]:
    """(dotted module name, path) of every hand-written module of the three packages."""
    for package in PACKAGES:
        for root, _dirs, files in os.walk(os.path.join(REPO, package)):
            for name in sorted(files):
                if not name.endswith(".py") or name.endswith(("_pb2.py", "_pb2_grpc.py")):
                    continue
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                yield dotted.removesuffix(".__init__"), path


def imports(path: str, module: str, known: frozenset[str] = frozenset()) -> set[str]:
    """Modules of the three packages that `module` imports, TYPE_CHECKING imports included.

    `from package import submodule` imports the submodule (when `known` names it), not the package.
    """
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    found: set[str] = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_no_module_is_over_600_lines() -> None:
    """Every module of supervisor/, worker/ and common/ (generated code aside) stays under 600 lines."""
    too_long = {}
    for module, path in modules():
        with open(path, encoding="utf-8") as fh:
            lines = sum(1 for _ in fh)
        if lines > MAX_MODULE_LINES:
            too_long[module] = lines
    assert too_long == {}


def test_the_class_that_owns_the_loop_is_under_400_lines() -> None:
    """supervisor.main.Supervisor, the loop and its wiring, stays readable in one sitting."""
    path = os.path.join(REPO, "supervisor", "main.py")
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Supervisor"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 < MAX_LOOP_CLASS_LINES


def test_no_import_cycle_between_modules() -> None:
    """The import graph of the three packages (TYPE_CHECKING imports too) has no cycle."""
    known = dict(modules())
    names = frozenset(known)
    graph = {m: {i for i in imports(p, m, names) if i in known and i != m} for m, p in known.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for nxt in sorted(graph[m]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_process_roles_never_import_each_other() -> None:
    """supervisor/ and worker/ meet only through common/ (plans and messages); common/ imports neither."""
    wrong = []
    for module, path in modules():
        role = module.split(".")[0]
        for imported in imports(path, module):
            other = imported.split(".")[0]
            if (role, other) in {("supervisor", "worker"), ("worker", "supervisor"), ("common", "supervisor"), ("common", "worker")}:
                wrong.append(f"{module} -> {imported}")
    assert wrong == []
