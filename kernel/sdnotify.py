"""Telling a service manager how a daemon is doing: systemd's notify protocol.

A daemon started by systemd with ``Type=notify`` finds a datagram socket in
``$NOTIFY_SOCKET`` and sends it lines of ``KEY=VALUE``: ``READY=1`` once it serves,
``STOPPING=1`` when it begins to shut down, ``STATUS=...`` for ``systemctl status``,
and ``WATCHDOG=1`` at least every ``$WATCHDOG_USEC`` microseconds when the unit has
``WatchdogSec=``. A name starting with ``@`` is in Linux's abstract namespace (a
leading NUL byte on the wire). Without ``$NOTIFY_SOCKET`` every call does nothing,
so the daemons send the same messages however they are run.

The registry and the watcher build one :class:`Notifier` in their ``main`` from the
environment mapping they are given; nothing here reads ``os.environ``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("baton.sdnotify")


@dataclass(frozen=True)
class Notifier:
    """Where to send notifications (``address`` empty: nowhere) and how often the
    watchdog wants a ping (``watchdog_usec`` 0: no watchdog)."""

    address: str = ""
    watchdog_usec: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], pid: int | None = None) -> Notifier:
        """The notifier systemd set up for this process, read from ``environ``.

        ``$WATCHDOG_PID``, when set, names the process the watchdog is for: any other
        process (a child that inherited the variables) gets no watchdog.
        """
        address = environ.get("NOTIFY_SOCKET", "")
        usec = 0
        raw = environ.get("WATCHDOG_USEC", "")
        owner = environ.get("WATCHDOG_PID", "")
        mine = not owner or owner == str(os.getpid() if pid is None else pid)
        if raw.isdigit() and mine:
            usec = int(raw)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half the timeout), or None without one."""
        if not self.address or self.watchdog_usec <= 0:
            return None
        return self.watchdog_usec / 2e6

    def notify(self, **fields: str) -> bool:
        """Send ``KEY=VALUE`` lines (keyword ``ready="1"`` is ``READY=1``); whether a
        datagram went out. A failure to send is logged, never raised: the daemon
        serves whether or not its manager hears about it."""
        if not self.address:
            return False
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(message, target)
        except OSError as e:
            log.warning("cannot notify the service manager at %s: %s", self.address, e)
            return False
        return True

    def ready(self, status: str) -> bool:
        """The daemon serves."""
        return self.notify(ready="1", status=status)

    def stopping(self, status: str = "stopping") -> bool:
        """The daemon has begun to shut down."""
        return self.notify(stopping="1", status=status)

    def watchdog(self) -> bool:
        """The daemon is alive (send at every :attr:`watchdog_interval`)."""
        return self.notify(watchdog="1")

    async def watchdog_pings(self) -> None:
        """Ping the watchdog until cancelled; returns at once without a watchdog. Run
        on the daemon's event loop, so a loop that stops turning stops the pings."""
        interval = self.watchdog_interval
        if interval is None:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)
