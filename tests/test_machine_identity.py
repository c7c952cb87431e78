"""Machine identity: the Node's providerID, else the DMI product UUID, else /etc/machine-id;
a change of machine or chassis is an inventory change that produces new records."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import NodeInventory, PlatformInfo
from gpuid_agent.records.readings import ReadingEmitter
from gpuid_agent.records.serialize import Wire, to_wire
from gpuid_agent.records.types import ReadingRecord
from gpuid_agent.sources.kube.provider_id import machine_from_provider_id
from gpuid_agent.sources.machine import resolve_machine
from gpuid_agent.state.inventory import diff
from tests.test_labels_layout import gb200, inventory
from tests.test_records_bus import snapshot

AZURE = (
    "azure:///subscriptions/0000-1111/resourceGroups/mc_rg/providers/Microsoft.Compute/"
    "virtualMachines/aks-gpu-12345678-vm0"
)
AZURE_VMSS = (
    "azure:///subscriptions/0000-1111/resourceGroups/mc_rg/providers/Microsoft.Compute/"
    "virtualMachineScaleSets/aks-gpu-12345678-vmss/virtualMachines/3"
)


@pytest.mark.parametrize(
    ("provider_id", "expected"),
    [
        ("aws:///us-east-1a/i-0123456789abcdef0", ("i-0123456789abcdef0", "aws")),
        ("aws:///us-west-2b/fargate-ip-10-0-1-2", ("fargate-ip-10-0-1-2", "aws")),
        ("gce://my-project/us-central1-a/gke-gpu-pool-1-abcd", ("gke-gpu-pool-1-abcd", "gce")),
        (AZURE, ("aks-gpu-12345678-vm0", "azure")),
        (AZURE_VMSS, ("aks-gpu-12345678-vmss_3", "azure")),
        ("kind://docker/kind/kind-worker2", ("kind-worker2", "kind")),
        ("openstack:///2c2d6c7e-6d3b-4b1e-8d16-3e2b7bb1c2a4", (
            "2c2d6c7e-6d3b-4b1e-8d16-3e2b7bb1c2a4", "openstack")),
        ("vsphere://4213a1b2-0000-1111-2222-333344445555", (
            "4213a1b2-0000-1111-2222-333344445555", "vsphere")),
        ("hcloud://12345678", ("12345678", "hcloud")),
        ("oci://ocid1.instance.oc1.iad.abc", ("ocid1.instance.oc1.iad.abc", "oci")),
        ("AWS:///us-east-1a/i-0abc/", ("i-0abc", "aws")),
        ("bare-metal-42", ("bare-metal-42", "other")),
        ("", None),
        ("aws:///", None),
        ("aws:///zone/has space", None),
        ("x://" + "a" * 300, None),
    ],
)  # fmt: skip
def test_provider_id_forms(provider_id: str, expected: tuple[str, str] | None) -> None:
    assert machine_from_provider_id(provider_id) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=300),
        st.builds(
            lambda scheme, parts: f"{scheme}://" + "/".join(parts),
            st.from_regex(r"[a-z][a-z0-9+.-]{0,10}", fullmatch=True),
            st.lists(st.text(max_size=30), max_size=6),
        ),
    )
)
def test_provider_id_parser_survives_hostile_input(provider_id: str) -> None:
    found = machine_from_provider_id(provider_id)
    if found is not None:
        machine, provider = found
        assert 0 < len(machine) <= 255
        assert re.fullmatch(r"[\x21-\x7e]+", machine)
        assert "/" not in machine or provider == "other"
        assert provider


def test_resolution_order(tmp_path: Path) -> None:
    dmi = tmp_path / "product_uuid"
    mid = tmp_path / "machine-id"
    dmi.write_text("4C4C4544-0042-3510-8051-B7C04F4B4E32\n")
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    assert resolve_machine("aws:///us-east-1a/i-0abc", str(dmi), str(mid)) == (
        "i-0abc",
        "provider_id:aws",
    )
    assert resolve_machine("", str(dmi), str(mid)) == (
        "4c4c4544-0042-3510-8051-b7c04f4b4e32",
        "dmi_product_uuid",
    )
    assert resolve_machine("aws:///", str(dmi), str(mid))[1] == "dmi_product_uuid"  # type: ignore[index]
    dmi.write_text("")  # unreadable/empty (e.g. no DMI in a VM): next source
    assert resolve_machine(None, str(dmi), str(mid)) == (
        "0123456789abcdef0123456789abcdef",
        "machine_id",
    )
    assert resolve_machine(None, str(tmp_path / "none"), "") is None


async def test_machine_change_is_an_inventory_change_with_new_records() -> None:
    before = gb200()
    after = dataclasses.replace(inventory(*before.gpus, machine="i-0new"))
    changes = diff(before, after)
    assert [c.kind for c in changes] == ["node"]
    assert changes[0].fields == ("machine",)
    records = await _records_after(before, after)
    assert len(records) == 4
    assert {r["machine"] for r in records} == {"i-0new"}
    assert {r["reason"] for r in records} == {"change"}


async def test_chassis_change_for_a_serial_is_an_inventory_change() -> None:
    before = gb200("CHASSIS-1")
    moved = [
        dataclasses.replace(
            g,
            platform=PlatformInfo(
                chassis_serial="CHASSIS-2",
                slot_number=1,
                tray_index=1,
                host_id=1,
                peer_type=0,
                module_id=g.module_id or 0,
            ),
        )
        for g in before.gpus
    ]
    after = inventory(*moved)
    changes = diff(before, after)
    assert {c.kind for c in changes} == {"changed"}
    assert all("platform" in c.fields for c in changes)
    records = await _records_after(before, after)
    assert {r["chassis"] for r in records} == {"CHASSIS-2"}
    assert {r["change"] for r in records} == {"changed"}


async def _records_after(before: NodeInventory, after: NodeInventory) -> list[Wire]:
    """The reading records `after` owes once `before` was emitted, in their wire form."""
    published: list[list[Wire]] = []

    async def publish(records: list[ReadingRecord]) -> None:
        published.append([to_wire(r) for r in records])

    emitter = ReadingEmitter(source="s", heartbeat_interval=3600, publish=publish)
    for seq, inv in enumerate((before, after)):
        emitter.note(snapshot(seq, inv))
        await emitter.flush()
    assert [r["reason"] for r in published[0]] == ["startup"] * len(before.gpus)
    return published[1]
