"""Everything the agent does with its own Node's labels: the machine identity from the Node's
providerID, and the labeller task, over the agent's one API client.

At start the Node is read once (bounded by STARTUP_READ_TIMEOUT) so the first records already
carry the cloud's machine id; if the API does not answer, the agent starts with the host's
DMI/machine-id and switches when the labeller first reads the Node (a machine change, so new
records). Labelling never blocks collection: it runs as its own supervised task.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from gpuid_agent.facts import NodeInventory
from gpuid_agent.node.labels.reconciler import COMPONENT, LabelledNode, NodeLabeler
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kube.client import KubeClient, read_provider_id
from gpuid_agent.sources.kube.provider_id import machine_from_provider_id

_log = log.get("labels")
STARTUP_READ_TIMEOUT = 3.0
Spawn = Callable[[str, Coroutine[Any, Any, Any]], Any]
MachineSink = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class LabellingConfig:
    mode: Literal["on", "off", "dry-run"]  # LABELS
    prefix: str
    annotation: bool
    resync_interval: float
    startup_jitter: float
    debounce: float  # a burst of inventory changes within this makes one patch
    kube_api_off: bool  # KUBE_API=off: said on /status as the reason labels are off


class NodeLabelling:
    def __init__(
        self,
        config: LabellingConfig,
        node: str,
        metrics: AgentMetrics,
        board: StatusBoard,
        on_machine: MachineSink,
    ) -> None:
        self.config = config
        self.node = node
        self.board = board
        self.metrics = metrics.labels
        self._on_machine = on_machine
        self.kube: KubeClient | None = None
        self.labeler: NodeLabeler | None = None
        self._warned_provider_id: str | None = None

    async def start(self, spawn: Spawn, kube: KubeClient | None) -> None:
        """Read the Node's providerID and start the labeller over the agent's API client."""
        self.kube = kube
        if self.kube is None:
            why = "KUBE_API=off" if self.config.kube_api_off else "no Kubernetes API"
            self.board.set(COMPONENT, "disabled", why)
            return
        provider_id = await read_provider_id(self.kube, self.node, within=STARTUP_READ_TIMEOUT)
        if provider_id is not None:
            self.use_provider_id(provider_id)
        config = self.config
        if config.mode == "off":
            self.board.set(COMPONENT, "disabled", "LABELS=off")
            return
        self.labeler = NodeLabeler(
            self.kube,
            self.node,
            prefix=config.prefix,
            metrics=self.metrics,
            board=self.board,
            mode=config.mode,
            annotation=config.annotation,
            resync_interval=config.resync_interval,
            startup_jitter=config.startup_jitter,
            debounce=config.debounce,
            on_node=self._seen,
        )
        spawn(COMPONENT, self.labeler.run())

    def _seen(self, node: LabelledNode) -> None:
        self.use_provider_id(node.provider_id)

    def use_provider_id(self, provider_id: str) -> None:
        found = machine_from_provider_id(provider_id)
        if found is None:
            if provider_id and provider_id != self._warned_provider_id:
                self._warned_provider_id = provider_id
                _log.warning(
                    "providerID gives no usable machine id; using the host's",
                    extra={"provider_id": provider_id[:300]},
                )
            return
        machine, provider = found
        self._on_machine(machine, f"provider_id:{provider}")

    def offer(self, inventory: NodeInventory) -> None:
        if self.labeler is not None:
            self.labeler.offer(inventory)

    def status(self) -> dict[str, Any]:
        labeler = self.labeler
        desired = labeler.desired if labeler is not None else None
        return {
            "mode": self.config.mode if labeler is not None else "off",
            "prefix": self.config.prefix,
            "api": self.kube.source if self.kube is not None else None,
            "desired": dict(desired.labels) if desired is not None else None,
            "rewritten_serials": [repr(s) for s in desired.rewritten] if desired else [],
        }
