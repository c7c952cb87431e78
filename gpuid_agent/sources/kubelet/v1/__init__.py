"""Stubs generated from api.proto (kubelet pod-resources v1); regenerate with `nox -s proto`."""
