"""The chart's DRA switch: the ResourceSlice RBAC rule and DRA_RESOURCE_SLICES follow whether
the cluster serves resource.k8s.io (as Helm's API discovery reports it), `dra.enabled` and
`dra.force`; every render validates against the strict schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from gpuid_agent.runtime.config_load import load_settings
from tests.chart_render import (
    Rendered,
    agent_container,
    cluster_apis,
    newest_supported,
    oldest_supported,
    render,
)

RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["resourceslices"],
    "verbs": ["list", "watch"],
}


def rendered(version: str, served: tuple[str, ...], **values: Any) -> Rendered:
    apis = [*cluster_apis(version), *(f"resource.k8s.io/{v}/ResourceSlice" for v in served)]
    result = render(values, kube_version=version, api_versions=apis)
    for obj in result.of_kind("ClusterRole") + result.of_kind("DaemonSet"):
        kubernetes_validate.validate(obj, version, strict=True)
    return result


def dra_state(result: Rendered) -> tuple[bool, str | None]:
    rules = result.one("ClusterRole")["rules"]
    env = {e["name"]: e.get("value") for e in agent_container(result.one("DaemonSet"))["env"]}
    return RULE in rules, env.get("DRA_RESOURCE_SLICES")


@pytest.mark.parametrize(
    ("version", "served", "values", "want"),
    [
        (newest_supported(), ("v1",), {}, (True, "true")),
        (newest_supported(), ("v1beta2", "v1beta1"), {}, (True, "true")),
        (oldest_supported(), ("v1beta1",), {}, (True, "true")),
        (newest_supported(), (), {}, (False, "false")),  # no DRA API: no grant
        (oldest_supported(), (), {"dra": {"force": True}}, (True, "true")),
        (newest_supported(), ("v1",), {"dra": {"enabled": False}}, (False, "false")),
    ],
)
def test_rule_and_setting_follow_the_served_api(
    version: str, served: tuple[str, ...], values: dict[str, Any], want: tuple[bool, str]
) -> None:
    result = rendered(version, served, **values)
    assert dra_state(result) == want
    # the value is one the agent accepts
    assert load_settings({"dra_resource_slices": want[1]}).dra_resource_slices is want[0]


def test_without_attribution_neither_rule_nor_setting() -> None:
    result = rendered(newest_supported(), ("v1",), podResources={"enabled": False})
    rules = result.one("ClusterRole")["rules"]
    env = {e["name"] for e in agent_container(result.one("DaemonSet"))["env"]}
    assert RULE not in rules and "DRA_RESOURCE_SLICES" not in env


def test_schema_refuses_unknown_dra_keys() -> None:
    # the refusal names the misspelt key where it is, not merely some schema error
    with pytest.raises(Exception, match=r"'/dra'.*'enabeld'"):
        render({"dra": {"enabeld": True}})


def test_notes_say_when_the_dra_rule_is_left_out() -> None:
    assert "no RBAC for DRA ResourceSlices" in rendered(newest_supported(), ()).notes
    assert "DRA" not in rendered(newest_supported(), ("v1",)).notes
    assert "DRA" not in rendered(newest_supported(), (), dra={"enabled": False}).notes
