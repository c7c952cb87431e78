"""Desired labels from an inventory: gpuid's layout, counts, and label-value sanitising."""

from __future__ import annotations

import json
import random
import re
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import GpuIdentity, NodeInventory, PlatformInfo
from gpuid_agent.node.labels.layout import (
    desired_labels,
    desired_state,
    detail_annotation,
    is_own_label,
)
from gpuid_agent.node.labels.reconciler import LabelledNode, plan_patch
from gpuid_agent.node.labels.values import is_valid_label_value, label_value
from gpuid_agent.state.inventory import build_inventory
from tests.fakekube.resources import validate_metadata

P = "gpuid.github.com"
K8S_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def gpu(
    index: int, serial: str | None, chassis: str | None = None, module: int | None = None
) -> GpuIdentity:
    platform = (
        PlatformInfo(
            chassis_serial=chassis,
            slot_number=3,
            tray_index=1,
            host_id=1,
            peer_type=0,
            module_id=module if module is not None else index + 1,
        )
        if chassis is not None
        else None
    )
    return GpuIdentity(
        index=index, uuid=f"GPU-{index:08d}", serial=serial, module_id=module, platform=platform
    )


def inventory(*gpus: GpuIdentity, machine: str = "i-0abc") -> NodeInventory:
    return build_inventory(
        gpus,
        node="n1",
        cluster="c",
        machine=machine,
        machine_source="provider_id:aws",
        driver_version="570.1",
        cuda_driver_version=None,
        read_time=datetime(2025, 1, 1, tzinfo=UTC),
    )


def h100() -> NodeInventory:
    serials = ["1652823054567", "1652823054001", "1652823054999", "1652823054123",
               "1652823054777", "1652823054333", "1652823054555", "1652823054888"]  # fmt: skip
    return inventory(*(gpu(i, s) for i, s in enumerate(serials)))


def gb200(chassis: str = "1821325191357") -> NodeInventory:
    # two superchips: both dies of each report the same serial
    return inventory(
        gpu(0, "1330824060087", chassis, 1),
        gpu(1, "1330824060087", chassis, 2),
        gpu(2, "1330824060012", chassis, 3),
        gpu(3, "1330824060012", chassis, 4),
    )


def test_h100_eight_serials_no_chassis() -> None:
    labels, rewritten = desired_labels(h100(), P)
    ordered = sorted(g.serial or "" for g in h100().gpus)
    assert labels == {
        **{f"{P}/gpu-{j}": s for j, s in enumerate(ordered)},
        f"{P}/gpu-count": "8",
    }  # gpuid sets no chassis-count without a chassis
    assert rewritten == []


def test_gb200_dual_die_serials_collapse_under_one_chassis() -> None:
    labels, _ = desired_labels(gb200(), P)
    assert labels == {
        f"{P}/chassis": "1821325191357",
        f"{P}/gpu-0": "1330824060012",
        f"{P}/gpu-1": "1330824060087",
        f"{P}/gpu-count": "4",
        f"{P}/chassis-count": "1",
    }


def test_two_chassis_use_indexed_keys() -> None:
    inv = inventory(
        gpu(0, "S-B2", "CH-B"),
        gpu(1, "S-A1", "CH-A"),
        gpu(2, "S-B1", "CH-B"),
        gpu(3, "S-A1", "CH-A"),
    )
    labels, _ = desired_labels(inv, P)
    assert labels == {
        f"{P}/chassis-0": "CH-A",
        f"{P}/chassis-0-gpu-0": "S-A1",
        f"{P}/chassis-1": "CH-B",
        f"{P}/chassis-1-gpu-0": "S-B1",
        f"{P}/chassis-1-gpu-1": "S-B2",
        f"{P}/gpu-count": "4",
        f"{P}/chassis-count": "2",
    }


def test_chassis_and_chassisless_gpus_do_not_collide() -> None:
    labels, _ = desired_labels(inventory(gpu(0, "S1", "CH"), gpu(1, "S2")), P)
    assert labels[f"{P}/chassis-0"] == "CH"
    assert labels[f"{P}/chassis-0-gpu-0"] == "S1"
    assert labels[f"{P}/gpu-0"] == "S2"
    assert f"{P}/chassis" not in labels


def test_gpus_without_serial_are_counted_not_labelled() -> None:
    labels, _ = desired_labels(inventory(gpu(0, None), gpu(1, "S1")), P)
    assert labels == {f"{P}/gpu-0": "S1", f"{P}/gpu-count": "2"}


def test_no_gpus_no_labels_no_annotation() -> None:
    state = desired_state(inventory(), P, annotation=True)
    assert dict(state.labels) == {}
    assert state.annotation is None


def test_prefix_is_configurable() -> None:
    labels, _ = desired_labels(gb200(), "gpu.example.org")
    assert all(k.startswith("gpu.example.org/") for k in labels)


def test_annotation_is_canonical_identity_json() -> None:
    inv = gb200()
    body = json.loads(detail_annotation(inv) or "")
    assert body["version"] == 1
    assert body["machine"] == "i-0abc"
    assert [g["uuid"] for g in body["gpus"]] == [g.uuid for g in inv.gpus]
    assert {g["serial"] for g in body["gpus"]} == {"1330824060087", "1330824060012"}
    assert body["gpus"][0]["chassis"] == "1821325191357"
    assert [g["module_id"] for g in body["gpus"]] == [1, 2, 3, 4]
    # another read of the same hardware (new read_time) gives byte-identical JSON
    later = inventory(*inv.gpus)
    assert detail_annotation(later) == detail_annotation(inv)


def test_own_labels_are_only_our_layout_under_our_prefix() -> None:
    assert is_own_label(f"{P}/gpu-3", P)
    assert is_own_label(f"{P}/chassis", P)
    assert is_own_label(f"{P}/chassis-2-gpu-11", P)
    assert is_own_label(f"{P}/gpu-count", P)
    assert not is_own_label(f"{P}/team", P)  # someone else's, under our prefix
    assert not is_own_label(f"{P}.evil/gpu-0", P)
    assert not is_own_label("nvidia.com/gpu-0", P)
    assert not is_own_label("gpu-0", P)


def test_plan_patch_sets_removes_and_keeps_foreign() -> None:
    desired = desired_state(gb200(), P, annotation=True)
    node = LabelledNode(
        labels={
            f"{P}/gpu-0": "1330824060012",  # already right
            f"{P}/gpu-5": "stale",  # ours, gone
            f"{P}/team": "ml",  # foreign under our prefix
            "kubernetes.io/hostname": "n1",
        },
        annotations={"other/x": "y"},
        resource_version="42",
        provider_id="",
    )
    patch = plan_patch(node, desired, P)
    assert patch is not None
    meta = patch["metadata"]
    assert meta["resourceVersion"] == "42"
    assert meta["labels"] == {
        f"{P}/chassis": "1821325191357",
        f"{P}/chassis-count": "1",
        f"{P}/gpu-1": "1330824060087",
        f"{P}/gpu-5": None,
        f"{P}/gpu-count": "4",
    }
    assert set(meta["annotations"]) == {f"{P}/gpus"}
    in_sync = LabelledNode(
        labels={**node.labels, **desired.labels, f"{P}/gpu-5": "x"},
        annotations={f"{P}/gpus": desired.annotation or ""},
        resource_version="43",
        provider_id="",
    )
    only_stale = plan_patch(in_sync, desired, P)
    assert only_stale == {"metadata": {"resourceVersion": "43", "labels": {f"{P}/gpu-5": None}}}
    synced = LabelledNode(
        labels={k: v for k, v in in_sync.labels.items() if k != f"{P}/gpu-5"},
        annotations=in_sync.annotations,
        resource_version="44",
        provider_id="",
    )
    assert plan_patch(synced, desired, P) is None


def test_annotation_off_removes_ours_only() -> None:
    desired = desired_state(gb200(), P, annotation=False)
    node = LabelledNode(
        labels=dict(desired.labels),
        annotations={f"{P}/gpus": "{}", "other/x": "y"},
        resource_version="1",
        provider_id="",
    )
    assert plan_patch(node, desired, P) == {
        "metadata": {"resourceVersion": "1", "annotations": {f"{P}/gpus": None}}
    }


# ---- sanitising ------------------------------------------------------------------------------


def test_valid_serials_are_kept_verbatim() -> None:
    for serial in ("1652823054567", "A", "0x1F.b_c-9", "a" * 63):
        assert label_value(serial) == (serial, True)


def test_unrepresentable_serials_are_hashed_deterministically() -> None:
    value, exact = label_value("SN 1234/ü")
    assert not exact
    assert value.startswith("SN-1234-")
    assert re.fullmatch(r"SN-1234-[0-9a-f]{10}", value)
    assert label_value("SN 1234/ü") == (value, False)
    assert label_value("SN 1234/u")[0] != value
    long_value, _ = label_value("9" * 64)
    assert len(long_value) <= 63
    assert long_value != label_value("9" * 65)[0]
    only_junk, _ = label_value("☃☃")
    assert re.fullmatch(r"[0-9a-f]{10}", only_junk)


hostile_text = st.one_of(
    st.text(max_size=80),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=80),
    st.text(alphabet="-_. \t\n/\\\x00é☃", max_size=70),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,70}", fullmatch=True),
    st.sampled_from(["", " ", "N/A", "-", "a" * 63, "a" * 64, "\udcff\udc80", "[N/A]"]),
)


@settings(max_examples=400, deadline=None)
@given(raw=hostile_text)
def test_every_label_value_is_valid(raw: str) -> None:
    value, exact = label_value(raw)
    assert len(value) <= 63
    assert K8S_VALUE.match(value)
    assert value != ""
    assert exact == (value == raw)
    assert exact == (raw != "" and is_valid_label_value(raw))
    assert label_value(raw) == (value, exact)


@settings(max_examples=200, deadline=None)
@given(a=hostile_text, b=hostile_text)
def test_distinct_serials_get_distinct_values(a: str, b: str) -> None:
    if a != b and a and b:
        assert label_value(a)[0] != label_value(b)[0]


serial = st.one_of(st.none(), hostile_text)
chassis = st.one_of(st.none(), st.sampled_from(["CH-A", "CH-B"]), hostile_text)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(st.tuples(serial, chassis), max_size=10),
    seed=st.integers(0, 1000),
    prefix=st.sampled_from([P, "a.b", "x" * 40 + ".example.com"]),
)
def test_any_inventory_gives_labels_the_api_server_accepts(
    specs: list[tuple[str | None, str | None]], seed: int, prefix: str
) -> None:
    gpus = [gpu(i, s, c) for i, (s, c) in enumerate(specs)]
    inv = inventory(*gpus)
    state = desired_state(inv, prefix, annotation=True)
    node = {"metadata": {"labels": dict(state.labels), "annotations": {}}}
    if state.annotation is not None:
        node["metadata"]["annotations"][f"{prefix}/gpus"] = state.annotation
        json.loads(state.annotation)
    assert validate_metadata(node) == []
    assert all(is_own_label(k, prefix) for k in state.labels)
    # independent of the order NVML enumerates the GPUs in
    shuffled = gpus[:]
    random.Random(seed).shuffle(shuffled)
    reordered = [
        GpuIdentity(index=i, uuid=g.uuid, serial=g.serial, platform=g.platform)
        for i, g in enumerate(shuffled)
    ]
    assert desired_labels(inventory(*reordered), prefix)[0] == dict(state.labels)
    unique = {(g.chassis_serial or None, g.serial) for g in gpus if g.serial}
    gpu_keys = [k for k in state.labels if re.search(r"/(chassis-\d+-)?gpu-\d+$", k)]
    assert len(gpu_keys) == len(unique)
