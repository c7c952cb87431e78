"""A real kubelet pod-resources v1 gRPC server on a unix socket, for tests.

The server itself lives in the package (`gpuid_agent.simulate.kubelet`) because the simulated
node runs it too; this package adds what only tests need: short socket paths (a unix socket
path must stay under 108 bytes, which pytest's tmp_path does not promise) and fixtures.
"""

from gpuid_agent.simulate.kubelet import Behaviour, FakeKubelet
from gpuid_agent.simulate.pods import (
    ClaimDevice,
    KubeletClaim,
    KubeletContainer,
    KubeletPod,
    claim_pod,
    pod,
)

__all__ = [
    "Behaviour",
    "ClaimDevice",
    "FakeKubelet",
    "KubeletClaim",
    "KubeletContainer",
    "KubeletPod",
    "claim_pod",
    "pod",
]
