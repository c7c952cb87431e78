"""Kubernetes Events on the agent's own Node: GPU health transitions, GPUs replaced and
latched XIDs cleared, as a series when they repeat and within a write budget."""

from gpuid_agent.node.events.ledger import EventLedger
from gpuid_agent.node.events.notes import REASONS, EventText
from gpuid_agent.node.events.writer import NodeEventWriter

__all__ = ["REASONS", "EventLedger", "EventText", "NodeEventWriter"]
