"""One producer agent of the producer-loops scenario (``bench/loops.py``), a process of its
own that runs one job after another.

It is run as a file (``python bench/loop_agent.py``), not as a module of the bench, so
that the same file drives the current tree and an earlier one: which ``baton_relay`` it
imports is the one ``PYTHONPATH`` names. It uses only what every tree's client offers
(``Client``, ``open_session``, ``produce``, ``produce_each``) and the standard library.

The parent speaks to it in lines: a job (JSON) on stdin; ``ready`` on stdout once the
job is prepared (connected, session open); a start instant (the machine-wide monotonic
clock) on stdin; the job's result (JSON) on stdout. ``null`` ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

Job = dict[str, Any]
Gate = Callable[[], float]


def _gate() -> float:
    """Say ready, wait for the common start and sleep until it; the start instant."""
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    time.sleep(max(0.0, start - time.monotonic()))
    return start


class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.claimed: list[str] = []
        self.written: dict[str, float] = {}
        self.cpu0 = 0.0

    def begin(self, gate: Gate) -> float:
        start = gate()
        self.cpu0 = time.process_time()
        return start

    def result(self) -> Job:
        return {"latencies": self.latencies, "claimed": self.claimed, "end": time.monotonic(),
                "cpu": time.process_time() - self.cpu0, "written": self.written}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def baton(job: Job, gate: Gate) -> Job:
    """Producer steps through the client's helpers on a kept-alive session: ``each`` is
    ``produce_each`` (what a producer loop calls), ``single`` the same one entry per
    step (``ahead=1``), ``checkpoint`` the same with one
    checkpoint per step (after the write, before the commit; trees that have
    ``Output.checkpoint``), ``plain`` a ``produce`` block per entry (a claim, then a
    commit)."""
    from baton_relay.client import Client, produce, produce_each

    payload = b"x" * job["size"]
    tally = Tally()
    with Client(job["address"], timeout=30) as c, c.open_session(job["agent"], ttl=30) as s:
        deadline = tally.begin(gate) + job["seconds"]
        t0 = time.perf_counter()
        if job["loop"] in ("each", "checkpoint", "single"):
            checkpoint = job["loop"] == "checkpoint"
            # the wall-clock instant each file was written (closed), for write → verified
            timed = bool(job.get("times"))
            # "single": one entry per step (trees that have ``ahead``)
            steps: Generator[Any, None, None] = (
                produce_each(c, s, job["task"], ahead=1) if job["loop"] == "single"
                else produce_each(c, s, job["task"]))
            for out in steps:
                closes = hasattr(out, "close")
                if not closes and time.monotonic() >= deadline:
                    # Trees older than ``Output.close`` fail the output in hand on
                    # leaving: it is left unwritten and uncounted.
                    steps.close()
                    break
                out.write(payload)
                if checkpoint:
                    out.checkpoint(data=b"offset 512", progress=1.0)
                if closes:
                    out.close()  # complete: leaving the loop commits it
                tally.claimed.append(out.claim.file_id)
                if timed:
                    tally.written[out.claim.file_id] = time.time()
                now = time.perf_counter()
                if len(tally.claimed) > 1:
                    tally.latencies.append(now - t0)
                t0 = now
                if closes and time.monotonic() >= deadline:
                    # Closing the loop while the session is open commits every output
                    # written (a loop working ahead commits several per step) and gives
                    # back the entries claimed ahead, so each one counted is published
                    # within the round and none is failed.
                    steps.close()
                    break
        else:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    with produce(c, s, job["task"]) as out:
                        out.write(payload)
                except Exception as e:
                    if type(e).__name__ == "NothingToClaim":
                        break
                    raise
                tally.latencies.append(time.perf_counter() - t0)
                tally.claimed.append(out.claim.file_id)
    return tally.result()


def postgres(job: Job, gate: Gate) -> Job:
    """The same producer on PostgreSQL: claim a row (``FOR UPDATE SKIP LOCKED``), write
    its file as ``produce`` does (temp file, fsync, rename, fsync of the directory), then
    mark the row written."""
    import psycopg
    from psycopg import sql

    t = sql.Identifier(job["table"])
    claim_q = sql.SQL(job["claim_sql"]).format(t=t)
    commit_q = sql.SQL(job["commit_sql"]).format(t=t)
    payload = b"x" * job["size"]
    where = job["staging"]
    os.makedirs(where, exist_ok=True)
    tally = Tally()
    with psycopg.connect(job["conninfo"], autocommit=True) as conn:
        conn.execute("SELECT 1")  # connected before the clock starts
        deadline = tally.begin(gate) + job["seconds"]
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            row = conn.execute(claim_q, (job["agent"],), prepare=True).fetchone()
            if row is None:
                break
            name = f"e{row[0]:06d}"
            tmp = os.path.join(where, f".{name}.{job['agent']}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, os.path.join(where, name))
            _fsync_dir(where)
            done = conn.execute(commit_q, (row[0], job["agent"]), prepare=True)
            if done.rowcount != 1:
                raise RuntimeError(f"row {row[0]} was not this agent's to commit")
            tally.latencies.append(time.perf_counter() - t0)
            tally.claimed.append(name)
    return tally.result()


def postgres_batched(job: Job, gate: Gate) -> Job:
    """The PostgreSQL loop a careful engineer writes: each step is one transaction that
    marks written (with their BLAKE3) the rows the last step's files were written for,
    checking they are still this agent's, and claims up to ``batch`` more rows
    (``FOR UPDATE SKIP LOCKED``). Each file is written as ``produce`` writes one (temp
    file, fsync, rename, fsync of the directory), its BLAKE3 taken from its bytes."""
    import blake3
    import psycopg
    from psycopg import sql

    t = sql.Identifier(job["table"])
    commit_q = sql.SQL(job["commit_sql"]).format(t=t)
    claim_q = sql.SQL(job["claim_sql"]).format(t=t)
    payload = b"x" * job["size"]
    where = job["staging"]
    os.makedirs(where, exist_ok=True)
    tally = Tally()
    held: list[int] = []
    written: list[tuple[int, str]] = []
    with psycopg.connect(job["conninfo"]) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        deadline = tally.begin(gate) + job["seconds"]
        t0 = time.perf_counter()
        while True:
            with conn.transaction():
                if written:
                    done = conn.execute(commit_q, ([i for i, _ in written],
                                                   [d for _, d in written], job["agent"]),
                                        prepare=True)
                    if done.rowcount != len(written):
                        raise RuntimeError("rows written were no longer this agent's")
                    for i, _ in written:
                        tally.claimed.append(f"e{i:06d}")
                    written = []
                if time.monotonic() >= deadline:
                    break
                held = [r[0] for r in conn.execute(claim_q, (job["agent"], job["batch"]),
                                                   prepare=True).fetchall()]
            if not held:
                break
            for row in held:
                name = f"e{row:06d}"
                tmp = os.path.join(where, f".{name}.{job['agent']}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, payload)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, os.path.join(where, name))
                _fsync_dir(where)
                written.append((row, blake3.blake3(payload).hexdigest()))
                now = time.perf_counter()
                tally.latencies.append(now - t0)
                t0 = now
    return tally.result()


RUNNERS = {"baton": baton, "postgres": postgres, "postgres-batched": postgres_batched}


def main() -> int:
    for line in sys.stdin:
        job = json.loads(line)
        if job is None:
            return 0
        print(json.dumps(RUNNERS[job["runner"]](job, _gate)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
