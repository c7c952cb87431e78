"""Where the inventory goes: records to exporters, node labels, /gpu/metrics."""
