"""The events.k8s.io/v1 objects as the API server takes them: an Event `regarding` the Node,
its series patch, its name and its times.

An Event about a Node lives in the `default` namespace, as the kubelet's do: `kubectl describe
node` lists the Events whose `regarding` (`involvedObject` in core/v1) is the Node by kind,
name and UID, in any namespace.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from gpuid_agent.node.events.ledger import Series
from gpuid_agent.node.events.notes import EventText

NAMESPACE = "default"
REPORTING_CONTROLLER = "gpuid.github.com/gpuid-agent"
INSTANCE_LIMIT = 128  # characters of reportingInstance the API server takes
_NAME_LIMIT = 253  # a DNS subdomain
_SUFFIX_HEX = 16


@dataclass(frozen=True, slots=True)
class NodeRef:
    """The Node the Events are about, as read from the API server."""

    name: str
    uid: str


def events_path(name: str | None = None) -> str:
    base = f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events"
    return base if name is None else f"{base}/{quote(name, safe='')}"


def micro_time(moment: datetime) -> str:
    """A MicroTime as the API writes it: UTC, microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_name(node: str) -> str:
    """`<node>.<16 hex digits>`, random: unique, and a DNS subdomain whatever the node is
    called (the node part is made one and shortened to leave room for the suffix)."""
    labels = (re.sub(r"[^a-z0-9-]", "-", part).strip("-") for part in node.lower().split("."))
    stem = ".".join(part for part in labels if part)
    stem = stem[: _NAME_LIMIT - _SUFFIX_HEX - 1].rstrip(".-") or "node"
    return f"{stem}.{secrets.token_hex(_SUFFIX_HEX // 2)}"


def event_object(text: EventText, name: str, node: NodeRef) -> dict[str, Any]:
    """A new Event for one occurrence (no series: a repeat patches one in)."""
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "eventTime": micro_time(text.observed),
        "type": text.type,
        "reason": text.reason,
        "action": text.action,
        "note": text.note,
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid},
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": node.name[:INSTANCE_LIMIT],
    }


def series_patch(series: Series) -> dict[str, Any]:
    """A merge patch bringing an Event's series to the occurrences seen so far."""
    return {"series": {"count": series.count, "lastObservedTime": micro_time(series.last_observed)}}
