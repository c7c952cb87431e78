"""What NVLinks each GPU model should have, kept as data in `nvlink_models.json`: the link
count and per-link speed of SXM and superchip modules, each with its source. Models not
listed (PCIe cards, whose links depend on the bridges fitted) are held to their peers only
(`nvlink_peers`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

MODELS_FILE = "nvlink_models.json"


@dataclass(frozen=True, slots=True)
class NvLinkModel:
    model: str
    name: re.Pattern[str]
    links: int
    speed_mbps: int
    source: str  # where the count and speed come from


def parse_models(doc: dict[str, Any]) -> tuple[NvLinkModel, ...]:
    models = []
    for raw in doc["models"]:
        links, speed, source = raw.get("links"), raw.get("speed_mbps"), raw.get("source")
        if not (
            isinstance(links, int) and 0 < links <= 18 and isinstance(speed, int) and speed > 0
        ):
            raise ValueError(f"NVLink model {raw!r}: links 1..18 and a positive speed wanted")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"NVLink model {raw.get('model')!r}: its source is missing")
        models.append(NvLinkModel(raw["model"], re.compile(raw["name"]), links, speed, source))
    return tuple(models)


MODELS = parse_models(
    json.loads(resources.files(__package__).joinpath(MODELS_FILE).read_text(encoding="utf-8"))
)


def expected_nvlinks(name: str | None) -> NvLinkModel | None:
    """The expectation for a GPU by its NVML name; None for a model not in the table."""
    if not name:
        return None
    return next((m for m in MODELS if m.name.match(name)), None)
