"""GPU health: checks over NVML signals and XID events, between the sources and the sinks.

`tracker.HealthTracker` holds each GPU's check states; `checks`, `xid`, `clocks` and `fabric`
are the pure rules it applies. See docs/health.md.
"""
