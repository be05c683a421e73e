"""Breaking a process's TCP connections from outside it, as a network fault does.

``ss -K`` (iproute2, on a kernel with socket destroy, as Debian's has) aborts a socket:
the process's next read or write on it fails at once and the peer gets a reset. The
process keeps running and its other connections stay up, so this breaks one client's
gRPC channel to a registry — and with it the session stream open on it — in the middle
of whatever the client was doing, which no signal or firewall rule does as sharply.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Collection
from dataclasses import dataclass

#: the owner of a socket in ``ss -p``: ``users:(("python3",pid=123,fd=7))``
_OWNER = re.compile(r"pid=(\d+),")


@dataclass(frozen=True)
class Connection:
    local: str
    peer: str

    @staticmethod
    def port(address: str) -> int:
        return int(address.rsplit(":", 1)[1])


def _ss(*argv: str, namespace: str = "") -> str:
    command = ["ss", *argv]
    if namespace:
        command = ["ip", "netns", "exec", namespace, *command]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: "
                           f"{done.stderr.strip()}")
    return done.stdout


def connections(pid: int, peer_ports: Collection[int], namespace: str = "") -> list[Connection]:
    """The established TCP connections of ``pid`` (seen in ``namespace``) to any of
    ``peer_ports``."""
    found = []
    for line in _ss("-tnpH", "state", "established", namespace=namespace).splitlines():
        fields = line.split()
        # Recv-Q Send-Q Local Peer Process (the State column is left out by the filter)
        if len(fields) < 5 or not any(int(p) == pid for p in _OWNER.findall(line)):
            continue
        conn = Connection(fields[2], fields[3])
        if Connection.port(conn.peer) in peer_ports:
            found.append(conn)
    return found


def destroy(pid: int, peer_ports: Collection[int], namespace: str = "") -> int:
    """Abort every established TCP connection of ``pid`` to ``peer_ports``; how many.

    Each is named by its two ports, so only the process's own end is aborted (the
    peer learns of it by the reset, as from a broken link).
    """
    cut = 0
    for conn in connections(pid, peer_ports, namespace):
        _ss("-K", "-tnH", "state", "established",
            f"( sport = :{Connection.port(conn.local)} and "
            f"dport = :{Connection.port(conn.peer)} )", namespace=namespace)
        cut += 1
    return cut
