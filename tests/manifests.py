"""Rendered Kubernetes objects, for the tests of deploy/ (kustomize) and of the Helm chart.

Lookups that fail say what they found, and `validate_strict` runs `kubernetes-validate --strict`
(an unknown field fails) the same way for both; it skips the test where the validator is not
installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

TIMEOUT = 60


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of `kind` named `name`."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (
        f"expected one {kind} {name}: {[(d['kind'], d['metadata']['name']) for d in docs]}"
    )
    return found[0]


def daemonset(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(docs, "DaemonSet", name)


def pod(daemonset: dict[str, Any]) -> dict[str, Any]:
    """The DaemonSet's pod spec."""
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    """The pod's one container (gpuvisor's pods have no sidecar, NVIDIA's config-manager included)."""
    containers = pod(daemonset)["containers"]
    assert len(containers) == 1, f"expected one container: {[c['name'] for c in containers]}"
    found: dict[str, Any] = containers[0]
    return found


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's env by name (each set once); a downward-API entry reads `fieldRef:<path>`."""
    entries = container.get("env", [])
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"an env var is set twice: {names}"
    return {
        e["name"]: e["value"] if "value" in e else "fieldRef:" + e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in entries
    }


def validate_strict(paths: Sequence[Path], *flags: str) -> subprocess.CompletedProcess[str]:
    """`kubernetes-validate --strict *flags paths` (its exit status and output, for the test to judge)."""
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate; test extra)")
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *flags, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
