"""A clock the test owns, and the event loop an in-process registry runs on by it.

Time runs at the machine's pace, shifted by whatever the test has moved it on: an agent's
calls, its retries and its waits take the time they take, and ``advance(600)`` makes ten
minutes pass for the registry and its store at once. The registry reads every time it
keeps from this clock: the loop's ``time()`` (its pauses, timers, lease times of the
in-memory store) and its wall clock (record stamps, deadlines, due times; see
``registry/records/clock.py``).

:meth:`Clock.advance` does not jump blindly. It goes from one timer of the registry's
loop to the next (a lease running out, a sweep's due time, a deadline, a backoff's
end), lets the registry do what that one set off, and only then goes on: what falls due
during the interval fires in order, as it would have had the time passed.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

#: what runs before each step of an advance, told the step's target (the loop's time)
Hook = Callable[[float], Coroutine[Any, Any, None]]

#: the most timers one :meth:`Clock.advance` goes through before it calls it a loop that
#: re-arms itself at once (a bug of the registry: it would spin in real time too)
MAX_STEPS = 200_000
#: turns of the loop with nothing ready and nothing due that count as "settled"
QUIET_TURNS = 3
#: turns one settling may take at most (a registry that is never quiet is still let go)
MAX_TURNS = 10_000


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is its :class:`Clock`'s."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def time(self) -> float:
        return self.clock.monotonic()

    def next_due(self) -> float:
        """When the earliest timer of this loop is due, in its time (inf: none)."""
        # A copy of the heap, taken in one call: it may be written on the loop's thread.
        handles = list(self._scheduled)  # type: ignore[attr-defined]
        return min((h.when() for h in handles if not h.cancelled()), default=math.inf)

    def busy(self) -> bool:
        """Whether a callback is ready to run or a timer is due."""
        return bool(self._ready) or self.next_due() <= self.time()  # type: ignore[attr-defined]


class Clock:
    """The machine's clock, moved on by :meth:`advance` (never back)."""

    def __init__(self) -> None:
        self._ahead = 0.0
        self._lock = threading.Lock()
        self._loops: list[ClockLoop] = []
        #: per loop, called on its thread before each step of :meth:`advance` with the
        #: step's target (loop time): what must hold through it (live sessions' leases)
        self._before_step: dict[ClockLoop, list[Hook]] = {}

    @property
    def ahead(self) -> float:
        """Seconds this clock has been moved on in all."""
        return self._ahead

    def time(self) -> float:
        """Now, in UTC epoch seconds."""
        return time.time() + self._ahead

    def monotonic(self) -> float:
        """Now, for durations (the registry loop's time)."""
        return time.monotonic() + self._ahead

    def loop(self) -> ClockLoop:
        """A new event loop run by this clock (an in-process registry's)."""
        loop = ClockLoop(self)
        with self._lock:
            self._loops.append(loop)
        return loop

    def forget(self, loop: ClockLoop) -> None:
        with self._lock:
            if loop in self._loops:
                self._loops.remove(loop)
            self._before_step.pop(loop, None)

    def before_step(self, loop: ClockLoop, hook: Hook) -> None:
        """Run ``hook(target)`` on ``loop`` before each step of an advance that holds
        sessions."""
        with self._lock:
            self._before_step.setdefault(loop, []).append(hook)

    def advance(self, seconds: float, *, hold_sessions: bool = True) -> None:
        """Move time on by ``seconds``, firing in order whatever falls due meanwhile, and
        return once the registry has done what they set off.

        ``hold_sessions``: the agents' sessions and watchers' registrations alive now
        stay alive through the jump, as if their holders had kept them alive all along
        (they do, at the machine's pace). False lets their leases run out too: every
        agent frozen for ``seconds``."""
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"advance: {seconds!r} is not a number of seconds ahead")
        loops = self._live_loops()
        end = self._ahead + seconds
        hooks = dict(self._before_step) if hold_sessions else {}
        if len(loops) == 1:  # the usual case: every step taken on the loop's own thread
            loop = loops[0]
            asyncio.run_coroutine_threadsafe(
                self._advance_on(loop, hooks.get(loop, []), end, seconds), loop).result()
            return
        for _ in range(MAX_STEPS):
            self._settle(loops)
            due = min((loop.next_due() for loop in loops), default=math.inf)
            step = max(0.0, due - self.monotonic())
            if self._ahead + step >= end:
                break
            target = self.monotonic() + step
            self._run(loops, hooks, target)
            self._ahead += step
            self._wake(loops)
        else:
            raise RuntimeError(f"advance({seconds:g}): more than {MAX_STEPS} timers fell "
                               "due: something re-arms itself at once")
        self._run(loops, hooks, self.monotonic() + (end - self._ahead))
        self._ahead = end
        self._wake(loops)
        self._settle(loops)

    async def _advance_on(self, loop: ClockLoop,
                          hooks: list[Hook], end: float,
                          seconds: float) -> None:
        """:meth:`advance` with one loop, run on it: no thread hand-off per step."""
        for _ in range(MAX_STEPS):
            await _settled(loop)
            step = max(0.0, loop.next_due() - self.monotonic())
            if self._ahead + step >= end:
                break
            for hook in hooks:
                await hook(self.monotonic() + step)
            self._ahead += step
        else:
            raise RuntimeError(f"advance({seconds:g}): more than {MAX_STEPS} timers fell "
                               "due: something re-arms itself at once")
        for hook in hooks:
            await hook(self.monotonic() + (end - self._ahead))
        self._ahead = end
        await _settled(loop)

    def _live_loops(self) -> list[ClockLoop]:
        with self._lock:
            return [loop for loop in self._loops if loop.is_running()]

    @staticmethod
    def _run(loops: list[ClockLoop],
             hooks: dict[ClockLoop, list[Hook]],
             target: float) -> None:
        for loop in loops:
            for hook in hooks.get(loop, ()):
                asyncio.run_coroutine_threadsafe(hook(target), loop).result(30)

    @staticmethod
    def _wake(loops: list[ClockLoop]) -> None:
        """A loop asleep in its selector computed its timeout by the old time."""
        for loop in loops:
            loop.call_soon_threadsafe(_nothing)

    @staticmethod
    def _settle(loops: list[ClockLoop]) -> None:
        for loop in loops:
            asyncio.run_coroutine_threadsafe(_settled(loop), loop).result(60)


def _nothing() -> None:
    pass


async def _settled(loop: ClockLoop) -> None:
    """Return once the loop has had nothing to do for a few turns."""
    quiet = 0
    for _ in range(MAX_TURNS):
        await asyncio.sleep(0)
        quiet = 0 if loop.busy() else quiet + 1
        if quiet >= QUIET_TURNS:
            return
