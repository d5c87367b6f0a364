"""The layout rules the tree must keep, so that the tree itself shows the architecture:

- the process roles never import each other, and `common/` holds only what both import;
- each supervisor subpackage imports only the subpackages below it in the order that
  supervisor/__init__.py's docstring lists (read from there, so the document and the rule are one);
- the test doubles (the NVML simulator, the kubelet stand-in) live in `supervisor/sim` alone, and
  production code reaches that package only inside a function, when asked to simulate;
- every package says in its docstring what it owns; the import graph has no cycle.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import supervisor
from tests.helpers import REPO

PACKAGES = ("supervisor", "worker", "common")
SUPERVISOR_TOP = {
    "supervisor",
    "supervisor.main",
    "supervisor.cli",
    "supervisor.launch",
    "supervisor.scheduler",
    "supervisor.__main__",
}
DOUBLE_NAMES = re.compile(r"^(Fake|Stub|Mock|Dummy)|Standin$|^Simulator$")


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


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read())


def imports(path: str, module: str, known: frozenset[str] = frozenset(), *, lazy: bool = True) -> set[str]:
    """Modules of the three packages that `module` imports, TYPE_CHECKING imports included
    (`lazy=False`: only those at module level, run when the module is imported).

    `from package import submodule` imports the submodule (when `known` names it), not the package.
    """
    tree = parse(path)
    found: set[str] = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    nodes = ast.walk(tree) if lazy else _module_level(tree.body)
    for node in nodes:
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


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import: the body, into `if` and `try` blocks (not TYPE_CHECKING's)."""
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                yield from _module_level(block)


def graph() -> dict[str, set[str]]:
    known = dict(modules())
    names = frozenset(known)
    return {m: {i for i in imports(p, m, names) if i in known and i != m} for m, p in known.items()}


def layers() -> list[str]:
    """The supervisor's subpackages, bottom first, as supervisor/__init__.py lists them."""
    doc = supervisor.__doc__ or ""
    listed = re.findall(r"^ {4}([a-z]+) {2,}\S", doc, flags=re.MULTILINE)
    return list(reversed(listed))


def subpackage(module: str) -> str | None:
    """The supervisor subpackage a module belongs to, or None (top-level modules, other roles)."""
    parts = module.split(".")
    if parts[0] != "supervisor" or module in SUPERVISOR_TOP:
        return None
    return parts[1]


def test_the_layers_named_in_the_docstring_are_the_subpackages() -> None:
    """Every supervisor subpackage is in the documented order, and nothing else is."""
    on_disk = {
        name
        for name in os.listdir(os.path.join(REPO, "supervisor"))
        if os.path.isfile(os.path.join(REPO, "supervisor", name, "__init__.py"))
    }
    assert sorted(layers()) == sorted(on_disk)


def test_each_supervisor_subpackage_imports_only_those_below_it() -> None:
    """A subpackage may import common/, supervisor.scheduler and the subpackages below it."""
    order = {name: i for i, name in enumerate(layers())}
    wrong = []
    for module, deps in graph().items():
        own = subpackage(module)
        if own is None:
            continue
        for dep in deps:
            if dep == "supervisor.scheduler" or dep.split(".")[0] == "common":
                continue
            other = subpackage(dep)
            if other is None or (other != own and order[other] > order[own]):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_common_holds_only_what_both_roles_import() -> None:
    """Each module of common/ (its generator scripts aside) is imported by the supervisor and by
    the worker: directly, or through another common/ module they import."""
    edges = graph()
    shared = [m for m in edges if m.startswith("common.") and not m.endswith(".generate")]
    users: dict[str, set[str]] = {m: set() for m in shared}
    for module, deps in edges.items():
        if not module.startswith("common"):
            for dep in deps:
                for m in shared:
                    if dep == m or dep.startswith(m + "."):
                        users[m].add(module.split(".")[0])
    changed = True
    while changed:  # what a common module imports is used by that module's users too
        changed = False
        for m in shared:
            for dep in edges[m]:
                if dep in users and not users[m] <= users[dep]:
                    users[dep] |= users[m]
                    changed = True
    assert {m: sorted(r) for m, r in users.items() if r != {"supervisor", "worker"}} == {}


def test_test_doubles_live_in_sim_and_production_reaches_them_only_when_simulating() -> None:
    """No stand-in or fake class outside supervisor/sim, and no module outside it imports it at
    import time: `gpuvisor run` on a real node never loads the simulator or the kubelet stand-in."""
    doubles, eager = [], []
    known = dict(modules())
    for module, path in known.items():
        in_sim = module == "supervisor.sim" or module.startswith("supervisor.sim.")
        if not in_sim:
            doubles += [
                f"{module}.{n.name}"
                for n in parse(path).body
                if isinstance(n, ast.ClassDef) and DOUBLE_NAMES.search(n.name)
            ]
            eager += [
                f"{module} -> {dep}"
                for dep in imports(path, module, frozenset(known), lazy=False)
                if dep == "supervisor.sim" or dep.startswith("supervisor.sim.")
            ]
    assert doubles == [] and eager == []


def test_every_package_says_what_it_owns() -> None:
    """Each package's __init__.py opens with a docstring (what it owns, what it may import)."""
    missing = [
        module
        for module, path in modules()
        if path.endswith("__init__.py") and not ast.get_docstring(parse(path))
    ]
    assert missing == []


def _members(package_dir: str) -> set[str]:
    """The modules and subpackages directly in a package (not __init__, __main__, generated)."""
    out = set()
    for name in os.listdir(package_dir):
        path = os.path.join(package_dir, name)
        if name.endswith("_pb2.py") or name.endswith("_pb2_grpc.py"):
            continue  # generated, named as `api_pb2*`
        if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
            out.add(name[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            out.add(name)
    return out


# "`name` (what it does", "`name`: what it does", "- `name`  what it does": a member described.
DESCRIBED = re.compile(r"`([a-z_]+)`(?: \(|: | {2,})")


def test_every_package_docstring_names_its_modules_and_no_others() -> None:
    """A package's docstring names each of its modules in backticks, and each name it describes
    as one of its parts is one: a moved or renamed module cannot leave its package's map wrong."""
    wrong = []
    for module, path in modules():
        if not path.endswith("__init__.py") or module == "supervisor":
            continue
        doc = ast.get_docstring(parse(path)) or ""
        members = _members(os.path.dirname(path))
        named = set(re.findall(r"`([a-z_]+)`", doc))
        wrong += [f"{module}: `{m}` not named" for m in sorted(members - named)]
        wrong += [f"{module}: `{m}` is no module here" for m in sorted(set(DESCRIBED.findall(doc)) - members)]
    assert wrong == [], "\n".join(wrong)


def test_each_subpackage_says_which_packages_it_may_import() -> None:
    """The "May import" line of each supervisor subpackage covers every supervisor subpackage its
    modules import (a line that says "every package below it" covers all it may import)."""
    layer_of = {name: i for i, name in enumerate(layers())}
    edges = graph()
    wrong = []
    for name in layers():
        doc = ast.get_docstring(parse(os.path.join(REPO, "supervisor", name, "__init__.py"))) or ""
        allowed = doc.partition("May import")[2]
        if "every package below it" in allowed:
            continue
        used = {
            sub
            for module, deps in edges.items()
            if subpackage(module) == name
            for dep in deps
            if (sub := subpackage(dep)) is not None and sub != name and sub in layer_of
        }
        wrong += [
            f"supervisor.{name} imports supervisor.{u}"
            for u in sorted(used)
            if f"supervisor.{u}`" not in allowed
        ]
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycle_between_modules() -> None:
    """The import graph of the three packages (TYPE_CHECKING imports too) has no cycle."""
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for nxt in sorted(edges[m]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_process_roles_never_import_each_other() -> None:
    """supervisor/ and worker/ meet only through common/ (plans and messages); common/ imports neither."""
    wrong = []
    for module, deps in graph().items():
        role = module.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if (
                role != other
                and (role, other) != ("supervisor", "common")
                and (role, other) != ("worker", "common")
            ):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_the_api_server_layer_is_not_loaded_at_start() -> None:
    """No module `gpuvisor` imports at start (supervisor.main, supervisor.cli, and what they import
    at module level) reaches supervisor.kube: the cluster side and the NodeFeature output import it
    inside functions, when a feature that needs it starts."""
    known = dict(modules())
    names = frozenset(known)
    eager = {m: {d for d in imports(p, m, names, lazy=False) if d in known} for m, p in known.items()}
    seen: set[str] = set()
    todo = ["supervisor.main", "supervisor.cli"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(eager.get(module, ()))
            parts = module.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # a package's __init__ runs too
    assert "supervisor.cluster.side" in seen  # the check looks where it should
    assert sorted(m for m in seen if m == "supervisor.kube" or m.startswith("supervisor.kube.")) == []
    assert "supervisor.cluster.writer" not in seen


def test_no_two_production_classes_share_a_name() -> None:
    """Every class defined in supervisor/, worker/ and common/ (generated stubs aside) has a name
    no other class there has: one name, one concept, and an import that cannot pick the wrong one."""
    where: dict[str, list[str]] = {}
    for name, path in modules():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    twice = {cls: places for cls, places in sorted(where.items()) if len(places) > 1}
    assert twice == {}
