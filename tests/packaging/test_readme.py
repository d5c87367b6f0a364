"""The README stays true: its settings table is the generated one, its quick start the CI's command."""

from __future__ import annotations

import os

from supervisor.config import settings_markdown
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


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the same pytest command the README's quick start gives."""
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    assert ".venv/bin/pip install -e '.[test]'" in _readme() and ".venv/bin/python -m pytest" in _readme()
    assert ".venv/bin/pip install -q -e '.[test]'" in ci and ".venv/bin/python -m pytest" in ci
