"""The pod-template translation the image tests run the chart's pod with
(tests/image/podspec.py): each kubelet rule it stands for, on the chart's own render and on
hand-made templates. No container runtime needed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.chart_render import CHART, load_values, render
from tests.image.podspec import Node, Refused, Unsupported, translate


def node(tmp_path: Path) -> Node:
    root = tmp_path / "node"
    for d in ("var/lib/kubelet/pod-resources", "etc", "sys/class/dmi/id"):
        (root / d).mkdir(parents=True)
    (root / "etc/machine-id").write_text("m\n")
    (root / "sys/class/dmi/id/product_uuid").write_text("u\n")
    return Node("n1", root, 6443, b"CA", "tok", injected=("--env", "X=1"))


def template(values: dict[str, Any] | None = None) -> dict[str, Any]:
    t: dict[str, Any] = render(values or {}).one("DaemonSet")["spec"]["template"]
    return t


def run_args(tmp_path: Path, t: dict[str, Any], user: str = "65532:65532") -> list[str]:
    pod = translate(t, node(tmp_path), tmp_path / "pod", name="p", namespace="ns",
                    image_user=user, published={8080: 18080})  # fmt: skip
    return pod.containers[0].args


def test_default_chart_pod_becomes_a_hardened_run(tmp_path: Path) -> None:
    pod = translate(template(), node(tmp_path), tmp_path / "pod", name="p", namespace="ns",
                    image_user="65532:65532", published={8080: 18080})  # fmt: skip
    args = pod.containers[0].args
    assert args[args.index("--user") + 1] == "0:0"
    for flag in ("--read-only", "--read-only-tmpfs=false", "--cap-drop=all", "no-new-privileges"):
        assert flag in args
    assert "--env" in args and "NODE_NAME=n1" in args and "POD_NAMESPACE=ns" in args
    assert "KUBERNETES_SERVICE_PORT=6443" in args
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "--volume"]
    assert any(m.endswith(":/var/lib/kubelet/pod-resources:ro") for m in mounts)
    assert any(m.endswith(":/var/run/secrets/kubernetes.io/serviceaccount:ro") for m in mounts)
    sa = tmp_path / "pod" / "kube-api-access"
    assert (sa / "token").read_text() == "tok" and (sa / "namespace").read_text() == "ns"
    assert "127.0.0.1:18080:8080" in args
    assert pod.containers[0].probes["readinessProbe"].path == "/readyz"
    assert pod.containers[0].probes["readinessProbe"].port == 8080
    assert pod.grace_seconds == 30 and pod.init == []


def test_nonroot_values_run_the_chown_init_container_first(tmp_path: Path) -> None:
    values = load_values(CHART / "ci" / "nonroot-values.yaml")
    pod = translate(template(values), node(tmp_path), tmp_path / "pod", name="p",
                    namespace="ns", image_user="65532:65532")  # fmt: skip
    (init,) = pod.init
    assert "--cap-add=chown" in init.args and "--entrypoint" in init.args
    assert init.args[-2:] == ["65532:65532", "/var/lib/gpuid-agent/spool"]
    assert (tmp_path / "node/var/lib/gpuid-agent/spool").is_dir()  # DirectoryOrCreate
    assert "--group-add" in pod.containers[0].args


def test_run_as_non_root_is_verified(tmp_path: Path) -> None:
    t = template()
    t["spec"]["securityContext"]["runAsNonRoot"] = True
    with pytest.raises(Refused, match="runAsNonRoot"):
        run_args(tmp_path, t)


def test_missing_host_path_of_type_file_is_refused(tmp_path: Path) -> None:
    t = template()
    n = node(tmp_path)
    (n.root / "etc/machine-id").unlink()
    with pytest.raises(Refused, match="/etc/machine-id is not a file"):
        translate(t, n, tmp_path / "pod", name="p", namespace="ns", image_user="0")


def test_probe_on_an_unnamed_port_is_refused(tmp_path: Path) -> None:
    t = template()
    t["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "metrics"
    with pytest.raises(Refused, match="no container port named 'metrics'"):
        run_args(tmp_path, t)


def test_unknown_fields_are_not_silently_dropped(tmp_path: Path) -> None:
    for where, key in (("spec", "hostNetwork"), ("container", "lifecycle")):
        t = copy.deepcopy(template())
        target = t["spec"] if where == "spec" else t["spec"]["containers"][0]
        target[key] = True
        with pytest.raises(Unsupported, match=key):
            run_args(tmp_path / where, t)


def test_env_references_and_secrets(tmp_path: Path) -> None:
    t = template()
    env = t["spec"]["containers"][0]["env"]
    env.append({"name": "WHERE", "value": "$(NODE_NAME)/$$(NODE_NAME)"})
    assert "WHERE=n1/$(NODE_NAME)" in run_args(tmp_path / "a", t)
    env.append({"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    with pytest.raises(Refused, match="secret s/k"):
        run_args(tmp_path / "b", t)
