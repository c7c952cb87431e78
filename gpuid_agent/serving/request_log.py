"""The logger aiohttp's connections write to.

aiohttp logs a request it cannot parse (oversized header, bad request line, bad method) as an
error with the parser's traceback: one scanner or broken client fills the log. That is the
client's fault, not the agent's: it becomes one debug line naming the client and the reason.
Any other exception (a handler's bug) stays an error with its traceback.
"""

from __future__ import annotations

import logging

from aiohttp.http import HttpProcessingError

from gpuid_agent.runtime import log

_REASON_CHARS = 200  # the reason may quote the client's bytes


class _MalformedRequests(logging.Filter):
    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if not self.logger.isEnabledFor(logging.DEBUG):
            return False
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else None
        record.msg, record.args = "malformed HTTP request", ()
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info, record.exc_text = None, None
        record.remote = remote
        record.reason = (exc.message or type(exc).__name__)[:_REASON_CHARS]
        record.status = exc.code
        return True


REQUEST_LOG = log.get("http")
REQUEST_LOG.addFilter(_MalformedRequests(REQUEST_LOG))
