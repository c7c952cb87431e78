"""The own-node ValidatingAdmissionPolicy, evaluated on admission requests.

The CEL expressions come from the rendered chart and run in a CEL interpreter the way the
API server applies them: matchConditions select the request, variables are computed in
order, and every validation must be true (an evaluation error denies: failurePolicy Fail).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.chart_render import ADMISSION_POLICY, NAMESPACE, render

NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
PREFIX = "gpuid.github.com/"


@dataclass(frozen=True)
class Policy:
    match_conditions: list[tuple[str, Any]]
    variables: list[tuple[str, Any]]
    validations: list[tuple[str, Any]]
    failure_policy: str


def _program(env: celpy.Environment, expression: str) -> Any:
    return env.program(env.compile(expression))


@cache
def policy() -> Policy:
    result = render(
        {"nodeLabels": {"prefix": PREFIX.rstrip("/")}},
        kube_version="1.31.0",
        api_versions=[ADMISSION_POLICY],
    )
    spec = result.one("ValidatingAdmissionPolicy")["spec"]
    env = celpy.Environment()
    return Policy(
        match_conditions=[
            (m["name"], _program(env, m["expression"])) for m in spec["matchConditions"]
        ],
        variables=[(v["name"], _program(env, v["expression"])) for v in spec["variables"]],
        validations=[
            (v.get("message") or v["messageExpression"], _program(env, v["expression"]))
            for v in spec["validations"]
        ],
        failure_policy=spec["failurePolicy"],
    )


def admit(
    new: dict[str, Any],
    old: dict[str, Any],
    *,
    node_name: str | None,
    username: str = f"system:serviceaccount:{NAMESPACE}:gpuid-gpuid-agent",
    sub_resource: str = "",
) -> list[str]:
    """The messages of the validations that deny the request ([] means admitted)."""
    extra = {NODE_NAME_KEY: [node_name]} if node_name is not None else {}
    request: dict[str, Any] = {
        "operation": "UPDATE",
        "userInfo": {"username": username, "extra": extra},
    }
    if sub_resource:  # the API server leaves the key out when there is no subresource
        request["subResource"] = sub_resource
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
    }
    rendered = policy()
    assert rendered.failure_policy == "Fail"
    for _, condition in rendered.match_conditions:
        if not condition.evaluate(activation):
            return []
    variables: dict[str, Any] = {}
    for name, program in rendered.variables:  # each may use the ones before it
        activation["variables"] = variables_map(variables)
        variables[name] = program.evaluate(activation)
    activation["variables"] = variables_map(variables)
    denied = []
    for message, program in rendered.validations:
        try:
            ok = program.evaluate(activation)
        except celpy.CELEvalError as exc:
            denied.append(f"{message} (evaluation error: {exc})")
            continue
        if not bool(ok):
            denied.append(message)
    return denied


def variables_map(values: dict[str, Any]) -> Any:
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


def node(name: str = "gpu-1", labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"providerID": "aws:///us-east-1a/i-0abc", "podCIDR": "10.0.0.0/24"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "MemoryPressure", "status": "False"},
            ]
        },
    }
    obj.update(extra)
    return obj


def changed(base: dict[str, Any], edit: Any) -> dict[str, Any]:
    new = copy.deepcopy(base)
    edit(new)
    return new


OLD = node(labels={f"{PREFIX}chassis": "old", "team": "ml"})


def test_own_node_prefixed_labels_and_annotations_are_admitted() -> None:
    def edit(n: dict[str, Any]) -> None:
        n["metadata"]["labels"][f"{PREFIX}chassis"] = "1652823010291"
        n["metadata"]["labels"][f"{PREFIX}gpu-0"] = "1652823010292"
        n["metadata"]["annotations"][f"{PREFIX}detail"] = '{"gpus": 4}'

    assert admit(changed(OLD, edit), OLD, node_name="gpu-1") == []
    removed = changed(OLD, lambda n: n["metadata"]["labels"].pop(f"{PREFIX}chassis"))
    assert admit(removed, OLD, node_name="gpu-1") == []


def test_another_node_is_refused() -> None:
    other = node("gpu-2", labels={"team": "ml"})
    new = changed(other, lambda n: n["metadata"]["labels"].update({f"{PREFIX}chassis": "x"}))
    (reason,) = admit(new, other, node_name="gpu-1")
    assert "may only modify its own Node" in reason


def test_a_token_without_node_name_is_refused() -> None:
    new = changed(OLD, lambda n: n["metadata"]["labels"].update({f"{PREFIX}chassis": "x"}))
    (reason,) = admit(new, OLD, node_name=None)
    assert "token carries no node name" in reason


def _label(key: str, value: str = "1") -> Any:
    return lambda n: n["metadata"]["labels"].update({key: value})


FORBIDDEN_EDITS = {
    "add foreign label": _label("node-role.kubernetes.io/gpu", ""),
    "change foreign label": _label("team", "infra"),
    "remove foreign label": lambda n: n["metadata"]["labels"].pop("team"),
    "look-alike prefix": _label("gpuid.github.com.evil/x"),
    "prefix without slash": _label("gpuid.github.comx"),
    "prefix inside another domain": _label("evil-gpuid.github.com/x"),
    "subdomain of the prefix": _label("sub.gpuid.github.com/x"),
    "foreign annotation": lambda n: n["metadata"]["annotations"].update({"ttl": "1"}),
    "drop all annotations": lambda n: n["metadata"].pop("annotations"),
    "spec change": lambda n: n["spec"].update({"unschedulable": True}),
    "taint": lambda n: n["spec"].update({"taints": [{"key": "k", "effect": "NoSchedule"}]}),
}


@pytest.mark.parametrize("edit", FORBIDDEN_EDITS.values(), ids=FORBIDDEN_EDITS.keys())
def test_own_node_changes_outside_the_prefix_are_refused(edit: Any) -> None:
    denied = admit(changed(OLD, edit), OLD, node_name="gpu-1")
    # Refused by a validation that says why, not by an expression that failed to evaluate
    # (failurePolicy Fail refuses then too, with CEL's error instead of the policy's words).
    assert denied and not [d for d in denied if "evaluation error" in d], denied


def test_status_may_add_own_conditions_but_not_touch_the_kubelets() -> None:
    def own(n: dict[str, Any]) -> None:
        n["status"]["conditions"].append({"type": "GpuidGpuHealthy", "status": "False"})

    assert admit(changed(OLD, own), OLD, node_name="gpu-1", sub_resource="status") == []

    def ready(n: dict[str, Any]) -> None:
        n["status"]["conditions"][0]["status"] = "False"

    (reason,) = admit(changed(OLD, ready), OLD, node_name="gpu-1", sub_resource="status")
    assert "kubelet's Node conditions" in reason
    other = node("gpu-2")
    assert admit(changed(other, own), other, node_name="gpu-1", sub_resource="status")


def test_other_users_are_not_this_policys_business() -> None:
    new = changed(OLD, _label("team", "infra"))
    assert admit(new, OLD, node_name=None, username="system:node:gpu-1") == []
    assert admit(new, OLD, node_name=None, username="system:serviceaccount:x:gpuid") == []


_key_part = st.text("abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=12)
_labels = st.dictionaries(
    st.one_of(
        _key_part.map(lambda k: PREFIX + k),
        _key_part,
        _key_part.map(lambda k: f"x.io/{k}"),
        _key_part.map(lambda k: f"{k}{PREFIX}{k}"),
    ),
    st.text("abc123", max_size=4),
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(before=_labels, after=_labels)
def test_admitted_exactly_when_only_prefixed_labels_change(
    before: dict[str, str], after: dict[str, str]
) -> None:
    old = node(labels=before)
    new = node(labels=after)
    foreign = {
        k
        for k in set(old["metadata"]["labels"]) | set(new["metadata"]["labels"])
        if not k.startswith(PREFIX)
        and old["metadata"]["labels"].get(k) != new["metadata"]["labels"].get(k)
    }
    denied = admit(new, old, node_name="gpu-1")
    assert bool(denied) == bool(foreign), (foreign, denied)
