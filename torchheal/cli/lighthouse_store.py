"""``torchheal lighthouse`` options for keeping its last quorum across restarts.

``--state-file`` keeps it in a file; ``--etcd`` in etcd, where only the lighthouse holding the
leadership lease serves and standbys take over (docs/lighthouse_ha.md).
"""

from __future__ import annotations

import argparse
import threading

from torchheal.coordination.lighthouse.store import FileStore, QuorumStore

__all__ = ["add_store_flags", "open_store"]


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--state-file`` and the ``--etcd*`` options to ``parser``."""
    group = parser.add_argument_group("restart safety and high availability")
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "--state-file",
        "--state_file",
        dest="state_file",
        default=None,
        metavar="PATH",
        help="keep the last issued quorum in PATH (written atomically before any group "
        "receives it) so a restarted lighthouse never issues a quorum id that goes backwards; "
        "needed with reference (torchft) replicas, which do not report their last quorum",
    )
    where.add_argument(
        "--etcd",
        default=None,
        metavar="URL[,URL...]",
        help="high availability: keep the last quorum in etcd (v3 gateway URLs, e.g. "
        "http://127.0.0.1:2379) and serve only while holding the leadership lease; other "
        "lighthouses started with the same --etcd and --etcd-prefix stand by and take over",
    )
    group.add_argument(
        "--etcd-prefix",
        "--etcd_prefix",
        dest="etcd_prefix",
        default="/torchheal/lighthouse/default",
        help="etcd key prefix of this job's lighthouses (default: %(default)s)",
    )
    group.add_argument(
        "--etcd-lease-s",
        "--etcd_lease_s",
        dest="etcd_lease_s",
        type=int,
        default=5,
        help="leadership lease in seconds: a standby takes over at most this long after the "
        "active lighthouse dies (default: %(default)s)",
    )


def open_store(args: argparse.Namespace, stop: threading.Event) -> QuorumStore | None:
    """The store the options ask for (None: neither); with ``--etcd``, once this lighthouse
    leads (``stop`` ends a standby's wait).

    Raises:
        StoreError: the store cannot be opened (an etcd outage is not one: a standby waits).
        SystemExit: (0) asked to stop while standing by.
    """
    if args.state_file:
        return FileStore(args.state_file)
    if args.etcd:
        from torchheal.coordination.lighthouse.etcd import EtcdLeaderStore

        store = EtcdLeaderStore(args.etcd, args.etcd_prefix, args.etcd_lease_s)
        if not store.acquire(stop):
            raise SystemExit(0)
        return store
    return None
