"""Operator commands: requeue, log (the journal), explain (sessions: ``leases``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ._common import (
    Settings,
    as_dict,
    emit_entry,
    emit_json,
    emit_table,
    folding_table,
    output_option,
    pass_settings,
)
from ._root import cli

if TYPE_CHECKING:
    from ...kernel.v1 import baton_pb2 as pb


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id", required=False, default="")
@click.option("-g", "--group", default="",
              help="hand the entry (without FILE_ID: every entry of the task) to this "
                   "consumer group again; the other groups are not handed it again")
@click.option("--reason", default="", help="why; kept in the entry's journal")
@click.option("--evidence", default="", help="a link or text backing --reason (kept with it)")
@output_option
@pass_settings
def requeue(settings: Settings, task_id: str, file_id: str, group: str, reason: str,
            evidence: str, output: str) -> None:
    """Bring a dead entry back to pending, or replay entries to one group.

    A dead entry gets a fresh retry budget; entries blocked by it (through
    depends_on) go ahead once it is verified. Only dead entries can be requeued
    (exit 4 otherwise). With --group G, a verified or consumed entry that G acked
    is handed to G again: G's ack is forgotten, the other groups' acks stay (exit
    4 if G has not acked it, or its file has left staging); without FILE_ID, every
    such entry of the task is.
    """
    if not file_id:
        if not group:
            raise click.UsageError("FILE_ID is needed, unless --group replays a whole task")
        replayed = settings.client().operator.replay_task(task_id, group, reason=reason,
                                                          evidence=evidence)
        if output == "json":
            emit_json({"task_id": task_id, "group": group, "replayed": replayed})
        else:
            click.echo(f"{task_id}: {replayed} entries handed to group {group} again")
        return
    emit_entry(settings.client().operator.requeue(task_id, file_id, group, reason=reason,
                                                  evidence=evidence), output)


@cli.command("log")
@click.argument("task_id", metavar="TASK")
@click.argument("file_id", required=False, default="")
@click.option("--limit", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help="only the last N records (0: all)")
@output_option
@pass_settings
def journal(settings: Settings, task_id: str, file_id: str, limit: int, output: str) -> None:
    """Show the journal of a task, or of one of its entries.

    One record per transition, oldest first: revision, time, file, event,
    from → to state, who (the caller's identity, then in quotes the name its client
    gave itself), consumer group (when any record has one), token,
    reason and the evidence backing it (-o json: one JSON object per line).
    """
    reply = settings.client().operator.journal_reply(task_id, file_id, limit)
    records = reply.records
    if reply.total > len(records) and not (limit and len(records) == limit):
        click.echo(f"baton: the newest {len(records):,} of {reply.total:,} records (the most "
                   "a reply carries); name an entry, or --limit N, for fewer", err=True)
    if output == "json":
        for r in records:
            emit_json(as_dict(r))
        return
    groups = any(r.group for r in records)
    columns = ["revision", "time", "file", "event", "from → to", "who",
               *(["group"] if groups else []), "token", "reason"]
    table = folding_table(*columns, whole=("revision", "event", "token"),
                          min_widths={"time": 13, "from → to": 10})
    for r in records:
        # A space instead of the T lets a narrow terminal wrap date and time apart.
        table.add_row(str(r.revision), r.at.replace("T", " ", 1), r.file_id, r.event,
                      transition(r), actor(r), *([r.group or "-"] if groups else []),
                      str(r.token) if r.token else "-",
                      r.reason + (f" (evidence: {r.evidence})" if r.evidence else ""))
    emit_table(table)


def actor(r: pb.JournalRecord) -> str:
    """Who: the authenticated identity, and in quotes the name the client gave itself
    (free text it sent, shown as such)."""
    label = f'"{r.label}"' if r.label else ""
    return " ".join(p for p in (r.who, label) if p) or "-"


def transition(r: pb.JournalRecord) -> str:
    return f"{r.from_state or '-'} → {r.to_state or '-'}"


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.argument("file_id")
@output_option
@pass_settings
def explain(settings: Settings, task_id: str, file_id: str, output: str) -> None:
    """Say where an entry is and what it waits for.

    One paragraph from the registry; a dead entry's ends with every attempt at it:
    when it was claimed, by whom (identity, "agent name", host), under which token,
    the digest it committed, when and how it ended. -o json: {"entry": {...},
    "text": "...", "attempts": [...], "attempts_total": N}.
    """
    explanation = settings.client().operator.explain(task_id, file_id)
    if output == "json":
        emit_json(as_dict(explanation))
    else:
        click.echo(explanation.text)
