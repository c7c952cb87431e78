"""The Helm chart: strict lint, rendering of every ci/*-values.yaml, strict schema validation
for the oldest and newest supported Kubernetes, and what the manifests must guarantee (RBAC,
securityContext, mounts, probes, env that the agent accepts, secrets by reference only)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

import gpuid_agent
from gpuid_agent.runtime.config import Settings, env_name
from gpuid_agent.runtime.config_load import load_settings
from tests.chart_render import (
    ADMISSION_POLICY,
    CHART,
    CI_VALUES,
    NAMESPACE,
    POD_MONITOR,
    POLICY_MIN_VERSION,
    PROMETHEUS_OPERATOR,
    PROMETHEUS_RULE,
    SERVICE_MONITOR,
    Rendered,
    agent_container,
    cluster_apis,
    containers,
    load_values,
    newest_supported,
    oldest_supported,
    render,
    versions,
)
from tests.servers.tls import make_ca_and_server

VERSIONS = versions()


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# Plus the first release that serves the own-node policy's API.
POLICY_FIRST = "{}.{}.0".format(*POLICY_MIN_VERSION)
CASES = [
    (path, version) for path in CI_VALUES for version in sorted({*VERSIONS, POLICY_FIRST}, key=_key)
]


def _case_id(case: tuple[Any, str]) -> str:
    return f"{case[0].name.removesuffix('-values.yaml')}@{case[1]}"


def _needs_newer(values: dict[str, Any], version: str) -> bool:
    """A forced own-node policy on a cluster older than 1.30 must be refused at render."""
    policy = values.get("ownNodePolicy", {})
    major, minor = (int(x) for x in version.split(".")[:2])
    return bool(policy.get("force")) and policy.get("enabled", True) and (major, minor) < (1, 30)


@cache
def rendered(path_name: str, version: str) -> Rendered:
    return render(
        load_values(CHART / "ci" / path_name),
        kube_version=version,
        api_versions=cluster_apis(version),
    )


def renderable_cases() -> Iterator[tuple[str, Rendered]]:
    for path, version in CASES:
        if not _needs_newer(load_values(path), version):
            yield f"{path.name}@{version}", rendered(path.name, version)


# ---- lint -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_chart_lints_strictly_with_every_ci_values_file(version: str) -> None:
    for path in [None, *CI_VALUES]:
        values = load_values(path) if path else None
        if path and _needs_newer(load_values(path), version):
            continue
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, f"{path.name if path else 'defaults'} @ {version}: {problems}"


def test_rendering_refuses_kubernetes_older_than_the_supported_range() -> None:
    major, minor, _ = oldest_supported().split(".")
    with pytest.raises(helm.HelmRenderError, match=r"gpuid-agent needs Kubernetes >=1\.28"):
        render({}, kube_version=f"{major}.{int(minor) - 1}.9")
    assert render({}, kube_version=oldest_supported()).of_kind("DaemonSet")


# ---- strict validation of every rendered object ----------------------------------------------


def _dropped_fields(given: Any, kept: Any, path: str = "") -> list[str]:
    """Fields of `given` that a model round trip lost: unknown to the schema."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        lost = []
        for key, value in given.items():
            if key not in kept:
                lost.append(f"{path}.{key}")
            else:
                lost += _dropped_fields(value, kept[key], f"{path}.{key}")
        return lost
    if isinstance(given, list):
        if not isinstance(kept, list) or len(given) != len(kept):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(given, kept, strict=True))
            for p in _dropped_fields(a, b, f"{path}[{i}]")
        ]
    return []


def validate_custom_resource(obj: dict[str, Any]) -> None:
    """prometheus-operator kinds, which kubernetes-validate has no schema for: validate with
    models generated from the operator's CRD schemas, strictly (an unknown field fails)."""
    from cloudcoil.models.prometheus_operator import v1 as monitoring_v1

    assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["apiVersion"]
    model = getattr(monitoring_v1, obj["kind"]).model_validate(obj)
    kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    lost = _dropped_fields(obj, kept)
    assert not lost, f"{obj['kind']}: fields unknown to the CRD schema: {lost}"


def validate_object(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            raise AssertionError(
                f"{obj['kind']} {obj['apiVersion']} is not served by Kubernetes {version}"
            ) from None
        validate_custom_resource(obj)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise AssertionError(
            f"{obj['kind']}/{obj['metadata']['name']} invalid for {version} at {where}: "
            f"{exc.message}"
        ) from None


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Iterator[None]:
    """kubernetes-validate re-reads its multi-megabyte definitions for every object; reading
    each schema file once keeps this module fast without changing what is validated."""
    with pytest.MonkeyPatch.context() as patch:
        utils = kubernetes_validate.utils
        patch.setattr(utils, "schema_contents", cache(utils.schema_contents))
        yield


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_rendered_object_validates_strictly(case: tuple[Any, str]) -> None:
    path, version = case
    values = load_values(path)
    if _needs_newer(values, version):
        with pytest.raises(helm.HelmError, match=r"ownNodePolicy.force needs Kubernetes 1\.30"):
            render(values, kube_version=version, api_versions=cluster_apis(version))
        return
    result = rendered(path.name, version)
    assert result.of_kind("DaemonSet"), "no DaemonSet rendered"
    for obj in result.objects:
        validate_object(obj, version)
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding"} and not obj["kind"].startswith(
            "ValidatingAdmissionPolicy"
        ):
            # Node events go to `default`, as the kubelet's do: the events Role is there
            events = obj["kind"] in {"Role", "RoleBinding"} and obj["metadata"]["name"].endswith(
                "-events"
            )
            wanted = "default" if events else NAMESPACE
            assert obj["metadata"]["namespace"] == wanted, obj["kind"]


def test_strict_validation_catches_a_misspelt_field() -> None:
    daemonset = rendered("default-values.yaml", newest_supported()).one("DaemonSet")
    broken = yaml.safe_load(yaml.safe_dump(daemonset))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(AssertionError, match="readinessprobe"):
        validate_object(broken, newest_supported())
    monitor = rendered("monitoring-values.yaml", newest_supported()).one("ServiceMonitor")
    broken = yaml.safe_load(yaml.safe_dump(monitor))
    broken["spec"]["endpoints"][0]["scrapeInterval"] = "30s"
    with pytest.raises(AssertionError, match="scrapeInterval"):
        validate_object(broken, newest_supported())


# ---- RBAC -------------------------------------------------------------------------------------

ALLOWED_RULES = {
    ("", "nodes"): {"get", "patch"},
    ("", "nodes/status"): {"patch"},
    ("", "pods"): {"list", "watch"},
    ("apps", "replicasets"): {"get"},
    ("batch", "jobs"): {"get"},
    ("resource.k8s.io", "resourceslices"): {"list", "watch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}


def _grants(result: Rendered) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for role in result.of_kind("ClusterRole") + result.of_kind("Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def test_rbac_grants_nothing_beyond_what_the_agent_uses() -> None:
    for name, result in renderable_cases():
        for (group, resource), verbs in _grants(result).items():
            allowed = ALLOWED_RULES.get((group, resource))
            assert allowed is not None, f"{name}: {group or 'core'}/{resource} is not needed"
            assert verbs <= allowed, f"{name}: {resource} verbs {verbs - allowed} not needed"
            assert "*" not in verbs
            assert "*" not in (group, resource)


def test_default_rbac_is_exactly_the_documented_list() -> None:
    grants = _grants(rendered("default-values.yaml", newest_supported()))
    # (no resource.k8s.io in this discovery: tests/test_chart_dra.py covers the DRA rule)
    unused = {("", "nodes/status"), ("resource.k8s.io", "resourceslices")}
    assert grants == {k: v for k, v in ALLOWED_RULES.items() if k not in unused}
    health = _grants(rendered("own-node-policy-values.yaml", newest_supported()))
    assert health[("", "nodes/status")] == {"patch"}
    dry_run = _grants(rendered("nonroot-values.yaml", newest_supported()))
    assert dry_run == {("", "nodes"): {"get"}}, "dry-run labels, no attribution, no events"


def test_events_are_granted_in_the_default_namespace_only() -> None:
    result = rendered("default-values.yaml", newest_supported())
    [role] = result.of_kind("Role")
    [binding] = result.of_kind("RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "default"
    assert role["rules"] == [
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = result.one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert not any(
        "events.k8s.io" in rule["apiGroups"] for rule in result.one("ClusterRole")["rules"]
    )
    env = _env(agent_container(result.one("DaemonSet")))
    assert env["NODE_EVENTS"]["value"] == "true"
    off = render({"health": {"nodeEvents": False}}, kube_version=newest_supported())
    assert not off.of_kind("Role") and not off.of_kind("RoleBinding")
    assert _env(agent_container(off.one("DaemonSet")))["NODE_EVENTS"]["value"] == "false"


def test_role_is_bound_to_the_agent_service_account() -> None:
    for name, result in renderable_cases():
        account = result.one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
        binding = result.one("ClusterRoleBinding")
        assert binding["roleRef"]["name"] == result.one("ClusterRole")["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        ], name
        assert result.one("ServiceAccount")["metadata"]["name"] == account


# ---- pod hardening, mounts, probes ------------------------------------------------------------


def test_every_container_is_hardened() -> None:
    for name, result in renderable_cases():
        daemonset = result.one("DaemonSet")
        pod = daemonset["spec"]["template"]["spec"]
        assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(key), f"{name}: {key}"
        values = load_values(CHART / "ci" / name.split("@")[0])
        kernel_log = values.get("kernelLog", {}).get("enabled", False)
        for container in containers(daemonset):
            ctx = container["securityContext"]
            # reading /dev/kmsg is the one opt-in that needs a privileged agent
            privileged = kernel_log and container["name"] == "agent"
            assert ctx["allowPrivilegeEscalation"] is privileged, name
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            assert bool(ctx.get("privileged")) is privileged, name
            added = ctx["capabilities"].get("add", [])
            if container["name"] == "agent":
                assert not added, f"{name}: the agent needs no capability"
                assert container["resources"]["requests"]
                assert container["resources"]["limits"]
            else:
                assert (container["name"], added) == ("spool-owner", ["CHOWN"]), name


def test_root_only_where_values_ask_for_it() -> None:
    for name, result in renderable_cases():
        values = load_values(CHART / "ci" / name.split("@")[0])
        user = values.get("podSecurity", {}).get("runAsUser", 0)
        ctx = result.one("DaemonSet")["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsUser"] == user, name
        assert ctx["runAsNonRoot"] is (user != 0), name
    nonroot = rendered("nonroot-values.yaml", newest_supported()).one("DaemonSet")
    init = nonroot["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["chown", "65532:65532", "/var/lib/gpuid-agent/spool"]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names = [e["name"] for e in container["env"]]
    duplicated = {n for n in names if names.count(n) > 1}
    assert not duplicated, f"env set twice: {duplicated}"
    return {e["name"]: e for e in container["env"]}


def _mounts(daemonset: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """hostPath volume name → (volume, agent mount)."""
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in agent_container(daemonset)["volumeMounts"]}
    return {name: (v, mounts[name]) for name, v in volumes.items() if "hostPath" in v}


HOST_PATHS = {
    # volume: (hostPath type, read-only, env naming a path inside it)
    "pod-resources": ("Directory", True, "POD_RESOURCES_SOCKET"),
    "dmi-product-uuid": ("File", True, "DMI_PRODUCT_UUID_PATH"),
    "machine-id": ("File", True, "MACHINE_ID_PATH"),
    "driver-root": ("Directory", True, "NVML_LIBRARY_PATH"),
    "host-proc": ("Directory", True, "HOST_PROC"),
    "kmsg": ("CharDevice", True, "KERNEL_LOG"),
    "spool": ("DirectoryOrCreate", False, "SPOOL_DIR"),
}


def test_host_paths_have_explicit_types_and_only_the_spool_is_writable() -> None:
    seen: set[str] = set()
    for name, result in renderable_cases():
        daemonset = result.one("DaemonSet")
        env = _env(agent_container(daemonset))
        for volume, (spec, mount) in _mounts(daemonset).items():
            assert volume in HOST_PATHS, f"{name}: unexpected hostPath {volume}"
            kind, read_only, variable = HOST_PATHS[volume]
            assert spec["hostPath"]["type"] == kind, f"{name}: {volume}"
            assert bool(mount.get("readOnly")) is read_only, f"{name}: {volume}"
            if variable in env:
                assert env[variable]["value"].startswith(mount["mountPath"]), f"{name}: {volume}"
            if volume == "spool":  # the allocation state survives restarts beside the spool
                assert env["STATE_DIR"]["value"].startswith(mount["mountPath"]), name
            seen.add(volume)
    assert seen == set(HOST_PATHS), "ci values must cover every host mount"
    default = rendered("default-values.yaml", newest_supported()).one("DaemonSet")
    assert set(_mounts(default)) == {"pod-resources", "dmi-product-uuid", "machine-id"}
    socket = _env(agent_container(default))["POD_RESOURCES_SOCKET"]["value"]
    assert socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert _env(agent_container(default))["PROCESS_ATTRIBUTION"]["value"] == "false"


def test_process_attribution_mounts_the_host_proc_read_only_without_host_pid() -> None:
    daemonset = rendered("process-attribution-values.yaml", newest_supported()).one("DaemonSet")
    agent = agent_container(daemonset)
    env = _env(agent)
    volume, mount = _mounts(daemonset)["host-proc"]
    assert volume["hostPath"] == {"path": "/proc", "type": "Directory"}
    assert mount["readOnly"] is True and mount["mountPath"] == env["HOST_PROC"]["value"]
    assert env["PROCESS_ATTRIBUTION"]["value"] == "true"
    assert not daemonset["spec"]["template"]["spec"].get("hostPID")


def test_kernel_log_is_opt_in_and_mounts_the_device_read_only() -> None:
    default = agent_container(rendered("default-values.yaml", newest_supported()).one("DaemonSet"))
    assert "KERNEL_LOG" not in _env(default)
    daemonset = rendered("kernel-log-values.yaml", newest_supported()).one("DaemonSet")
    env = _env(agent_container(daemonset))
    volume, mount = _mounts(daemonset)["kmsg"]
    assert volume["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert mount["readOnly"] is True and mount["mountPath"] == env["KERNEL_LOG"]["value"]


def test_probes_hit_healthz_and_readyz_on_the_agent_port() -> None:
    for name, result in renderable_cases():
        agent = agent_container(result.one("DaemonSet"))
        (port,) = agent["ports"]
        assert port["name"] == "http"
        assert str(port["containerPort"]) == _env(agent)["SERVER_PORT"]["value"], name
        assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        service = result.one("Service")
        assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_gpu_node_selection_and_taint_tolerations_by_default() -> None:
    pod = rendered("default-values.yaml", newest_supported()).one("DaemonSet")["spec"]["template"]
    spec = pod["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert "nvidia.com/gpu" not in str(
        agent_container(rendered("default-values.yaml", newest_supported()).one("DaemonSet"))[
            "resources"
        ]
    ), "the agent must not take a GPU from workloads"
    operator = rendered("gpu-operator-values.yaml", newest_supported()).one("DaemonSet")
    spec = operator["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == "system-node-critical"
    assert "nodeAffinity" not in spec["affinity"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.deploy.operands": "true"}
    image = agent_container(operator)["image"]
    assert image.endswith("@sha256:" + "0123456789abcdef" * 4)


def test_own_node_affinity_conflict_is_a_clear_error() -> None:
    values = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "a", "operator": "Exists"}]}
                    ]
                }
            }
        }
    }
    with pytest.raises(helm.HelmError, match=r"gpuNodeAffinity\.enabled=false"):
        render(values)


# ---- environment: downward API, settings the agent accepts, secrets by reference --------------

NON_SETTINGS_ENV = {
    "NVIDIA_VISIBLE_DEVICES",  # read by the NVIDIA container runtime
    "NVIDIA_DRIVER_CAPABILITIES",
    "AWS_ACCESS_KEY_ID",  # read by botocore
    "AWS_SECRET_ACCESS_KEY",
}
SETTING_ENV = {env_name(f) for f in Settings.model_fields}


def test_env_names_are_agent_settings() -> None:
    for name, result in renderable_cases():
        values = load_values(CHART / "ci" / name.split("@")[0])
        extra = {e["name"] for e in values.get("extraEnv", [])}
        env = _env(agent_container(result.one("DaemonSet")))
        unknown = set(env) - SETTING_ENV - NON_SETTINGS_ENV - extra
        assert not unknown, f"{name}: the agent has no setting {sorted(unknown)}"
        for variable, path in (
            ("NODE_NAME", "spec.nodeName"),
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
        ):
            assert env[variable]["valueFrom"] == {"fieldRef": {"fieldPath": path}}, name


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for variable in SETTING_ENV | NON_SETTINGS_ENV:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.mark.parametrize("path", CI_VALUES, ids=lambda p: p.name)
def test_rendered_env_is_accepted_by_the_agent(
    path: Any, clean_environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = rendered(path.name, newest_supported())
    container = agent_container(result.one("DaemonSet"))
    env = _env(container)
    mounted = [m["mountPath"] for m in container.get("volumeMounts", [])]
    ca_file, _ = make_ca_and_server(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    # the agent reads these files at start: each must lie in a volume the chart mounts; the
    # test stands in for the mounted Secret/ConfigMap with files of the same kind
    stand_ins = {"HTTP_AUTH_TOKEN_FILE": token_file, "HTTP_CA_BUNDLE": ca_file}
    for variable, entry in env.items():
        if variable in stand_ins and "value" in entry:
            assert any(entry["value"].startswith(m.rstrip("/") + "/") for m in mounted), variable
            clean_environ.setenv(variable, str(stand_ins[variable]))
        elif "value" in entry:
            clean_environ.setenv(variable, entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            clean_environ.setenv(variable, "from-downward-api")
    settings = load_settings()  # raises ConfigError naming each variable it rejects
    values = load_values(path)
    types = values.get("exporters", {}).get("types", ["stdout"])
    assert settings.exporter_type == types
    assert settings.server_port == values.get("agent", {}).get("port", 8080)
    for key, value in values.get("settings", {}).items():
        assert os.environ[key] == str(value)


def test_credentials_reach_the_pod_only_through_secret_references() -> None:
    secretish = re.compile(r"PASSWORD|SECRET|TOKEN(?!_FILE)|ACCESS_KEY|HEADERS")
    covered: set[str] = set()
    for name, result in renderable_cases():
        daemonset = result.one("DaemonSet")
        for entry in agent_container(daemonset)["env"]:
            if secretish.search(entry["name"]):
                assert "value" not in entry, f"{name}: {entry['name']} given in plain text"
                assert "secretKeyRef" in entry["valueFrom"], name
                covered.add(entry["name"])
        token = _env(agent_container(daemonset)).get("HTTP_AUTH_TOKEN_FILE")
        if token:
            volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
            assert volumes["http-auth-token"]["secret"]["secretName"] == "gpuid-http-token"
            covered.add("HTTP_AUTH_TOKEN_FILE")
        assert result.of_kind("Secret") == [], "the chart creates no Secret"
    assert covered == {
        "POSTGRES_PASSWORD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "HTTP_AUTH_TOKEN_FILE",
        "OTEL_EXPORTER_OTLP_HEADERS",
    }


# ---- values.schema.json -----------------------------------------------------------------------

BAD_VALUES = [
    ({"exporters": {"types": ["kafka"]}}, "exporters/types/0"),
    ({"exporters": {"types": []}}, "exporters/types"),
    ({"exporters": {"types": ["http"]}}, "exporters/http/endpoint"),
    ({"exporters": {"types": ["postgres"]}}, "exporters/postgres/host"),
    ({"exporters": {"types": ["s3"]}}, "exporters/s3/bucket"),
    ({"exporters": {"types": ["otlp"]}}, "exporters/otlp"),
    ({"exporters": {"otlp": {"metrics": {"enabled": True}}}}, "exporters/otlp"),
    ({"exporters": {"otlp": {"headers": "api-key=abc"}}}, "exporters/otlp/headers"),
    ({"settings": {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc"}}, "settings"),
    ({"exporters": {"postgres": {"password": "hunter2"}}}, "exporters/postgres/password"),
    ({"exporters": {"http": {"authToken": "abc"}}}, "exporters/http/authToken"),
    ({"settings": {"POSTGRES_PASSWORD": "hunter2"}}, "settings"),
    ({"settings": {"log-level": "debug"}}, "settings"),
    ({"nodeLabels": {"mode": True}}, "nodeLabels/mode"),  # a bare `on` in YAML
    ({"nodeLabels": {"prefix": "Not A Prefix"}}, "nodeLabels/prefix"),
    ({"agent": {"collectInterval": "10 seconds"}}, "agent/collectInterval"),
    ({"agent": {"port": "8080"}}, "agent/port"),
    ({"agent": {"port": 70000}}, "agent/port"),
    ({"agent": {"metricsNaming": "otel"}}, "agent/metricsNaming"),
    ({"image": {"digest": "latest"}}, "image/digest"),
    ({"exporters": {"postgres": {"table": "readings; drop table x"}}}, "exporters/postgres/table"),
    ({"podSecurity": {"runAsUser": -1}}, "podSecurity/runAsUser"),
    ({"ownNodePolicy": {"validationActions": ["Deny", "Warn"]}}, "ownNodePolicy/validationActions"),
    ({"updateStrategy": {"type": "OnDelete"}}, "updateStrategy/type"),
    ({"sevrice": {"port": 80}}, "sevrice"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_key(values: dict[str, Any], where: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    message = str(caught.value)
    assert where in message, message
    with pytest.raises(helm.HelmError):
        render(values)


def test_schema_accepts_defaults_and_every_ci_file() -> None:
    # a chart without a schema passes anything: make sure this one is really checked
    assert (CHART / "values.schema.json").is_file()
    assert CI_VALUES, "no ci/*-values.yaml files found"
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({})  # raises HelmValuesError naming the key if refused
        for path in CI_VALUES:
            chart.validate_schema(load_values(path))


# ---- Capabilities: CRD-backed and version-gated objects ---------------------------------------


def test_monitoring_objects_follow_the_crds_the_cluster_serves() -> None:
    newest = newest_supported()
    bare = render({}, kube_version=newest)
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"}.isdisjoint(bare.kinds())
    assert "no ServiceMonitor was rendered" in bare.notes
    operator = render({}, kube_version=newest, api_versions=PROMETHEUS_OPERATOR)
    assert {"ServiceMonitor", "PrometheusRule"} <= operator.kinds()
    assert "PodMonitor" not in operator.kinds()
    only_rules = render({}, kube_version=newest, api_versions=[PROMETHEUS_RULE])
    assert "ServiceMonitor" not in only_rules.kinds()
    assert "PrometheusRule" in only_rules.kinds()
    pods = render(
        load_values(CHART / "ci" / "podmonitor-values.yaml"),
        kube_version=newest,
        api_versions=[POD_MONITOR],
    )
    monitor = pods.one("PodMonitor")
    paths = [e["path"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert paths == ["/metrics", "/gpu/metrics"]
    assert "ServiceMonitor" not in pods.kinds()
    off = render(
        {
            "monitoring": {
                "serviceMonitor": {"enabled": False},
                "prometheusRule": {"enabled": False},
            }
        },
        kube_version=newest,
        api_versions=PROMETHEUS_OPERATOR,
    )
    assert {"ServiceMonitor", "PrometheusRule"}.isdisjoint(off.kinds())
    forced = render(load_values(CHART / "ci" / "monitoring-values.yaml"), kube_version=newest)
    endpoints = forced.one("ServiceMonitor")["spec"]["endpoints"]
    assert [e["path"] for e in endpoints] == ["/metrics", "/gpu/metrics"]
    assert all(e["port"] == "http" for e in endpoints)
    assert SERVICE_MONITOR in PROMETHEUS_OPERATOR


def test_own_node_policy_needs_the_api_and_kubernetes_1_30() -> None:
    policy_kinds = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert (
        policy_kinds <= render({}, kube_version="1.30.0", api_versions=[ADMISSION_POLICY]).kinds()
    )
    assert policy_kinds.isdisjoint(render({}, kube_version="1.30.0").kinds()), "API not served"
    assert policy_kinds.isdisjoint(
        render({}, kube_version="1.29.5", api_versions=[ADMISSION_POLICY]).kinds()
    ), "before 1.30 tokens carry no node name by default"
    disabled = render(
        {"ownNodePolicy": {"enabled": False}},
        kube_version="1.33.0",
        api_versions=[ADMISSION_POLICY],
    )
    assert policy_kinds.isdisjoint(disabled.kinds())
    assert "own-node admission policy was not rendered" in render({}, kube_version="1.29.0").notes
    forced = render({"ownNodePolicy": {"force": True}}, kube_version="1.31.0")
    binding = forced.one("ValidatingAdmissionPolicyBinding")
    assert (
        binding["spec"]["policyName"] == forced.one("ValidatingAdmissionPolicy")["metadata"]["name"]
    )
    assert binding["spec"]["validationActions"] == ["Deny"]


# ---- the rest of the chart --------------------------------------------------------------------


def test_notes_give_curl_lines_for_the_endpoints() -> None:
    notes = rendered("settings-values.yaml", newest_supported()).notes
    for path in ("/healthz", "/readyz", "/metrics", "/gpu/metrics", "/status"):
        assert re.search(rf"curl -s localhost:9400{re.escape(path)}\s", notes), path


def test_dashboard_config_map_carries_the_sidecar_label_and_valid_json() -> None:
    import json

    result = rendered("monitoring-values.yaml", newest_supported())
    (config_map,) = [c for c in result.of_kind("ConfigMap") if "dashboard" in c["metadata"]["name"]]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["gpuid-agent.json"])
    assert dashboard["uid"] == "gpuid-agent"
    assert dashboard["panels"]


def test_network_policy_opens_only_the_agent_port() -> None:
    policy = rendered("networkpolicy-values.yaml", newest_supported()).one("NetworkPolicy")
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "NetworkPolicy" not in rendered("default-values.yaml", newest_supported()).kinds()


def test_chart_app_version_is_the_agent_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == gpuid_agent.__version__


_CI_OPTIONS = (
    "spool",
    "networkPolicy",
    "podMonitor",
    "dashboard",
    "ownNodePolicy",
    "runtimeClassName",
    "priorityClassName",
    "driverRoot",
    "runAsUser",
    "settings",
    "extraEnv",
    "nodeConditions",
    "nodeEvents",
    "metricsNaming",
    "digest",
)


def test_ci_values_cover_every_exporter_and_option() -> None:
    covered: set[str] = set()
    for path in CI_VALUES:
        values = load_values(path)
        covered |= {f"exporter:{t}" for t in values.get("exporters", {}).get("types", [])}
        flat = yaml.safe_dump(values)
        covered |= {o for o in _CI_OPTIONS if re.search(rf"^\s*{o}:", flat, re.M)}
    expected = {f"exporter:{e}" for e in ("stdout", "http", "postgres", "s3", "otlp")}
    expected |= set(_CI_OPTIONS)
    assert expected <= covered, expected - covered
