"""Device ids the kubelet reports for GPU resources, parsed into what they point at.

Forms seen in the wild (see docs/attribution.md):

    GPU-<uuid>                 device plugin default (uuid strategy)
    GPU-<uuid>::N              time-slicing / MPS replica N of that GPU
    0, 1, …                    device plugin index strategy (NVML index)
    0:1                        index strategy on a MIG device (GPU index : MIG index)
    MIG-<uuid>                 a MIG device; EKS appends ::N
    MIG-GPU-<uuid>/<gi>/<ci>   MIG device, drivers before R470
    nvidia0                    GKE: the /dev/nvidia0 device
    nvidia0/gi1                GKE: GPU instance 1 of nvidia0 (MIG)
    nvidia0/vgpu1              GKE: time-shared replica 1 of nvidia0

Parsing only reads the text; whether a GPU with that id exists is decided later against the
NVML inventory.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gpuid_agent.runtime.errors import DeviceIdError

MAX_DEVICE_ID = 256
_MAX_NUMBER = 99_999  # far above any GPU index, minor, GI id or replica count

DeviceForm = Literal["uuid", "index", "mig_uuid", "mig_index", "mig_legacy", "gke", "gke_mig"]

_HEX_ID = r"[0-9A-Fa-f]+(?:-[0-9A-Fa-f]+)*"
_GPU_UUID = re.compile(rf"GPU-{_HEX_ID}")
_MIG_UUID = re.compile(rf"MIG-{_HEX_ID}")
_MIG_LEGACY = re.compile(rf"MIG-(GPU-{_HEX_ID})/(\d{{1,5}})/(\d{{1,5}})")
_INDEX = re.compile(r"\d{1,5}")
_MIG_INDEX = re.compile(r"(\d{1,5}):(\d{1,5})")
_GKE = re.compile(r"nvidia(\d{1,5})(?:/gi(\d{1,5}))?(?:/vgpu(\d{1,5}))?")
_REPLICA = re.compile(r"\d{1,5}")

DEFAULT_RESOURCE_PATTERNS = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """What one device id names. `form` says which of the optional fields are set."""

    device_id: str
    form: DeviceForm
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    gpu_minor: int | None = None
    mig_uuid: str | None = None
    mig_index: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    replica: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.form in ("mig_uuid", "mig_index", "mig_legacy", "gke_mig")


def check_id_text(text: str, what: str, limit: int) -> None:
    """Refuse a device id or name (`what`) that is empty, over `limit` characters, or not
    printable ASCII without spaces, before any pattern is tried on it."""
    if not text:
        raise DeviceIdError("empty", f"empty {what}")
    if len(text) > limit:
        raise DeviceIdError("too_long", f"{what} longer than {limit} characters")
    if not (text.isascii() and text.isprintable()) or " " in text:
        raise DeviceIdError("bad_characters", f"{what} has non-printable or non-ASCII text")


def id_number(text: str) -> int:
    """A number within a device id or name (digits already matched), bounded."""
    value = int(text)
    if value > _MAX_NUMBER:
        raise DeviceIdError("out_of_range", f"number {value} is out of range")
    return value


def parse_device_id(device_id: str) -> DeviceRef:
    """Parse one kubelet device id; raises DeviceIdError naming why it is not understood."""
    check_id_text(device_id, "device id", MAX_DEVICE_ID)
    base, replica = device_id, None
    if "::" in device_id:
        base, _, suffix = device_id.rpartition("::")
        if not _REPLICA.fullmatch(suffix) or "::" in base:
            raise DeviceIdError("bad_replica", "replica suffix after :: is not a number")
        replica = id_number(suffix)
    if _GPU_UUID.fullmatch(base):
        return DeviceRef(device_id, "uuid", gpu_uuid=base, replica=replica)
    if match := _MIG_LEGACY.fullmatch(base):
        return DeviceRef(
            device_id,
            "mig_legacy",
            gpu_uuid=match.group(1),
            gpu_instance_id=id_number(match.group(2)),
            compute_instance_id=id_number(match.group(3)),
            replica=replica,
        )
    if _MIG_UUID.fullmatch(base):
        return DeviceRef(device_id, "mig_uuid", mig_uuid=base, replica=replica)
    if _INDEX.fullmatch(base):
        return DeviceRef(device_id, "index", gpu_index=id_number(base), replica=replica)
    if match := _MIG_INDEX.fullmatch(base):
        return DeviceRef(
            device_id,
            "mig_index",
            gpu_index=id_number(match.group(1)),
            mig_index=id_number(match.group(2)),
            replica=replica,
        )
    if match := _GKE.fullmatch(base):
        minor, gi, vgpu = match.groups()
        if vgpu is not None:
            if replica is not None:
                raise DeviceIdError("bad_replica", "both /vgpuN and ::N replica suffixes")
            replica = id_number(vgpu)
        return DeviceRef(
            device_id,
            "gke" if gi is None else "gke_mig",
            gpu_minor=id_number(minor),
            gpu_instance_id=None if gi is None else id_number(gi),
            replica=replica,
        )
    raise DeviceIdError("unknown_form", "device id fits no known GPU id form")


class ResourceMatcher:
    """Which extended-resource names carry GPUs: the defaults plus configured glob patterns."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        patterns = [*DEFAULT_RESOURCE_PATTERNS, *(p.strip() for p in extra if p.strip())]
        self.patterns = tuple(dict.fromkeys(patterns))
        self._exact = frozenset(p for p in self.patterns if not _is_glob(p))
        self._globs = tuple(p for p in self.patterns if _is_glob(p))
        self._cache: dict[str, bool] = {}

    def __call__(self, resource_name: str) -> bool:
        known = self._cache.get(resource_name)
        if known is None:
            known = resource_name in self._exact or any(
                fnmatch.fnmatchcase(resource_name, p) for p in self._globs
            )
            if len(self._cache) < 1024:
                self._cache[resource_name] = known
        return known


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")
