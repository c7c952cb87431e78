"""GPU inventory and pod attribution agent for Kubernetes GPU nodes."""

__version__ = "0.1.0"
