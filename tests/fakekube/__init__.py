"""A fake Kubernetes API server for tests (aiohttp on 127.0.0.1), used through the real
kubernetes_asyncio client via a kubeconfig.

    async with FakeKube() as kube:                       # or ThreadedFakeKube for a session
        kube.add_node("n1", provider_id="aws:///us-east-1a/i-0abc")
        pod = kube.create(objects.pod("p", node_name="n1", owners=[objects.owner(rs)]))
        path = write_kubeconfig(tmp_path / "kubeconfig", kube.url)  # then KUBECONFIG=path
        kube.inject(429, verb="patch", retry_after=2, times=1)       # next matching request
        kube.inject(verb="get", delay=5)                             # a stall (client timeout)
        kube.inject(410, verb="watch")                               # watch answered Expired
        kube.inject(verb="watch", as_list=True, times=3)             # watch=true ignored
        kube.expire_watches(); kube.close_watches(); kube.bookmark()
        kube.count("patch"); kube.requests                          # the request log

Objects: Nodes and Namespaces; Pods, ConfigMaps, Events (core); ReplicaSets, Deployments,
StatefulSets, DaemonSets (apps/v1); Jobs, CronJobs (batch/v1).
"""

from tests.fakekube import objects
from tests.fakekube.kubeconfig import kubeconfig_dict, write_kubeconfig
from tests.fakekube.server import FakeKube, Fault, RequestRecord, free_port, status_body
from tests.fakekube.threaded import ThreadedFakeKube

__all__ = [
    "FakeKube",
    "Fault",
    "RequestRecord",
    "ThreadedFakeKube",
    "free_port",
    "kubeconfig_dict",
    "objects",
    "status_body",
    "write_kubeconfig",
]
