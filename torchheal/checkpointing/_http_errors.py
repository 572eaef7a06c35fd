"""The HTTP transport's receive errors: ``CheckpointError`` and the reference's urllib errors.

The reference fetches with ``urllib``, so its callers catch ``URLError``/``HTTPError``;
torchheal's catch ``CheckpointError``. Each receive error is both, except integrity failures,
which stay plain ``CheckpointError`` (the reference has no counterpart).
"""

from __future__ import annotations

import io
import urllib.error
from email.message import Message

from torchheal.checkpointing.transport import (
    CheckpointError,
    CheckpointTimeoutError,
    TornCheckpointError,
)

__all__ = [
    "CheckpointHTTPError",
    "CheckpointURLError",
    "CheckpointURLTimeoutError",
    "receive_error",
]


class CheckpointHTTPError(CheckpointError, urllib.error.HTTPError):
    """The source's server refused the request (a status other than 200)."""

    def __init__(self, url: str, code: int, message: str) -> None:
        text = f"checkpoint server answered {code} for {url}: {message}"
        # A real body: HTTPError without one breaks attribute lookups (traceback's included).
        urllib.error.HTTPError.__init__(
            self, url, code, text, Message(), io.BytesIO(message.encode())
        )
        self.args = (text,)


class CheckpointURLError(CheckpointError, urllib.error.URLError):
    """The fetch failed on the way (connection refused or reset, a bad address)."""

    def __init__(self, reason: str) -> None:
        urllib.error.URLError.__init__(self, reason)
        self.args = (reason,)


class CheckpointURLTimeoutError(CheckpointTimeoutError, urllib.error.URLError):
    """A connect or read of the fetch timed out (also a ``TimeoutError``)."""

    def __init__(self, reason: str) -> None:
        urllib.error.URLError.__init__(self, reason)
        self.args = (reason,)


def receive_error(error: BaseException, source: str, aborted: bool) -> CheckpointError:
    """The error a receive from ``source`` raises for ``error`` (``aborted``: by
    ``abort_receives``)."""
    if aborted:
        why = f"checkpoint fetch from {source} aborted (its source is gone): {error}"
        return (TornCheckpointError if isinstance(error, TornCheckpointError) else CheckpointError)(
            why
        )
    if isinstance(error, CheckpointError):
        return error
    if isinstance(error, TimeoutError):
        return CheckpointURLTimeoutError(f"checkpoint fetch from {source} timed out: {error}")
    return CheckpointURLError(f"checkpoint fetch from {source} failed: {error}")
