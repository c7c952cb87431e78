"""The parts of kubernetes_asyncio the agent uses, without the rest of the package.

`import kubernetes_asyncio.<anything>` runs the package's `__init__`, which imports every
generated API class and all of its ~850 model classes (~35 MiB and ~0.5 s of start). The agent
needs only the configuration and authentication (Configuration, the in-cluster and kubeconfig
loaders, ApiClient's auth and transport); it reads answers as JSON itself. `load()` registers
the package, `client` and `client.models` as modules whose code has not run yet, so importing
those few submodules costs only them; the first attribute asked of such a module that is not
one of those submodules (a model class, `kubernetes_asyncio.watch`, …) runs the package's own
`__init__` then, so other code in the process sees the whole library as usual.

Nothing here is imported until the agent has a Kubernetes API to talk to.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_ROOT = "kubernetes_asyncio"
# Names of `kubernetes_asyncio.client` served from one submodule without loading the rest.
_CLIENT_NAMES = {
    "ApiClient": "api_client",
    "Configuration": "configuration",
    "ApiException": "exceptions",
    "ApiValueError": "exceptions",
    "rest": "rest",
}
_lock = threading.RLock()  # completing one package may complete another


@dataclass(frozen=True, slots=True)
class Library:
    """What the agent's client uses of kubernetes_asyncio."""

    ApiClient: type[Any]
    Configuration: type[Any]
    ConfigException: type[Exception]
    InClusterConfigLoader: type[Any]
    load_kube_config: Any  # async (config_file=, client_configuration=, persist_config=)


def _complete(module: ModuleType) -> None:
    """Run a deferred package's own `__init__` in place (once)."""
    if module.__dict__.pop("_gpuid_deferred", False):
        spec = module.__spec__
        assert spec is not None
        assert spec.loader is not None
        spec.loader.exec_module(module)


def _deferred(name: str, resolve: Any) -> ModuleType:
    """A package registered under `name` whose `__init__` has not run; attributes come from
    `resolve(name)` or, for anything else, from running the `__init__`."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(name)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["_gpuid_deferred"] = True

    def __getattr__(attr: str) -> Any:  # noqa: N807 - the module hook of PEP 562
        if attr.startswith("__"):
            raise AttributeError(attr)
        found = resolve(attr)
        if found is not None:
            return found
        with _lock:
            _complete(module)
        if attr in module.__dict__:
            return module.__dict__[attr]
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    module.__dict__["__getattr__"] = __getattr__
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _client_name(attr: str) -> Any:
    submodule = _CLIENT_NAMES.get(attr)
    if submodule is None:
        return None
    loaded = importlib.import_module(f"{_ROOT}.client.{submodule}")
    return loaded if attr == submodule else getattr(loaded, attr)


def _install() -> None:
    with _lock:
        if _ROOT in sys.modules:
            return  # already imported (whole, or deferred by an earlier call)
        _deferred(_ROOT, lambda attr: None)
        _deferred(f"{_ROOT}.client", _client_name)
        _deferred(f"{_ROOT}.client.models", lambda attr: None)


@functools.cache
def load() -> Library:
    """kubernetes_asyncio's configuration, loaders and ApiClient (imported on first call)."""
    _install()
    # `import … as` (not `from … import`, which would ask the deferred package for the name
    # first, nor importlib) so that `python -X importtime` lists these too
    import kubernetes_asyncio.client.api_client as api_client  # noqa: PLR0402
    import kubernetes_asyncio.client.configuration as configuration  # noqa: PLR0402
    import kubernetes_asyncio.config.config_exception as exception
    import kubernetes_asyncio.config.incluster_config as incluster
    import kubernetes_asyncio.config.kube_config as kube_config  # noqa: PLR0402

    return Library(
        ApiClient=api_client.ApiClient,
        Configuration=configuration.Configuration,
        ConfigException=exception.ConfigException,
        InClusterConfigLoader=incluster.InClusterConfigLoader,
        load_kube_config=kube_config.load_kube_config,
    )
