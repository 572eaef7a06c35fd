"""Length-delimited protobuf messages on a byte stream: the direct session lane's framing.

Each message travels as its varint length and its bytes (protobuf's ``writeDelimitedTo``).
:class:`FrameReader` is fed whatever bytes arrive and hands back the complete messages. Pure, so
the lighthouse (asyncio) and the blocking client share it.
"""

from __future__ import annotations

from torchheal._wire.splice import varint

__all__ = ["DEFAULT_MAX_FRAME", "FrameError", "FrameReader", "frame"]

#: Largest message accepted, as gRPC's default receive limit (4 MiB).
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
# A varint longer than this cannot be a length below any sane limit.
_MAX_VARINT_BYTES = 10


class FrameError(ValueError):
    """The byte stream is not a sequence of acceptable frames (the connection must end)."""


def frame(message: bytes) -> bytes:
    """``message`` preceded by its length."""
    return varint(len(message)) + message


class FrameReader:
    """Splits a byte stream into messages.

    Args:
        max_frame: the largest message accepted; a longer one is a :class:`FrameError`.
        first_frame: the largest first message (default: ``max_frame``), so that an unknown
            peer cannot make a server hold ``max_frame`` bytes before its ``Hello``.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, first_frame: int | None = None) -> None:
        self._max = max_frame
        self._limit = max_frame if first_frame is None else first_frame
        # An incomplete message grows in one buffer until ``_need`` bytes are in (a list of
        # pieces would cost an object per read, however finely the stream is split).
        self._partial = bytearray()
        self._need = 0

    @property
    def pending(self) -> int:
        """Bytes received that do not make a whole message yet."""
        return len(self._partial)

    def feed(self, data: bytes) -> list[bytes]:
        """Take the next bytes of the stream; return the messages they complete.

        ``FrameError`` for a length over the limit, or a malformed one.
        """
        if self._partial:
            self._partial += data
            if len(self._partial) < self._need:
                return []
            buffer = bytes(self._partial)
            self._partial = bytearray()
            self._need = 0
        else:
            buffer = data
        messages: list[bytes] = []
        pos = 0
        end = len(buffer)
        while pos < end:
            length = buffer[pos]
            start = pos + 1
            if length & 0x80:  # a multi-byte varint (messages of 128 bytes or more)
                length &= 0x7F
                shift = 7
                while True:
                    if start >= end:
                        if start - pos >= _MAX_VARINT_BYTES:
                            raise FrameError("malformed frame length")
                        self._partial = bytearray(buffer[pos:])
                        return messages
                    byte = buffer[start]
                    start += 1
                    length |= (byte & 0x7F) << shift
                    if not byte & 0x80:
                        break
                    shift += 7
                    if start - pos >= _MAX_VARINT_BYTES:
                        raise FrameError("malformed frame length")
            if length > self._limit:
                which = "frame" if self._limit == self._max else "first frame"
                raise FrameError(f"{which} of {length} bytes is over the limit of {self._limit}")
            stop = start + length
            if stop > end:
                self._partial = bytearray(memoryview(buffer)[pos:])
                self._need = stop - pos
                return messages
            messages.append(buffer[start:stop])
            self._limit = self._max
            pos = stop
        return messages
