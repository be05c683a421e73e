"""Agent commands: claim, commit, commit-batch, fail, checkpoint, put, consume, ack,
ack-batch, nack, sessions, watch."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from ...kernel import errors
from ._common import (
    F,
    Settings,
    agent_option,
    as_dict,
    close_quietly,
    emit_entry,
    emit_json,
    emit_table,
    entry_summary,
    err_console,
    folding_table,
    hash_file,
    output_option,
    parse_session_id,
    pass_settings,
    progress_reader,
    session_json,
    session_line,
    slots_option,
    state_name,
    ttl_option,
)
from ._root import cli

if TYPE_CHECKING:
    from .._client import Client


def attributes_option(f: F) -> F:
    # Sent as written, so that a number keeps every digit; the registry checks it.
    return click.option(
        "--attributes", metavar="JSON", default="",
        help="a JSON object committed with the entry, for the task's routing rules",
    )(f)  # fmt: skip


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id", required=False, default="")
@click.option("--batch", type=click.IntRange(min=1), metavar="N",
              help="claim up to N entries in one transaction (not with FILE_ID)")
@agent_option
@ttl_option
@slots_option
@output_option
@pass_settings
def claim(settings: Settings, task_id: str, file_id: str, batch: int | None, agent: str,
          ttl: int, slots: int, output: str) -> None:
    """Claim an entry for writing.

    Claims FILE_ID, or the next claimable entry without it, and prints the
    fencing token and the path to write. With --batch N, claims up to N of
    the next claimable entries at once (-o json: a list). The claims outlive
    this command for --ttl seconds; `baton keepalive SESSION` extends them,
    `baton release SESSION` gives them up.
    """
    if batch is not None and file_id:
        raise click.UsageError("--batch claims the next claimable entries; leave out FILE_ID")
    client = settings.client()
    session = client.open_session(agent, ttl, keepalive=False, slots=slots)
    try:
        if batch is None:
            claims = [client.claim(task_id, file_id, session=session)]
        else:
            claims = client.claim_batch(task_id, batch, session=session)
    except BaseException:
        close_quietly(client, session)
        raise
    if output == "json":
        data = [{**c.as_dict(), "session": session_json(c.session_id)} for c in claims]
        emit_json(data if batch is not None else data[0])
        return
    if batch is None:
        c = claims[0]
        click.echo(f"claimed  {c.task_id}/{c.file_id}  token {c.token}")
        click.echo(f"path     {c.path}")
    else:
        table = folding_table("file_id", "token", "path", whole=("token",))
        for c in claims:
            table.add_row(c.file_id, str(c.token), c.path)
        emit_table(table)
    click.echo(session_line(session))


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.option("--token", type=int, required=True, help="the claim's fencing token")
@click.option("--size", type=click.IntRange(min=0), help="bytes written")
@click.option("--digest", metavar="HEX", help="BLAKE3 hex digest of the bytes written")
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="compute --size and --digest from this file")
@attributes_option
@output_option
@pass_settings
def commit(settings: Settings, task_id: str, file_id: str, token: int, size: int | None,
           digest: str | None, path: Path | None, attributes: str, output: str) -> None:
    """Declare a claimed entry written.

    Give the --size (and BLAKE3 --digest) of what was written, or --file to
    compute both from the file. --attributes: a JSON object the task's routing
    rules look at.
    """
    if path is not None and (size is not None or digest):
        raise click.UsageError("give either --file or --size/--digest, not both")
    if path is None and size is None:
        raise click.UsageError("give --size (and --digest), or --file")
    if path is not None:
        size, digest = hash_file(path)
    assert size is not None
    entry = settings.client().commit(task_id, file_id, token, size, digest or "",
                                     attributes=attributes)
    emit_entry(entry, output)


@cli.command("commit-batch")
@click.argument("commits", type=click.File("rb"), metavar="FILE")
@output_option
@pass_settings
def commit_batch(settings: Settings, commits: IO[bytes], output: str) -> None:
    """Commit many claimed entries in one transaction.

    FILE (- reads stdin) is a JSON list of objects with task, file_id, token,
    size and optionally digest (the path and session of `claim -o json` are
    ignored). All are committed or, if one is refused, none.
    """
    entries = settings.client().commit_batch(load_commits(commits))
    if output == "json":
        emit_json([as_dict(e) for e in entries])
        return
    for e in entries:
        click.echo(entry_summary(e))


#: keys of a commit-batch item; ``path`` and ``session`` come along from `claim -o json`
COMMIT_KEYS = {"task": str, "file_id": str, "token": int, "size": int, "digest": str}
IGNORED_KEYS = {"path", "session", "attempt", "checkpoint"}
#: keys of an ack-batch item; the rest of `consume -o json` comes along, ignored
ACK_KEYS = {"task": str, "file_id": str, "group": str, "token": int}
ACK_IGNORED_KEYS = {"path", "size", "digest", "session", "attempt", "checkpoint"}


def load_batch(source: IO[bytes], what: str, keys: dict[str, type], defaults: dict[str, Any],
               ignored: set[str]) -> list[dict[str, Any]]:
    """The items of a batch file (a non-empty JSON list of objects with ``keys``),
    checked; ``what`` names an item in errors (``commit``, ``ack``)."""
    name = getattr(source, "name", "<stdin>")
    name = "<stdin>" if name in ("-", "<stdin>") else name
    try:
        data = json.loads(source.read())
    except ValueError as e:  # not JSON, or not UTF-8
        raise errors.InvalidArgument(f"{name}: not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise errors.InvalidArgument(f"{name}: expected a non-empty JSON list of {what}s")
    out = []
    for i, item in enumerate(data):
        where = f"{name}: {what} [{i}]"
        if not isinstance(item, dict):
            raise errors.InvalidArgument(f"{where} is not an object")
        unknown = sorted(set(item) - set(keys) - ignored)
        if unknown:
            raise errors.InvalidArgument(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = dict(defaults)
        for key, kind in keys.items():
            value = item.get(key, values.get(key))
            # bool is an int to Python, never a token or size to us
            if value is None or not isinstance(value, kind) or isinstance(value, bool):
                what_kind = "an integer" if kind is int else "a string"
                raise errors.InvalidArgument(f"{where}: {key} must be {what_kind}")
            values[key] = value
        out.append(values)
    return out


def load_commits(source: IO[bytes]) -> list[tuple[str, str, int, int, str]]:
    """The (task, file_id, token, size, digest) tuples of a commit-batch file."""
    return [(v["task"], v["file_id"], v["token"], v["size"], v["digest"])
            for v in load_batch(source, "commit", COMMIT_KEYS, {"digest": ""}, IGNORED_KEYS)]


def load_acks(source: IO[bytes]) -> list[tuple[str, str, str, int]]:
    """The (task, file_id, group, token) tuples of an ack-batch file."""
    return [(v["task"], v["file_id"], v["group"], v["token"])
            for v in load_batch(source, "ack", ACK_KEYS, {"group": "default"},
                                ACK_IGNORED_KEYS)]


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.option("--token", type=int, required=True, help="the claim's fencing token")
@click.option("--reason", default="", help="why, kept as the entry's error")
@click.option("--permanent", is_flag=True,
              help="no retry can succeed: dead at once, no retry spent")
@click.option("--delay", type=float, default=0.0, metavar="S",
              help="claimable again no sooner than S seconds from now, instead of after "
                   "the task's backoff (at most 7 days)")
@click.option("--release", is_flag=True,
              help="the work never began (claimed ahead): pending again at once, no "
                   "retry spent")
@output_option
@pass_settings
def fail(settings: Settings, task_id: str, file_id: str, token: int, reason: str,
         permanent: bool, delay: float, release: bool, output: str) -> None:
    """Give up a claim; the entry is retried.

    The entry goes back to pending, or to dead once its retries are used up.
    --permanent sends it to dead at once, keeping its retries; --delay S keeps it
    from being claimed again for S seconds (a retry is spent as usual); --release
    gives back a claim whose work never began, as it was.
    """
    emit_entry(settings.client().fail(task_id, file_id, token, reason, permanent=permanent,
                                      delay=delay, release=release), output)


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.option("--token", type=int, required=True,
              help="the fencing token of the claim (or, with --group, of the consume lease)")
@click.option("--group", default="", help="the consumer group of a consume lease; "
              "none: a producer's claim")
@click.option("--progress", type=float, default=0.0, show_default=True,
              help="how far the attempt got, a fraction within 0..1")
@click.option("--message", default="", help="a short note (at most 200 characters)")
@click.option("--data-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True,
                                             path_type=Path),
              help="opaque bytes for the next attempt to resume from, at most 64 KiB "
                   "(- reads stdin)")
@output_option
@pass_settings
def checkpoint(settings: Settings, task_id: str, file_id: str, token: int, group: str,
               progress: float, message: str, data_file: Path | None, output: str) -> None:
    """Record how far a claim (or a consume lease) got.

    The registry keeps the latest checkpoint of the entry (per consumer group for a
    lease); if this attempt does not finish, the next attempt's claim (consume)
    carries it, with the data of --data-file, so that it resumes there.
    """
    data = b""
    if data_file is not None:
        data = sys.stdin.buffer.read() if str(data_file) == "-" else data_file.read_bytes()
    kept = settings.client().checkpoint(task_id, file_id, token, data=data,
                                        progress=progress, message=message, group=group)
    if output == "json":
        emit_json(as_dict(kept))
    else:
        click.echo(f"{task_id}/{file_id}: checkpoint of attempt {kept.attempt} at "
                   f"{kept.progress:.0%}, {len(data)} bytes (blake3 {kept.digest[:16]}), "
                   f"{kept.at}")


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, allow_dash=True,
                                       path_type=Path))
@agent_option
@ttl_option
@attributes_option
@click.option("--resume", is_flag=True,
              help="resumable: record a resume point every --resume-every MiB, and go on "
                   "from the partial file of an earlier attempt that recorded one")
# The default is the library's RESUME_EVERY (8 MiB), not imported so that `baton
# --help` does not load the producer's modules; tests/integration/test_produce_promises.py checks.
@click.option("--resume-every", type=click.IntRange(min=1), default=8, show_default=True,
              metavar="MIB",
              help="at most this many MiB written between two resume points, fewer where "
                   "5%% of SRC's size is fewer (with --resume)")
@click.option("--wait", type=click.FloatRange(min=0), default=300.0, show_default=True,
              metavar="SECONDS", help="how long to wait while the task is back-pressured "
                                      "(a consumer group at its backlog limit); then exit 9")
@output_option
@pass_settings
def put(settings: Settings, task_id: str, file_id: str, src: Path, agent: str, ttl: int,
        attributes: str, resume: bool, resume_every: int, wait: float, output: str) -> None:
    """Claim, copy SRC in durably, and commit.

    SRC (- reads stdin) is written to a temporary file beside the entry's path,
    fsynced, renamed into place, and committed with its size and BLAKE3 digest
    (and --attributes, a JSON object the task's routing rules look at). With
    --resume, an attempt that dies part-way leaves its partial file and a checkpoint;
    the next `put --resume` of the entry copies only the rest. While a consumer
    group of the task is at its backlog limit, the claim is tried again for up to
    --wait seconds.
    """
    from ..producer import put as put_file

    client = settings.client()
    # Unlike `claim`, the session lives only as long as the copy: it is kept alive
    # while the bytes move and revoked (with nothing left on it) at the end.
    with client.open_session(agent, ttl) as session:
        if str(src) == "-":
            entry = put_file(client, session, task_id, file_id, sys.stdin.buffer,
                             attributes=attributes, resumable=resume,
                             resume_every=resume_every << 20, wait=wait)
        else:
            size = src.stat().st_size
            with src.open("rb") as f, progress_reader(f, size,
                                                      f"copying {src.name}") as reader:
                entry = put_file(client, session, task_id, file_id, reader,
                                 attributes=attributes, size=size, resumable=resume,
                                 resume_every=resume_every << 20, wait=wait)
    emit_entry(entry, output)


# --- consumers -------------------------------------------------------------------


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id", required=False, default="")
@click.option("-g", "--group", default="default", show_default=True, help="consumer group")
@click.option("--batch", type=click.IntRange(min=1), metavar="N",
              help="take up to N verified entries in one transaction (not with FILE_ID)")
@agent_option
@ttl_option
@slots_option
@click.option("--wait", type=click.FloatRange(min=0), metavar="SECONDS",
              help="wait this long for an entry to be verified (not with FILE_ID)")
@output_option
@pass_settings
def consume(settings: Settings, task_id: str, file_id: str, group: str, batch: int | None,
            agent: str, ttl: int, slots: int, wait: float | None, output: str) -> None:
    """Take a verified entry for a consumer group.

    Takes FILE_ID, or the next verified entry without it, and prints the token,
    the path to read and its size and digest. With --batch N, takes up to N of
    the next verified entries at once (-o json: a list, which `ack-batch`
    reads). Like `claim`, the hold outlives this command for --ttl seconds.
    """
    if wait is not None and file_id:
        raise click.UsageError("--wait takes the next verified entry; leave out FILE_ID")
    if batch is not None and (file_id or wait is not None):
        raise click.UsageError("--batch takes the next verified entries; leave out FILE_ID "
                               "and --wait")
    client = settings.client()
    if batch is not None:
        _consume_batch(client, task_id, group, batch, agent, ttl, slots, output)
        return
    # While waiting, a keepalive thread stops the session expiring under us.
    session = client.open_session(agent, ttl, keepalive=wait is not None, slots=slots)
    try:
        if wait is None:
            lease = client.consume(task_id, group, file_id, session=session)
        else:
            from ..consumer import next_lease

            console = err_console()
            with console.status(f"waiting up to {wait:g} s for a verified entry of {task_id}",
                                spinner="dots") if console.is_terminal else nullcontext():
                lease = next_lease(client, session, task_id, group, timeout=wait)
            session.close(revoke=False)
            client.keepalive(session.session_id)  # the full --ttl from now on
    except BaseException:
        session.close(revoke=False)
        close_quietly(client, session)
        raise
    if output == "json":
        emit_json({**lease.as_dict(), "session": session_json(lease.session_id)})
        return
    click.echo(f"consumed {lease.task_id}/{lease.file_id}  group {lease.group}  "
               f"token {lease.token}")
    click.echo(f"path     {lease.path}")
    click.echo(f"size     {lease.size}")
    click.echo(f"digest   {lease.digest}")
    click.echo(session_line(session))


def _consume_batch(client: Client, task_id: str, group: str, batch: int, agent: str,
                   ttl: int, slots: int, output: str) -> None:
    session = client.open_session(agent, ttl, keepalive=False, slots=slots)
    try:
        leases = client.consume_batch(task_id, group, batch, session=session)
    except BaseException:
        close_quietly(client, session)
        raise
    if output == "json":
        emit_json([{**x.as_dict(), "session": session_json(x.session_id)} for x in leases])
        return
    table = folding_table("file_id", "token", "size", "path", whole=("token", "size"))
    for x in leases:
        table.add_row(x.file_id, str(x.token), str(x.size), x.path)
    emit_table(table)
    click.echo(session_line(session))


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.option("-g", "--group", default="default", show_default=True, help="consumer group")
@click.option("--token", type=int, required=True, help="the consume token")
@output_option
@pass_settings
def ack(settings: Settings, task_id: str, file_id: str, group: str, token: int,
        output: str) -> None:
    """Mark an entry done for a group.

    The entry is consumed once every one of its groups has acked.
    """
    emit_entry(settings.client().ack(task_id, file_id, group, token), output)


@cli.command("ack-batch")
@click.argument("acks", type=click.File("rb"), metavar="FILE")
@output_option
@pass_settings
def ack_batch(settings: Settings, acks: IO[bytes], output: str) -> None:
    """Ack many consumed entries in one transaction.

    FILE (- reads stdin) is a JSON list of objects with task, file_id, token and
    optionally group (default: default); the path, size, digest and session of
    `consume -o json` are ignored. All are acked or, if one is refused, none.
    """
    entries = settings.client().ack_batch(load_acks(acks))
    if output == "json":
        emit_json([as_dict(e) for e in entries])
        return
    for e in entries:
        click.echo(entry_summary(e))


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@click.option("-g", "--group", default="default", show_default=True, help="consumer group")
@click.option("--token", type=int, required=True, help="the consume token")
@click.option("--reason", default="", help="why")
@click.option("--delay", type=float, default=0.0, metavar="S",
              help="hand it back to the group no sooner than S seconds from now "
                   "(at most 7 days)")
@click.option("--permanent", is_flag=True,
              help="it can never be consumed: dead at once, for every group")
@output_option
@pass_settings
def nack(settings: Settings, task_id: str, file_id: str, group: str, token: int, reason: str,
         delay: float, permanent: bool, output: str) -> None:
    """Hand an entry back to its group.

    At once, or after --delay S seconds; --permanent gives it up instead: it goes
    dead, and no group is handed it again until `baton requeue`.
    """
    emit_entry(settings.client().nack(task_id, file_id, group, token, reason, delay=delay,
                                      permanent=permanent), output)


# --- sessions and events ----------------------------------------------------------


@cli.command()
@click.argument("session_id", callback=parse_session_id)
@output_option
@pass_settings
def keepalive(settings: Settings, session_id: int, output: str) -> None:
    """Refresh a session once; prints its TTL.

    The session's claims live another TTL from now.
    """
    ttl = settings.client().keepalive(session_id)
    if output == "json":
        emit_json({"session": session_json(session_id), "ttl": ttl})
    else:
        click.echo(f"session {session_id}: ttl {ttl} s")


@cli.command()
@click.argument("session_id", callback=parse_session_id)
@pass_settings
def release(settings: Settings, session_id: int) -> None:
    """Close a session; its claims die now."""
    settings.client().close_session(session_id)
    click.echo(f"session {session_id} released")


#: the entry states `baton watch --state` takes (the contract's, short)
WATCH_STATES = ("pending", "writing", "written", "verified", "consumed", "dead")


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.option("--from-revision", type=click.IntRange(min=-1), default=-1, show_default=True,
              metavar="N", help="-1: changes from now; 0: every entry first, then changes; "
                                "N: changes since revision N")
@click.option("--state", "states", multiple=True, metavar="STATE",
              type=click.Choice(WATCH_STATES, case_sensitive=False),
              help="only entries in this state (repeatable): the others' changes are not "
                   "sent")
@output_option
@pass_settings
def watch(settings: Settings, task_id: str, from_revision: int, states: tuple[str, ...],
          output: str) -> None:
    """Print a task's entry changes until Ctrl-C.

    One line per event: time, file_id, state, revision (-o json: one JSON
    object per line, including the SYNCED marker).
    """
    from ...kernel.v1 import baton_pb2 as pb

    events = settings.client().watch(
        task_id, start_revision=from_revision,
        states=[pb.EntryState.Value(f"ENTRY_STATE_{s.upper()}") for s in states])
    try:
        for ev in events:
            if output == "json":
                emit_json(as_dict(ev))
            elif ev.kind == pb.TaskEvent.KIND_SYNCED:
                click.echo(f"watching {task_id} after revision {ev.revision}; Ctrl-C stops",
                           err=True)
            else:
                e = ev.entry
                click.echo(f"{e.updated_at}  {e.file_id}  {state_name(e.state)}  "
                           f"{ev.revision}")
    except KeyboardInterrupt:
        pass
    finally:
        events.close()


