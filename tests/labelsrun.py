"""`gpuvisor labels` as a child process, for the tests that run the real command.

The child's environment holds none of the variables a label setting reads (GFD's names: MIG_STRATEGY,
GFD_*, ...) nor GPUVISOR_* or FAKENVML_* ones from the calling environment, so a test sees only
what it sets; `fakenvml.environ(..., base=labels_env())` adds the fake libnvidia-ml on top.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from supervisor.labels.settings import LABEL_SETTINGS
from tests.helpers import REPO, checkout_path

TIMEOUT = 60.0


def labels_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "supervisor", "labels", *args]


def labels_env(**extra: str) -> dict[str, str]:
    """This process's environment without what a label setting reads, the checkout first on PYTHONPATH, `extra` over it."""
    names = {n for s in LABEL_SETTINGS for n in s.envs}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in names and not k.startswith(("GFD_", "GPUVISOR_", "FAKENVML_"))
    }
    env["PYTHONPATH"] = checkout_path()
    env.update(extra)
    return env


def run_labels(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`gpuvisor labels *args` to completion (`env` default: `labels_env()`), its output captured."""
    return subprocess.run(
        labels_argv(*args),
        env=env or labels_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def start_labels(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`gpuvisor labels *args` started, its stderr (the log) going to `log`; the caller ends it."""
    with open(log, "w") as fh:
        return subprocess.Popen(
            labels_argv(*args), env=env or labels_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh
        )
