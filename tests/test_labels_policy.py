"""The labeller's API error policy: classification and the 429's Retry-After."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import aiohttp
import pytest

from gpuid_agent.node.labels.policy import classify
from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.sources.kube.client import api_error as error_from
from gpuid_agent.sources.kube.client import describe_request
from tests.fakekube import status_body


def api_error(
    status: int, message: str = "m", headers: dict[str, str] | None = None
) -> KubeApiError:
    """The error the client raises for this Status answer."""
    return error_from(status, json.dumps(status_body(status, message)).encode(), headers)


@pytest.mark.parametrize(
    ("status", "reason", "retry"),
    [
        (409, "conflict", "now"),
        (429, "throttled", "backoff"),
        (500, "server_error", "backoff"),
        (502, "server_error", "backoff"),
        (503, "server_error", "backoff"),
        (504, "server_error", "backoff"),
        (401, "unauthorized", "resync"),
        (403, "forbidden", "resync"),
        (404, "not_found", "resync"),
        (422, "invalid", "resync"),
        (400, "client_error", "resync"),
    ],
)
def test_status_classification(status: int, reason: str, retry: str) -> None:
    failure = classify(api_error(status, "Status message"))
    assert (failure.reason, failure.retry) == (reason, retry)


def test_other_failures() -> None:
    assert classify(TimeoutError()).reason == "timeout"
    assert classify(aiohttp.ServerDisconnectedError()).reason == "connection"
    assert classify(ConnectionRefusedError()).reason == "connection"
    assert classify(ValueError("bad model")).reason == "malformed"
    assert classify(ValueError("bad model")).retry == "backoff"


def test_details_are_stable_and_carry_the_status_message() -> None:
    a = classify(api_error(403, 'nodes "n1" is forbidden: User "x" cannot patch'))
    b = classify(api_error(403, 'nodes "n1" is forbidden: User "x" cannot patch'))
    assert a.detail == b.detail == '403 nodes "n1" is forbidden: User "x" cannot patch'
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
