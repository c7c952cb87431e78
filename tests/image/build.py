"""Build docker/Dockerfile with buildah on a stand-in base, without a registry.

`python -m tests.image.build` (what `nox -s image` runs): installs buildah, podman, runc and
mmdebstrap with apt where missing, builds a Debian bookworm base with Python once (cached),
imports it into the local image store, and builds the project's Dockerfile on it. Prints the
image reference on the last line of stdout.

The stand-in base replaces `python:3.11-slim-bookworm` (the Dockerfile's default), which
needs a registry: Debian's own python3 from the same release. The differences are the
interpreter's path (/usr/bin, not /usr/local/bin), which the venv records, and its pip:
Debian's python3-pip on an interpreter marked externally managed (PEP 668), which the final
stage must remove with apt, where the default base's pip uninstalls itself.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"buildah": "buildah", "podman": "podman", "runc": "runc", "mmdebstrap": "mmdebstrap"}
# Packages of the stand-in base: the interpreter, venv support, and Debian's own pip, which
# the Dockerfile's build stage does not use (its venv takes pip from ensurepip) and its final
# stage must remove from an externally managed (PEP 668) interpreter.
BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
BASE_SUITE = "bookworm"
# The tag and the cached tarball name the package list: another list builds another base.
BASE_KEY = f"{BASE_SUITE}-{hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:8]}"
BASE_IMAGE = f"localhost/gpuid-agent-base:{BASE_KEY}"
IMAGE = "localhost/gpuid-agent:dev"
# crun refuses hybrid cgroup hosts and raising RLIMIT_NOFILE/NPROC is not always permitted:
# a private containers.conf instead of editing /etc.
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


class BuildError(RuntimeError):
    """A step that cannot go on; the message says which and what to do."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "gpuid-agent" / "image"
    path.mkdir(parents=True, exist_ok=True)
    return path


def container_env() -> dict[str, str]:
    """The environment podman and buildah run with: the private containers.conf."""
    conf = cache_dir() / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def run(argv: list[str], *, step: str, env: dict[str, str] | None = None) -> str:
    """Run a command without stdin; its output is returned, or shown in the error."""
    print(f"+ {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env or container_env(),
            check=False,
        )
    except FileNotFoundError as exc:
        raise BuildError(f"{step}: {argv[0]} not found") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-25:]
        raise BuildError(f"{step} failed (exit {done.returncode}):\n" + "\n".join(tail))
    return done.stdout


def ensure_tools() -> None:
    """apt-get install what is missing: CI starts bare, as root, with no stdin."""
    missing = sorted(pkg for pkg, binary in TOOLS.items() if shutil.which(binary) is None)
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise BuildError(f"{', '.join(missing)} missing and no apt-get: install them first")
    if os.geteuid() != 0:
        raise BuildError(
            f"{', '.join(missing)} missing; install as root: apt-get install {' '.join(missing)}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-q", "-y", "-o", "Dpkg::Use-Pty=0"]
    run([*apt, "update"], step="apt-get update (is the network reachable?)", env=env)
    run(
        [*apt, "install", "--no-install-recommends", *missing, "uidmap", "slirp4netns"],
        step="apt-get install",
        env=env,
    )


def image_exists(ref: str) -> bool:
    probe = subprocess.run(
        ["podman", "image", "exists", ref],
        stdin=subprocess.DEVNULL,
        env=container_env(),
        check=False,
    )
    return probe.returncode == 0


def ensure_base() -> str:
    """The stand-in base in the local store, built once: the tarball is cached beside the
    containers.conf, so a cleaned image store only re-imports it."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    tarball = cache_dir() / f"base-{BASE_KEY}.tar"
    if not tarball.exists():
        partial = tarball.with_suffix(".partial.tar")
        run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                BASE_SUITE,
                str(partial),
            ],
            step="mmdebstrap (stand-in base)",
        )
        partial.replace(tarball)
    run(["podman", "import", str(tarball), BASE_IMAGE], step="podman import")
    return BASE_IMAGE


def pip_mounts() -> list[str]:
    """This machine's pip configuration and CA bundle, read-only inside the build's RUN
    steps, so pip reaches the package index the way the host's pip does."""
    mounts = []
    for path in ("/etc/pip.conf", "/etc/xdg/pip"):
        if Path(path).exists():
            mounts += ["--volume", f"{path}:{path}:ro"]
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if bundle and Path(bundle).is_file():
        mounts += ["--volume", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
    return mounts


def version() -> str:
    init = (ROOT / "gpuid_agent" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', init, re.MULTILINE)
    return found.group(1) if found else "0.0.0"


def build_image(base: str, tag: str = IMAGE) -> str:
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    run(
        [
            "buildah",
            "bud",
            "--layers",
            "--isolation",
            "chroot",
            "--network",
            "host",
            "--pull-never",
            *pip_mounts(),
            "--build-arg",
            f"PYTHON_IMAGE={base}",
            "--build-arg",
            f"VERSION={version()}",
            "--build-arg",
            f"REVISION={revision or 'unknown'}",
            "-f",
            str(ROOT / "docker" / "Dockerfile"),
            "-t",
            tag,
            str(ROOT),
        ],
        step="buildah bud docker/Dockerfile",
    )
    return tag


VENV = "/opt/gpuid-agent"


def export_venv(ref: str, target: Path) -> Path:
    """The image's venv copied out, its interpreter links pointed at this machine's Python of
    the same version, so an SBOM tool can run it and read what it has installed."""
    created = run(["podman", "create", ref], step="podman create").strip()
    try:
        shutil.rmtree(target, ignore_errors=True)
        run(["podman", "cp", f"{created}:{VENV}", str(target)], step="podman cp")
    finally:
        run(["podman", "rm", created], step="podman rm")
    (lib,) = (target / "lib").glob("python3.*")
    here = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if lib.name != here:
        raise BuildError(f"the image's venv is {lib.name}; run this with {lib.name}, not {here}")
    base = Path(getattr(sys, "_base_executable", sys.executable))
    for name in ("python", "python3", here):
        link = target / "bin" / name
        link.unlink(missing_ok=True)
        link.symlink_to(base)
    cfg = target / "pyvenv.cfg"
    lines = [ln for ln in cfg.read_text().splitlines() if not ln.startswith("home")]
    cfg.write_text("\n".join([f"home = {base.parent}", *lines]) + "\n")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=IMAGE)
    parser.add_argument("--export-venv", type=Path, help="only copy the built image's venv out")
    args = parser.parse_args()
    if args.export_venv:
        try:
            print(export_venv(args.tag, args.export_venv))
        except BuildError as exc:
            print(f"image venv: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        started = time.monotonic()
        ensure_tools()
        tools = time.monotonic()
        base = ensure_base()
        based = time.monotonic()
        ref = build_image(base, args.tag)
        built = time.monotonic()
    except BuildError as exc:
        print(f"image build: {exc}", file=sys.stderr)
        return 1
    print(
        f"tools {tools - started:.1f}s, base {based - tools:.1f}s, build {built - based:.1f}s",
        file=sys.stderr,
    )
    print(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
