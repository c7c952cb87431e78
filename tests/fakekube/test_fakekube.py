"""The fake API server, driven through the real kubernetes_asyncio client."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import certifi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from tests.fakekube import (
    FakeKube,
    ThreadedFakeKube,
    free_port,
    kubeconfig_dict,
    objects,
    write_kubeconfig,
)
from tests.fakekube.patch import json_patch, merge_patch, strategic_merge_patch


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(token="secret-token") as server:
        yield server


@pytest.fixture
async def api(kube: FakeKube, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    path = write_kubeconfig(tmp_path / "kubeconfig", kube.url, token="secret-token")
    made = await create_kube_client(environ={"KUBECONFIG": str(path), "HOME": str(tmp_path)})
    assert made is not None
    yield made.api
    await made.close()


CA_BUNDLE = Path(certifi.where()).read_bytes()


def _status(exc: ApiException) -> dict[str, Any]:
    body = json.loads(exc.body)
    assert body["kind"] == "Status"
    assert body["code"] == exc.status
    return body


async def test_get_and_strategic_merge_patch_of_labels(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_node("n1", labels={"keep": "me", "old": "x"})
    core = client.CoreV1Api(api)
    node = await core.read_node("n1")
    rv = node.metadata.resource_version
    patched = await core.patch_node("n1", {"metadata": {"labels": {"new": "y", "old": None}}})
    assert patched.metadata.labels == {"keep": "me", "new": "y"}
    assert int(patched.metadata.resource_version) > int(rv)
    assert kube.requests[-1].content_type == "application/strategic-merge-patch+json"
    assert kube.count("get") == 1
    assert kube.count("patch") == 1


async def test_merge_patch_null_deletes_and_noop_keeps_resource_version(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_node("n1", labels={"a": "1", "b": "2"})
    core = client.CoreV1Api(api)
    out = await core.patch_node(
        "n1",
        {"metadata": {"labels": {"a": None}}},
        _content_type="application/merge-patch+json",
    )
    assert out.metadata.labels == {"b": "2"}
    again = await core.patch_node(
        "n1",
        {"metadata": {"labels": {"b": "2"}}},
        _content_type="application/merge-patch+json",
    )
    assert again.metadata.resource_version == out.metadata.resource_version


async def test_json_patch_escapes_and_test_op(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_node("n1", labels={"x.io/a": "1"})
    core = client.CoreV1Api(api)
    out = await core.patch_node(
        "n1",
        [
            {"op": "test", "path": "/metadata/labels/x.io~1a", "value": "1"},
            {"op": "remove", "path": "/metadata/labels/x.io~1a"},
            {"op": "add", "path": "/metadata/labels/x.io~1b", "value": "2"},
        ],
    )
    assert kube.requests[-1].content_type == "application/json-patch+json"
    assert out.metadata.labels == {"x.io/b": "2"}
    with pytest.raises(ApiException) as failed:
        await core.patch_node(
            "n1", [{"op": "test", "path": "/metadata/labels/x.io~1b", "value": "nope"}]
        )
    assert failed.value.status == 422


async def test_resource_version_precondition_conflicts(
    kube: FakeKube, api: client.ApiClient
) -> None:
    created = kube.add_node("n1")
    kube.patch("Node", "n1", {"metadata": {"labels": {"someone": "else"}}})
    core = client.CoreV1Api(api)
    stale = created["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as conflict:
        await core.patch_node(
            "n1", {"metadata": {"resourceVersion": stale, "labels": {"mine": "1"}}}
        )
    body = _status(conflict.value)
    assert body["reason"] == "Conflict"
    assert "mine" not in kube.node_labels("n1")
    fresh = kube.node("n1")["metadata"]["resourceVersion"]
    await core.patch_node("n1", {"metadata": {"resourceVersion": fresh, "labels": {"mine": "1"}}})
    assert kube.node_labels("n1") == {"someone": "else", "mine": "1"}


async def test_invalid_label_value_is_422_with_causes(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_node("n1")
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as invalid:
        await core.patch_node("n1", {"metadata": {"labels": {"ok": "not valid!"}}})
    body = _status(invalid.value)
    assert body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"] == "metadata.labels"
    with pytest.raises(ApiException) as too_long:
        await core.patch_node("n1", {"metadata": {"labels": {"ok": "a" * 64}}})
    assert too_long.value.status == 422
    assert kube.node_labels("n1") == {}


async def test_status_is_kept_out_of_main_resource_patches(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_node("n1")
    core = client.CoreV1Api(api)
    await core.patch_node("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert kube.node("n1")["status"]["conditions"][0]["status"] == "True"
    await core.patch_node_status(
        "n1", {"status": {"conditions": [{"type": "GpuHealthy", "status": "False"}]}}
    )
    types = [c["type"] for c in kube.node("n1")["status"]["conditions"]]
    assert types == ["Ready", "GpuHealthy"]  # merged by the `type` merge key


async def test_not_found_and_unauthorized(kube: FakeKube, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as missing:
        await core.read_node("nope")
    assert _status(missing.value)["reason"] == "NotFound"
    api.configuration.api_key["BearerToken"] = "Bearer wrong"
    with pytest.raises(ApiException) as denied:
        await core.read_node("nope")
    assert denied.value.status == 401


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (403, "Forbidden"),
        (404, "NotFound"),
        (409, "Conflict"),
        (422, "Invalid"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
    ],
)
async def test_injected_status_errors(
    kube: FakeKube, api: client.ApiClient, code: int, reason: str
) -> None:
    kube.add_node("n1")
    kube.inject(code, method="PATCH", path="/api/v1/nodes/n1", times=2)
    core = client.CoreV1Api(api)
    for _ in range(2):
        with pytest.raises(ApiException) as failed:
            await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
        assert _status(failed.value)["reason"] == reason
    await core.read_node("n1")  # GETs were never affected
    await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    assert kube.count("patch", status=code) == 2
    assert kube.count("patch", status=200) == 1


async def test_injected_429_carries_retry_after(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_node("n1")
    kube.inject(429, verb="get", retry_after=3)
    with pytest.raises(ApiException) as limited:
        await client.CoreV1Api(api).read_node("n1")
    assert limited.value.headers["Retry-After"] == "3"
    assert _status(limited.value)["details"]["retryAfterSeconds"] == 3


async def test_stall_times_out_and_drop_disconnects(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_node("n1")
    core = client.CoreV1Api(api)
    kube.inject(verb="get", delay=5.0)
    with pytest.raises(asyncio.TimeoutError):
        await core.read_node("n1", _request_timeout=0.1)
    # aiohttp retries an idempotent request once on a dropped connection: drop two.
    kube.inject(verb="get", drop=True, times=2)
    with pytest.raises(aiohttp.ClientError):
        await core.read_node("n1")
    kube.inject(verb="get", hang=True, path=re.compile(r"/nodes/n1$"))
    with pytest.raises(asyncio.TimeoutError):
        await core.read_node("n1", _request_timeout=0.1)
    assert (await core.read_node("n1")).metadata.name == "n1"


async def test_list_pods_by_node_and_label_with_pages(
    kube: FakeKube, api: client.ApiClient
) -> None:
    for i in range(5):
        kube.create(
            objects.pod(
                f"p{i}",
                namespace="ml" if i % 2 else "default",
                labels={"app": "train" if i < 3 else "serve"},
                node_name="n1" if i != 4 else "n2",
            )
        )
    core = client.CoreV1Api(api)
    on_n1 = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert sorted(p.metadata.name for p in on_n1.items) == ["p0", "p1", "p2", "p3"]
    train = await core.list_namespaced_pod("default", label_selector="app in (train)")
    assert sorted(p.metadata.name for p in train.items) == ["p0", "p2"]
    not_train = await core.list_pod_for_all_namespaces(label_selector="app!=train")
    assert sorted(p.metadata.name for p in not_train.items) == ["p3", "p4"]
    first = await core.list_pod_for_all_namespaces(limit=2)
    assert len(first.items) == 2
    assert first.metadata._continue
    rest = await core.list_pod_for_all_namespaces(limit=10, _continue=first.metadata._continue)
    assert len(rest.items) == 3
    assert kube.count("list") == 5


async def test_owner_chain_objects(kube: FakeKube, api: client.ApiClient) -> None:
    dep = kube.create(objects.deployment("web", namespace="ml"))
    rs = kube.create(objects.replicaset("web-1", namespace="ml", owners=[objects.owner(dep)]))
    kube.create(objects.pod("web-1-x", namespace="ml", owners=[objects.owner(rs)]))
    cron = kube.create(objects.cronjob("nightly", namespace="ml"))
    kube.create(objects.job("nightly-1", namespace="ml", owners=[objects.owner(cron)]))
    kube.create(objects.statefulset("db", namespace="ml"))
    kube.create(objects.daemonset("agent", namespace="ml"))
    apps = client.AppsV1Api(api)
    batch = client.BatchV1Api(api)
    pod = await client.CoreV1Api(api).read_namespaced_pod("web-1-x", "ml")
    assert pod.metadata.owner_references[0].kind == "ReplicaSet"
    read_rs = await apps.read_namespaced_replica_set("web-1", "ml")
    assert read_rs.metadata.owner_references[0].uid == dep["metadata"]["uid"]
    job = await batch.read_namespaced_job("nightly-1", "ml")
    assert job.metadata.owner_references[0].name == "nightly"
    assert (await apps.read_namespaced_stateful_set("db", "ml")).spec.service_name == "db"
    assert len((await apps.list_daemon_set_for_all_namespaces()).items) == 1
    assert (await batch.read_namespaced_cron_job("nightly", "ml")).metadata.uid


async def test_watch_initial_then_live_events(kube: FakeKube, api: client.ApiClient) -> None:
    kube.create(objects.pod("a", node_name="n1"))
    core = client.CoreV1Api(api)
    seen: list[tuple[str, str]] = []
    async with watch.Watch() as w:
        stream = w.stream(core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1")
        async for event in stream:
            seen.append((event["type"], event["object"].metadata.name))
            if len(seen) == 1:
                kube.create(objects.pod("other", node_name="n2"))
                kube.create(objects.pod("b", node_name="n1"))
                kube.delete("Pod", "a", "default")
            if len(seen) == 3:
                break
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]


async def test_watch_resume_from_resource_version(kube: FakeKube, api: client.ApiClient) -> None:
    first = kube.create(objects.pod("a"))
    kube.patch("Pod", "a", {"metadata": {"labels": {"x": "1"}}}, namespace="default")
    kube.create(objects.pod("b"))
    core = client.CoreV1Api(api)
    resp = await core.list_namespaced_pod(
        "default",
        watch=True,
        resource_version=first["metadata"]["resourceVersion"],
        _preload_content=False,
    )
    lines = [json.loads(await resp.content.readline()) for _ in range(2)]
    kube.close_watches()
    assert await resp.content.readline() == b""  # nothing else was replayed
    resp.release()
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [
        ("MODIFIED", "a"),
        ("ADDED", "b"),
    ]


async def test_watch_expired_after_compaction(kube: FakeKube, api: client.ApiClient) -> None:
    old = kube.create(objects.pod("a"))
    kube.create(objects.pod("b"))
    kube.store.compact()
    core = client.CoreV1Api(api)

    async def resume() -> None:
        async with watch.Watch() as w:
            async for _ in w.stream(
                core.list_namespaced_pod,
                "default",
                resource_version=old["metadata"]["resourceVersion"],
                timeout_seconds=5,
            ):
                pass

    with pytest.raises(ApiException) as expired:
        await resume()
    assert expired.value.status == 410


async def test_forced_410_and_expire_open_watches(kube: FakeKube, api: client.ApiClient) -> None:
    kube.create(objects.pod("a"))
    core = client.CoreV1Api(api)
    kube.inject(410, verb="watch")
    resp = await core.list_namespaced_pod("default", watch=True, _preload_content=False)
    event = json.loads(await resp.content.readline())
    resp.release()
    assert event["type"] == "ERROR"
    assert event["object"]["reason"] == "Expired"

    resp = await core.list_namespaced_pod("default", watch=True, _preload_content=False)
    assert json.loads(await resp.content.readline())["type"] == "ADDED"
    assert kube.open_watches == 1
    kube.expire_watches()
    event = json.loads(await resp.content.readline())
    assert event["object"]["code"] == 410
    assert await resp.content.readline() == b""
    resp.release()


async def test_bookmarks_only_when_allowed(kube: FakeKube, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    resp = await core.list_node(watch=True, allow_watch_bookmarks=True, _preload_content=False)
    plain = await core.list_node(watch=True, _preload_content=False)
    kube.bookmark()  # both watches are open: the client returned after the headers
    event = json.loads(await resp.content.readline())
    assert event["type"] == "BOOKMARK"
    assert event["object"]["metadata"]["resourceVersion"] == str(kube.store.rv)
    kube.close_watches()
    assert await plain.content.readline() == b""  # closed with nothing sent
    resp.release()
    plain.release()


async def test_stop_and_start_keeps_objects_and_port(tmp_path: Path) -> None:
    port = free_port()
    server = FakeKube(port=port)
    path = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}")
    made = await create_kube_client(environ={"KUBECONFIG": str(path)})
    assert made is not None
    core = client.CoreV1Api(made.api)
    try:
        with pytest.raises(aiohttp.ClientConnectionError):
            await core.read_node("n1")
        await server.start()
        server.add_node("n1")
        await server.stop()
        await server.start()
        assert server.port == port
        assert (await core.read_node("n1")).metadata.name == "n1"
    finally:
        await made.close()
        await server.stop()


def test_threaded_server_serves_other_loops(tmp_path: Path) -> None:
    with ThreadedFakeKube() as threaded:
        threaded.call(lambda k: k.add_node("n1", labels={"a": "b"}))
        path = write_kubeconfig(tmp_path / "kc", threaded.url)

        async def read() -> dict[str, str]:
            made = await create_kube_client(environ={"KUBECONFIG": str(path)})
            assert made is not None
            try:
                return dict((await client.CoreV1Api(made.api).read_node("n1")).metadata.labels)
            finally:
                await made.close()

        assert asyncio.run(read()) == {"a": "b"}
        assert threaded.call(lambda k: k.count("get")) == 1


# ---- the kube client -------------------------------------------------------------------------


async def test_kube_client_sources(tmp_path: Path) -> None:
    assert await create_kube_client("off", environ={"KUBECONFIG": "/nonexistent"}) is None
    assert await create_kube_client(environ={"HOME": str(tmp_path)}) is None

    home_config = write_kubeconfig(tmp_path / ".kube" / "config", "http://127.0.0.1:1")
    made = await create_kube_client(environ={"HOME": str(tmp_path)})
    assert isinstance(made, KubeClient)
    assert made.source == str(home_config)
    assert made.host == "http://127.0.0.1:1"
    await made.close()

    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("in-cluster-token")
    # any valid PEM bundle: the client only builds its TLS context from it here
    (sa / "ca.crt").write_bytes(CA_BUNDLE)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    made = await create_kube_client(environ=env, service_account_dir=str(sa))
    assert made is not None
    assert made.source == "in-cluster"
    assert made.host == "https://10.0.0.1:443"
    await made.close()


async def test_kube_client_rejects_broken_kubeconfig(tmp_path: Path) -> None:
    from gpuid_agent.runtime.errors import KubeConfigError

    bad = tmp_path / "kc"
    bad.write_text("clusters: [not: a: valid")
    with pytest.raises(KubeConfigError, match="unusable: not valid YAML"):
        await create_kube_client(environ={"KUBECONFIG": str(bad)})
    # an entry missing a key: the library's message would quote the entry, token and all
    config = kubeconfig_dict("http://127.0.0.1:1", token="s3cret-token-value")
    config["users"] = [{"name": "fake", "token": "s3cret-token-value"}]
    bad.write_text(json.dumps(config))
    with pytest.raises(KubeConfigError) as refused:
        await create_kube_client(environ={"KUBECONFIG": str(bad)})
    assert "s3cret" not in str(refused.value)
    assert "Expected key user" in str(refused.value)


# ---- patch semantics -------------------------------------------------------------------------

_labels = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=6)


@settings(max_examples=200, deadline=None)
@given(before=_labels, after=_labels)
def test_merge_patches_reach_the_target_labels(
    before: dict[str, str], after: dict[str, str]
) -> None:
    change: dict[str, str | None] = {k: v for k, v in after.items() if before.get(k) != v}
    change.update({k: None for k in before if k not in after})
    obj = {"metadata": {"labels": before}}
    for apply in (merge_patch, strategic_merge_patch):
        assert apply(obj, {"metadata": {"labels": change}})["metadata"]["labels"] == after
    ops = [
        {
            "op": "add",
            "path": "/metadata/labels/" + k.replace("~", "~0").replace("/", "~1"),
            "value": v,
        }
        for k, v in change.items()
        if v is not None
    ] + [
        {"op": "remove", "path": "/metadata/labels/" + k.replace("~", "~0").replace("/", "~1")}
        for k, v in change.items()
        if v is None
    ]
    assert json_patch(obj, ops)["metadata"]["labels"] == after


def test_strategic_merge_directives() -> None:
    obj = {
        "metadata": {
            "finalizers": ["a"],
            "ownerReferences": [{"uid": "1", "name": "x"}, {"uid": "2", "name": "y"}],
        },
        "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}], "other": {"a": 1, "b": 2}},
    }
    out = strategic_merge_patch(
        obj,
        {
            "metadata": {
                "finalizers": ["b"],
                "ownerReferences": [{"uid": "1", "$patch": "delete"}, {"uid": "3", "name": "z"}],
            },
            "spec": {"other": {"$patch": "replace", "c": 3}, "$retainKeys": ["other", "taints"]},
        },
    )
    assert out["metadata"]["finalizers"] == ["a", "b"]
    assert [o["uid"] for o in out["metadata"]["ownerReferences"]] == ["2", "3"]
    assert out["spec"] == {"taints": [{"key": "k", "effect": "NoSchedule"}], "other": {"c": 3}}


async def test_create_replace_delete_through_the_client(
    kube: FakeKube, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    made = await core.create_namespaced_pod("ml", objects.pod("p", namespace="ml"))
    assert made.metadata.namespace == "ml"
    with pytest.raises(ApiException) as exists:
        await core.create_namespaced_pod("ml", objects.pod("p", namespace="ml"))
    assert _status(exists.value)["reason"] == "AlreadyExists"
    body = kube.get("Pod", "p", "ml")
    assert body is not None
    body["metadata"]["labels"] = {"v": "2"}
    await core.replace_namespaced_pod("p", "ml", body)
    with pytest.raises(ApiException) as stale:
        await core.replace_namespaced_pod("p", "ml", body)  # same resourceVersion again
    assert stale.value.status == 409
    await core.delete_namespaced_pod("p", "ml")
    assert kube.get("Pod", "p", "ml") is None
    assert [kube.count(v) for v in ("create", "update", "delete")] == [2, 2, 1]


async def test_watch_selector_transitions(kube: FakeKube, api: client.ApiClient) -> None:
    kube.create(objects.pod("a", labels={"gpu": "yes"}))
    core = client.CoreV1Api(api)
    resp = await core.list_namespaced_pod(
        "default", watch=True, label_selector="gpu=yes", _preload_content=False
    )
    first = json.loads(await resp.content.readline())
    kube.patch("Pod", "a", {"metadata": {"labels": {"gpu": "no"}}}, namespace="default")
    left = json.loads(await resp.content.readline())
    kube.patch("Pod", "a", {"metadata": {"labels": {"gpu": "yes"}}}, namespace="default")
    back = json.loads(await resp.content.readline())
    resp.release()
    assert [first["type"], left["type"], back["type"]] == ["ADDED", "DELETED", "ADDED"]


async def test_resource_slices_in_the_served_versions_only(tmp_path: Path) -> None:
    async with FakeKube(resource_versions=("v1beta1",)) as kube:
        path = write_kubeconfig(tmp_path / "kubeconfig", kube.url)
        made = await create_kube_client(environ={"KUBECONFIG": str(path), "HOME": str(tmp_path)})
        assert made is not None
        try:
            with pytest.raises(ApiException) as gone:
                await client.ResourceV1Api(made.api).list_resource_slice()
            assert gone.value.status == 404
            beta = client.ResourceV1beta1Api(made.api)
            slice_ = objects.resource_slice(
                "s1", "n1", [objects.gpu_device("gpu-0", "GPU-1", version="v1beta1")],
                version="v1beta1",
            )  # fmt: skip
            kube.create(slice_)
            kube.create(objects.resource_slice("s2", "n2", [], version="v1beta1"))
            resp = await beta.list_resource_slice(
                field_selector="spec.nodeName=n1", _preload_content=False
            )
            listed = json.loads(await resp.read())
            assert [i["metadata"]["name"] for i in listed["items"]] == ["s1"]
            device = listed["items"][0]["spec"]["devices"][0]
            assert device["basic"]["attributes"]["uuid"] == {"string": "GPU-1"}
            assert listed["apiVersion"] == "resource.k8s.io/v1beta1"
        finally:
            await made.close()
