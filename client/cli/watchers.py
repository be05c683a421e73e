"""Watcher shards: ``watcher ls|drain`` and ``shard ls|move|rebalance``.

The registry keeps every shard owned and the watchers balanced by itself; these
commands are for the operator who wants to see who checks what, move one shard by
hand, or empty a watcher before its host goes down. A move is two-phase (the owner
hands the shard over at its next heartbeat, or loses it at the deadline), so the
commands that start moves wait, by default, until the moves are done: a script can
stop the drained watcher as soon as ``baton watcher drain`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from ...kernel import errors
from ._common import (
    BatonGroup,
    F,
    Settings,
    as_dict,
    emit_json,
    emit_table,
    err_console,
    folding_table,
    output_option,
    pass_settings,
)
from ._root import cli

if TYPE_CHECKING:
    from ...kernel.v1 import baton_pb2 as pb

#: seconds between two looks at the registry while a move or a drain is waited for
#: (ListShards reads every task header to count each shard's tasks: not too often)
POLL_INTERVAL = 0.5


class StillMoving(errors.BatonError):
    """A drain or a move was not done within the command's ``--timeout``; it goes on
    in the registry."""


class MoveCalledOff(errors.BatonError):
    """The shard being waited for ended up with another watcher than the one asked
    for (``shard``, ``owner``): the target left or started draining, or the owner
    left and the shard was owned again."""

    exit_code = 4


@dataclass
class Waiter:
    """Polls until a condition holds or ``timeout`` seconds passed. On a terminal a
    spinner on stderr says what it waits for (as ``consume --wait`` does); elsewhere
    stderr stays for the one error line. Clock and sleep are swappable for tests."""

    timeout: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    @contextmanager
    def showing(self, first: str) -> Iterator[Callable[[str], None]]:
        """A spinner showing ``first``; what is yielded replaces its text."""
        console = err_console()
        if not console.is_terminal:
            yield lambda text: None
            return
        with console.status(first, spinner="dots") as status:
            yield lambda text: status.update(text)

    def until(self, done: Callable[[], str | None], what: str) -> str:
        """Call ``done`` until it returns a text (what happened), for at most
        ``timeout`` seconds; ``what`` says what is still not done if it never does."""
        deadline = self.clock() + self.timeout
        while True:
            result = done()
            if result is not None:
                return result
            if self.clock() >= deadline:
                raise StillMoving(f"{what} after {self.timeout:g} s; it goes on in the "
                                  "registry (see `baton shard ls`)")
            self.sleep(POLL_INTERVAL)


def timeout_option(default: float) -> Callable[[F], F]:
    return click.option(
        "--timeout", "limit", type=click.FloatRange(min=0, min_open=True), default=default,
        show_default=True, metavar="SECONDS", help="give up waiting after this long (exit 1)")


def wait_option(f: F) -> F:
    return click.option(
        "--wait/--no-wait", default=True, show_default=True,
        help="wait until the shards have moved")(f)


# --- watchers ------------------------------------------------------------------------


@cli.group(cls=BatonGroup)
def watcher() -> None:
    """Watchers registered with the registry, and draining one."""


def _watches(cap: pb.WatcherCapacity) -> tuple[str, str]:
    """``used/max`` and the watches left; ``?`` where the host did not say its limit."""
    if not cap.watches_max:
        return f"{cap.watches_used}/?", "?"
    return f"{cap.watches_used}/{cap.watches_max}", str(cap.watches_max - cap.watches_used)


def watcher_json(w: pb.WatcherInfo) -> dict[str, Any]:
    """One watcher for scripts: flat, with its capacity's fields at the top level."""
    cap = w.capacity
    return {
        "watcher_id": w.watcher_id, "host": w.host, "pid": w.pid, "root": w.root,
        "reporter": w.reporter, "identity": w.identity, "shards": w.shards,
        "watches_used": cap.watches_used, "watches_max": cap.watches_max,
        "watches_free": cap.watches_max - cap.watches_used if cap.watches_max else None,
        "hash_mbps": cap.hash_mbps, "backlog": cap.backlog, "tasks": cap.tasks,
        "cold_tasks": cap.cold_tasks, "ttl_left": w.ttl_left, "draining": w.draining,
        "registered_at": w.registered_at,
    }  # fmt: skip


@watcher.command("ls")
@output_option
@pass_settings
def watcher_ls(settings: Settings, output: str) -> None:
    """List the registered watchers: where each runs and what it can take.

    Per watcher: id, host, pid, the staging root as it mounts it, the shards it
    owns, inotify watches used/max and free, its hashing rate (MB/s), checks
    queued, cold tasks (unwatched for having had no change), seconds its lease
    has left, and whether it is draining. A watcher at 95% of its watches, or
    draining, takes no more shards.
    """
    watchers = sorted(settings.client().operator.list_watchers(),
                      key=lambda w: (w.host, w.watcher_id))
    if output == "json":
        emit_json([watcher_json(w) for w in watchers])
        return
    if not watchers:
        click.echo("no watcher is registered")
        return
    table = folding_table("id", "host", "pid", "root", "shards", "watches", "free", "hash_mbps",
                          "backlog", "cold", "ttl_left", "draining", whole=("id",))
    for w in watchers:
        cap = w.capacity
        watches, free = _watches(cap)
        table.add_row(w.watcher_id, w.host, str(w.pid), w.root, str(w.shards), watches, free,
                      f"{cap.hash_mbps:.1f}" if cap.hash_mbps else "-", str(cap.backlog),
                      str(cap.cold_tasks), f"{w.ttl_left} s", "yes" if w.draining else "no")
    emit_table(table)


@watcher.command("drain")
@click.argument("watcher_id", metavar="WATCHER")
@click.option("--undo", is_flag=True, help="let the watcher take shards again")
@wait_option
@timeout_option(300)
@pass_settings
def watcher_drain(settings: Settings, watcher_id: str, undo: bool, wait: bool,
                  limit: float) -> None:
    """Move every shard away from a watcher, so that it can stop.

    The watcher takes no shards from now on; each of its shards moves to another
    watcher (two-phase: it hands them over at its next heartbeat, or loses them
    at the move deadline). Waits, by default, until it owns none: then it may
    stop. --undo: it takes shards again (the registry rebalances at once).
    """
    client = settings.client()
    reply = client.operator.drain_watcher(watcher_id, undo=undo)
    if undo:
        click.echo(f"watcher {watcher_id} takes shards again ({reply.watcher.shards} owned; "
                   "the registry balances the others onto it)")
        return
    click.echo(f"watcher {watcher_id} draining: {len(reply.moves)} shard moves started, "
               f"{reply.watcher.shards} shards owned")
    if not wait:
        return

    def left() -> int | None:
        """Shards the watcher still owns; None once its registration is gone."""
        found = [w for w in client.operator.list_watchers() if w.watcher_id == watcher_id]
        return found[0].shards if found else None

    if reply.watcher.shards and not any(
            w.watcher_id != watcher_id and not w.draining for w in client.operator.list_watchers()):
        click.echo("no other watcher takes shards: its shards stay until one registers",
                   err=True)
    waiter = Waiter(limit)
    with waiter.showing(f"draining {watcher_id}: {reply.watcher.shards} shards owned") as show:

        def done() -> str | None:
            owned = left()
            if owned is None:
                return f"watcher {watcher_id} is gone (its lease expired): its shards are " \
                       "owned by the others"
            if owned == 0:
                return f"watcher {watcher_id} owns no shards: it may stop now"
            show(f"draining {watcher_id}: {owned} shards owned")
            return None

        click.echo(waiter.until(done, f"watcher {watcher_id} still owns shards"))


# --- shards --------------------------------------------------------------------------


@cli.group(cls=BatonGroup)
def shard() -> None:
    """Shards of tasks and the watchers that own them; moving them."""


NO_SHARDS = "no shards yet: no watcher has registered with this registry"


def moving(s: pb.ShardInfo, now: float) -> str:
    """Where a shard is going, and in how long the move is forced."""
    if not s.moving_to:
        return "-"
    return f"{s.moving_to} (forced in {max(s.move_deadline - now, 0):.0f} s)"


@shard.command("ls")
@output_option
@pass_settings
def shard_ls(settings: Settings, output: str) -> None:
    """List the shards: owner, epoch, a move in progress, tasks and checks queued.

    Every shard once, by number: its owner (a watcher id, - while nobody owns
    it) and the owner's host, its epoch (grows at every change of owner), the
    watcher it is moving to and when that move is forced, its unfinished tasks,
    and the checks queued for it at its owner. -o json: {"shard_count": N,
    "shards": [ShardInfo, ...]}.
    """
    reply = settings.client().operator.list_shards()
    if output == "json":
        emit_json({"shard_count": reply.shard_count,
                   "shards": [as_dict(s) for s in reply.shards]})
        return
    if not reply.shard_count:
        click.echo(NO_SHARDS)
        return
    now = time.time()
    table = folding_table("shard", "owner", "host", "epoch", "moving_to", "tasks", "backlog",
                          whole=("shard", "owner", "epoch"))
    for s in reply.shards:
        table.add_row(str(s.shard), s.owner or "-", s.host or "-", str(s.epoch), moving(s, now),
                      str(s.tasks), str(s.backlog))
    emit_table(table)


@shard.command("move")
@click.argument("number", metavar="SHARD", type=click.IntRange(min=0))
@click.option("--to", "to", required=True, metavar="WATCHER", help="the watcher to own it")
@click.option("--deadline", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="SECONDS",
              help="time the owner has to hand it over before it is taken (0: the "
                   "registry's --shard-move-deadline)")
@click.option("--reason", default="", help="why (logged by the registry with the move)")
@click.option("--evidence", default="", help="a link or text backing --reason (kept with it)")
@wait_option
@timeout_option(120)
@pass_settings
def shard_move(settings: Settings, number: int, to: str, deadline: int, reason: str,
               evidence: str, wait: bool, limit: float) -> None:
    """Move one shard to another watcher.

    Its owner hands it over at its next heartbeat, after the checks in hand;
    one that does not within --deadline loses it anyway (forced). Waits, by
    default, until WATCHER owns it, and says whether the move was forced. The
    registry's own balancing may move shards later: a hand-made imbalance does
    not last.
    """
    client = settings.client()
    started = client.operator.move_shard(number, to, deadline, reason, evidence)
    if started.owner == to and not started.moving_to:
        click.echo(f"shard {number} owned by {to} at epoch {started.epoch}")
        return
    click.echo(f"shard {number} moving from {started.owner} to {to}; forced in "
               f"{max(started.move_deadline - time.time(), 0):.0f} s if not handed over")
    if not wait:
        return
    waiter = Waiter(limit)
    with waiter.showing(f"shard {number}: waiting for {started.owner} to hand it over"):

        def done() -> str | None:
            s = next(s for s in client.operator.list_shards().shards if s.shard == number)
            if s.owner == to:
                # The shard's record does not say how the move ended: one done after
                # its deadline was forced (the registry's clock and ours agree to well
                # under the deadline's seconds).
                how = ("forced at its deadline: the owner did not hand it over"
                       if time.time() >= started.move_deadline else "handed over")
                return f"shard {number} owned by {to} at epoch {s.epoch} ({how})"
            if s.epoch != started.epoch or s.moving_to != to:
                raise MoveCalledOff(
                    f"shard {number} did not move to {to}: it is owned by {s.owner or 'nobody'} "
                    f"at epoch {s.epoch} (the move was called off, or its owner left)",
                    shard=number, owner=s.owner)
            return None

        click.echo(waiter.until(done, f"shard {number} still owned by {started.owner}"))


@shard.command("rebalance")
@click.option("--dry-run", is_flag=True, help="only say what would move")
@output_option
@pass_settings
def shard_rebalance(settings: Settings, dry_run: bool, output: str) -> None:
    """Start the moves that balance the shards among the watchers now.

    The registry does this by itself whenever the counts differ by more than
    one; this is for not waiting for it, or (--dry-run) for seeing what it
    would do. Nothing moves while a move is in progress. -o json: a list of
    {shard, from_watcher, to_watcher}.
    """
    client = settings.client()
    moves = client.operator.rebalance(dry_run=dry_run)
    if output == "json":
        emit_json([as_dict(m) for m in moves])
        return
    if not moves:
        in_flight = sum(1 for s in client.operator.list_shards().shards if s.moving_to)
        click.echo(f"{in_flight} moves in progress: nothing more starts until they are done"
                   if in_flight else "balanced: nothing to move")
        return
    table = folding_table("shard", "from", "to", whole=("shard", "from", "to"))
    for m in moves:
        table.add_row(str(m.shard), m.from_watcher, m.to_watcher)
    emit_table(table)
    click.echo(f"{len(moves)} moves " + ("would start (dry run)" if dry_run else
                                         "started; watch them with `baton shard ls`"))
