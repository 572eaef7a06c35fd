"""The HTTP transport's receive errors: ``CheckpointError`` and the reference's urllib errors.

The reference fetches with ``urllib``, so its callers catch ``urllib.error.URLError`` (and its
``HTTPError`` for a refused request); torchheal's callers catch ``CheckpointError``. Each error
of a receive is both: a refusal is a :class:`CheckpointHTTPError` (``HTTPError``, with the
status code), a failed or timed-out connection a :class:`CheckpointURLError` or
:class:`CheckpointURLTimeoutError` (``URLError``, printed as ``<urlopen error ...>``).
Integrity failures (checksum, truncation, a malformed description) stay plain
``CheckpointError``: the reference has no counterpart for them.
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
    """The source's server refused the request (a status other than 200).

    Args:
        url: the path requested.
        code: the HTTP status.
        message: what the server said.
    """

    def __init__(self, url: str, code: int, message: str) -> None:
        text = f"checkpoint server answered {code} for {url}: {message}"
        # A real body: HTTPError without one breaks attribute lookups (traceback's included).
        urllib.error.HTTPError.__init__(
            self, url, code, text, Message(), io.BytesIO(message.encode())
        )
        self.args = (text,)


class CheckpointURLError(CheckpointError, urllib.error.URLError):
    """The fetch failed on the way (connection refused or reset, a bad address).

    Args:
        reason: what failed.
    """

    def __init__(self, reason: str) -> None:
        urllib.error.URLError.__init__(self, reason)
        self.args = (reason,)


class CheckpointURLTimeoutError(CheckpointTimeoutError, urllib.error.URLError):
    """A connect or read of the fetch timed out (also a ``TimeoutError``).

    Args:
        reason: what timed out.
    """

    def __init__(self, reason: str) -> None:
        urllib.error.URLError.__init__(self, reason)
        self.args = (reason,)


def receive_error(error: BaseException, source: str, aborted: bool) -> CheckpointError:
    """The error a failed receive raises.

    Args:
        error: what the fetch raised (a ``CheckpointError`` or an ``OSError``).
        source: the source's address, for the message.
        aborted: the receive was ended by ``abort_receives`` (its source is gone).
    """
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
