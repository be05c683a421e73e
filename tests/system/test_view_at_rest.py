"""The registry's view at rest: its etcd watch lives across compactions (issue 39).

The view (``registry.view``) loads the keys it mirrors once and follows them with one
etcd watch. etcd compacts only history: a watch that has caught up stays, however far
the compaction moves past the revision it started from, so an idle view neither
breaks nor loads again. The test runs an etcd of its own that compacts every second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from compacting import COMPACTING, compacted, start_etcd, tick

from baton_relay.registry.store.etcd import Etcd, Put
from baton_relay.registry.store.keys import Keys
from baton_relay.registry.store.view import View

PREFIX = "/baton-view-rest/"


#: seconds each wait of the test may take
DEADLINE = 20.0


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` until it is true, failing at a deadline."""
    deadline = time.monotonic() + DEADLINE
    while not await condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {DEADLINE:g} s waiting for {what}")
        await asyncio.sleep(0.05)


def test_an_idle_view_keeps_its_watch_across_compactions(tmp_path: Path) -> None:
    """While nothing it watches changes and etcd compacts past the revision its watch
    started from, several times over, the view loads once (at start), stays ready, and
    its watch still brings the next change."""
    etcd_process = start_etcd(tmp_path, *COMPACTING)
    try:
        asyncio.run(idle_view(etcd_process.endpoint))
    finally:
        etcd_process.stop()


async def idle_view(endpoint: str) -> None:
    etcd = Etcd(endpoint, timeout=10)
    await etcd.connect()
    keys = Keys(PREFIX)
    view = View(etcd, keys)
    loads = 0
    load = view._load

    async def counted() -> int:
        nonlocal loads
        loads += 1
        return await load()

    view._load = counted  # type: ignore[method-assign]
    await view.start()
    try:
        assert view.ready and loads == 1
        started = view.revision

        # etcd compacts past the watch's start, then past three later marks
        for _ in range(4):
            mark = await tick(etcd)

            async def past(mark: int = mark) -> bool:
                await tick(etcd)
                return await compacted(etcd, mark)

            await until(past, f"etcd compacting past revision {mark}")
        assert await compacted(etcd, started + 1)
        assert loads == 1 and view.ready
        # the watch is alive: a task header written now reaches the mirror
        header = keys.task("t")
        await etcd.txn([], [Put(header, b'{"status": "active"}')])

        async def mirrored() -> bool:
            return bool(await view.scan(keys.tasks(), 0, False))

        await until(mirrored, "the new task header in the view")
        assert loads == 1
    finally:
        await view.stop()
        await etcd.close()
