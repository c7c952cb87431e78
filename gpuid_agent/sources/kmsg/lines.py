"""Parsing kernel log records into typed driver events; pure functions, no I/O.

A /dev/kmsg record is `<prefix>,<seq>,<usec>,<flags>[,...];<message>` with non-printable bytes
escaped as `\\xNN`, followed by continuation lines (` KEY=value`) that carry no message. The
lines parsed, as the NVIDIA drivers print them:

    NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:18:00): 79, pid=1234, GPU has fallen off the bus.   (no name=)
    NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 13 (0x00000082 0x00000004 ...)
    NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 ...)
    NVRM: Xid (PCI:0000:b3:00): 154, GPU recovery action changed from 0x0 (None) to 0x1
          (GPU Reset Required)   (one line)
    NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.
    NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has
          fallen off the bus and is not responding to commands.   (one record or three)
    nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ interrupt

The driver pads NVLink5 lines into columns, so every run of blanks is read as one space.
Anything else, or anything malformed, is None: a parser fed the whole kernel log never raises.
Every number is bounded and every text cut to TEXT_MAX characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TEXT_MAX = 200
_CODE_MAX = 99_999
_BLANKS = re.compile(r"\s+")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_PCI = r"(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"\): (\d{1,5}),? ?(.*)")
# `name=` is left out by some drivers (and when the process is gone): the pid still counts
_PROCESS = re.compile(r"pid=([^,]{0,32}), (?:name=([^,]{0,64}), ?)?(.*)")
_NVLINK5 = re.compile(
    r"([A-Z][A-Z0-9_]{0,40}) (Fatal|Nonfatal|Non-fatal) XC\d{1,3} i\d{1,3} Link (-?\d{1,3}) "
    r"\((0x[0-9a-fA-F]{1,8}) (0x[0-9a-fA-F]{1,8})"
)
_RECOVERY = re.compile(
    r"GPU recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) "
    r"to 0x([0-9a-fA-F]{1,8}) \(([^)]{0,60})\)"
)
_OFF_BUS = re.compile(r"NVRM: GPU " + _PCI + r": GPU has fallen off the bus")
_THE_GPU = re.compile(r"NVRM: The NVIDIA GPU " + _PCI)
_SXID = re.compile(r"nvidia-nvswitch(\d{1,3}): SXid \(" + _PCI + r"\): (\d{1,5}), (.*)")
_SEVERITY = re.compile(r"(Non-fatal|Fatal)\b")


@dataclass(frozen=True, slots=True, order=True)
class PciAddress:
    """A PCI device by domain, bus and device (the function is left out: one GPU per device)."""

    domain: int
    bus: int
    device: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}"


@dataclass(frozen=True, slots=True)
class NvLink5Detail:
    """What an NVLink5 XID (144-150) says beyond its code: the unit, its severity, the link
    and the two registers NVIDIA's decode table is keyed by."""

    unit: str
    fatal: bool
    link: int | None  # None: not one link (the driver prints -1)
    intr_info: int
    error_status: int

    @property
    def subcode(self) -> int:
        """Bits 20-25 of the interrupt information: the link-event reason of XID 149."""
        return (self.intr_info >> 20) & 0x3F


@dataclass(frozen=True, slots=True)
class KernelXid:
    pci: PciAddress
    code: int
    text: str
    pid: int | None = None
    process: str | None = None
    nvlink: NvLink5Detail | None = None
    recovery_action: int | None = None  # XID 154: the action it changed to (NVML's numbering)
    recovery_text: str | None = None


@dataclass(frozen=True, slots=True)
class GpuOffBus:
    pci: PciAddress


@dataclass(frozen=True, slots=True)
class NvSwitchSxid:
    switch: int  # the N of nvidia-nvswitchN
    pci: PciAddress
    code: int
    fatal: bool | None  # None: the line does not say
    text: str


KernelEvent = KernelXid | GpuOffBus | NvSwitchSxid


def pci_address(text: str) -> PciAddress | None:
    """A PCI address from NVML's `00000000:18:00.0` or the kernel's `0000:18:00` forms."""
    m = re.fullmatch(_PCI, text.strip())
    return _address(m.group(1), m.group(2), m.group(3)) if m else None


def _address(domain: str, bus: str, device: str) -> PciAddress:
    return PciAddress(int(domain, 16), int(bus, 16), int(device, 16))


def _clip(text: str) -> str:
    """Blanks collapsed, anything unprintable replaced, at most TEXT_MAX characters."""
    printable = "".join(c if c.isprintable() else " " for c in text[: TEXT_MAX * 2])
    return _BLANKS.sub(" ", printable).strip()[:TEXT_MAX]


def record_message(record: str) -> str:
    """The message of one /dev/kmsg record (a line without the header is taken whole)."""
    first = record.split("\n", 1)[0]
    head, sep, message = first.partition(";")
    if (
        sep
        and head
        and all(part.strip().lstrip("-").isdigit() or not part for part in head.split(",")[:3])
    ):
        first = message
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), first)


def _xid(m: re.Match[str]) -> KernelXid | None:
    code = int(m.group(4))
    if code > _CODE_MAX:
        return None
    rest = m.group(5)
    pid = process = None
    if (p := _PROCESS.match(rest)) is not None:
        pid = int(p.group(1)) if p.group(1).isdigit() and len(p.group(1)) < 11 else None
        name = _clip(p.group(2) or "")
        process = name[:64] if name and not name.startswith("<") else None
        rest = p.group(3)
    nvlink = action = action_text = None
    if 144 <= code <= 150 and (n := _NVLINK5.search(rest)) is not None:
        link = int(n.group(3))
        nvlink = NvLink5Detail(
            unit=n.group(1),
            fatal=n.group(2) == "Fatal",
            link=link if link >= 0 else None,
            intr_info=int(n.group(4), 16),
            error_status=int(n.group(5), 16),
        )
    if code == 154 and (r := _RECOVERY.search(rest)) is not None:
        action, action_text = int(r.group(1), 16), _clip(r.group(2))
    return KernelXid(
        pci=_address(m.group(1), m.group(2), m.group(3)),
        code=code,
        text=_clip(rest),
        pid=pid,
        process=process,
        nvlink=nvlink,
        recovery_action=action,
        recovery_text=action_text,
    )


class KernelLogParser:
    """Turns kernel log records into events. Holds one piece of state: a GPU named by
    "The NVIDIA GPU <pci>" whose "fallen off the bus" arrives in a later record."""

    _PENDING_RECORDS = 3  # records within which the rest of a split message must follow

    def __init__(self) -> None:
        self._named: PciAddress | None = None
        self._named_left = 0

    def parse(self, record: str) -> KernelEvent | None:
        try:
            return self._parse(_clip_raw(record_message(record)))
        except (ValueError, IndexError):  # a malformed record: nothing to report
            return None

    def _parse(self, raw: str) -> KernelEvent | None:
        message = _BLANKS.sub(" ", raw)  # column-aligned lines: one space between words
        if self._named_left > 0:
            self._named_left -= 1
        if "NVRM" not in message and "SXid" not in message:
            return None
        if (m := _XID.search(message)) is not None:
            return _xid(m)
        if (m := _OFF_BUS.search(message)) is not None:
            return GpuOffBus(_address(m.group(1), m.group(2), m.group(3)))
        if (m := _THE_GPU.search(message)) is not None:
            named = _address(m.group(1), m.group(2), m.group(3))
            if "fallen off the bus" in message:
                return GpuOffBus(named)
            self._named, self._named_left = named, self._PENDING_RECORDS
            return None
        if "fallen off the bus" in message and self._named_left > 0 and self._named:
            named, self._named, self._named_left = self._named, None, 0
            return GpuOffBus(named)
        if (m := _SXID.search(message)) is not None:
            code = int(m.group(5))
            if code > _CODE_MAX:
                return None
            text = m.group(6)
            sev = _SEVERITY.match(text)
            return NvSwitchSxid(
                switch=int(m.group(1)),
                pci=_address(m.group(2), m.group(3), m.group(4)),
                code=code,
                fatal=None if sev is None else sev.group(1) == "Fatal",
                text=_clip(text),
            )
        return None


def _clip_raw(message: str) -> str:
    # a kernel record is at most ~1 KiB; anything longer is not a driver line worth the regexes
    return message[:4096]
