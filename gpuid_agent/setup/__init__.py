"""The wiring root's helpers: Settings turned into each component's own small config, once."""
