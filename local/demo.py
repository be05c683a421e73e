"""A small live pipeline: producer agents hand files to consumer agents through Baton.

``baton demo`` (or ``baton up --demo``) creates a task, starts producer and
consumer threads, each an agent with its own session, and shows the entries
moving from ``pending`` to ``consumed`` until every file has been handed over.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..client._client import Client
from ..client.consumer import consume
from ..client.producer import produce
from ..kernel import errors

STATES = ("pending", "writing", "written", "verified", "consumed", "dead")


@dataclass
class DemoResult:
    task_id: str
    files: int
    consumed: int
    seconds: float
    problems: list[str] = field(default_factory=list)


def _producer(client: Client, task_id: str, name: str, stop: threading.Event,
              problems: list[str]) -> None:
    try:
        with client.open_session(name, ttl=10) as session:
            while not stop.is_set():
                try:
                    with produce(client, session, task_id) as out:
                        out.write(f"{out.claim.file_id} by {name}\n".encode())
                        out.write(os.urandom(16 * 1024))
                except errors.NothingToClaim:
                    return
    except errors.BatonError as e:
        problems.append(f"{name}: {e}")


def _consumer(client: Client, task_id: str, name: str, stop: threading.Event,
              problems: list[str]) -> None:
    try:
        with client.open_session(name, ttl=10) as session:
            while not stop.is_set():
                try:
                    with consume(client, session, task_id, "default", timeout=0.5):
                        pass  # the bytes were checked against the verified digest
                except errors.NothingToClaim:
                    continue
    except errors.BatonError as e:
        problems.append(f"{name}: {e}")


def _table(task_id: str, states: dict[str, int], files: int, elapsed: float) -> Table:
    table = Table(title=f"task {task_id}: {states.get('consumed', 0)}/{files} handed over "
                        f"in {elapsed:.1f}s")
    for state in STATES:
        table.add_column(state, justify="right")
    table.add_row(*(str(states.get(s, 0)) for s in STATES))
    return table


def run_demo(
    client: Client,
    *,
    files: int = 24,
    producers: int = 3,
    consumers: int = 2,
    timeout: float = 60.0,
    console: Console | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> DemoResult:
    """Run the pipeline to completion (or ``timeout``); the outcome."""
    console = console or Console(stderr=True)
    task_id = f"demo-{int(time.time())}"
    client.operator.create_task({
        "task_id": task_id,
        "labels": {"kind": "demo"},
        "entries": [{"file_id": f"f{i:03d}", "path": f"out/f{i:03d}.bin"} for i in range(files)],
    })
    stop = threading.Event()
    problems: list[str] = []
    threads = [threading.Thread(target=_producer, args=(client, task_id, f"producer-{i}", stop,
                                                        problems), daemon=True)
               for i in range(producers)]
    threads += [threading.Thread(target=_consumer, args=(client, task_id, f"consumer-{i}", stop,
                                                         problems), daemon=True)
                for i in range(consumers)]
    start = clock()
    for t in threads:
        t.start()
    states: dict[str, int] = {}
    # A live table only where it can redraw itself: into a pipe or a file, Live would
    # print just its last frame, without a line end, and the next line would be glued
    # to it. There the final table is printed once, as a whole.
    live = (Live(_table(task_id, states, files, 0.0), console=console, refresh_per_second=8)
            if console.is_terminal else None)
    with live or nullcontext():
        while clock() - start < timeout:
            states = dict(client.operator.get_task(task_id).states)
            if live is not None:
                live.update(_table(task_id, states, files, clock() - start))
            if states.get("consumed", 0) + states.get("dead", 0) >= files:
                break
            time.sleep(0.1)
    if live is None:
        console.print(_table(task_id, states, files, clock() - start))
    stop.set()
    for t in threads:
        t.join(timeout=5)
    consumed = states.get("consumed", 0)
    if consumed < files:
        problems.append(f"only {consumed}/{files} files were consumed within {timeout:.0f}s "
                        "(is a watcher verifying the staging directory?)")
    return DemoResult(task_id, files, consumed, clock() - start, problems)
