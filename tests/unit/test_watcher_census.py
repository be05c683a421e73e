"""The watcher's census (its metrics' entries by state, and the oldest written) is kept
as entries change, so a scrape at rest reads counts, not every stored entry (issue 39);
it must say what a pass over the entries says, whatever the news."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.watcher.state import STATE_NAMES, Table

STATES = [s for s in pb.EntryState.values() if s]
START = datetime(2026, 1, 1, tzinfo=UTC)


def entry(file_id: int, state: int, revision: int) -> pb.Entry:
    return pb.Entry(file_id=f"f{file_id}", path=f"d{file_id % 3}/f{file_id}", state=state,
                    revision=revision,
                    updated_at=(START + timedelta(seconds=revision)).isoformat())


def by_pass(table: Table) -> tuple[dict[str, int], int]:
    """The census the slow way: every entry of every task."""
    counts = {name: 0 for state, name in STATE_NAMES.items() if state}
    oldest = 0
    for task_id in table.task_ids():
        for e in table.entries(task_id):
            counts[e.state_name] += 1
            if e.state == pb.ENTRY_STATE_WRITTEN and (not oldest or e.updated_ns < oldest):
                oldest = e.updated_ns
    return counts, oldest


def test_the_census_follows_news_snapshots_and_dropped_tasks(tmp_path: object) -> None:
    rng = random.Random(39)
    table = Table(str(tmp_path))
    for step in range(400):
        revision = step + 1
        task_id = f"t{rng.randrange(3)}"
        table.add_task(task_id)
        if step % 50 == 49:
            # a snapshot: some entries stay (some changed), the others are dropped
            table.replace(task_id, [entry(i, rng.choice(STATES), revision)
                                    for i in range(rng.randrange(8))])
        elif step % 97 == 96:
            table.remove_task(task_id)
        else:
            # news, sometimes older than what is known (ignored)
            table.apply(task_id, entry(rng.randrange(12), rng.choice(STATES),
                                       revision - rng.choice((0, 0, 0, 5))))
        assert table.census() == by_pass(table), f"after step {step}"
    counts, oldest = table.census()
    assert sum(counts.values()) > 0 and oldest > 0  # the walk met written entries
