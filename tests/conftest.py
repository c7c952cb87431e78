"""Shared test plugins: the real servers the exporter tests run against."""

pytest_plugins = ["tests.servers.fixtures"]
