"""Exporters deliver record batches to one sink each; see base.Exporter."""
