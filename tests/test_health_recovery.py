"""The driver's recovery action (NVML field 230), NVIDIA's buckets on a whole node, resets
clearing latched XIDs, and MIG-scoped XID holders: through the real pynvml, the fake
libnvidia-ml.so.1 and a running agent, the holders from the kubelet's own pod-resources server
(Go, `real_kubelet`). No stand-in: the API server is not used, and the kubelet answers
normally."""

from __future__ import annotations

import io
import math
import struct

import pynvml
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi, _field_value
from tests import fakenvml
from tests.conftest import node_health, running_agent, settings
from tests.fakekubelet import pod
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.test_health_nvml import agent_on
from tests.test_health_workloads import _health
from tests.waiting import eventually

NONE, GPU_RESET, NODE_REBOOT, DRAIN_P2P = 0, 1, 2, 3


def test_the_recovery_values_are_pynvmls() -> None:
    assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
    assert (NONE, GPU_RESET, NODE_REBOOT, DRAIN_P2P) == (
        pynvml.NVML_GPU_RECOVERY_ACTION_NONE,
        pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
        pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
        pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
    )
    assert pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET == 4


def test_the_field_reads_through_the_real_field_values_layout(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:3]
    config.gpus[0].recovery_action = NODE_REBOOT
    config.gpus[2].errors["field.230"] = pynvml.NVML_ERROR_INVALID_ARGUMENT
    fake_nvml.apply(config)
    api = PynvmlApi(str(fake_nvml.lib_path))
    api.init()
    try:
        assert api.field_values(api.handle_by_index(0), [(230, 0), (173, 0)]) == [NODE_REBOOT, None]
        for index in (1, 2):  # unset; a driver that does not know the field id
            assert api.field_values(api.handle_by_index(index), [(230, 0)]) == [None]
    finally:
        api.shutdown()


async def test_the_drivers_action_over_time_sets_and_clears_the_gpu(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:2]
    for gpu in config.gpus:
        gpu.recovery_action = NONE
    async with agent_on(fake_nvml, config) as run:
        await eventually(lambda: run.check(1, "recovery").state == "healthy")
        await eventually(lambda: run.agent.collector.health.xid.alive)
        config.gpus[1].xids.append((46, 0))  # RESET_GPU: latched until a reset
        config.gpus[1].recovery_action = GPU_RESET
        fake_nvml.apply(config)
        await eventually(lambda: run.check(1, "recovery").action == "reset")
        await eventually(lambda: run.check(1, "xid").state == "unhealthy")
        gpu = node_health(run.agent).gpus[1]
        assert (gpu.state, gpu.action) == ("unhealthy", "reset")
        assert "GPU reset" in (run.check(1, "recovery").reason or "")

        config.gpus[1].recovery_action = DRAIN_P2P
        fake_nvml.apply(config)
        await eventually(lambda: run.check(1, "recovery").action == "drain")
        assert run.check(1, "recovery").state == "degraded"

        config.gpus[1].recovery_action = NONE  # the driver saw its recovery done: a reset
        fake_nvml.apply(config)
        await eventually(lambda: node_health(run.agent).gpus[1].state == "healthy")
        assert run.check(1, "xid").state == "healthy"  # the latched XID 46 went with it
        assert node_health(run.agent).gpus[1].xid_counts == {46: 1}  # counted still
        rows = await run.settled_health(4, index=1)
        assert [(r["check"], r["state"], r["action"]) for r in rows][-2:] in (
            [("recovery", "healthy", "none"), ("xid", "healthy", "none")],
            [("xid", "healthy", "none"), ("recovery", "healthy", "none")],
        )
        assert node_health(run.agent).gpus[0].state == "healthy"


async def test_a_driver_without_the_field_says_so_and_154_falls_back_to_the_catalogue(
    fake_nvml: FakeNvml,
) -> None:
    lib = fake_nvml.build(omit=["nvmlDeviceGetFieldValues"])
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:2]
    async with agent_on(fake_nvml, config, lib=lib) as run:
        recovery = await eventually(lambda: run.check(0, "recovery"))
        assert recovery.state == "not_supported" and "field 230" in (recovery.reason or "")
        await eventually(lambda: run.agent.collector.health.xid.alive)
        config.gpus[0].xids.append((154, 0))
        fake_nvml.apply(config)
        xid = await eventually(
            lambda: run.check(0, "xid") if run.check(0, "xid").state == "unhealthy" else None
        )
        assert xid.action == "reboot"  # the XID_154 bucket: all an old driver tells


async def test_an_8_gpu_node_gets_nvidias_verdicts_not_false_reboots(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    for gpu in config.gpus:
        gpu.recovery_action = NONE
    async with agent_on(fake_nvml, config) as run:
        await eventually(lambda: run.agent.collector.health.xid.alive)
        injected = {0: 63, 1: 148, 2: 154, 3: 154, 4: 173, 5: 79}
        for index, code in injected.items():
            config.gpus[index].xids.append((code, 0))
        config.gpus[3].recovery_action = GPU_RESET
        config.gpus[6].recovery_action = NODE_REBOOT
        fake_nvml.apply(config)
        await eventually(
            lambda: (
                all(node_health(run.agent).gpus[i].xid_counts for i in injected)
                and node_health(run.agent).gpus[6].state == "unhealthy"
                and node_health(run.agent).gpus[3].action == "reset"
            )
        )
        await run.wait_ticks(3)
        verdicts = {g.index: (g.state, g.action) for g in node_health(run.agent).gpus}
    reboot = {i for i, (state, action) in verdicts.items() if action == "reboot"}
    assert reboot == {5, 6} and verdicts[5][0] == verdicts[6][0] == "unhealthy"
    assert verdicts[3] == ("unhealthy", "reset")  # 154 with the driver saying GPU_RESET
    assert verdicts[4] == ("unhealthy", "reset")  # 173: reset, not a node reboot
    assert verdicts[1] == ("degraded", "none")  # 148 without its subcode
    assert verdicts[0] == verdicts[2] == verdicts[7] == ("healthy", "none")  # 63, 154+NONE


async def test_an_xid_on_a_mig_device_names_only_that_devices_holders(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = fakenvml.mig_h100()
    fake_nvml.apply(config)
    big, small = config.gpus[0].mig
    real_kubelet.pods = [
        pod("research", "big", "w", "nvidia.com/mig-3g.40gb", big.uuid or ""),
        pod("research", "small", "w", "nvidia.com/mig-1g.10gb", small.uuid or ""),
    ]
    real_kubelet.publish()
    out = io.BytesIO()
    s = settings(
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        nvml_library_path=str(fake_nvml.lib_path),
    )
    agent = Agent(s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(out)])
    async with running_agent(agent):
        await eventually(lambda: out.getvalue().count(b'"kind":"allocation"') >= 2)
        await eventually(lambda: agent.collector.health.xid.alive)
        config.gpus[0].xids.append((31, 0, small.gi_id or 0, small.ci_id or 0))
        fake_nvml.apply(config)
        [record] = await eventually(lambda: [r for r in _health(out) if r["check"] == "xid"])
    assert record["state"] == "degraded" and record["reason"].startswith("XID 31")
    assert [h["pod"] for h in record["holders"]] == ["small"]


# nvmlValue_t's members by NVML_VALUE_TYPE_*, as struct formats of the union's first bytes
# (little-endian, LP64: unsigned long is 64 bits): double, uint, ulong, ulonglong, slonglong,
# int, ushort.
VALUE_FORMATS = ("<d", "<I", "<Q", "<Q", "<q", "<i", "<H")
# the bits of doubles (NaN and infinities among them) beside any 64-bit pattern
RAW_BITS = st.integers(0, 2**64 - 1) | st.floats().map(
    lambda f: int.from_bytes(struct.pack("<d", f), "little")
)


@examples(max_examples=500)
@given(
    st.integers(0, 7) | st.integers(0, 2**32 - 1), RAW_BITS, st.just(0) | st.sampled_from([2, 3])
)
def test_a_field_value_of_any_type_decodes_or_is_left_out(
    value_type: int, raw: int, rc: int
) -> None:
    entry = pynvml.c_nvmlFieldValue_t()
    entry.fieldId, entry.valueType, entry.value.ullVal, entry.nvmlReturn = 230, value_type, raw, rc
    value = _field_value(entry)  # never raises: a bad entry fails that one reading
    if rc != 0 or value_type >= len(VALUE_FORMATS):
        assert value is None
        return
    layout = VALUE_FORMATS[value_type]
    [sent] = struct.unpack_from(layout, raw.to_bytes(8, "little"))
    if isinstance(sent, float) and not math.isfinite(sent):
        assert value is None  # a double that is no number
    else:
        assert value == int(sent) and type(value) is int
