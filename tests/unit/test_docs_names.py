"""The docstrings, the README and docs/ name only functions that exist.

A backticked call, `name()` or `part.name()`, names a function, method or class defined in the
tree, a callable parameter of the code it documents, or something outside gpuvisor (a module of
Python's or of a dependency, or one of the few outside names listed here). A renamed or removed
function then fails here instead of leaving a text that sends a reader looking for nothing.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

from tests.helpers import REPO

PACKAGES = ("supervisor", "worker", "common", "tests")
CALL = re.compile(r"`([A-Za-z_][\w.]*)\(\)`")
# Named in prose, defined outside Python: NVIDIA's Go source, PromQL.
OUTSIDE = {"Sharing.SharingStrategy", "rate"}


def _python_files() -> list[str]:
    out = []
    for package in PACKAGES:
        for root, _dirs, files in os.walk(os.path.join(REPO, package)):
            out += [
                os.path.join(root, f)
                for f in files
                if f.endswith(".py") and not f.endswith(("_pb2.py", "_pb2_grpc.py"))
            ]
    return sorted(out)


def _pages() -> list[tuple[str, str]]:
    """The README and every page of docs/, as (path from the repository root, text)."""
    docs = os.path.join(REPO, "docs")
    paths = ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))]
    out = []
    for path in paths:
        with open(os.path.join(REPO, path), encoding="utf-8") as fh:
            out.append((path, fh.read()))
    return out


def _parameters(node: ast.AST) -> set[str]:
    return {
        a.arg
        for n in ast.walk(node)
        if isinstance(n, ast.arguments)
        for a in (*n.posonlyargs, *n.args, *n.kwonlyargs)
    }


def _is_outside(ref: str) -> bool:
    first = ref.split(".")[0]
    if ref in OUTSIDE or first in PACKAGES:
        return ref in OUTSIDE
    return "." in ref and importlib.util.find_spec(first) is not None


def test_every_named_function_exists() -> None:
    """Each `name()` in a docstring, the README or docs/ is defined, a parameter, or from outside."""
    defined: set[str] = set()
    texts: list[tuple[str, str, set[str]]] = []
    for path in _python_files():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        module_params = _parameters(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc:
                    params = module_params if isinstance(node, ast.Module) else _parameters(node)
                    texts.append((os.path.relpath(path, REPO), doc, params))
    texts += [(path, text, set()) for path, text in _pages()]
    unknown = sorted(
        f"{where}: `{ref}()`"
        for where, text, params in texts
        for ref in CALL.findall(text)
        if ref.split(".")[-1] not in defined and ref not in params and not _is_outside(ref)
    )
    assert unknown == []


TEST_NAME = re.compile(r"\btest_[a-z0-9_]+")


def test_every_named_test_exists() -> None:
    """Each `test_...` name in a docstring, a comment, the README or docs/ is a test module or a test
    function of the suite: moving tests between tiers cannot leave a map pointing at nothing."""
    known: set[str] = set()
    texts: list[tuple[str, str]] = []
    for path in _python_files():
        known.add(os.path.basename(path)[:-3])
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        known.update(
            n.name
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        )
        texts.append((os.path.relpath(path, REPO), source))
    texts += _pages()
    unknown = sorted(
        {f"{where}: {name}" for where, text in texts for name in TEST_NAME.findall(text) if name not in known}
    )
    assert unknown == [], "\n".join(unknown)
