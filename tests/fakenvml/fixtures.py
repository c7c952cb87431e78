"""pytest fixtures for the fake NVML library.

Import them where they are needed, e.g. in a ``conftest.py``::

    from tests.fakenvml.fixtures import fake_nvml, fake_nvml_build_dir, fake_nvml_lib

``fake_nvml_lib`` (session) is the path of the built ``libnvidia-ml.so.1``;
``fake_nvml`` (function) points ``FAKE_NVML_CONFIG`` at a per-test file, loads
the library into pynvml and, on teardown, shuts pynvml down and restores the
library pynvml had before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from . import CONFIG_ENV, FakeNvmlConfig, build_fake_nvml, load_fake_into_pynvml

__all__ = ["FakeNvml", "fake_nvml", "fake_nvml_build_dir", "fake_nvml_lib"]


class FakeNvml:
    """Per-test handle on the fake library and its config file."""

    def __init__(self, lib_path: Path, config_path: Path, build_dir: Path) -> None:
        self.lib_path = lib_path
        self.config_path = config_path
        self.build_dir = build_dir
        self.lib: ctypes.CDLL | None = None
        self.loaded: list[ctypes.CDLL] = []

    def apply(self, config: FakeNvmlConfig) -> Path:
        """Write ``config`` (atomically) to the file the library reads."""
        return config.write(self.config_path)

    def write_text(self, text: str) -> Path:
        """Write a hand-made config file, atomically."""
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.config_path)
        return self.config_path

    def load(self, lib_path: Path | None = None) -> ctypes.CDLL:
        """Load ``lib_path`` (default: the standard build) into pynvml."""
        self.lib = load_fake_into_pynvml(lib_path or self.lib_path)
        self.loaded.append(self.lib)
        return self.lib

    def build(self, omit: Sequence[str] = ()) -> Path:
        """Build (or reuse) a variant of the library lacking the ``omit`` exports."""
        return build_fake_nvml(self.build_dir, omit=omit)


@pytest.fixture(scope="session")
def fake_nvml_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fakenvml-build")


@pytest.fixture(scope="session")
def fake_nvml_lib(fake_nvml_build_dir: Path) -> Path:
    return build_fake_nvml(fake_nvml_build_dir)


def _shutdown_all(libs: Sequence[ctypes.CDLL]) -> None:
    """Bring every fake library used by a test back to the uninitialised state."""
    import pynvml

    for lib in libs:
        shutdown = getattr(lib, "nvmlShutdown", None)
        if shutdown is None:
            continue
        for _ in range(1000):
            if shutdown() != 0:  # NVML_ERROR_UNINITIALIZED once the count is 0
                break
    with pynvml.libLoadLock:
        pynvml._nvmlLib_refcount = 0


@pytest.fixture
def fake_nvml(
    fake_nvml_lib: Path,
    fake_nvml_build_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[FakeNvml]:
    import pynvml

    config_path = tmp_path / "fake-nvml.conf"
    monkeypatch.setenv(CONFIG_ENV, str(config_path))
    previous = pynvml.nvmlLib
    fake = FakeNvml(fake_nvml_lib, config_path, fake_nvml_build_dir)
    fake.load()
    try:
        yield fake
    finally:
        _shutdown_all(fake.loaded)
        with pynvml.libLoadLock:
            pynvml.nvmlLib = previous
            pynvml._nvmlGetFunctionPointer_cache.clear()
