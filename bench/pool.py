"""A pool of agent processes, one per agent, reused across the points of a scenario.

A job prepares (connects, opens its session), calls ``ready()`` and starts when every
job of the round is prepared, at the same instant of the machine-wide monotonic
clock. Workers are spawned (not forked: the parent holds gRPC channels), ignore
Ctrl-C (the parent stops them once the daemons are down) and die with the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any, Self

from .harness import BenchError, check_interrupted, die_with_parent

Ready = Callable[[], float]
Job = Callable[[Any, Ready], Any]

#: how long the agents of a round may take to start and prepare (64 spawns on 2 busy cores)
PREPARE_TIMEOUT = 240.0
#: how long a round may take beyond its own duration before it is given up
ROUND_SLACK = 120.0


def _worker(index: int, jobs: Queue[Any], results: Queue[Any]) -> None:
    die_with_parent()
    # Ctrl-C is the parent's to handle: it stops the workers once their daemons are down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    began: list[float] = []

    def ready() -> float:
        results.put(("ready", index, None))
        message = jobs.get()
        if message is None:
            raise SystemExit(0)
        start: float = message[1]
        time.sleep(max(0.0, start - time.monotonic()))
        began[:] = [time.process_time()]
        return start

    while True:
        message = jobs.get()
        if message is None:
            return
        fn, arg = message
        began.clear()
        try:
            value = fn(arg, ready)
            # This process's CPU from the common start to the job's end (its own work
            # in the measured part: the agent's client library, not the daemons).
            cpu = time.process_time() - began[0] if began else 0.0
            results.put(("done", index, (value, cpu)))
        except BaseException:
            results.put(("error", index, traceback.format_exc()))


@dataclass
class Round:
    """The outcome of one :meth:`Pool.run`: when it started, and each job's result."""

    start: float
    results: list[Any]
    #: each job's CPU seconds from the common start to its end
    cpu: list[float] = field(default_factory=list)


class Pool:
    """``size`` spawned worker processes, each running one job (one agent) per round."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.results: Queue[Any] = ctx.Queue()
        self.jobs: list[Queue[Any]] = [ctx.Queue() for _ in range(size)]
        self.processes = [
            ctx.Process(target=_worker, args=(i, self.jobs[i], self.results), daemon=True,
                        name=f"bench-agent-{i}")
            for i in range(size)
        ]
        for p in self.processes:
            p.start()
        self._running = 0
        self.last_cpu: list[float] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for q in self.jobs:
            # Twice: a worker waiting in ready() takes the first one as "stop the job".
            q.put(None)
            q.put(None)
        deadline = time.monotonic() + 5
        for p in self.processes:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def _get(self, deadline: float) -> tuple[str, int, Any]:
        while True:
            check_interrupted()
            try:
                kind, index, value = self.results.get(timeout=0.5)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise BenchError("agents did not answer in time") from None
        if kind == "error":
            raise BenchError(f"agent {index} failed:\n{value}")
        return kind, index, value

    def start(self, fn: Job, args: Sequence[Any]) -> float:
        """Start ``fn(arg, ready)`` for each of ``args`` on its own worker, all together.

        Returns the common start instant (``time.monotonic()``) once every job is
        prepared; :meth:`collect` gathers the results. A job that fails raises
        :class:`BenchError`, and the pool is unusable after that.
        """
        if len(args) > len(self.jobs):
            raise ValueError(f"{len(args)} jobs for {len(self.jobs)} workers")
        for q, arg in zip(self.jobs, args, strict=False):
            q.put((fn, arg))
        deadline = time.monotonic() + PREPARE_TIMEOUT
        for _ in args:
            kind, _, _ = self._get(deadline)
            if kind != "ready":
                raise BenchError("an agent finished before it was ready")
        start = time.monotonic() + 0.05
        for q in self.jobs[: len(args)]:
            q.put(("go", start))
        self._running = len(args)
        return start

    def collect(self, seconds: float) -> list[Any]:
        """The results of the jobs :meth:`start` started, waiting up to ``seconds`` + slack."""
        results: list[Any] = [None] * self._running
        cpu = [0.0] * self._running
        deadline = time.monotonic() + seconds + ROUND_SLACK
        for _ in range(self._running):
            _, index, (value, seconds_cpu) = self._get(deadline)
            results[index] = value
            cpu[index] = seconds_cpu
        self._running = 0
        self.last_cpu = cpu
        return results

    def run(self, fn: Job, args: Sequence[Any], seconds: float) -> Round:
        """:meth:`start` then :meth:`collect`: one round of jobs that run ``seconds`` or less."""
        start = self.start(fn, args)
        results = self.collect(start - time.monotonic() + seconds)
        return Round(start, results, self.last_cpu)
