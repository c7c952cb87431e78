"""NVLinks judged against their peers as well as the models table, the table's speeds as boards
show them, the models it now lists, and a PCIe link that climbs a moment after the load."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.facts import NvLink
from gpuid_agent.state.health.links import NvLinkWatch
from gpuid_agent.state.health.nvlink_models import MODELS, expected_nvlinks
from tests import fakenvml
from tests.fakenvml.fixtures import FakeNvml
from tests.test_health_nvml import agent_on

SPEED = "164"  # NVML_FI_DEV_NVLINK_GET_SPEED


def _node(name: str, n: int, links: int, speed: int) -> fakenvml.FakeNvmlConfig:
    config = fakenvml.h100x8()
    config.gpus = [fakenvml.with_links(g, nvlinks=links) for g in config.gpus[:n]]
    for gpu in config.gpus:
        gpu.name = name
        gpu.fields = {SPEED: speed}
    return config


async def test_a100_sxm4_links_at_25_gb_s_are_healthy(fake_nvml: FakeNvml) -> None:
    """`nvidia-smi nvlink -s` on A100 SXM4 boards shows 25 GB/s per link."""
    config = _node("NVIDIA A100-SXM4-80GB", 4, 12, 25000)
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert {run.check(i, "nvlink").state for i in range(4)} == {"healthy"}
        _, status = await run.get("/status")
        assert status["health"]["gpus"][0]["nvlink_expected"].startswith(
            "A100 SXM4: 12 links at 25000 MB/s"
        )


def test_the_models_fleets_run_are_listed_with_their_sources() -> None:
    for name, links, speed in (
        ("NVIDIA H20", 18, 26562),
        ("NVIDIA H800", 8, 26562),
        ("NVIDIA A800-SXM4-80GB", 8, 25000),
        ("NVIDIA B300 SXM6 AC", 18, 53125),
        ("NVIDIA GB300", 18, 53125),
        ("NVIDIA GH200 480GB", 18, 26562),
        ("NVIDIA A100-SXM4-40GB", 12, 25000),
    ):
        model = expected_nvlinks(name)
        assert model is not None and (model.links, model.speed_mbps) == (links, speed), name
    for card in ("NVIDIA H200", "NVIDIA H800 PCIe", "NVIDIA H200 NVL"):
        model = expected_nvlinks(card)
        assert model is None or model.model == "H200 SXM", card
    assert all(m.source.strip() for m in MODELS)


async def test_an_h20_link_down_since_boot_is_unhealthy(fake_nvml: FakeNvml) -> None:
    config = _node("NVIDIA H20", 2, 18, 26562)
    config.gpus[1].nvlink_down = 1 << 7
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        down = run.check(1, "nvlink")
        assert (down.state, down.action) == ("unhealthy", "reboot")
        assert "NVLink 7 inactive since the agent started" in down.reason
        assert run.check(0, "nvlink").state == "healthy"


async def test_a_model_not_in_the_table_is_held_to_its_peers(fake_nvml: FakeNvml) -> None:
    config = _node("NVIDIA X900 SXM", 5, 18, 40000)
    config.gpus[1] = fakenvml.with_links(config.gpus[1], nvlinks=12)  # 6 links absent
    config.gpus[1].name, config.gpus[1].fields = "NVIDIA X900 SXM", {SPEED: 40000}
    config.gpus[2].nvlink_down = 1 << 3  # down since boot, up on every peer
    config.gpus[3].fields = {SPEED: 20000}  # every link at half the peers' speed
    config.gpus[4].fields = {SPEED: 40000, f"{SPEED}:9": 20000}  # one link slower than the rest
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert run.check(0, "nvlink").state == "healthy"
        absent = run.check(1, "nvlink")
        assert (absent.state, absent.reason) == (
            "unhealthy",
            "12 NVLinks reported, 18 on the other 4 NVIDIA X900 SXM GPUs on the node",
        )
        never = run.check(2, "nvlink")
        assert never.state == "unhealthy"
        assert never.reason == (
            "NVLink 3 never up while the other 4 NVIDIA X900 SXM GPUs on the node have it up"
        )
        slow = run.check(3, "nvlink")
        assert (slow.state, slow.action) == ("degraded", "hardware_inspection")
        assert slow.reason == (
            "NVLinks at 20000 MB/s, 40000 MB/s on the other 4 NVIDIA X900 SXM GPUs on the node"
        )
        one = run.check(4, "nvlink")
        assert one.state == "degraded" and one.reason.endswith("9 at 20000")
        _, status = await run.get("/status")
        assert status["health"]["gpus"][0]["nvlink_expected"] == (
            "4 other NVIDIA X900 SXM GPUs on the node: 18 links at 40000 MB/s"
        )


async def test_one_gpu_of_an_unknown_model_has_no_expectation_and_no_alarm(
    fake_nvml: FakeNvml,
) -> None:
    config = _node("NVIDIA X900 SXM", 1, 18, 40000)
    config.gpus[0].nvlink_down = (1 << 18) - 1  # nothing up: nothing to hold it to
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(3)
        assert run.check(0, "nvlink").state == "healthy"
        _, status = await run.get("/status")
        assert status["health"]["gpus"][0]["nvlink_expected"].startswith("no expectation")


def _links(n: int, speed: int, down: frozenset[int] = frozenset()) -> tuple[NvLink, ...]:
    return tuple(
        NvLink(i, i not in down, (0, 0, 0, 0), speed if i not in down else None) for i in range(n)
    )


def test_a_table_speed_slightly_off_never_alone_degrades_a_gpu() -> None:
    """A model whose boards run 3 % below the table's figure (as A100 SXM4's 25 GB/s against
    V100's 25.781): healthy; a link at half the table's rate still is not."""
    model = expected_nvlinks("NVIDIA H100 80GB HBM3")
    assert model is not None
    off = NvLinkWatch(60.0, model).verdict(_links(18, model.speed_mbps * 97 // 100), 0.0)
    assert off.state == "healthy"
    half = NvLinkWatch(60.0, model).verdict(_links(18, model.speed_mbps // 2), 0.0)
    assert half.state == "degraded" and "below 3/4 of the H100 SXM's" in (half.reason or "")


def test_a_card_with_no_bridge_among_bridged_peers_is_degraded_not_unhealthy() -> None:
    from gpuid_agent.state.health.nvlink_peers import PeerInput, peer_views

    bridged = PeerInput("a", "NVIDIA Z PCIe", _links(4, 25000), frozenset())
    bare = PeerInput("b", "NVIDIA Z PCIe", _links(4, 25000, frozenset(range(4))), frozenset())
    peers = peer_views([bridged, bare])["b"]
    verdict = NvLinkWatch(60.0).verdict(bare.links or (), 0.0, peers)
    assert (verdict.state, verdict.reason) == (
        "degraded",
        "no NVLink up while the other NVIDIA Z PCIe GPU on the node has links up",
    )


_LINK = st.builds(
    NvLink,
    st.integers(0, 17),
    st.booleans(),
    st.tuples(*[st.none() | st.integers(0, 2**64)] * 4),
    st.none() | st.integers(-(2**31), 2**63),
)


@given(st.lists(_LINK, max_size=20), st.integers(1, 8))
def test_gpus_that_look_alike_never_judge_each_other(links: list[NvLink], n: int) -> None:
    """Hostile link lists (odd speeds, duplicates, negatives) never raise, and GPUs of one
    model showing the same links never find each other short or slow."""
    from gpuid_agent.state.health.nvlink_peers import PeerInput, peer_views

    gpus = [PeerInput(str(i), "NVIDIA Same", tuple(links), frozenset()) for i in range(n)]
    views = peer_views(gpus)
    for gpu in gpus:
        verdict = NvLinkWatch(60.0).verdict(gpu.links or (), 0.0, views.get(gpu.uuid))
        assert "on the node" not in (verdict.reason or "")


async def test_a_busy_gpu_whose_link_climbs_a_moment_later_is_not_downtrained(
    fake_nvml: FakeNvml,
) -> None:
    config = _node("NVIDIA H100 80GB HBM3", 2, 18, 26562)
    for gpu in config.gpus:
        gpu.util_gpu, gpu.pcie_gen = 0, 1  # idle, the link saving power
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(2)
        config.gpus[0].util_gpu = 95  # the load arrives; the link has not climbed yet
        fake_nvml.apply(config)
        await run.wait_ticks(1)
        config.gpus[0].pcie_gen = 5
        fake_nvml.apply(config)
        await run.wait_ticks(4)
        assert run.health(check="pcie") == []
        assert run.check(0, "pcie").state == "healthy"
        config.gpus[1].util_gpu, config.gpus[1].pcie_gen = 95, 2  # busy and staying at Gen2
        fake_nvml.apply(config)
        [record] = await run.settled_health(1, check="pcie")
        assert record["index"] == 1 and record["state"] == "degraded"
        assert "Gen2 of Gen5 in 3 busy readings in a row" in record["reason"]
