"""Which machine this node runs on, from the host's own identity files.

The Kubernetes providerID (a cloud instance id) is preferred when known; these files are the
fallback: the DMI product UUID (the VM or board), then /etc/machine-id (the OS install).
"""

from __future__ import annotations

import re
from pathlib import Path

_UUIDISH = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._:-]{0,127}$")


def _read_id(path: str) -> str | None:
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="ascii", errors="strict").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text.lower() if _UUIDISH.match(text) else None


def local_machine_id(dmi_product_uuid_path: str, machine_id_path: str) -> tuple[str, str] | None:
    """(machine id, source) from the host's files, or None when neither is readable."""
    product = _read_id(dmi_product_uuid_path)
    if product:
        return product, "dmi_product_uuid"
    machine = _read_id(machine_id_path)
    if machine:
        return machine, "machine_id"
    return None
