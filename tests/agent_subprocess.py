"""The agent as a real subprocess on a simulated GB200 node, its stderr appended to a log file:
what the kill-and-restart tests start again and again with the same settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_agent(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuid_agent", "run", "--simulate", "gb200x4"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
