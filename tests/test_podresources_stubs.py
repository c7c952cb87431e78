"""The generated pod-resources stubs: in step with api.proto, and importable once installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("gpuid_agent/sources/kubelet/v1")
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra")
    from importlib.metadata import version

    from gpuid_agent.sources.kubelet.v1 import api_pb2_grpc

    tools = version("grpcio-tools")
    if tools != api_pb2_grpc.GRPC_GENERATED_VERSION:
        pytest.skip(
            f"stubs come from grpcio-tools {api_pb2_grpc.GRPC_GENERATED_VERSION}, "
            f"{tools} is installed: output differs in its version stamps"
        )
    del grpc_tools
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / V1 / "api.proto"),
        ],
        check=True,
        capture_output=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / V1 / name).read_text()
        assert fresh == (ROOT / V1 / name).read_text(), f"{name} is stale: run nox -s proto"


def test_stubs_import_from_an_installed_wheel(tmp_path: Path) -> None:
    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # build from a copy: an in-tree build would leave build/ and egg-info in the checkout
    shutil.copytree(
        ROOT / "gpuid_agent", src / "gpuid_agent", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("gpuid_agent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*GENERATED, "api.proto", "__init__.py"):
        assert f"{V1.as_posix()}/{name}" in names, name
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    probe = (
        "import gpuid_agent, gpuid_agent.sources.kubelet as p;"
        "from gpuid_agent.sources.kubelet.v1 import api_pb2, api_pb2_grpc;"
        "assert gpuid_agent.__file__.startswith(sys.argv[1]), gpuid_agent.__file__;"
        "assert api_pb2_grpc.PodResourcesListerStub and p.PodResourcesClient;"
        "print(api_pb2.DESCRIPTOR.package)"
    )
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; {probe}", str(site)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip() == "v1"
