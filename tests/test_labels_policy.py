"""The labeller's API error policy: classification and the 429's Retry-After.

The refusals a real API server gives on its own (400, 401, 403, 404, 409, 422) are taken from
the real kube-apiserver, asked through the agent's client with its pod-bound token under the
chart's RBAC and own-node policy. 429 and 5xx answers, and a 429's Retry-After, are faults the
real server cannot be made to give on demand: their Status bodies are built as the stand-in
(`tests/fakekube`) sends them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuid_agent.node.labels.policy import classify
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client, describe_request
from gpuid_agent.sources.kube.client import api_error as error_from
from tests.fakekube import status_body
from tests.realkube.chart import AgentIdentity, write_kubeconfig
from tests.realkube.cluster import ApiError, KubeCluster

P = "gpuid.github.com"


def api_error(
    status: int, message: str = "m", headers: dict[str, str] | None = None
) -> KubeApiError:
    """The error the client raises for this Status answer."""
    return error_from(status, json.dumps(status_body(status, message)).encode(), headers)


@pytest.mark.parametrize(
    ("status", "reason", "retry"),
    [
        (429, "throttled", "backoff"),
        (500, "server_error", "backoff"),
        (502, "server_error", "backoff"),
        (503, "server_error", "backoff"),
        (504, "server_error", "backoff"),
    ],
)
def test_status_classification(status: int, reason: str, retry: str) -> None:
    failure = classify(api_error(status, "Status message"))
    assert (failure.reason, failure.retry) == (reason, retry)


@pytest.fixture
async def agent_client(
    agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KubeClient]:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    client = await create_kube_client("auto", environ={"KUBECONFIG": str(agent_node.kubeconfig)})
    assert client is not None
    yield client
    await client.close()


async def refusal(client: KubeClient, method: str, path: str, **kwargs: Any) -> KubeApiError:
    with pytest.raises(KubeApiError) as refused:
        await client.request_json(method, path, within=10, **kwargs)
    return refused.value


async def test_the_real_servers_refusals_classify(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, agent_client: KubeClient, tmp_path: Path
) -> None:
    own = f"/api/v1/nodes/{agent_node.node}"
    stale = kube_cluster.admin.get(own)["metadata"]["resourceVersion"]
    kube_cluster.admin.strategic_patch(own, {"metadata": {"labels": {"team": "ml"}}})
    moved_on = {"resourceVersion": stale, "labels": {f"{P}/gpu-0": "S0"}}
    bad_token = write_kubeconfig(tmp_path / "bad", kube_cluster.url, kube_cluster.ca_path, "x.y.z")
    stranger = await create_kube_client("auto", environ={"KUBECONFIG": str(bad_token)})
    assert stranger is not None
    try:
        answers = {
            # a field the pod field selector does not know
            400: await refusal(
                agent_client, "GET", "/api/v1/pods", query=[("fieldSelector", "spec.bogus=x")]
            ),
            401: await refusal(stranger, "GET", own),
            # RBAC: the chart grants no Secrets
            403: await refusal(agent_client, "GET", "/api/v1/namespaces/default/secrets"),
            404: await refusal(agent_client, "GET", "/api/v1/nodes/no-such-node"),
            # the Node changed since the resourceVersion the patch names
            409: await refusal(agent_client, "PATCH", own, body={"metadata": moved_on}),
            # not a label value
            422: await refusal(
                agent_client, "PATCH", own, body={"metadata": {"labels": {f"{P}/gpu-0": "a b"}}}
            ),
        }
    finally:
        await stranger.close()
    classified = {
        status: (exc.status, classify(exc).reason, classify(exc).retry)
        for status, exc in answers.items()
    }
    assert classified == {
        400: (400, "client_error", "resync"),
        401: (401, "unauthorized", "resync"),
        403: (403, "forbidden", "resync"),
        404: (404, "not_found", "resync"),
        409: (409, "conflict", "now"),
        422: (422, "invalid", "resync"),
    }
    assert f"{P}/gpu-0" not in kube_cluster.admin.get(own)["metadata"]["labels"]


def test_other_failures() -> None:
    assert classify(TimeoutError()).reason == "timeout"
    assert classify(aiohttp.ServerDisconnectedError()).reason == "connection"
    assert classify(ConnectionRefusedError()).reason == "connection"
    assert classify(ValueError("bad model")).reason == "malformed"
    assert classify(ValueError("bad model")).retry == "backoff"


async def test_details_are_stable_and_carry_the_status_message(
    agent_node: AgentIdentity, agent_client: KubeClient
) -> None:
    secrets = "/api/v1/namespaces/default/secrets"
    a = classify(await refusal(agent_client, "GET", secrets))
    b = classify(await refusal(agent_client, "GET", secrets))
    with pytest.raises(ApiError) as refused:
        agent_node.client.get(secrets)
    message = refused.value.body["message"]
    assert 'secrets is forbidden: User "system:serviceaccount:' in message
    assert a.detail == b.detail == f"403 {message}"


def test_server_error_details_leave_the_message_out() -> None:
    assert classify(api_error(503)).detail == classify(api_error(503, "other")).detail


def test_429_retry_after_forms() -> None:
    assert classify(api_error(429, headers={"Retry-After": "7"})).retry_after == 7.0
    assert classify(api_error(429)).retry_after is None
    soon = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 20 < (classify(api_error(429, headers={"Retry-After": soon})).retry_after or 0) <= 30
    # the one parser's rules: capped at 300 s, signs and decimals refused
    assert classify(api_error(429, headers={"Retry-After": "86400"})).retry_after == 300.0
    assert classify(api_error(429, headers={"Retry-After": "-5"})).retry_after is None
    assert classify(api_error(429, headers={"Retry-After": "1.5"})).retry_after is None
    # only a 429 carries a pause to honour
    assert classify(api_error(503, headers={"Retry-After": "7"})).retry_after is None


@pytest.mark.parametrize(
    ("method", "url", "query", "expected"),
    [
        ("GET", "https://h/api/v1/nodes/n1", None, ("get", "nodes")),
        ("PATCH", "https://h/api/v1/nodes/n1", None, ("patch", "nodes")),
        ("PATCH", "https://h/api/v1/nodes/n1/status", None, ("patch", "nodes/status")),
        ("GET", "https://h/api/v1/pods", [("fieldSelector", "x")], ("list", "pods")),
        ("GET", "https://h/api/v1/pods", [("watch", True)], ("watch", "pods")),
        ("GET", "https://h/apis/apps/v1/namespaces/ns/replicasets/r", None, ("get", "replicasets")),
        ("GET", "https://h/version", None, ("get", "other")),
    ],
)
def test_request_naming_for_metrics(
    method: str, url: str, query: list[tuple[str, object]] | None, expected: tuple[str, str]
) -> None:
    assert describe_request(method, url, query) == expected
