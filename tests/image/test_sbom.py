"""The image's SBOM (IMAGE_SBOM, written by `nox -s image` from the image's own venv) lists
every Python distribution the image runs with, at the version installed in it."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from gpuid_agent import __version__
from tests.image.build import ROOT
from tests.image.kubelet import podman

LIST = (
    "import importlib.metadata as m, json;"
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="session")
def sbom() -> dict[str, object]:
    path = os.environ.get("IMAGE_SBOM")
    if not path:
        pytest.skip("IMAGE_SBOM not set: `nox -s image` writes it before these tests")
    document: dict[str, object] = json.loads(Path(path).read_text())
    return document


async def test_sbom_lists_every_installed_distribution_with_its_version(
    image: str, sbom: dict[str, object]
) -> None:
    _, out = await podman("run", "--rm", "--entrypoint", "python", image, "-c", LIST)
    installed = {canonical(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    components = sbom["components"]
    assert isinstance(components, list)
    listed = {canonical(c["name"]): c["version"] for c in components}
    assert listed == installed
    assert listed["gpuid-agent"] == __version__
    assert "pip" not in listed and "setuptools" not in listed
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in declared:
        name = canonical(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])
        assert name in listed, f"runtime dependency {name} missing from the SBOM"
