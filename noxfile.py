"""Project automation: `nox -s lint tests image` (what CI runs), `bench`, `docs`, `sbom`,
`proto`."""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
# A module holds one role; past this many lines it has taken on a second one (generated
# gRPC stubs excepted). Checked by `nox -s lint`.
MODULE_LINE_LIMIT = 400
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, real servers included (PostgreSQL, moto S3, gRPC kubelet)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check and format), mypy --strict on the package, the import-linter layering
    contracts, the module size limit, and gofmt and go vet on the suite's Go programs."""
    session.install("-e", ".[lint]")
    session.run("ruff", "check", "gpuid_agent", "tests", "noxfile.py", "benchmarks")
    session.run("ruff", "format", "--check", "gpuid_agent")
    session.run("mypy", "--strict", "gpuid_agent")
    session.run("lint-imports")
    oversized = oversized_modules(Path("gpuid_agent"))
    if oversized:
        session.error(f"modules over {MODULE_LINE_LIMIT} lines: {', '.join(oversized)}")
    go_lint(session)


# The Go programs the suite builds (tests/realkube/build.py): held to gofmt and go vet.
GO_MODULES = ("tests/realkube/go/kubernetes", "tests/realkube/go/etcd")


def go_tool(name: str) -> str:
    """A Go tool from PATH, else from the Go installation's usual place."""
    return shutil.which(name) or f"/usr/local/go/bin/{name}"


def go_lint(session: nox.Session) -> None:
    """gofmt (no file it would change) and go vet on each Go module. vet compiles the
    dependencies; with the suite's build flags (static, -trimpath) those are the compilations
    the suite's build (tests/realkube/build.py) then takes from Go's build cache."""
    unformatted = session.run(go_tool("gofmt"), "-l", *GO_MODULES, external=True, silent=True)
    if str(unformatted).strip():
        session.error(f"gofmt would change: {' '.join(str(unformatted).split())}")
    env = {"CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    for module in GO_MODULES:
        with session.chdir(module):
            session.run(go_tool("go"), "vet", "-trimpath", "./...", external=True, env=env)


def oversized_modules(package: Path) -> list[str]:
    """Modules of the package longer than MODULE_LINE_LIMIT lines, generated stubs excepted."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LINE_LIMIT:
            found.append(f"{path} ({lines})")
    return found


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; prints a table. Not a test: figures vary with the machine."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate docs/configuration.md and docs/metrics.md from the code; `-- --check`
    only verifies them."""
    session.install("-e", ".")
    session.run("python", "-m", "gpuid_agent.docs", *session.posargs)


@nox.session
def sbom(session: nox.Session) -> None:
    """CycloneDX SBOM (sbom.cdx.json) of what the image ships: the project's wheel installed
    alone into a clean venv, so test and lint tools stay out of it."""
    session.install("cyclonedx-bom>=4")
    tmp = Path(session.create_tmp())
    wheels = tmp / "wheels"
    runtime = tmp / "runtime"
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), ".")
    (wheel,) = sorted(wheels.glob("gpuid_agent-*.whl"))
    session.run("python", "-m", "venv", "--clear", str(runtime))
    pip = str(runtime / "bin" / "pip")
    session.run(pip, "install", "--quiet", str(wheel), external=True)
    # As in the image: nothing imports pip or setuptools at run time.
    session.run(pip, "uninstall", "--quiet", "--yes", "pip", "setuptools", external=True)
    output = session.posargs[0] if session.posargs else "sbom.cdx.json"
    cyclonedx(session, runtime / "bin" / "python", output)


def cyclonedx(session: nox.Session, python: Path, output: str, root: bool = True) -> None:
    """CycloneDX JSON of what `python`'s environment has installed; pyproject.toml is the
    root component, or (root=False) the project's own distribution is listed like the rest."""
    session.run(
        "cyclonedx-py",
        "environment",
        *(["--pyproject", "pyproject.toml"] if root else []),
        "--output-format",
        "JSON",
        "--output-reproducible",
        "--output-file",
        output,
        str(python),
    )


@nox.session
def image(session: nox.Session) -> None:
    """Build docker/Dockerfile with buildah on a stand-in Debian base (buildah, podman, runc
    and mmdebstrap apt-installed where missing; the base built once, cached), write its SBOM
    (sbom-image.cdx.json, from the image's own venv), then run tests/image: the image alone
    and the chart's pod under podman as the kubelet runs it."""
    session.install("-e", ".[test]", "cyclonedx-bom>=4")
    out = session.run("python", "-m", "tests.image.build", silent=True)
    ref = str(out).strip().splitlines()[-1]
    venv = Path(session.create_tmp()) / "image-venv"
    session.run("python", "-m", "tests.image.build", "--export-venv", str(venv), "--tag", ref)
    cyclonedx(session, venv / "bin" / "python", "sbom-image.cdx.json", root=False)
    facts = Path(session.create_tmp()) / "image-facts.json"
    env = {"GPUID_AGENT_IMAGE": ref, "IMAGE_SBOM": "sbom-image.cdx.json", "IMAGE_FACTS": str(facts)}
    session.run("pytest", "tests/image", *session.posargs, env=env)
    if facts.exists():
        session.log(facts.read_text())


PROTO = "gpuid_agent/sources/kubelet/v1/api.proto"
GRPC_TOOLS = "grpcio-tools==1.85.1"  # keep in step with the grpcio/protobuf floors


@nox.session
def proto(session: nox.Session) -> None:
    """Regenerate the kubelet pod-resources stubs (api_pb2.py, .pyi, api_pb2_grpc.py).

    Run from the repository root with `-I.` so the generated modules import each other by
    their package path and work from an installed wheel."""
    session.install(GRPC_TOOLS)
    session.run(
        "python",
        "-m",
        "grpc_tools.protoc",
        "-I.",
        "--python_out=.",
        "--pyi_out=.",
        "--grpc_python_out=.",
        PROTO,
    )
