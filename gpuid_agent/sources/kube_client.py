"""A kubernetes_asyncio ApiClient for the agent: in-cluster config, else a kubeconfig, else
none (the agent then runs without the Kubernetes API).

The kubeconfig path is read from the environment when called (kubernetes_asyncio reads
KUBECONFIG once at import), and each client gets its own Configuration instead of the
library's process-wide default, so several agents in one process do not share credentials.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from gpuid_agent import log
from gpuid_agent.errors import GpuidError

_log = log.get("kube")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeConfigError(GpuidError):
    """A Kubernetes configuration was found but cannot be used (malformed, unreadable)."""


@dataclass(slots=True)
class KubeClient:
    """An ApiClient and where its configuration came from ("in-cluster" or the file path)."""

    api: Any  # kubernetes_asyncio.client.ApiClient
    source: str

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    async def close(self) -> None:
        await self.api.close()


def _kubeconfig_paths(environ: Mapping[str, str]) -> list[str]:
    listed = environ.get("KUBECONFIG", "")
    if listed:
        return [p for p in listed.split(os.pathsep) if p]
    home = environ.get("HOME") or str(Path.home())
    default = Path(home) / ".kube" / "config"
    return [str(default)] if default.is_file() else []


def _in_cluster_available(environ: Mapping[str, str], sa_dir: str) -> bool:
    return bool(
        environ.get("KUBERNETES_SERVICE_HOST")
        and environ.get("KUBERNETES_SERVICE_PORT")
        and Path(sa_dir, "token").is_file()
    )


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if Path(p).is_file()]


async def create_kube_client(
    mode: str = "auto",
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
) -> KubeClient | None:
    """The client to use, or None when KUBE_API=off or no configuration exists at all.

    Raises KubeConfigError when configuration exists but is unusable, so the operator sees
    why instead of the agent silently running without the API.
    """
    if mode == "off":
        return None
    env = os.environ if environ is None else environ
    configuration = k8s_client.Configuration()
    if _in_cluster_available(env, service_account_dir):
        try:
            loader = InClusterConfigLoader(
                token_filename=str(Path(service_account_dir, "token")),
                cert_filename=str(Path(service_account_dir, "ca.crt")),
                environ=dict(env),
            )
            loader.load_and_set(configuration)
        except (k8s_config.ConfigException, OSError) as exc:
            raise KubeConfigError(f"in-cluster configuration unusable: {exc}") from exc
        return KubeClient(k8s_client.ApiClient(configuration=configuration), "in-cluster")
    paths = _existing(_kubeconfig_paths(env))
    if not paths:
        return None
    try:
        await k8s_config.load_kube_config(
            config_file=os.pathsep.join(paths),
            client_configuration=configuration,
            persist_config=False,
        )
    except Exception as exc:  # a malformed file surfaces as yaml, key, type or value errors
        raise KubeConfigError(f"kubeconfig {', '.join(paths)} unusable: {exc}") from exc
    _log.debug("kube client from kubeconfig", extra={"paths": paths})
    return KubeClient(k8s_client.ApiClient(configuration=configuration), ", ".join(paths))
