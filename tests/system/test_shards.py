"""Watcher shards: membership, reports believed only from a shard's owner at its
epoch, two-phase and forced moves, failover, and several watcher processes over one
staging root (real etcd, real registry, real watcher processes)."""

from __future__ import annotations

import math
import random
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from registry_fixtures import RegistryHandle
from watcher_fixtures import (
    Producing,
    WatcherProcess,
    digest,
    histories,
    make_task,
    put_bytes,
    verified_events,
)

from baton_relay.client import Client, Session
from baton_relay.kernel.contract import shard_of
from baton_relay.kernel.errors import NotFound, NotShardOwner
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.registry.verbs.shards import moves_bound, plan_moves
from baton_relay.watcher import Watcher, daemon

Wait = Callable[..., None]
SHARDS = 16


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    return registry_factory(shards=SHARDS, shard_move_deadline=3.0)


class FakeHost:
    """A watcher that follows the protocol by hand: registers, heartbeats, and hands
    shards over when asked (``release`` False: it ignores the request, as a hung one)."""

    def __init__(self, client: Client, name: str, release: bool = True, ttl: int = 3,
                 capacity: Callable[[], pb.WatcherCapacity] = pb.WatcherCapacity) -> None:
        self.client = client
        self.release = release
        self.capacity = capacity
        self.id = client.watcher.register_watcher(f"/roots/{name}", name, ttl=ttl,
                                                  capacity=capacity()).watcher_id
        self.grants: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                reply = self.client.watcher.watcher_heartbeat(self.id, self.capacity())
            except Exception:  # the test stops the registry or the host under it
                continue
            self.grants = {g.shard: g.epoch for g in reply.shards}
            for g in reply.shards:
                if g.release and self.release:
                    self.client.watcher.release_shard(self.id, g.shard, g.epoch)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def hosts(client: Client) -> Iterator[Callable[..., FakeHost]]:
    made: list[FakeHost] = []

    def make(name: str, **kw: object) -> FakeHost:
        h = FakeHost(client, name, **kw)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


def owners(client: Client) -> dict[int, pb.ShardInfo]:
    return {s.shard: s for s in client.operator.list_shards().shards}


def counts(client: Client) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in client.operator.list_shards().shards:
        out[s.owner] = out.get(s.owner, 0) + 1
    return out


def balanced(client: Client, ids: list[str]) -> Callable[[], bool]:
    def check() -> bool:
        shards = client.operator.list_shards().shards
        c = counts(client)
        return (all(s.owner in ids and not s.moving_to for s in shards)
                and max(c.values()) - min(c.get(i, 0) for i in ids) <= 1)

    return check


# the plan, alone ---------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_adding_a_watcher_moves_at_most_a_fair_share(shards: int, n: int) -> None:
    owned: dict[str, list[tuple[int, int]]] = {f"w{i}": [] for i in range(n)}
    for s in range(shards):
        owned[f"w{s % n}"].append((s, 1))
    owned["new"] = []
    moves = plan_moves(owned, list(owned))
    assert len(moves) <= math.ceil(shards / (n + 1) * 1.05)
    assert len(moves) <= moves_bound(shards, n)
    assert all(to == "new" for _, _, to in moves)
    assert len({s for s, _, _ in moves}) == len(moves)  # no shard moved twice


def test_balanced_shards_do_not_move_and_a_draining_watcher_gives_all_up() -> None:
    owned = {"a": [(0, 1), (1, 1), (2, 1)], "b": [(3, 1), (4, 1)], "c": [(5, 1), (6, 1)]}
    assert plan_moves(owned, ["a", "b", "c"]) == []
    moves = plan_moves(owned, ["b", "c"])  # a drains
    assert sorted(s for s, frm, _ in moves if frm == "a") == [0, 1, 2]
    assert {to for _, _, to in moves} <= {"b", "c"}
    keep = plan_moves({"a": [(0, 1)] * 6, "b": []}, ["b"], keepers=["a"])
    assert keep == []  # a full watcher keeps its shards; nothing to give b


def test_a_donor_gives_up_its_oldest_shards_first() -> None:
    moves = plan_moves({"a": [(0, 9), (1, 2), (2, 5)], "b": [(3, 1)]}, ["a", "b"])
    assert moves == [(1, "a", "b")]


# membership on a real registry ----------------------------------------------------------

def test_shards_are_owned_and_balanced_and_listed(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    assert client.operator.list_shards().shard_count == 0  # no watcher yet: no shards
    a, b, c = hosts("a"), hosts("b"), hosts("c")
    wait_for(balanced(client, [a.id, b.id, c.id]), what="16 shards over 3 watchers")
    listing = client.operator.list_shards()
    assert listing.shard_count == SHARDS and len(listing.shards) == SHARDS
    assert {w.watcher_id: w.shards for w in client.operator.list_watchers()} == counts(client)
    wait_for(lambda: sum(len(h.grants) for h in (a, b, c)) == SHARDS, what="grants")


def test_nothing_moves_while_load_merely_jitters(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    """Balanced watchers whose backlog, hash rate and watches change at every heartbeat:
    no shard changes owner (the epochs stay as they were)."""
    rng = random.Random(7)

    def jittering() -> pb.WatcherCapacity:
        return pb.WatcherCapacity(backlog=rng.randrange(0, 5000), hash_mbps=rng.uniform(50, 900),
                                  watches_used=rng.randrange(100, 80_000),
                                  watches_max=100_000, tasks=rng.randrange(0, 50))

    a, b, c = (hosts(n, capacity=jittering) for n in "abc")
    wait_for(balanced(client, [a.id, b.id, c.id]), what="balanced")
    epochs = {n: s.epoch for n, s in owners(client).items()}

    def new_figures(before: list[pb.WatcherInfo]) -> Callable[[], bool]:
        return lambda: all(w.capacity.backlog != x.capacity.backlog for w, x in
                           zip(client.operator.list_watchers(), before, strict=True))

    for _ in range(4):  # several sweeps of the assigner, each after new heartbeats
        wait_for(new_figures(client.operator.list_watchers()),
                 what="new figures from every watcher")
    assert {n: s.epoch for n, s in owners(client).items()} == epochs


def test_a_watcher_near_its_watch_limit_keeps_its_shards_and_takes_no_more(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    full = pb.WatcherCapacity(watches_used=97_000, watches_max=100_000)
    a = hosts("a")
    wait_for(lambda: counts(client).get(a.id) == SHARDS, what="a owns every shard")
    b = hosts("b", capacity=lambda: full)
    wait_for(lambda: b.id in {w.watcher_id for w in client.operator.list_watchers()},
             what="b listed")
    assert client.operator.rebalance(dry_run=True) == []  # b is full: nothing goes its way
    assert counts(client) == {a.id: SHARDS}
    # a goes away: its shards have nowhere to go but to nobody... until a watcher with
    # room registers, which gets them all at once.
    client.operator.drain_watcher(a.id)
    assert counts(client) == {a.id: SHARDS}  # no taker: a keeps them while draining
    c = hosts("c")
    wait_for(lambda: counts(client).get(c.id) == SHARDS, what="c took a's shards")
    assert counts(client).get(b.id, 0) == 0


def test_a_report_from_anyone_but_the_owner_at_its_epoch_is_refused(
    client: Client, session: Session, hosts: Callable[..., FakeHost], wait_for: Wait,
    staging: Path,
) -> None:
    a, b = hosts("a"), hosts("b")
    wait_for(balanced(client, [a.id, b.id]), what="shards balanced")
    make_task(client, "t1", {"f": "f.bin"})
    claim = client.claim("t1", "f", session=session)
    data = b"sharded bytes"
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    Path(claim.path).write_bytes(data)
    client.commit("t1", "f", claim.token, len(data), digest(data), session=session)
    shard = owners(client)[shard_of("t1", SHARDS)]
    owner, other = (a, b) if shard.owner == a.id else (b, a)
    before = client.operator.get_entry("t1", "f")
    for watcher_id, epoch in [(other.id, shard.epoch), ("", 0), (owner.id, shard.epoch - 1),
                              (owner.id, shard.epoch + 1)]:
        with pytest.raises(NotShardOwner) as refused:
            client.watcher.report("t1", "f", len(data), digest(data), reporter="forger",
                                  watcher_id=watcher_id, shard_epoch=epoch)
        assert refused.value.shard == shard.shard and refused.value.owner == owner.id
    after = client.operator.get_entry("t1", "f")
    assert (after.state, after.revision) == (pb.ENTRY_STATE_WRITTEN, before.revision)
    reply = client.watcher.report("t1", "f", len(data), digest(data), reporter="owner",
                                  watcher_id=owner.id, shard_epoch=shard.epoch)
    assert reply.state == pb.ENTRY_STATE_VERIFIED


def test_a_move_is_two_phase_and_the_old_epoch_dies_with_it(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    a, b = hosts("a"), hosts("b")
    wait_for(balanced(client, [a.id, b.id]), what="shards balanced")
    n = next(s for s, i in owners(client).items() if i.owner == a.id)
    epoch = owners(client)[n].epoch
    started = client.operator.move_shard(n, b.id)
    assert started.owner in (a.id, b.id)
    wait_for(lambda: owners(client)[n].owner == b.id and not owners(client)[n].moving_to,
             what="the shard handed over")
    assert owners(client)[n].epoch == epoch + 1
    wait_for(lambda: b.grants.get(n) == epoch + 1, what="b told of its new shard")
    in_n = next(t for t in (f"t{i}" for i in range(10_000)) if shard_of(t, SHARDS) == n)
    with pytest.raises(NotShardOwner):  # the releasing owner's epoch is over
        client.watcher.report(in_n, "f", 1, "0" * 64, watcher_id=a.id, shard_epoch=epoch)


def test_an_owner_that_never_releases_loses_the_shard_at_the_deadline(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    hung = hosts("hung", release=False)
    wait_for(lambda: counts(client).get(hung.id) == SHARDS, what="one watcher owns all")
    fresh = hosts("fresh")
    wait_for(lambda: any(s.moving_to == fresh.id for s in owners(client).values()),
             what="moves started")
    # The hung owner never releases: after the 3 s deadline each move is forced.
    wait_for(balanced(client, [hung.id, fresh.id]), timeout=20, what="moves forced")


def test_a_dead_watchers_shards_are_owned_again_within_its_ttl(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    a, b = hosts("a", ttl=2), hosts("b", ttl=2)
    wait_for(balanced(client, [a.id, b.id]), what="shards balanced")
    mine = {n for n, s in owners(client).items() if s.owner == a.id}
    a.stop()  # no more heartbeats: its lease expires in 2 s
    wait_for(lambda: all(owners(client)[n].owner == b.id for n in mine), timeout=2 + 5,
             what="a's shards owned by b")
    with pytest.raises(NotFound):
        client.watcher.watcher_heartbeat(a.id)


def test_draining_a_watcher_moves_its_shards_away_and_undo_takes_them_back(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    a, b = hosts("a"), hosts("b")
    wait_for(balanced(client, [a.id, b.id]), what="shards balanced")
    reply = client.operator.drain_watcher(a.id)
    assert reply.watcher.draining and reply.moves
    wait_for(lambda: counts(client).get(a.id, 0) == 0, what="a drained")
    assert [w.draining for w in client.operator.list_watchers() if w.watcher_id == a.id] == [True]
    client.operator.drain_watcher(a.id, undo=True)
    wait_for(balanced(client, [a.id, b.id]), what="balanced again")
    with pytest.raises(NotFound):
        client.operator.drain_watcher("0123456789abcdef")


def test_a_drain_reply_names_the_moves_under_way_away_from_the_watcher(
    client: Client, hosts: Callable[..., FakeHost], wait_for: Wait,
) -> None:
    """A drain while a move away from the watcher is already under way (here an
    operator's, which the watcher has not acted on yet) starts none of its own until
    that one ends, and its reply names that move: an operator sees what the drain is
    waiting for."""
    b = hosts("b")
    a = hosts("a", release=False)  # holds on to what it is asked to hand over
    wait_for(balanced(client, [a.id, b.id]), what="shards balanced")
    shard = next(n for n, info in owners(client).items() if info.owner == a.id)
    client.operator.move_shard(shard, b.id, deadline=120)
    reply = client.operator.drain_watcher(a.id)
    assert reply.watcher.draining
    assert [(m.shard, m.from_watcher, m.to_watcher) for m in reply.moves] == [
        (shard, a.id, b.id)]


# real watcher processes over one staging root ----------------------------------------------

def sharded(processes: Callable[..., WatcherProcess], name: str) -> WatcherProcess:
    """A watcher process named ``name``, registered for 3 s, reconciling every 5 s."""
    return processes("--reporter", name, "--shard-ttl", "3", "--reconcile-interval", "5",
                     log_name=name)


@pytest.mark.slow
def test_three_watchers_over_one_root_survive_a_kill_and_a_fourth_joins(
    client: Client, session: Session, processes: Callable[..., WatcherProcess],
    registry: RegistryHandle, wait_for: Wait,
) -> None:
    """SIGKILL one of three while files land: its shards move, every file is verified
    exactly once and never retried; a fourth joining moves at most its fair share."""
    tasks = [f"t{i}" for i in range(12)]
    files = [f"f{j:03d}" for j in range(25)]
    for t in tasks:
        make_task(client, t, {f: f"{f}.bin" for f in files})
    w = [sharded(processes, f"w{i}") for i in range(3)]
    wait_for(lambda: len(client.operator.list_watchers()) == 3, what="3 registered")
    ids = [x.watcher_id for x in client.operator.list_watchers()]
    wait_for(balanced(client, ids), timeout=20, what="balanced over 3")
    producer = Producing(client, session, [(t, f) for f in files for t in tasks])
    total = len(tasks) * len(files)
    verified = lambda: sum(len(client.operator.list_entries(t, pb.ENTRY_STATE_VERIFIED))  # noqa: E731
                           for t in tasks)
    wait_for(lambda: verified() >= total // 4, timeout=60, what="a quarter verified")
    victim = w[0]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    wait_for(lambda: len(client.operator.list_watchers()) == 2, timeout=15, what="victim expired")
    alive = [x.watcher_id for x in client.operator.list_watchers()]
    wait_for(balanced(client, alive), timeout=15, what="victim's shards owned again")
    producer.join(180)
    wait_for(lambda: verified() == total, timeout=120, what="every file verified")
    for t in tasks:
        hist = histories(registry.etcd, registry.prefix, t, files)
        twice = {f: verified_events(h) for f, h in hist.items() if verified_events(h) != 1}
        retried = [f for f, h in hist.items() if any(e["event"] == "failed" for e in h)]
        assert not twice and not retried, (t, twice, retried)
    # A fourth joins: the shards it takes are the only ones that move.
    before = owners(client)
    sharded(processes, "w3")
    wait_for(lambda: len(client.operator.list_watchers()) == 3, what="fourth registered")
    ids = [x.watcher_id for x in client.operator.list_watchers()]
    wait_for(balanced(client, ids), timeout=20, what="balanced over 3 again")
    moved = [n for n, s in owners(client).items() if s.owner != before[n].owner]
    assert len(moved) <= math.ceil(SHARDS / 3 * 1.05), moved
    for p in w[1:]:
        assert "registry refused" not in p.log_tail(10_000), p.log_tail()


# cold task directories --------------------------------------------------------------

def test_a_cold_task_is_unwatched_left_to_reconciliation_and_warms_up_on_a_change(
    client: Client, session: Session, watcher_factory: Callable[..., Watcher],
    wait_for: Wait, staging: Path,
) -> None:
    """No change for ``cold_after``: the tree is unwatched and the reconciliation still
    sees what happens there; a change in the registry watches it again."""
    make_task(client, "t1", {"a": "a.bin", "b": "b.bin"})
    w = watcher_factory(cold_after=0.5, reconcile_interval=1.0)
    put_bytes(client, session, "t1", "a", b"verified while warm")
    wait_for(lambda: client.operator.get_entry("t1", "a").state == pb.ENTRY_STATE_VERIFIED,
             what="a verified")
    wait_for(lambda: w.table.task("t1").cold and not w.table.task("t1").watched,  # type: ignore[union-attr]
             what="t1 cold and unwatched")
    assert w.capacity().cold_tasks == 1
    # Routine passes over the idle cold tree look at its directory, not at its files.
    passes = w.metrics.get("reconciliations")
    # (four passes a second apart: past daemon.RACY_SECONDS since the tree last changed)
    wait_for(lambda: w.metrics.get("reconciliations") >= passes + 4, timeout=15,
             what="the first looks at the cold tree")
    checked, passes = (w.metrics.get("reconcile_entries_checked"),
                       w.metrics.get("reconciliations"))
    wait_for(lambda: w.metrics.get("reconciliations") >= passes + 3, timeout=15,
             what="three routine passes")
    assert w.metrics.get("reconcile_entries_checked") == checked, "an idle cold tree's files"
    # A file put into place there (written aside, renamed over) is seen at the next pass.
    path = Path(client.operator.get_entry("t1", "a").abs_attempt_path)
    aside = path.with_name(".aside")
    aside.write_bytes(b"changed behind the watcher's back")
    aside.rename(path)
    wait_for(lambda: client.operator.get_entry("t1", "a").state != pb.ENTRY_STATE_VERIFIED,
             timeout=15,
             what="the reconciliation saw the change")
    # That change, and the claim, reach the watcher from the registry: it warms up.
    claim = client.claim("t1", "b", session=session)
    wait_for(lambda: w.table.task("t1").watched, what="warm again")  # type: ignore[union-attr]
    data = b"landed while warm"
    Path(claim.path).write_bytes(data)
    client.commit("t1", "b", claim.token, len(data), digest(data), session=session)
    wait_for(lambda: client.operator.get_entry("t1", "b").state == pb.ENTRY_STATE_VERIFIED,
             what="b verified")


def test_near_the_watch_limit_the_watcher_says_so_and_sheds_the_idlest_tasks(
    client: Client, watcher_factory: Callable[..., Watcher], wait_for: Wait, staging: Path,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    for i in range(4):
        make_task(client, f"t{i}", {"a": "a.bin"})
        (staging / f"t{i}").mkdir()
    limit = tmp_path / "max_user_watches"
    limit.write_text("1000000\n")
    monkeypatch.setattr(daemon, "MAX_USER_WATCHES", str(limit))
    w = watcher_factory()
    wait_for(lambda: sum(1 for t in w.table.task_ids() if w.table.task(t).watched) == 4,  # type: ignore[union-attr]
             what="4 tasks watched")
    used = w.watches.watch_count()
    assert w.capacity().watches_max == 1_000_000
    limit.write_text(f"{used}\n")  # the host's limit drops to what is used now
    wait_for(lambda: w.watches.watch_count() <= used * daemon.WATCHES_LOW, what="shed")
    assert any("near the inotify watch limit" in r.getMessage() for r in caplog.records)
    assert w.table.cold_count() >= 1 and w.capacity().cold_tasks == w.table.cold_count()


def test_a_restart_naming_its_previous_registration_takes_its_shards_back_at_once(
    client: Client,
) -> None:
    """Registering again with ``previous`` ends the old registration at once (not after
    its TTL) and the new one owns every shard the old one did; a previous id that is
    gone already is nothing to end."""
    old = client.watcher.register_watcher("/roots/r", "w", ttl=600)
    assert {s.owner for s in owners(client).values()} == {old.watcher_id}
    new = client.watcher.register_watcher("/roots/r", "w", ttl=600, previous=old.watcher_id)
    with pytest.raises(NotFound):
        client.watcher.watcher_heartbeat(old.watcher_id)
    assert {s.owner for s in owners(client).values()} == {new.watcher_id}
    assert {g.shard for g in new.shards} == set(range(SHARDS))
    again = client.watcher.register_watcher("/roots/r", "w", ttl=600, previous=old.watcher_id)
    assert client.watcher.watcher_heartbeat(new.watcher_id).ttl > 0  # not touched
    client.watcher.watcher_heartbeat(again.watcher_id)


def test_a_killed_watcher_restarted_on_its_state_file_is_back_at_once(
    registry: RegistryHandle, client: Client, processes: Callable[..., WatcherProcess],
    tmp_path: Path, wait_for: Wait,
) -> None:
    """SIGKILL a watcher with a 600 s registration and start it again on the same state
    file: the new registration ends the dead one and owns every shard within seconds."""
    state = str(tmp_path / "state.sqlite")
    first = processes("--state-file", state, "--shard-ttl", "600")
    wait_for(lambda: len(client.operator.list_watchers()) == 1, what="registered")
    (dead,) = [w.watcher_id for w in client.operator.list_watchers()]
    first.proc.kill()
    first.proc.wait()
    processes("--state-file", state, "--shard-ttl", "600", log_name="again")
    wait_for(lambda: [w.watcher_id for w in client.operator.list_watchers()] not in ([], [dead]),
             timeout=20, what="the restart registered")
    (alive,) = [w.watcher_id for w in client.operator.list_watchers()]
    assert alive != dead
    wait_for(lambda: {s.owner for s in owners(client).values()} == {alive}, timeout=10,
             what="every shard the restart's")
