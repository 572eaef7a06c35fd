"""Where a lighthouse keeps the little it must not forget across a restart: its last quorum.

A restarted lighthouse that forgot it would reuse quorum ids the groups already hold, so they
would keep a process group whose members changed. torchheal groups also report their last quorum
on reconnecting (``quorum.restore``); a store covers reference peers, and etcd a standby.
``save`` runs before any group receives a changed quorum; if it raises, nothing is delivered and
the next tick tries again.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.types import Quorum

__all__ = ["FileStore", "MemoryStore", "QuorumStore", "StoreError", "decode", "encode"]

# Bumped if the record's layout changes; a record of another version is refused, not guessed at.
FORMAT_VERSION = 1


class StoreError(RuntimeError):
    """The store cannot load or save the lighthouse's record (says which and why)."""


class QuorumStore(Protocol):
    """Durable home of the lighthouse's last issued quorum."""

    def load(self) -> Quorum | None:
        """The last saved quorum, or None; :class:`StoreError` if the record is unreadable."""

    def save(self, quorum: Quorum) -> None:
        """Record ``quorum`` durably; :class:`StoreError`: not recorded, so not to be issued."""


def encode(quorum: Quorum) -> str:
    """The record for ``quorum``: JSON with its id (readable) and the quorum as protobuf bytes."""
    raw = convert.quorum_to_pb(quorum).SerializeToString()
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "quorum_id": quorum.quorum_id,
            "members": [m.replica_id for m in quorum.participants],
            "quorum": base64.b64encode(raw).decode("ascii"),
        },
        indent=1,
    )


def decode(text: str | bytes, where: str) -> Quorum:
    """Parse a record made by :func:`encode` (``where`` names it in a :class:`StoreError`)."""
    try:
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        if record.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown format version {record.get('version')!r}")
        raw = base64.b64decode(record["quorum"], validate=True)
        quorum = convert.quorum_from_pb(pb.Quorum.FromString(raw), strict_data=False)
        if quorum.quorum_id != record["quorum_id"] or quorum.quorum_id < 1:
            raise ValueError(f"inconsistent quorum id {record['quorum_id']!r}")
    except (ValueError, KeyError, TypeError, DecodeError) as e:
        raise StoreError(f"lighthouse state {where} is damaged or not a state record: {e}") from e
    return quorum


class FileStore:
    """The record as a JSON file (its directory must exist), replaced atomically at every save."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise StoreError(f"lighthouse state file {self.path}: no directory {self.path.parent}")

    def load(self) -> Quorum | None:
        """The last saved quorum, or None when the file does not exist yet."""
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read lighthouse state file {self.path}: {e}") from e
        return decode(text, str(self.path))

    def save(self, quorum: Quorum) -> None:
        """Replace the file with ``quorum``'s record, atomically and durably."""
        data = encode(quorum).encode()
        directory = self.path.parent
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            # The rename itself must survive a power cut: sync the directory entry.
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            raise StoreError(f"cannot write lighthouse state file {self.path}: {e}") from e


class MemoryStore:
    """An in-memory :class:`QuorumStore` (tests; a lighthouse that forgets on exit)."""

    def __init__(self, quorum: Quorum | None = None) -> None:
        self.quorum = quorum
        self.saves = 0
        self.attempts = 0
        #: When set, :meth:`save` raises it (to test a store that fails).
        self.fail: StoreError | None = None

    def load(self) -> Quorum | None:
        """The last saved quorum."""
        return self.quorum

    def save(self, quorum: Quorum) -> None:
        """Keep ``quorum`` (or raise :attr:`fail`)."""
        self.attempts += 1
        if self.fail is not None:
            raise self.fail
        self.quorum = quorum
        self.saves += 1
