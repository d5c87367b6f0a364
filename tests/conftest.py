"""Session fixtures shared by several test modules.

The real-binding tier's session directories are made with `tempfile`, not `tmp_path_factory`:
with `tmp_path_retention_policy = "none"` pytest takes no lock on its base temp dir, and any other
pytest session that ends on the same machine deletes every `pytest-N` dir, this session's too,
which would pull the mock library from under later child processes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests import mocknvml


@pytest.fixture(scope="session")
def mock_nvml_libdir() -> Iterator[str]:
    """A directory holding NVIDIA's mock libnvidia-ml.so.1, unpacked once per session.

    Skips the test, with the reason, where the mock is not beside the checkout.
    """
    reason = mocknvml.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with mocknvml.unpacked() as path:
        yield path


@pytest.fixture(scope="session")
def oldest_binding() -> Iterator[str]:
    """A directory holding the oldest `pynvml` (nvidia-ml-py) pyproject.toml accepts, installed once
    per session with pip (the binding is one pure-Python module); put it first on PYTHONPATH."""
    version = mocknvml.binding_floor()
    path = tempfile.mkdtemp(prefix=f"gv-nvidia-ml-py-{version}-")
    try:
        yield mocknvml.install_binding(version, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
