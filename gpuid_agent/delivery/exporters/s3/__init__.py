"""S3 exporter: `layout` decides keys and bodies, `exporter` puts them with aiobotocore."""

from gpuid_agent.delivery.exporters.s3.exporter import S3Exporter
from gpuid_agent.delivery.exporters.s3.layout import (
    CSV_COLUMNS,
    Layout,
    hive_value,
    key_part,
    partition,
    to_csv,
    to_ndjson,
)

__all__ = [
    "CSV_COLUMNS",
    "Layout",
    "S3Exporter",
    "hive_value",
    "key_part",
    "partition",
    "to_csv",
    "to_ndjson",
]
