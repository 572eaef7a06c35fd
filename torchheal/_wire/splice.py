"""Protobuf wire bytes assembled around an already serialized message.

An issued quorum is serialized once and then sent to every waiting group: inside a
``LighthouseQuorumResponse`` to the reference's unary callers and inside a ``SessionEvent`` to
each torchheal session, with that session's request id. Building those envelopes from bytes
avoids parsing and re-serializing a message of N members N times per round. The encoding is
protobuf's own (varints, and length-delimited fields for embedded messages); tests check the
bytes against the generated classes.
"""

from __future__ import annotations

__all__ = ["int_field", "message_field", "uint_field", "varint"]

_LENGTH_DELIMITED = 2
_VARINT = 0
_MASK64 = (1 << 64) - 1
_SMALL = [bytes([v]) for v in range(128)]


def varint(value: int) -> bytes:
    """The wire bytes of an unsigned varint (also the length prefix of a delimited message).

    Args:
        value: a value >= 0.

    Raises:
        ValueError: ``value`` is negative.
    """
    if value < 128:
        if value < 0:
            raise ValueError(f"varints here are unsigned, got {value}")
        return _SMALL[value]
    return _varint(value)


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"varints here are unsigned, got {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def message_field(number: int, payload: bytes) -> bytes:
    """The wire bytes of field ``number`` holding the serialized message ``payload``.

    Args:
        number: the field number (>= 1).
        payload: the embedded message, serialized.
    """
    return varint(number << 3 | _LENGTH_DELIMITED) + varint(len(payload)) + payload


def uint_field(number: int, value: int) -> bytes:
    """The wire bytes of an unsigned integer field (omitted when 0, as proto3 does).

    Args:
        number: the field number (>= 1).
        value: a value >= 0.
    """
    if value == 0:
        return b""
    return varint(number << 3 | _VARINT) + varint(value)


def int_field(number: int, value: int) -> bytes:
    """The wire bytes of a signed ``int64``/``int32`` field (omitted when 0, as proto3 does):
    a negative value is its 64-bit two's complement, ten bytes long, as protobuf encodes it.

    Args:
        number: the field number (>= 1).
        value: a value in the field's range.
    """
    if value == 0:
        return b""
    return varint(number << 3 | _VARINT) + varint(value & _MASK64)
