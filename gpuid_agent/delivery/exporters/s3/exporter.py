"""The S3 exporter: one object per (kind, cluster, node) of a batch, with aiobotocore.

Keys and bodies come from `layout.Layout`. The timestamp and the batch id in a key are the
batch's own (kept in the spool), so a retried batch writes the same keys with the same bytes
and two agents never write the same key.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth
from gpuid_agent.delivery.exporters.s3.layout import Layout, S3Object, key_part
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError

# Content problems S3 will never accept; anything else (auth, bucket, throttling) may heal.
_REJECTING_CODES = frozenset({"EntityTooLarge", "InvalidDigest", "BadDigest", "InvalidArgument"})


class S3Exporter(Exporter):
    name = "s3"

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "gpuid",
        region: str = "",
        partition_pattern: str = "year=%Y/month=%m/day=%d/hour=%H",
        endpoint_url: str = "",
        path_style: bool = False,
        fmt: str = "csv",
        csv_header: bool = False,
        gzip_objects: bool = False,
        timeout: float = 30.0,
    ) -> None:
        self.bucket = bucket
        self.layout = Layout(prefix, partition_pattern, fmt, csv_header, gzip_objects)
        self.region = region
        self.endpoint_url = endpoint_url
        self.path_style = path_style
        self.timeout = timeout
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: Any = None
        self._lock = asyncio.Lock()

    async def _client(self) -> Any:
        async with self._lock:
            if self._s3 is None:
                config = AioConfig(
                    s3={"addressing_style": "path" if self.path_style else "auto"},
                    retries={"total_max_attempts": 1},  # the pipeline retries, with backoff
                    connect_timeout=self.timeout,
                    read_timeout=self.timeout,
                )
                stack = contextlib.AsyncExitStack()
                self._s3 = await stack.enter_async_context(
                    get_session().create_client(
                        "s3",
                        region_name=self.region or None,
                        endpoint_url=self.endpoint_url or None,
                        config=config,
                    )
                )
                self._stack = stack
            return self._s3

    def objects(self, batch: Sequence[AnyRecord], meta: BatchMeta) -> list[S3Object]:
        """Every object this batch becomes (key, body, metadata, content type)."""
        return self.layout.objects(batch, meta)

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        meta = meta or BatchMeta.new()
        try:
            s3 = await self._client()
            for obj in self.objects(batch, meta):
                await s3.put_object(
                    Bucket=self.bucket,
                    Key=obj.key,
                    Body=obj.body,
                    ContentType=obj.content_type,
                    Metadata=obj.metadata,
                )
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "unknown"))
            raise ExportError(
                f"S3 {code}: {error.get('Message', '')}",
                error_type=f"s3_{key_part(code)[:40]}",
                retryable=code not in _REJECTING_CODES,
            ) from exc
        except (BotoCoreError, OSError) as exc:
            kind = "timeout" if "timeout" in type(exc).__name__.lower() else "connection"
            raise ExportError(f"S3 unreachable: {exc}", error_type=kind) from exc

    async def health(self) -> ExporterHealth:
        try:
            s3 = await self._client()
            await s3.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "unknown")
            return ExporterHealth(ok=False, reason=f"bucket {self.bucket}: {code}")
        except (BotoCoreError, OSError) as exc:
            return ExporterHealth(ok=False, reason=f"S3 unreachable: {exc}")
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = None
        self._s3 = None
