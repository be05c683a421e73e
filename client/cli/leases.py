"""Operator commands on sessions' leases: ``baton lease ls | show | revoke | rotate |
drain | undrain`` (``baton agents`` is ``lease ls``)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from ...kernel import errors
from ._common import (
    Settings,
    emit_json,
    emit_table,
    err_console,
    folding_table,
    output_option,
    parse_session_id,
    pass_settings,
    session_json,
)
from ._root import cli

if TYPE_CHECKING:
    from ...kernel.v1 import baton_pb2 as pb
    from .._client import Client

#: how often `lease drain` looks at what the host's sessions still hold (seconds)
DRAIN_POLL = 0.5
#: how long `lease drain` waits past the deadline for a registry's sweep to revoke
#: what is left before it gives up (the sweep runs every half second or so)
SWEEP_GRACE = 30.0


@cli.group()
def lease() -> None:
    """Agent sessions and their etcd leases (operators).

    A session keeps its id for life; its claims, slots and record live on one
    etcd lease at a time, which `rotate` replaces without freeing a claim.
    """


def session_row(a: pb.AgentInfo) -> dict[str, Any]:
    """One session as `lease ls -o json` prints it (and its table shows it)."""
    return {"session": session_json(a.session_id), "agent": a.agent, "host": a.host,
            "pid": a.pid, "ttl": a.granted_ttl, "ttl_left": a.ttl_left,
            "claims": len(a.claims), "draining": a.draining}


@lease.command("ls")
@output_option
@pass_settings
def lease_ls(settings: Settings, output: str) -> None:
    """List live sessions: one row each.

    Columns (and -o json keys): session, agent, host, pid, ttl (granted), ttl_left
    (seconds its lease has left), claims (held now), draining (its host is drained).
    `baton lease show SESSION` lists the claims.
    """
    agents = sorted(settings.client().operator.list_agents(), key=lambda a: (a.agent, a.session_id))
    rows = [session_row(a) for a in agents]
    if output == "json":
        emit_json(rows)
        return
    # The session id stays whole: it is what `show`, `revoke` and `rotate` take.
    table = folding_table("session", "agent", "host", "pid", "ttl", "ttl_left", "claims",
                          "draining", whole=("session",))
    for r in rows:
        table.add_row(r["session"], r["agent"], r["host"] or "-", str(r["pid"] or "-"),
                      str(r["ttl"]), str(r["ttl_left"]), str(r["claims"]),
                      "yes" if r["draining"] else "no")
    emit_table(table)


cli.add_command(lease_ls, "agents")


def held_for(claimed_at: str, now: float) -> float | None:
    """Seconds since an RFC 3339 time (None: not known)."""
    if not claimed_at:
        return None
    try:
        at = datetime.fromisoformat(claimed_at.replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(now - at.timestamp(), 0.0)


@lease.command("show")
@click.argument("session_id", callback=parse_session_id)
@output_option
@pass_settings
def lease_show(settings: Settings, session_id: int, output: str) -> None:
    """One session and each claim it holds.

    Per claim: task, file, kind (produce, or consume for a group), token, how
    long it has been held (from the claim's time, on this machine's clock), and
    the progress its last checkpoint gave with that checkpoint's age ("-": none yet).
    Exit 5 if there is no such live session.
    """
    found = [a for a in settings.client().operator.list_agents() if a.session_id == session_id]
    if not found:
        raise errors.NotFound(f"no live session {session_id}", session_id=session_id)
    (a,) = found
    now = time.time()
    claims = [{"task": c.task_id, "file_id": c.file_id,
               "kind": f"consume {c.group}" if c.group else "produce", "group": c.group,
               "token": c.token, "claimed_at": c.claimed_at,
               "held": held_for(c.claimed_at, now),
               "progress": c.progress if c.checkpoint_at else None,
               "checkpoint_at": c.checkpoint_at,
               "checkpoint_age": held_for(c.checkpoint_at, now)}
              for c in sorted(a.claims, key=lambda c: (c.task_id, c.file_id, c.group))]
    if output == "json":
        emit_json({**session_row(a), "lease": str(a.lease_id), "slots": a.slots,
                   "opened_at": a.opened_at, "claims": claims})
        return
    draining = "  draining" if a.draining else ""
    click.echo(f"session {a.session_id}  agent {a.agent}  host {a.host or '-'}  pid "
               f"{a.pid or '-'}{draining}")
    click.echo(f"lease   {a.lease_id}  ttl {a.granted_ttl} s, {a.ttl_left} s left")
    if not claims:
        click.echo("no claims")
        return
    table = folding_table("task", "file", "kind", "token", "held", "progress", "checkpoint",
                          whole=("token",))
    for c in claims:
        held, progress, age = c["held"], c["progress"], c["checkpoint_age"]
        table.add_row(str(c["task"]), str(c["file_id"]), str(c["kind"]), str(c["token"]),
                      "-" if held is None else f"{held:.0f} s",
                      "-" if progress is None else f"{progress:.0%}",
                      "-" if age is None else f"{age:.0f} s ago")
    emit_table(table)


def one_way(session_id: int | None, **named: Any) -> None:
    """Sessions are named one way: a SESSION argument or exactly one option."""
    ways = [session_id is not None, *(bool(v) for v in named.values())]
    if sum(ways) != 1:
        options = ", ".join(f"--{k.replace('_', '-')}" for k in named)
        raise click.UsageError(f"name the sessions one way: SESSION, or one of {options}")


def optional_session(ctx: click.Context, param: click.Parameter,
                     value: str | None) -> int | None:
    return None if value is None else parse_session_id(ctx, param, value)


@lease.command("revoke")
@click.argument("session_id", required=False, callback=optional_session, metavar="[SESSION]")
@click.option("--agent", "agent", default="", metavar="NAME",
              help="every session of this agent name")
@click.option("--host", default="", metavar="HOST", help="every session of this host")
@click.option("--reason", default="", help="why, kept in the journal of each claim")
@click.option("--evidence", default="", help="a link or text backing --reason (kept with it)")
@output_option
@pass_settings
def lease_revoke(settings: Settings, session_id: int | None, agent: str, host: str,
                 reason: str, evidence: str, output: str) -> None:
    """Revoke sessions now: their claims go back at once.

    Producer claims go back to pending without spending a retry, consume-claims
    back to their group; their tokens die (a later commit or ack is refused),
    and the journal records `revoked` with who and --reason. Nothing more is
    handed to a session once its revocation starts; running it again finishes
    one that was interrupted.
    """
    one_way(session_id, agent=agent, host=host)
    done = settings.client().operator.revoke_sessions(session_id or 0, agent=agent, host=host,
                                                      reason=reason, evidence=evidence)
    if output == "json":
        emit_json([{"session": session_json(s.session_id), "agent": s.agent, "host": s.host,
                    "claims_returned": s.claims_returned} for s in done])
        return
    for s in done:
        click.echo(f"session {s.session_id} ({s.agent} on {s.host or '-'}) revoked (claims "
                   f"returned: {s.claims_returned})")
    if not done:
        click.echo("no live session matched")


@lease.command("rotate")
@click.argument("session_id", required=False, callback=optional_session, metavar="[SESSION]")
@click.option("--all", "every", is_flag=True, help="every live session")
@click.option("--host", default="", metavar="HOST", help="every session of this host")
@click.option("--ttl", type=click.IntRange(2, 3600), default=None,
              help="the sessions' TTL in seconds from their next keepalive (default: each "
              "session's own)")
@output_option
@pass_settings
def lease_rotate(settings: Settings, session_id: int | None, every: bool, host: str,
                 ttl: int | None, output: str) -> None:
    """Move sessions onto fresh etcd leases.

    Every claim, slot and record key of a session is re-attached to the new
    lease (one transaction when they fit etcd's limit of 128 operations, else in
    chunks while both leases are kept alive), then the old lease is revoked.
    Claims are never free meanwhile, tokens and session ids stay, and agents'
    keepalives follow the new lease by themselves. A rotation never extends
    liveness: the new lease has what the old one had left (or --ttl if less),
    and only the agent's next keepalive gives the session its TTL again.
    """
    one_way(session_id, every=every, host=host)
    done = settings.client().operator.rotate_leases(session_id or 0, every=every, host=host,
                                                    ttl=ttl or 0)
    if output == "json":
        emit_json([{"session": session_json(s.session_id), "old_lease": str(s.old_lease),
                    "new_lease": str(s.new_lease), "ttl": s.ttl, "keys_moved": s.keys_moved,
                    "transactions": s.transactions} for s in done])
        return
    for s in done:
        click.echo(f"session {s.session_id}: lease {s.old_lease} -> {s.new_lease} (ttl "
                   f"{s.ttl} s, keys moved: {s.keys_moved}, transactions: {s.transactions})")
    if not done:
        click.echo("no live session matched")


def host_claims(client: Client, host: str) -> tuple[int, int]:
    """(sessions, claims) the host's live sessions hold."""
    mine = [a for a in client.operator.list_agents() if a.host == host]
    return len(mine), sum(len(a.claims) for a in mine)


@lease.command("drain")
@click.option("--host", required=True, metavar="HOST", help="the host to drain")
@click.option("--deadline", type=click.IntRange(1, 7 * 24 * 3600), default=300,
              show_default=True, metavar="SECONDS",
              help="after this, the registry revokes what the host still holds")
@click.option("--reason", default="", help="why (kept with the drain)")
@click.option("--evidence", default="", help="a link or text backing --reason (kept with it)")
@click.option("--no-wait", is_flag=True, help="return at once instead of waiting")
@pass_settings
def lease_drain(settings: Settings, host: str, deadline: int, reason: str, evidence: str,
                no_wait: bool) -> None:
    """Drain a host: its sessions take no new work.

    Claims and consumes of the host's sessions (and of sessions opened there
    later) are refused with exit 8; what they hold may still be committed,
    failed, acked or nacked. At the deadline the registry revokes the rest (as
    `lease revoke` does). Waits, showing the claims left on the host, until
    none is left; `--no-wait` returns at once. `lease undrain` ends it.
    """
    client = settings.client()
    reply = client.operator.drain_host(host, deadline, reason, evidence)
    click.echo(f"host {host} draining until {reply.deadline} (sessions {reply.sessions}, "
               f"claims {reply.claims})")
    if no_wait:
        return
    give_up = time.monotonic() + deadline + SWEEP_GRACE
    console = err_console()
    last = -1
    with console.status(f"{host}: waiting", spinner="dots") if console.is_terminal else (
            _Quiet()) as status:
        while True:
            sessions, claims = host_claims(client, host)
            if claims != last:
                text = f"{host}: claims left {claims} (sessions {sessions})"
                if console.is_terminal:
                    status.update(text)
                else:
                    click.echo(text, err=True)
                last = claims
            if claims == 0:
                break
            if time.monotonic() > give_up:
                raise errors.Unavailable(
                    f"{host} still holds {claims} claims {SWEEP_GRACE:g} s past the "
                    "deadline: is a registry running to revoke them?")
            time.sleep(DRAIN_POLL)
    click.echo(f"host {host} drained: no claims left")


class _Quiet:
    """Stands in for a status spinner off a terminal."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, text: str) -> None:
        return None


@lease.command("undrain")
@click.option("--host", required=True, metavar="HOST", help="the drained host")
@pass_settings
def lease_undrain(settings: Settings, host: str) -> None:
    """End a host's drain: its sessions take work again."""
    reply = settings.client().operator.undrain_host(host)
    click.echo(f"host {host} undrained (sessions taking work again: {reply.sessions})")
