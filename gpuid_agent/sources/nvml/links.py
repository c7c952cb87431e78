"""Reading a GPU's PCIe link and NVLinks through NVML; call only from the NVML thread.

PCIe: the link counts as read when its current and maximum generation and width all read; the
GPU's own maximum generation is extra (older drivers lack the call). NVLink: links are probed
from 0 until NVML says there are no more (INVALID_ARGUMENT or NOT_SUPPORTED past link 0). A
GPU whose link 0 is NOT_SUPPORTED has no NVLink: "not applicable", never an alarm. The AER
counters and link speeds are field values (see `fields`).
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuid_agent.facts import NVLINK_COUNTERS, NvLink, PcieLink
from gpuid_agent.sources.nvml.api import Handle, NvmlApi
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.errors import ABSENT, NvmlFault, fault, lost_error

# NVML_NVLINK_MAX_LINKS of current drivers; probing stops earlier at the GPU's last link
MAX_NVLINKS = 18
_END_OF_LINKS = frozenset({*ABSENT, NvmlFault.INVALID_ARGUMENT})


def read_pcie(
    api: NvmlApi,
    calls: FieldCalls,
    index: int,
    handle: Handle,
    *,
    absent: dict[str, str],
    failed: dict[str, str],
) -> PcieLink | None:
    def get(call: Any) -> Any:
        return calls.get(index, "pcie_link", call, handle, absent=absent, failed=failed)

    values = (
        get(api.pcie_link_gen),
        get(api.pcie_link_max_gen),
        get(api.pcie_link_width),
        get(api.pcie_link_max_width),
    )
    if any(v is None for v in values):
        return None
    gpu_max = calls.get(index, "pcie_gpu_max_gen", api.pcie_link_gpu_max_gen, handle)
    gen, max_gen, width, max_width = (int(v) for v in values)
    return PcieLink(gen, max_gen, width, max_width, None if gpu_max is None else int(gpu_max))


def read_nvlinks(
    api: NvmlApi,
    calls: FieldCalls,
    index: int,
    handle: Handle,
    *,
    absent: dict[str, str],
    failed: dict[str, str],
) -> tuple[NvLink, ...] | None:
    links: list[NvLink] = []
    for link in range(MAX_NVLINKS):
        try:
            active = api.nvlink_state(handle, link)
        except pynvml.NVMLError as exc:
            lost = lost_error(index, exc)
            if lost is not None:
                raise lost from exc
            found = fault(exc)
            if found in _END_OF_LINKS and (links or found is not NvmlFault.INVALID_ARGUMENT):
                if not links:
                    absent["nvlink"] = f"no NVLink on this GPU ({exc})"
                    return None
                break
            calls.warn_once(index, "nvlink", f"NVML error reading NVLink {link}: {exc}")
            calls.errors += 1
            failed["nvlink"] = f"NVML error on link {link}: {exc}"
            return None
        errors = tuple(
            calls.get(index, "nvlink_errors", api.nvlink_error_counter, handle, link, counter)
            for counter in range(len(NVLINK_COUNTERS))
        )
        links.append(NvLink(link, bool(active), tuple(_count(e) for e in errors)))
    calls.recovered(index, "nvlink")
    return tuple(links)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
