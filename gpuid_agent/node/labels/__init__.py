"""Node labels: GPU and chassis serials on the agent's own Node, kept reconciled."""

from gpuid_agent.node.labels.layout import DesiredState, desired_state, is_own_label
from gpuid_agent.node.labels.metrics import LabelMetrics
from gpuid_agent.node.labels.reconciler import LabelledNode, NodeLabeler, plan_patch

__all__ = [
    "DesiredState",
    "LabelMetrics",
    "LabelledNode",
    "NodeLabeler",
    "desired_state",
    "is_own_label",
    "plan_patch",
]
