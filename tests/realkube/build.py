"""Builds the Go programs the suite runs for real, once per machine: kube-apiserver and the
kubelet's pod-resources server (go/kubernetes), and etcd (go/etcd).

Each wrapper module is built into `$XDG_CACHE_HOME/gpuid-agent/go/<module>-<key>/`, the key being
a hash of its go.sum, go.mod and Go sources: a changed pin or program builds anew, anything else
reuses the binaries. A lock keeps two test runs from building the same module at once. The build
is static (CGO_ENABLED=0) and kube-apiserver carries its release in the version ldflags, so
`/version` tells which Kubernetes the suite ran against.

`python -m tests.realkube.build` builds both and prints where they are and how long it took.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GO_DIR = Path(__file__).resolve().parent / "go"
PROGRAMS = {
    "kubernetes": ("kube-apiserver", "podresources-server"),
    "etcd": ("etcd",),
}
_VERSION_PACKAGE = "k8s.io/component-base/version"


class BuildError(RuntimeError):
    """A module that cannot be built here; the message says which step failed."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuid-agent" / "go"


def module_key(module: Path) -> str:
    digest = hashlib.sha256()
    files = [module / "go.sum", module / "go.mod", *sorted(module.rglob("*.go"))]
    for path in files:
        digest.update(str(path.relative_to(module)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def kubernetes_release(module: Path) -> str:
    """The k8s.io/kubernetes version go.mod requires ("v1.35.4")."""
    found = re.search(
        r"^\s*(?:require\s+)?k8s\.io/kubernetes (v\S+)$", (module / "go.mod").read_text(), re.M
    )
    if found is None:
        raise BuildError(f"{module}/go.mod requires no k8s.io/kubernetes release")
    return found.group(1)


def _ldflags(name: str, module: Path) -> str:
    flags = ["-s", "-w"]
    if name == "kubernetes":
        release = kubernetes_release(module)
        major, minor = release.lstrip("v").split(".")[:2]
        built = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        values = {
            "gitVersion": release,
            "gitMajor": major,
            "gitMinor": minor,
            "gitTreeState": "archive",  # built from the module proxy's zip: no git tree, no commit
            "gitCommit": "",
            "buildDate": built,
        }
        flags += [f"-X {_VERSION_PACKAGE}.{k}={v}" for k, v in values.items()]
    return " ".join(flags)


def _go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if go is None:
        raise BuildError("go not found: the suite builds kube-apiserver and etcd with Go")
    return go


def ensure_built(name: str) -> Path:
    """The directory holding module `name`'s programs, built now if this machine has not yet."""
    module = GO_DIR / name
    target = cache_root() / f"{name}-{module_key(module)}"
    if (target / "build.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "build.json").exists():  # built while we waited
            return target
        _build(name, module, target)
    return target


def _build(name: str, module: Path, target: Path) -> None:
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    command = [_go(), "build", "-trimpath", "-ldflags", _ldflags(name, module)]
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    started = time.monotonic()
    command += ["-o", f"{staging}/"]
    # A main package is named after its directory: cmd/<program>, or the etcd module itself.
    command += [f"./cmd/{p}" for p in PROGRAMS[name]] if name == "kubernetes" else ["."]
    print(
        f"building {name} ({' '.join(PROGRAMS[name])}) into {target}", file=sys.stderr, flush=True
    )
    done = subprocess.run(command, cwd=module, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(f"go build of {name} failed:\n{done.stderr[-4000:]}")
    seconds = round(time.monotonic() - started, 1)
    (staging / "build.json").write_text(json.dumps({"module": name, "seconds": seconds}))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def program(name: str) -> Path:
    """The path of one built program ("kube-apiserver", "podresources-server", "etcd")."""
    module = next(m for m, names in PROGRAMS.items() if name in names)
    return ensure_built(module) / name


def main() -> int:
    for name in PROGRAMS:
        started = time.monotonic()
        try:
            where = ensure_built(name)
        except BuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{name}: {where} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
