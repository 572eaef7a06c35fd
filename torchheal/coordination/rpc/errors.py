"""How a failed call reads on each side: statuses raised by handlers, exceptions raised to callers.

A handler raises :class:`StatusError` to answer with a status; a caller gets ``TimeoutError``
for a deadline or a cancellation and :class:`RPCError` (a ``RuntimeError``) for anything else,
worded as the reference words them, because users match on that text.
"""

from __future__ import annotations

import grpc

__all__ = ["RPCError", "StatusError", "rpc_error_to_exception", "status_error", "status_name"]


class RPCError(RuntimeError):
    """A remote call failed with a gRPC status other than a timeout.

    Args:
        message: human-readable text, naming the call.
        code: the gRPC status code.
        details: the server's status message.
    """

    def __init__(self, message: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class StatusError(Exception):
    """Raised inside a server handler to answer with a given gRPC status.

    Args:
        code: the status to answer with.
        details: the message the client sees.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def status_name(code: grpc.StatusCode) -> str:
    """The status name as the reference prints it, e.g. ``InvalidArgument``."""
    return "".join(part.capitalize() for part in code.name.split("_"))


def rpc_error_to_exception(error: grpc.RpcError, what: str) -> Exception:
    """Map a failed call to the exception the public API raises (reference §2.4).

    ``DEADLINE_EXCEEDED`` and ``CANCELLED`` become :class:`TimeoutError` reading ``status:
    Cancelled, message: "Timeout expired"`` as the reference's servers answer; any other status
    becomes :class:`RPCError`. ``what`` names the call, e.g. ``"LighthouseService/Quorum to h:1"``.
    """
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else str(error)) or ""
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return TimeoutError(
            f'{what} failed: status: Cancelled, message: "Timeout expired" '
            f"(gRPC {code.name}: {details})"
        )
    return status_error(what, code, details)


def status_error(what: str, code: grpc.StatusCode, details: str) -> RPCError:
    """The :class:`RPCError` a caller gets for ``code`` (the same text as over gRPC)."""
    return RPCError(
        f'{what} failed: status: {status_name(code)}, message: "{details}"', code, details
    )
