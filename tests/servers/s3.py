"""moto's S3 server in a subprocess on 127.0.0.1 (its threads and warnings stay out of ours)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

from tests.servers.postgres import free_port
from tests.waiting import eventually_blocking

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        env = {**os.environ, **CREDENTIALS}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        proc = self._proc

        def answering() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}")
            with urllib.request.urlopen(self.url + "/moto-api/", timeout=1):
                return True

        try:
            eventually_blocking(answering, within=timeout, ignoring=(OSError,))
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None

    def client(self) -> object:
        """A synchronous botocore S3 client for setting up and reading back."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            region_name="us-east-1",
            endpoint_url=self.url,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
