"""A throwaway PostgreSQL cluster from the installed server binaries, run as `postgres`."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

PG_BIN = Path(os.environ.get("GPUID_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
USER = "gpuid"
PASSWORD = "s3cret-pw"  # a test password; the tests check it never reaches logs
DATABASE = "gpuid"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresCluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.root: Path | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why a cluster cannot be started here, or None."""
        if not (PG_BIN / "initdb").exists():
            return f"PostgreSQL server binaries not found in {PG_BIN}"
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no `postgres` system user to run the server as"
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
            return "starting the server as `postgres` needs root (runuser)"
        if os.geteuid() == 0 and not shutil.which("runuser"):
            return "runuser not found"
        return None

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [*prefix, *argv], check=check, capture_output=True, text=True, timeout=120
        )

    @property
    def data(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gpuid-pg-"))
        entry = pwd.getpwnam("postgres")
        os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._as_postgres(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        conf = (
            f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\n"
            f"unix_socket_directories = '{self.root}'\n"
            # fsync off: commits survive a server crash (not an OS crash), which is all a
            # throwaway cluster needs; synchronous_commit stays on so an immediate stop keeps
            # what was acknowledged.
            "fsync = off\nfull_page_writes = off\n"
            "max_connections = 200\nlog_min_messages = warning\n"
        )
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write(conf)
        self.start_server()
        self.psql(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
        self.psql(f"CREATE DATABASE {DATABASE} OWNER {USER}")

    def start_server(self) -> None:
        assert self.root is not None
        self._as_postgres(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop_server(self, mode: str = "fast") -> None:
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False
        )

    def psql(self, sql: str, database: str = "postgres") -> str:
        assert self.root is not None
        done = self._as_postgres(
            str(PG_BIN / "psql"),
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            str(self.root),
            "-p",
            str(self.port),
            "-d",
            database,
            "-c",
            sql,
        )
        return done.stdout

    def connect_kwargs(self) -> dict[str, object]:
        return {
            "host": "127.0.0.1",
            "port": self.port,
            "user": USER,
            "password": PASSWORD,
            "database": DATABASE,
        }

    def env(self) -> dict[str, str]:
        """POSTGRES_* settings for an agent writing to this cluster."""
        return {
            "POSTGRES_HOST": "127.0.0.1",
            "POSTGRES_PORT": str(self.port),
            "POSTGRES_USER": USER,
            "POSTGRES_PASSWORD": PASSWORD,
            "POSTGRES_DB": DATABASE,
            "POSTGRES_SSLMODE": "disable",
        }

    def close(self) -> None:
        if self.root is None:
            return
        self.stop_server("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
