"""A small switched network of Linux network namespaces that a test can partition.

One *hub* namespace holds a bridge (the switch) whose own address is the lighthouse's host;
each replica group gets a namespace of its own, joined to the bridge by a veth pair::

    hub ns: br0 10.77.0.1/24 ── port p0 ═══ veth ═══ g0 ns: eth0 10.77.0.10/24
                              ── port p1 ═══ veth ═══ g1 ns: eth0 10.77.0.11/24
                              ── port p2 ═══ veth ═══ g2 ns: eth0 10.77.0.12/24

Cutting group ``g`` sets its switch port down: packets to and from it are dropped silently
(no FIN, no RST, no ICMP: every neighbour's MAC address is set for good, so no failed ARP
lookup makes a kernel report "No route to host" either), as when a link behind a router fails.
Its TCP connections stay open on both sides and only time out; healing sets the port up again
and they carry on.

The addresses live inside the namespaces, so two runs never clash on them; the namespace names
are unique per run (``ip netns`` names are machine-wide). Everything is removed by
:meth:`Network.close` (deleting a namespace deletes its links), which the owner calls in a
``finally``.

A process runs in a group's namespace through :meth:`Network.command`, which also gives it a
UTS namespace whose host name is the group's IP address: torchheal and Gloo advertise
``socket.gethostname()`` to peers (manager server, checkpoint server, Gloo pairs), and on this
machine that name resolves to 127.0.0.1, which in another namespace is that namespace's own
loopback.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Sequence

__all__ = ["Network", "require_tools"]

SUBNET = "10.77.0"
HUB_IP = f"{SUBNET}.1"


def require_tools() -> None:
    """Fails loudly when ``ip`` or ``unshare`` is missing (the set-up script installs them).

    Raises:
        RuntimeError: a tool is missing.
    """
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"partition tests need {missing} (iproute2, util-linux) on PATH")


def _mac(last: int) -> str:
    """The MAC address of the host ``{SUBNET}.{last}`` (locally administered)."""
    return f"02:77:00:00:00:{last:02x}"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


class Network:
    """A hub namespace with a bridge, and one namespace per group plugged into it.

    Args:
        groups: how many group namespaces to create.
    """

    def __init__(self, groups: int) -> None:
        require_tools()
        self.run_id = uuid.uuid4().hex[:8]
        self.hub = f"thp-{self.run_id}-hub"
        self.names = [f"thp-{self.run_id}-g{g}" for g in range(groups)]
        self._created: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "address", _mac(1))
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for g, name in enumerate(self.names):
            self._add_ns(name)
            # Both ends are created inside their namespaces: the root namespace never sees them.
            _ip(
                "link", "add", "name", self.port(g), "netns", self.hub, "type", "veth",
                "peer", "name", "eth0", "netns", name,
            )  # fmt: skip
            _ip("-n", self.hub, "link", "set", self.port(g), "master", "br0")
            _ip("-n", name, "link", "set", "eth0", "address", _mac(10 + g))
            _ip("-n", name, "addr", "add", f"{self.ip(g)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", self.port(g), "up")
        # Every neighbour is known for good: no ARP, so a cut is silent. (With ARP, a cut-off
        # host's failed lookups make its kernel report "No route to host" on its connections,
        # which a partition behind a router never does.)
        hosts = [(None, 1)] + [(g, 10 + g) for g in range(len(self.names))]
        for where, _ in hosts:
            ns, dev = (self.hub, "br0") if where is None else (self.names[where], "eth0")
            for other, last in hosts:
                if other != where:
                    _ip(
                        "-n", ns, "neigh", "replace", f"{SUBNET}.{last}",
                        "lladdr", _mac(last), "dev", dev, "nud", "permanent",
                    )  # fmt: skip

    @staticmethod
    def port(group: int) -> str:
        """The name of ``group``'s switch port (in the hub namespace)."""
        return f"p{group}"

    @staticmethod
    def ip(group: int) -> str:
        """``group``'s address."""
        return f"{SUBNET}.{10 + group}"

    def command(self, where: int | None, argv: Sequence[str]) -> list[str]:
        """``argv`` run in group ``where``'s namespace (the hub's when None), named by its IP.

        Args:
            where: the group, or None for the hub.
            argv: the command.
        """
        ns, host = (self.hub, HUB_IP) if where is None else (self.names[where], self.ip(where))
        return [
            "ip", "netns", "exec", ns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv,
        ]  # fmt: skip

    def cut(self, group: int) -> None:
        """Partitions ``group`` from everything else (its switch port goes down)."""
        _ip("-n", self.hub, "link", "set", self.port(group), "down")

    def heal(self, group: int) -> None:
        """Ends ``group``'s partition (its switch port comes up)."""
        _ip("-n", self.hub, "link", "set", self.port(group), "up")

    def close(self) -> None:
        """Deletes every namespace this network created (and with them, their links).

        Raises:
            RuntimeError: a namespace could not be deleted (after trying every one).
        """
        errors = []
        for name in reversed(self._created):
            try:
                _ip("netns", "delete", name)
            except RuntimeError as e:
                errors.append(str(e))
        self._created.clear()
        if errors:
            raise RuntimeError("; ".join(errors))
