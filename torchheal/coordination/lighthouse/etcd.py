"""High availability: the lighthouse's record in etcd, written only by the lighthouse that leads.

Lighthouses sharing endpoints and a key prefix compete to create ``{prefix}/leader`` under a
lease; the others stand by. ``{prefix}/quorum`` is written only while the leader key still holds
this process's token, so a deposed leader never writes and an unwritten quorum is never
delivered. A leader that cannot renew its lease stops serving at once (``on_lost``). The client,
``etcd3gw``, is optional: ``pip install torchheal[ha]``.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from torchheal.coordination.lighthouse.store import StoreError, decode, encode
from torchheal.coordination.types import Quorum

__all__ = ["EtcdLeaderStore", "Outage"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.lighthouse.etcd")

# One etcd call may take this long before the next endpoint is tried.
CALL_TIMEOUT_S = 2.0
# A standby looks for a vacant leadership this often.
STANDBY_POLL_S = 0.25
# While etcd does not answer, a standby's polls back off from STANDBY_POLL_S up to this.
OUTAGE_BACKOFF_MAX_S = 2.0
# An outage that goes on is logged again this often (never once per poll: that fills the disk).
OUTAGE_REMIND_S = 60.0


@dataclass
class Outage:
    """A standby's view of an etcd outage: when to poll again and when to say so (pure)."""

    since: float | None = None  # the first failed poll of the outage; None while etcd answers
    failures: int = 0  # failed polls in this outage
    said_at: float = 0.0  # when the outage was last logged

    def failed(self, now: float) -> tuple[float, bool]:
        """Count a poll that reached no endpoint: (seconds to wait, whether to log now: at the
        start, then once per ``OUTAGE_REMIND_S``)."""
        if self.since is None:
            self.since, self.failures, self.said_at = now, 1, now
            return STANDBY_POLL_S, True
        self.failures += 1
        wait = min(STANDBY_POLL_S * 2 ** min(self.failures - 1, 16), OUTAGE_BACKOFF_MAX_S)
        remind = now - self.said_at >= OUTAGE_REMIND_S
        if remind:
            self.said_at = now
        return wait, remind

    def answered(self, now: float) -> tuple[float, int] | None:
        """etcd answered a poll: the outage that just ended (seconds, failed polls), or None."""
        if self.since is None:
            return None
        ended = (now - self.since, self.failures)
        self.since, self.failures = None, 0
        return ended

    def lasted(self, now: float) -> float:
        """Seconds since the outage began (0 with none)."""
        return 0.0 if self.since is None else now - self.since


def _client_module() -> Any:
    try:
        import etcd3gw  # noqa: F401
        import requests
        from etcd3gw import exceptions, utils
        from etcd3gw.client import Etcd3Client
    except ImportError as e:  # an optional dependency: say how to get it
        raise StoreError(
            "--etcd needs the etcd3gw package: pip install 'torchheal[ha]' (or etcd3gw)"
        ) from e
    return Etcd3Client, exceptions, utils, requests


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class EtcdLeaderStore:
    """The lighthouse's record in etcd, guarded by a leadership lease.

    Args:
        endpoints: comma-separated etcd URLs (``http://127.0.0.1:2379``); tried in turn.
        prefix: the job's key prefix (every lighthouse of the job uses the same).
        lease_s: the leadership lease (whole seconds >= 1): how long after the leader dies a
            standby takes over.
        on_lost: called (once, from the keep-alive thread) when this lighthouse loses the
            leadership; default: SIGTERM to this process, which stops the lighthouse CLI.

    Raises:
        StoreError: etcd3gw is missing, or an option is malformed.
    """

    def __init__(
        self,
        endpoints: str,
        prefix: str,
        lease_s: int,
        on_lost: Callable[[], None] = _terminate_self,
    ) -> None:
        etcd_client, exceptions, utils, requests = _client_module()
        if isinstance(lease_s, bool) or not isinstance(lease_s, int) or lease_s < 1:
            raise StoreError(f"the etcd lease must be a whole number of seconds >= 1: {lease_s!r}")
        # A connection dropped mid-answer escapes etcd3gw as requests' own error.
        self._errors = (exceptions.Etcd3Exception, requests.RequestException)
        self._encode = utils._encode
        self._clients = []
        for url in (u.strip() for u in endpoints.split(",")):
            parts = urlsplit(url if "://" in url else f"http://{url}")
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise StoreError(f"bad etcd endpoint {url!r}: use http://HOST:PORT")
            self._clients.append(
                etcd_client(
                    host=parts.hostname,
                    port=parts.port or 2379,
                    protocol=parts.scheme,
                    timeout=CALL_TIMEOUT_S,
                    api_path="/v3/",
                )
            )
        if not self._clients:
            raise StoreError("no etcd endpoint given")
        prefix = prefix.rstrip("/")
        self.leader_key = f"{prefix}/leader"
        self.quorum_key = f"{prefix}/quorum"
        self.lease_s = lease_s
        self.token = secrets.token_hex(16)
        self._on_lost = on_lost
        self._lease: Any = None
        self._current = 0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._lost = False
        self._lost_lock = threading.Lock()
        #: Elections tried so far (a standby's progress, for tests and logs).
        self.attempts = 0

    # ------------------------------------------------------------------------------------------
    # etcd calls, on the first endpoint that answers

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        errors = []
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except self._errors as e:
                # etcd3gw keeps the reason in detail_text (str(e) is often empty).
                detail = (getattr(e, "detail_text", None) or str(e))[:200]
                errors.append(f"{self._clients[index].base_url}: {type(e).__name__} {detail}")
                continue
            self._current = index
            return result
        raise StoreError(f"etcd: {what} failed on every endpoint: {'; '.join(errors)}")

    # ------------------------------------------------------------------------------------------
    # Leadership

    def acquire(self, stop: threading.Event) -> bool:
        """Stand by until this lighthouse leads (True), then keep its lease alive in the
        background; False when ``stop`` was set first. An etcd outage does not end the wait
        (nobody would be left to take over)."""
        announced = False
        outage = Outage()
        while not stop.is_set():
            self.attempts += 1
            try:
                lease = self._elect()
            except StoreError as e:
                now = time.monotonic()
                wait, say = outage.failed(now)
                if say and outage.failures == 1:
                    logger.warning(
                        "etcd outage: standing by, polling again every %.2g-%.2g s (%s)",
                        STANDBY_POLL_S,
                        OUTAGE_BACKOFF_MAX_S,
                        e,
                    )
                elif say:
                    logger.warning(
                        "etcd outage for %.0f s so far (%d polls failed): standing by (%s)",
                        outage.lasted(now),
                        outage.failures,
                        e,
                    )
                stop.wait(wait)
                continue
            ended = outage.answered(time.monotonic())
            if ended is not None:
                logger.warning(
                    "etcd outage over after %.1f s (%d polls failed): etcd answers again",
                    *ended,
                )
            if lease is not None:
                self._lease = lease
                logger.warning(
                    "This lighthouse leads (etcd key %s, lease %ds)", self.leader_key, self.lease_s
                )
                self._keeper = threading.Thread(
                    target=self._keep_alive, name="torchheal-lighthouse-lease", daemon=True
                )
                self._keeper.start()
                # A clean exit hands the leadership over at once instead of after the lease.
                atexit.register(self.close)
                return True
            if not announced:
                logger.warning(
                    "Standing by: another lighthouse leads (etcd key %s); taking over when its "
                    "lease (%ds) lapses",
                    self.leader_key,
                    self.lease_s,
                )
                announced = True
            stop.wait(STANDBY_POLL_S)
        return False

    def _elect(self) -> Any | None:
        """One election: the lease this lighthouse now leads with, or None (another leads)."""
        lease = self._call("lease grant", lambda c: c.lease(self.lease_s))
        try:
            # The lease must be granted on the client that creates the key (same cluster).
            won = self._call(
                "leader election",
                lambda c: c.create(self.leader_key, self.token, lease=lease),
            )
        except StoreError:
            # The key may exist with the answer lost: revoking the lease deletes it.
            self._revoke(lease)
            raise
        if won:
            return lease
        self._revoke(lease)
        return None

    def _revoke(self, lease: Any) -> None:
        try:
            self._call(
                "lease revoke",
                lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease.id}),
            )
        except StoreError:
            pass  # it expires by itself

    def _keep_alive(self) -> None:
        period = self.lease_s / 3.0
        last_ok = time.monotonic()
        while not self._stop.wait(period):
            try:
                ttl = self._call("lease keep-alive", lambda c: self._refresh(c))
            except StoreError as e:
                if time.monotonic() - last_ok < self.lease_s:
                    logger.warning("renewing the leadership lease failed (retrying): %s", e)
                    continue
                ttl = -1
                logger.error("etcd unreachable for the lease time: %s", e)
            if ttl <= 0:
                self._lose(f"lease {self._lease.id} expired")
                return
            last_ok = time.monotonic()

    def _lose(self, why: str) -> None:
        with self._lost_lock:
            if self._lost:
                return
            self._lost = True
        logger.error("This lighthouse lost the leadership (%s): it stops serving", why)
        self._stop.set()
        self._on_lost()

    def _refresh(self, client: Any) -> int:
        result = client.post(client.get_url("/lease/keepalive"), json={"ID": self._lease.id})
        return int(result.get("result", {}).get("TTL", -1))

    def pause(self) -> None:
        """Stop renewing the lease without giving it up (what a dead leader does; tests)."""
        self._stop.set()

    def close(self) -> None:
        """Stop renewing and give the leadership up at once (a clean shutdown)."""
        self._stop.set()
        if self._lease is not None:
            self._revoke(self._lease)

    # ------------------------------------------------------------------------------------------
    # The record

    def load(self) -> Quorum | None:
        """The last quorum any leader saved, or None."""
        values = self._call("read", lambda c: c.get(self.quorum_key))
        if not values:
            return None
        return decode(values[0], f"etcd key {self.quorum_key}")

    def save(self, quorum: Quorum) -> None:
        """Write ``quorum``'s record, only while this lighthouse still leads (else StoreError)."""
        leader = self._encode(self.leader_key)
        txn = {
            "compare": [
                {
                    "key": leader,
                    "result": "EQUAL",
                    "target": "VALUE",
                    "value": self._encode(self.token),
                }
            ],
            "success": [
                {
                    "request_put": {
                        "key": self._encode(self.quorum_key),
                        "value": self._encode(encode(quorum)),
                    }
                }
            ],
            "failure": [],
        }
        result = self._call("save", lambda c: c.transaction(txn))
        if not result.get("succeeded", False):
            self._lose("another lighthouse leads")
            raise StoreError(
                f"etcd: this lighthouse no longer leads ({self.leader_key} is not its token); "
                f"quorum {quorum.quorum_id} not saved"
            )
