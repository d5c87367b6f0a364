"""Session fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from tests import mocknvml


@pytest.fixture(scope="session")
def mock_nvml_libdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding NVIDIA's mock libnvidia-ml.so.1, unpacked once per session.

    Skips the test, with the reason, where the mock is not beside the checkout.
    """
    reason = mocknvml.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return mocknvml.unpack(str(tmp_path_factory.mktemp("mocknvml")))


@pytest.fixture(scope="session")
def oldest_binding(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding the oldest `pynvml` (nvidia-ml-py) pyproject.toml accepts, installed once
    per session with pip (the binding is one pure-Python module); put it first on PYTHONPATH."""
    version = mocknvml.binding_floor()
    return mocknvml.install_binding(version, str(tmp_path_factory.mktemp("nvidia-ml-py-" + version)))
