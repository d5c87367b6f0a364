"""The README stays true: its settings and XID tables are the generated ones, its quick start the CI's command."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from supervisor.config import settings_markdown
from supervisor.health import policy
from tests.helpers import REPO


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def test_settings_table_is_generated_from_the_declarations() -> None:
    """The README's settings table equals `python -m supervisor.config --markdown` (regenerate it when this fails)."""
    text = _readme()
    start = text.index("<!-- settings:start -->") + len("<!-- settings:start -->")
    end = text.index("<!-- settings:end -->")
    assert text[start:end].strip() == settings_markdown().strip()


def test_the_xid_tables_are_generated_from_the_default_rules() -> None:
    """The README's default XID table and the one in supervisor/health/policy.py's docstring both
    equal `policy.xid_table_markdown()`, made from DEFAULT_XID_RULES (paste it in when this fails)."""
    table = policy.xid_table_markdown().strip()
    text = _readme()
    start = text.index("<!-- xid-table:start -->") + len("<!-- xid-table:start -->")
    assert text[start : text.index("<!-- xid-table:end -->")].strip() == table
    doc = policy.__doc__ or ""
    assert "\n".join(line for line in doc.splitlines() if line.startswith("|")) == table


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the same pytest command the README's quick start gives."""
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    assert ".venv/bin/pip install -e '.[test]'" in _readme() and ".venv/bin/python -m pytest" in _readme()
    assert ".venv/bin/pip install -q -e '.[test]'" in ci and ".venv/bin/python -m pytest" in ci


def test_the_dra_examples_are_valid_kubernetes_objects() -> None:
    """Every object in the README's DRA section passes the resource.k8s.io/v1 (and core) 1.34 schema
    strictly, the DeviceClass selects gpu.nvidia.com's GPUs under NVIDIA's names and maps
    nvidia.com/gpu, which the second pod asks for."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    text = _readme()
    section = text[text.index("## DRA mode") : text.index("## Node labels")]
    docs = [d for block in re.findall(r"```yaml\n(.*?)```", section, re.S) for d in yaml.safe_load_all(block)]
    assert [d["kind"] for d in docs] == ["DeviceClass", "ResourceClaimTemplate", "Pod", "Pod"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34.0", strict=True)
    selector = docs[0]["spec"]["selectors"][0]["cel"]["expression"]
    assert "device.driver == 'gpu.nvidia.com'" in selector and "['gpu.nvidia.com'].type == 'gpu'" in selector
    assert docs[0]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert docs[3]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
