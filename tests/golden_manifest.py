"""The SHA-256 of every golden wire file, checked in as `tests/data/SHA256SUMS` (the form
`sha256sum -c` reads): `tests/data/records_wire.json` and each file of
`tests/data/wire_golden/`.

The golden files are written by running their test modules as scripts
(`python -m tests.test_records_wire`, `python -m tests.test_wire_golden`). That leaves the
manifest as it was, so a rewritten file fails `test_golden_files_match_their_manifest` until
the same command is run again with `--update-manifest`: a change of the wire format is then a
deliberate step, seen in the manifest's diff, never a side effect of regenerating.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
MANIFEST = DATA / "SHA256SUMS"
UPDATE_FLAG = "--update-manifest"


def golden_files() -> list[Path]:
    golden = DATA / "wire_golden"
    return [DATA / "records_wire.json", *sorted(p for p in golden.iterdir() if p.is_file())]


def digests() -> dict[str, str]:
    """The golden files' SHA-256 as they are now, by path under tests/data."""
    return {
        path.relative_to(DATA).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in golden_files()
    }


def recorded() -> dict[str, str]:
    """The checked-in manifest, by path under tests/data."""
    entries = {}
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        entries[name] = digest
    return entries


def write() -> None:
    MANIFEST.write_text(
        "".join(f"{digest}  {name}\n" for name, digest in sorted(digests().items())),
        encoding="utf-8",
    )


def after_regenerating(argv: list[str]) -> None:
    """What a module that rewrote golden files does with the manifest: update it only when
    told to."""
    if UPDATE_FLAG in argv:
        write()
        print(f"{MANIFEST} updated", file=sys.stderr)
        return
    if recorded() != digests():
        print(
            f"golden files changed; {MANIFEST} left as it was, so the suite fails until this "
            f"is run again with {UPDATE_FLAG} (only when the wire format is meant to change)",
            file=sys.stderr,
        )
