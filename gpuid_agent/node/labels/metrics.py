"""Label reconciliation metrics; defined with the agent's other metrics in one registry."""

from gpuid_agent.runtime.metrics import LabelMetrics

__all__ = ["LabelMetrics"]
