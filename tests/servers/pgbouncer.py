"""A throwaway PgBouncer in transaction pooling mode in front of the test PostgreSQL cluster.

The binary comes from Debian's `pgbouncer` package; on a machine without it, `ensure_installed`
installs it with apt-get when running as root (as CI does), and otherwise says why not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.servers.postgres import DATABASE, PASSWORD, USER, PostgresCluster, free_port
from tests.waiting import eventually_blocking

BINARY = "pgbouncer"


def ensure_installed() -> str | None:
    """None when pgbouncer can be run here, else why not (after trying to install it)."""
    if shutil.which(BINARY) or Path("/usr/sbin/pgbouncer").exists():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "pgbouncer is not installed and cannot be installed here (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", BINARY]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"installing pgbouncer failed: {done.stderr.strip()[-300:]}"
    return None


def _binary() -> str:
    return shutil.which(BINARY) or "/usr/sbin/pgbouncer"


class PgBouncer:
    def __init__(self, cluster: PostgresCluster, pool_size: int = 2) -> None:
        self.cluster = cluster
        self.pool_size = pool_size
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="gpuid-pgbouncer-"))
        self._process: subprocess.Popen[bytes] | None = None

    def connect_kwargs(self) -> dict[str, object]:
        return {**self.cluster.connect_kwargs(), "port": self.port}

    def start(self) -> None:
        (self.root / "userlist.txt").write_text(f'"{USER}" "{PASSWORD}"\n')
        (self.root / "pgbouncer.ini").write_text(
            f"""[databases]
{DATABASE} = host=127.0.0.1 port={self.cluster.port} dbname={DATABASE}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
pool_mode = transaction
auth_type = scram-sha-256
auth_file = {self.root}/userlist.txt
default_pool_size = {self.pool_size}
max_client_conn = 500
server_reset_query =
logfile = {self.root}/pgbouncer.log
pidfile = {self.root}/pgbouncer.pid
"""
        )
        shutil.chown(self.root, "postgres", "postgres")
        for entry in self.root.iterdir():
            shutil.chown(entry, "postgres", "postgres")
        user = ["-u", "postgres"] if os.geteuid() == 0 else []
        errors = self.root / "stderr.log"
        with open(errors, "wb") as err:
            self._process = subprocess.Popen(
                [_binary(), *user, str(self.root / "pgbouncer.ini")],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        process = self._process

        def listening() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {errors.read_text().strip()[-500:]}")
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True

        eventually_blocking(listening, within=20, ignoring=(OSError,))

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
