"""Node labels: GPU and chassis serials on the agent's own Node, kept reconciled."""

from gpuid_agent.node.labels.layout import DesiredState, desired_state, is_own_label
from gpuid_agent.node.labels.reconciler import LabelledNode, NodeLabeler, plan_patch
from gpuid_agent.runtime.metrics import LabelMetrics

__all__ = [
    "DesiredState",
    "LabelMetrics",
    "LabelledNode",
    "NodeLabeler",
    "desired_state",
    "is_own_label",
    "plan_patch",
]
