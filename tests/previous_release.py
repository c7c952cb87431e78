"""An earlier release of the agent, built from this repository's own history into a venv of its
own, and a "newer" copy of the working tree that writes every format one higher.

The release is taken from git (`git archive <commit>`), installed with pip into
`$XDG_CACHE_HOME/gpuid-agent/releases/<commit>/venv` once per machine (about 50 s) and reused
after that; its dependencies are held to the versions this suite runs with, so the only thing
that differs between the two agents is the project's own code. A clone without the commit (a
shallow one) fetches it from `origin`; where that fails the error says what to do.

`python -m tests.previous_release` builds it ahead and prints where it is.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The release before state files and spooled batches said their format: the last commit of main
# before `runtime/formats.py` (2026-11-28, "One way to end the suite's Go servers").
PREVIOUS_RELEASE = "ed3963078617eef47b4b0de32e0e76626979fbf7"


class ReleaseError(RuntimeError):
    """The release cannot be built here; the message says which step failed and what to do."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuid-agent" / "releases"


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=False)


def _ensure_commit(commit: str) -> None:
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
        return
    fetched = _git("fetch", "--quiet", "--depth", "1", "origin", commit)
    if fetched.returncode != 0 or _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        raise ReleaseError(
            f"commit {commit} (the previous release) is not in {REPO} and could not be fetched "
            f"from origin ({fetched.stderr.decode(errors='replace').strip()}): clone with full "
            "history, or run `git fetch --unshallow`"
        )


def _constraints(target: Path) -> Path:
    """This suite's installed versions (the project itself left out), as pip constraints."""
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in frozen.splitlines() if "==" in line and "gpuid" not in line.lower()]
    target.write_text("\n".join(lines) + "\n")
    return target


def release_agent(commit: str = PREVIOUS_RELEASE) -> Path:
    """The `gpuid-agent` program of `commit`, built once and cached."""
    root = cache_root() / commit
    program, built = root / "venv" / "bin" / "gpuid-agent", root / "built"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second run waits and reuses it
        if built.is_file() and program.is_file():
            return program
        shutil.rmtree(root, ignore_errors=True)  # what an interrupted build left
        root.mkdir()
        _ensure_commit(commit)
        archive = _git("archive", "--format=tar", commit)
        if archive.returncode != 0:
            raise ReleaseError(f"git archive {commit}: {archive.stderr.decode(errors='replace')}")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gpuid-release-") as tmp:
            source = Path(tmp) / "src"
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(source, filter="data")
            venv = root / "venv"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            installed = subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--constraint",
                    str(_constraints(Path(tmp) / "constraints.txt")),
                    str(source),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
        if installed.returncode != 0:
            raise ReleaseError(f"pip install of {commit}: {installed.stderr[-2000:]}")
        built.write_text(f"{commit} built in {time.monotonic() - started:.0f} s\n")
        return program


def newer_copy(target: Path) -> Path:
    """A copy of this working tree's package that writes (and reads) every format one higher
    than this version: the version after this one, as far as its files go. Run it with
    `PYTHONPATH=<target>`."""
    shutil.copytree(
        REPO / "gpuid_agent", target / "gpuid_agent", ignore=shutil.ignore_patterns("__pycache__")
    )
    formats = target / "gpuid_agent" / "runtime" / "formats.py"
    with open(formats, "a", encoding="utf-8") as f:
        f.write("\nFORMATS.update({kind: known + 1 for kind, known in FORMATS.items()})\n")
    return target


if __name__ == "__main__":
    began = time.monotonic()
    print(release_agent(), f"({time.monotonic() - began:.0f} s)")
