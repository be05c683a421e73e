"""Keeping ``baton up``'s daemons running: a crashed one is started again.

A daemon that exits on its own is restarted after a backoff that doubles with
each recent crash (jittered: Baton's one backoff), and the console is told both.
Only a crash loop stops the stack: a daemon that crashed ``max_crashes`` times
within ``window`` seconds is left down, and :meth:`Supervisor.run` returns why,
with its log tail.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..kernel.backoff import Backoff
from .etcdproc import DaemonFailed, StartCancelled

__all__ = ["Daemon", "RestartPolicy", "Supervisor"]

#: how often a running stack checks that none of its processes died
SUPERVISE_INTERVAL = 0.2


class Daemon(Protocol):
    """One supervised process of the stack."""

    @property
    def name(self) -> str: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def pid(self) -> int | None: ...

    def returncode(self) -> int | None:
        """Its exit status once it exited, else None."""

    def start(self, timeout: float, cancel: threading.Event) -> None:
        """Start it (again) and return once it is ready; raises ``DaemonFailed``."""

    def stop(self) -> None: ...


@dataclass(frozen=True)
class RestartPolicy:
    """When a crashed daemon is started again, and when the stack gives up on it."""

    #: crashes of one daemon within ``window`` seconds that stop the stack
    max_crashes: int = 5
    window: float = 60.0
    #: at most this long before the first restart; doubled for each recent crash, up
    #: to ``cap`` (Baton's one :class:`Backoff`, jittered)
    initial: float = 0.5
    cap: float = 8.0
    #: a number between its two arguments
    jitter: Callable[[float, float], float] = random.uniform

    def delay(self, recent: int) -> float:
        """Seconds to wait before restarting a daemon with ``recent`` crashes in the window."""
        return Backoff(self.initial, self.cap, jitter=self.jitter).delay(max(recent, 1))


def exit_status(code: int) -> str:
    """``status 7``, or ``SIGKILL`` for a daemon a signal ended."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    """Watches daemons until a stop is asked for; restarts those that exit."""

    def __init__(
        self,
        daemons: Sequence[Daemon],
        out: Callable[[str], None],
        policy: RestartPolicy | None = None,
        *,
        ready_timeout: float = 30.0,
        interval: float = SUPERVISE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.daemons = list(daemons)
        self.out = out
        self.policy = policy or RestartPolicy()
        self.ready_timeout = ready_timeout
        self.interval = interval
        self.clock = clock
        self._crashes: dict[str, deque[float]] = {d.name: deque() for d in self.daemons}

    def run(self, stop: threading.Event) -> str | None:
        """Until ``stop`` is set; why it gave up (a daemon that keeps crashing), or None."""
        while not stop.wait(self.interval):
            for daemon in self.daemons:
                code = daemon.returncode()
                if code is None:
                    continue
                failure = self._crashed(daemon, code, stop)
                if failure is not None or stop.is_set():
                    return failure
        return None

    def _crashed(self, daemon: Daemon, code: int, stop: threading.Event) -> str | None:
        now = self.clock()
        crashes = self._crashes[daemon.name]
        crashes.append(now)
        while now - crashes[0] > self.policy.window:
            crashes.popleft()
        recent = len(crashes)
        if recent >= self.policy.max_crashes:
            return str(DaemonFailed(
                f"exited with {exit_status(code)}: {recent} crashes within "
                f"{self.policy.window:g} s; not restarting it again",
                daemon=daemon.name, log_path=daemon.log_path, returncode=code))
        delay = self.policy.delay(recent)
        self.out(f"{daemon.name}: exited with {exit_status(code)}; restarting in {delay:.1f} s "
                 f"(crash {recent} of {self.policy.max_crashes} allowed within "
                 f"{self.policy.window:g} s, log: {daemon.log_path})")
        if stop.wait(delay):
            return None
        try:
            daemon.start(self.ready_timeout, stop)
        except StartCancelled:
            return None
        except DaemonFailed as e:
            # Counted as a crash when the next round finds it exited.
            daemon.stop()
            self.out(f"{daemon.name}: restart failed: {e.reason}")
            return None
        self.out(f"{daemon.name}: restarted (pid {daemon.pid})")
        return None
