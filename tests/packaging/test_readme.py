"""The docs stay true: the settings and XID tables are the generated ones, the DRA examples valid
objects, and the README's quick start the CI's command."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from supervisor.config import settings_markdown
from supervisor.health import policy
from tests.helpers import REPO


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return fh.read()


def _readme() -> str:
    return _read("README.md")


def test_settings_table_is_generated_from_the_declarations() -> None:
    """docs/configuration.md's settings table equals `python -m supervisor.config --markdown`
    (regenerate it when this fails)."""
    text = _read("docs/configuration.md")
    start = text.index("<!-- settings:start -->") + len("<!-- settings:start -->")
    end = text.index("<!-- settings:end -->")
    assert text[start:end].strip() == settings_markdown().strip()


def test_the_xid_tables_are_generated_from_the_default_rules() -> None:
    """docs/health.md's default XID table and the one in supervisor/health/policy.py's docstring
    both equal `policy.xid_table_markdown()`, made from DEFAULT_XID_RULES (paste it in when this fails)."""
    table = policy.xid_table_markdown().strip()
    text = _read("docs/health.md")
    start = text.index("<!-- xid-table:start -->") + len("<!-- xid-table:start -->")
    assert text[start : text.index("<!-- xid-table:end -->")].strip() == table
    doc = policy.__doc__ or ""
    assert "\n".join(line for line in doc.splitlines() if line.startswith("|")) == table


# What .ci/run may add to the README's pytest command: how much it prints, not what runs or how.
_CI_OUTPUT_ONLY = re.compile(r" (-q|-p no:cacheprovider|--durations=\d+)(?= |$)")


def _pytest_args(text: str) -> str:
    """The arguments of the first `pytest` command line in `text` that is not the unit tier's."""
    line = next(ln for ln in text.splitlines() if ".venv/bin/python -m pytest" in ln and "-m unit" not in ln)
    return line.split(".venv/bin/python -m pytest", 1)[1].split("#", 1)[0].rstrip()


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the pytest command the README's quick start gives, the same arguments (the
    process count among them), adding only ones that change what it prints."""
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    assert ".venv/bin/pip install -e '.[test]'" in _readme() and ".venv/bin/pip install -q -e '.[test]'" in ci
    readme = _pytest_args(_readme())
    assert "-n" in readme.split()
    assert _CI_OUTPUT_ONLY.sub("", _pytest_args(ci)).split() == readme.split()


def test_the_dra_examples_are_valid_kubernetes_objects() -> None:
    """Every object in docs/dra.md passes the resource.k8s.io/v1 (and core) 1.34 schema strictly,
    the DeviceClass selects gpu.nvidia.com's GPUs under NVIDIA's names and maps nvidia.com/gpu,
    which the second pod asks for. (A block without `apiVersion`, such as the excerpt of a claim's
    status, shows part of an object and is not one.)"""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    text = _read("docs/dra.md")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    docs = [d for block in blocks for d in yaml.safe_load_all(block) if "apiVersion" in d]
    assert [d["kind"] for d in docs] == ["DeviceClass", "ResourceClaimTemplate", "Pod", "Pod"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34.0", strict=True)
    selector = docs[0]["spec"]["selectors"][0]["cel"]["expression"]
    assert "device.driver == 'gpu.nvidia.com'" in selector and "['gpu.nvidia.com'].type == 'gpu'" in selector
    assert docs[0]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert docs[3]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
