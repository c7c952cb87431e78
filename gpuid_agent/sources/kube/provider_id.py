"""Machine id from a Node's `spec.providerID` (what the cloud calls the instance).

The id is the last path segment, as gpuid does it, with one exception where the last segment
alone is not unique:

  aws:///us-east-1a/i-0abc123                          → i-0abc123               (aws)
  gce://my-project/us-central1-a/gke-pool-1-abcd       → gke-pool-1-abcd         (gce)
  azure:///subscriptions/…/virtualMachines/vm-7        → vm-7                    (azure)
  azure:///…/virtualMachineScaleSets/pool/virtualMachines/3
                                                       → pool_3 (the VM's name)  (azure)
  kind://docker/kind/kind-worker                       → kind-worker             (kind)
  openstack:///0f8e…, vsphere://4213…, hcloud://123,
  digitalocean://123, oci://ocid1.instance.…, …        → last segment            (scheme)

A value without a scheme is used whole. Anything else unusable (empty, whitespace or control
characters, over 255 characters) gives None and the caller falls back to the host's files.
"""

from __future__ import annotations

import re

MAX_MACHINE_ID = 255
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_USABLE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
_AZURE_VMSS = re.compile(
    r"/virtualMachineScaleSets/([^/]+)/virtualMachines/([^/]+)/*$", re.IGNORECASE
)


def machine_from_provider_id(provider_id: str | None) -> tuple[str, str] | None:
    """(machine id, provider) or None. `provider` is the scheme (aws, gce, azure, kind, …)."""
    if not provider_id:
        return None
    text = provider_id.strip()
    match = _SCHEME.match(text)
    if match is None:
        scheme, rest = "", text
    else:
        scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "azure":
        vmss = _AZURE_VMSS.search(rest)
        if vmss is not None:
            candidate = f"{vmss.group(1)}_{vmss.group(2)}"
            return _checked(candidate, scheme)
    segments = [s for s in rest.split("/") if s]
    if not segments:
        return None
    return _checked(segments[-1], scheme or "other")


def _checked(candidate: str, provider: str) -> tuple[str, str] | None:
    if len(candidate) > MAX_MACHINE_ID or not _USABLE.match(candidate):
        return None
    return candidate, provider
