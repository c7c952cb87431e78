"""/proc/<pid>/cgroup → pod UID and container id: every layout the kubelet makes, a fake host
/proc tree, a PID that exits between two reads, and hostile text."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.sources.procfs import (
    HOST_PROCESS,
    PID_GONE,
    UNKNOWN_CGROUP,
    CgroupOwner,
    HostProc,
    parse_cgroup,
)
from tests.fakeproc import FakeProc, cgroupfs_path, systemd_path, v1, v2

UID = "3f2a1b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b"
CID = "a1" * 32
STATIC_UID = "0123456789abcdef0123456789abcdef"  # a static pod's UID: a config hash


@pytest.mark.parametrize("qos", ["guaranteed", "burstable", "besteffort"])
@pytest.mark.parametrize("layout", [systemd_path, cgroupfs_path])
@pytest.mark.parametrize("version", [v1, v2])
def test_every_driver_and_version_names_pod_and_container(layout, version, qos) -> None:  # type: ignore[no-untyped-def]
    text = version(layout(UID, CID, qos))
    assert parse_cgroup(text) == CgroupOwner(UID, CID, qos)


@pytest.mark.parametrize(
    ("path", "want"),
    [
        # other runtimes' scope and directory prefixes
        (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope", CID),
        (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope", CID),
        (f"/kubepods/besteffort/pod{UID}/crio-{CID}", CID),
        # a reader in its own cgroup namespace sees the path relative to its root
        (f"/../../kubepods/burstable/pod{UID}/{CID}", CID),
        # a nested cgroup inside the container (systemd in a container, a job runner)
        (f"/kubepods/burstable/pod{UID}/{CID}/init.scope", CID),
        # the pod's own cgroup, no container part
        (f"/kubepods/burstable/pod{UID}", ""),
    ],
)
def test_runtime_prefixes_namespaces_and_nesting(path: str, want: str) -> None:
    owner = parse_cgroup(v2(path))
    assert isinstance(owner, CgroupOwner)
    assert (owner.pod_uid, owner.container_id) == (UID, want)


def test_static_pod_uid_and_upper_case() -> None:
    owner = parse_cgroup(v2(cgroupfs_path(STATIC_UID, CID.upper())))
    assert owner == CgroupOwner(STATIC_UID, CID, "burstable")


def test_v1_prefers_a_hierarchy_that_names_the_container() -> None:
    text = f"4:pids:/kubepods/burstable/pod{UID}\n3:memory:/kubepods/burstable/pod{UID}/{CID}\n"
    owner = parse_cgroup(text)
    assert isinstance(owner, CgroupOwner) and owner.container_id == CID


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0::/system.slice/nvidia-persistenced.service\n", HOST_PROCESS),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", HOST_PROCESS),
        (f"0::/system.slice/docker-{CID}.scope\n", HOST_PROCESS),  # plain docker, no pod
        ("0::/\n", HOST_PROCESS),
        ("", HOST_PROCESS),
        ("0::/kubepods.slice/kubepods-burstable.slice\n", UNKNOWN_CGROUP),  # QoS level only
        ("0::/kubepods/burstable/podnot-a-uid/abc\n", UNKNOWN_CGROUP),
        (f"0::/kubepods/burstable/pod{UID}x/{CID}\n", UNKNOWN_CGROUP),
        ("garbage without colons kubepods\n", HOST_PROCESS),  # not a cgroup line at all
    ],
)
def test_not_a_pod(text: str, reason: str) -> None:
    assert parse_cgroup(text) == reason


def test_fake_proc_tree_and_a_pid_that_exits_between_two_reads(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    other = str(uuid.uuid4())
    proc.add(100, v2(systemd_path(UID, CID)))
    proc.add(200, v1(cgroupfs_path(other, "b2" * 32, "besteffort")))
    proc.add(300, v2("/system.slice/sshd.service"))
    host = HostProc(str(proc.root))
    first = host.owners([100, 200, 300, 400])
    assert first[100] == CgroupOwner(UID, CID, "burstable")
    assert first[200] == CgroupOwner(other, "b2" * 32, "besteffort")
    assert (first[300], first[400]) == (HOST_PROCESS, PID_GONE)
    proc.remove(100)  # exited after NVML listed it
    assert host.owner(100) == PID_GONE
    proc.add(500, b"")  # a zombie's cgroup file reads empty
    assert host.owner(500) == PID_GONE
    assert host.owner(0) == PID_GONE and host.owner(-1) == PID_GONE


def test_unreadable_and_oversized_files(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    (proc.root / "7").mkdir()
    (proc.root / "7" / "cgroup").mkdir()  # not a file: read fails with an OSError
    proc.add(8, b"\xff\xfe" * 100_000 + v2(cgroupfs_path(UID, CID)).encode())
    host = HostProc(str(proc.root))
    assert host.owner(7) == "proc_unreadable"
    assert host.owner(8) == HOST_PROCESS  # the line past the read bound is not seen


hex_chars = st.sampled_from("0123456789abcdefABCDEF_-/.:x")
hostile_text = st.one_of(
    st.text(max_size=400),
    st.lists(
        st.one_of(
            st.text(alphabet=hex_chars, max_size=120),
            st.sampled_from(
                ["kubepods", "-pod", ".slice", ".scope", "/pod", "cri-containerd-", "0::", "\n"]
            ),
        ),
        max_size=30,
    ).map("".join),
)


@given(hostile_text)
@settings(max_examples=300, deadline=None)
def test_hostile_text_never_raises(text: str) -> None:
    got = parse_cgroup(text)
    if isinstance(got, CgroupOwner):
        assert "_" not in got.pod_uid and got.pod_uid == got.pod_uid.lower()
        assert len(got.pod_uid) in (32, 36)
        assert got.container_id == "" or len(got.container_id) == 64
        assert got.qos in ("guaranteed", "burstable", "besteffort")
    else:
        assert got in (HOST_PROCESS, UNKNOWN_CGROUP)


@given(
    uid=st.uuids().map(str),
    cid=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    qos=st.sampled_from(["guaranteed", "burstable", "besteffort"]),
    layout=st.sampled_from([systemd_path, cgroupfs_path]),
    noise=st.lists(st.text(alphabet="abc:/ 019", max_size=40), max_size=5),
)
@settings(max_examples=200, deadline=None)
def test_real_paths_survive_noise_lines(uid, cid, qos, layout, noise) -> None:  # type: ignore[no-untyped-def]
    text = "\n".join([*noise, v2(layout(uid, cid, qos)).strip(), *noise])
    assert parse_cgroup(text) == CgroupOwner(uid, cid, qos)


@given(st.binary(max_size=2000))
@settings(max_examples=100, deadline=None)
def test_hostile_bytes_in_the_file_never_raise(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:  # type: ignore[no-untyped-def]
    proc = FakeProc(tmp_path_factory.mktemp("proc"))
    proc.add(42, data)
    got = HostProc(str(proc.root)).owner(42)
    assert isinstance(got, CgroupOwner) or got in (HOST_PROCESS, UNKNOWN_CGROUP, PID_GONE)
