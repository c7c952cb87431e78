"""Which machine this node runs on, from the host's own identity files.

The Kubernetes providerID (a cloud instance id) is preferred when known; these files are the
fallback: the DMI product UUID (the VM or board), then /etc/machine-id (the OS install).
"""

from __future__ import annotations

import re
from pathlib import Path

from gpuid_agent.sources.kube.provider_id import machine_from_provider_id

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


def resolve_machine(
    provider_id: str | None, dmi_product_uuid_path: str, machine_id_path: str
) -> tuple[str, str] | None:
    """(machine id, source): the Node's providerID first (source `provider_id:<provider>`),
    then the DMI product UUID, then /etc/machine-id; None when none is usable."""
    from_provider = machine_from_provider_id(provider_id)
    if from_provider is not None:
        machine, provider = from_provider
        return machine, f"provider_id:{provider}"
    return local_machine_id(dmi_product_uuid_path, machine_id_path)
