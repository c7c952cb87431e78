"""Fixtures of the image tests: the image `nox -s image` built (GPUID_AGENT_IMAGE), the fake
NVML library and its GPUs, injected as the NVIDIA container toolkit injects the driver's."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import fakenvml
from tests.image.build import container_env

# Where the NVIDIA container toolkit mounts the driver's NVML library on Debian-based images.
NVML_IN_CONTAINER = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
FAKE_CONFIG_DIR = "/run/fake-nvml"


@pytest.fixture(scope="session")
def image() -> str:
    ref = os.environ.get("GPUID_AGENT_IMAGE")
    if not ref:
        pytest.skip("GPUID_AGENT_IMAGE not set: `nox -s image` builds the image and sets it")
    return ref


@pytest.fixture(scope="session")
def image_config(image: str) -> dict[str, object]:
    out = subprocess.run(
        ["podman", "image", "inspect", image],
        capture_output=True,
        check=True,
        env=container_env(),
        stdin=subprocess.DEVNULL,
    ).stdout
    config: dict[str, object] = json.loads(out)[0]["Config"]
    return config


@pytest.fixture(scope="session")
def gpus() -> fakenvml.FakeNvmlConfig:
    return fakenvml.h100x8()


@pytest.fixture(scope="session")
def nvml_injection(
    tmp_path_factory: pytest.TempPathFactory, gpus: fakenvml.FakeNvmlConfig
) -> tuple[str, ...]:
    """podman arguments standing for the toolkit's injection: the library bind-mounted
    read-only where the driver's goes, and the fake's GPU description beside it."""
    build = tmp_path_factory.mktemp("fakenvml-image")
    lib = fakenvml.build_fake_nvml(build)
    config_dir = tmp_path_factory.mktemp("fakenvml-config")
    gpus.write(config_dir / "gpus.conf")
    config_dir.chmod(0o755)
    (config_dir / "gpus.conf").chmod(0o644)
    return (
        "--volume",
        f"{lib}:{NVML_IN_CONTAINER}:ro",
        "--volume",
        f"{config_dir}:{FAKE_CONFIG_DIR}:ro",
        "--env",
        f"{fakenvml.CONFIG_ENV}={FAKE_CONFIG_DIR}/gpus.conf",
    )


@pytest.fixture(scope="session")
def facts() -> Iterator[dict[str, object]]:
    """Figures measured on the way (RSS, start-to-ready, probe timings): written to
    IMAGE_FACTS when set, for the session to print."""
    found: dict[str, object] = {}
    yield found
    target = os.environ.get("IMAGE_FACTS")
    if target:
        Path(target).write_text(json.dumps(found, indent=2, sort_keys=True) + "\n")
