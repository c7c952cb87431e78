"""The generated pod-resources stubs: in step with api.proto, and importable once installed."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto, FileDescriptorSet

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("gpuid_agent/sources/kubelet/v1")
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def protoc(*outputs: str) -> None:
    """The installed grpcio-tools' protoc over api.proto, from the repository root (`nox -s
    proto`'s way)."""
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", *outputs]
    subprocess.run([*command, str(ROOT / V1 / "api.proto")], check=True, capture_output=True)


def descriptor_of_the_proto(tmp_path: Path) -> FileDescriptorProto:
    """api.proto compiled by the installed grpcio-tools' protoc, as a descriptor."""
    out = tmp_path / "api.pb"
    protoc(f"--descriptor_set_out={out}")
    [file] = FileDescriptorSet.FromString(out.read_bytes()).file
    # a descriptor set spells out each field's json_name, which Python stubs leave out: it is
    # derived from the field's name (api.proto sets none of its own)
    for message in file.message_type:
        for field in message.field:
            field.ClearField("json_name")
    return file


def stub_calls(source: str) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """What the gRPC module wires: (path, request, response) of each client call and (method,
    request, response) of each server handler, messages by name."""

    def message(node: ast.AST | None, method: str) -> str:
        assert isinstance(node, ast.Attribute) and node.attr == method
        assert isinstance(node.value, ast.Attribute)
        return node.value.attr

    client, server = set(), set()
    for call in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)):
        keywords = {k.arg: k.value for k in call.keywords}
        paths = [a.value for a in call.args if isinstance(a, ast.Constant)]
        if paths and isinstance(paths[0], str) and paths[0].startswith("/"):
            refs = [a for a in (*call.args, *keywords.values()) if isinstance(a, ast.Attribute)]
            [request] = [message(r, r.attr) for r in refs if r.attr == "SerializeToString"]
            [response] = [message(r, r.attr) for r in refs if r.attr == "FromString"]
            client.add((paths[0], request, response))
        elif "request_deserializer" in keywords:
            servicer = call.args[0]
            assert isinstance(servicer, ast.Attribute)
            request = message(keywords["request_deserializer"], "FromString")
            response = message(keywords["response_serializer"], "SerializeToString")
            server.add((servicer.attr, request, response))
    return client, server


def type_stub_fields(source: str) -> dict[str, list[str]]:
    """Each message class of the .pyi with the fields it declares, in order."""
    return {
        node.name: [
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and not item.target.id.endswith("_FIELD_NUMBER")
        ]
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef)
    }


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Compared by what they say, so a newer grpcio-tools (other version stamps, another
    layout) still checks them: the descriptor api_pb2 registers, the calls and handlers
    api_pb2_grpc wires, the messages and fields api_pb2.pyi declares."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra")
    from gpuid_agent.sources.kubelet.v1 import api_pb2, api_pb2_grpc

    proto = descriptor_of_the_proto(tmp_path)
    stale = "is stale: run nox -s proto"
    committed = FileDescriptorProto.FromString(api_pb2.DESCRIPTOR.serialized_pb)
    assert committed == proto, f"api_pb2.py {stale}"

    def short(type_name: str) -> str:
        return type_name.removeprefix(f".{proto.package}.")

    methods = [(s, m) for s in proto.service for m in s.method]
    client, server = stub_calls((ROOT / V1 / "api_pb2_grpc.py").read_text())
    assert client == {
        (f"/{proto.package}.{s.name}/{m.name}", short(m.input_type), short(m.output_type))
        for s, m in methods
    }, f"api_pb2_grpc.py {stale}"
    assert server == {(m.name, short(m.input_type), short(m.output_type)) for _, m in methods}, (
        f"api_pb2_grpc.py {stale}"
    )
    declared = type_stub_fields((ROOT / V1 / "api_pb2.pyi").read_text())
    assert declared == {m.name: [f.name for f in m.field] for m in proto.message_type}, (
        f"api_pb2.pyi {stale}"
    )
    # From the grpcio-tools that made them, byte for byte as well.
    if version("grpcio-tools") == api_pb2_grpc.GRPC_GENERATED_VERSION:
        protoc(f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}")
        for name in GENERATED:
            fresh = (tmp_path / V1 / name).read_text()
            assert fresh == (ROOT / V1 / name).read_text(), f"{name} {stale}"


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
