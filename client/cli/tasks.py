"""Task commands: ``task create|get|ls|pause|resume|cancel|archive|delete`` and ``status``."""

from __future__ import annotations

import copy
import json
import sys
from typing import IO, TYPE_CHECKING, Any

import click

from ...kernel import errors
from ._common import (
    DIGEST_PREFIX,
    STATES,
    BatonGroup,
    F,
    Settings,
    as_dict,
    emit_json,
    emit_table,
    folding_table,
    output_option,
    pass_settings,
    state_name,
    status_name,
)
from ._root import cli

if TYPE_CHECKING:
    from ...kernel.v1 import baton_pb2 as pb


@cli.group(cls=BatonGroup)
def task() -> None:
    """Create, inspect and control tasks (manifests)."""


def load_manifest(source: IO[bytes]) -> pb.TaskSpec:
    name = getattr(source, "name", "<stdin>")
    name = "<stdin>" if name in ("-", "<stdin>") else name
    try:
        data = json.loads(source.read())
    except json.JSONDecodeError as e:
        raise errors.InvalidManifest(
            f"{name}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
            f"(char {e.pos})", problems=[str(e)],
        ) from None
    except ValueError as e:  # not UTF-8
        raise errors.InvalidManifest(f"{name}: not valid JSON: {e}", problems=[str(e)]) from None
    if not isinstance(data, dict):
        raise errors.InvalidManifest(
            f"{name}: a manifest is a JSON object, not {type(data).__name__}",
            problems=["not an object"],
        )
    from .._client import parse_manifest

    return parse_manifest(data)


@task.command("create")
@click.argument("manifest", type=click.File("rb"), metavar="FILE")
@output_option
@pass_settings
def task_create(settings: Settings, manifest: IO[bytes], output: str) -> None:
    """Create a task from a JSON manifest.

    FILE is the manifest (- reads stdin). Creating the same manifest again is a
    no-op; a different manifest under an existing task id is refused (exit 4).
    """
    spec = load_manifest(manifest)
    created_task, created = settings.client().operator.create_task(spec)
    if output == "json":
        emit_json({"created": created, "task": as_dict(created_task)})
    elif created:
        n = created_task.entry_count
        click.echo(f"created task {spec.task_id}: {n} entr{'y' if n == 1 else 'ies'}, "
                   f"staging {created_task.staging_dir}")
    else:
        click.echo(f"task {spec.task_id} already exists with this manifest: nothing changed")


@task.command("get")
@click.argument("task_id", metavar="TASK")
@output_option
@pass_settings
def task_get(settings: Settings, task_id: str, output: str) -> None:
    """Show a task and its entry counts."""
    t = settings.client().operator.get_task(task_id)
    if output == "json":
        emit_json(as_dict(t))
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    b = t.spec.backoff
    rows = {
        "task": t.spec.task_id,
        "status": status_name(t.status) + (f" ({t.status_reason})" if t.status_reason else ""),
        "entries": str(t.entry_count),
        "done": f"{progress(t)}  (dead {t.dead}, blocked {t.blocked})",
        "states": "  ".join(f"{s} {t.states[s]}" for s in STATES if t.states.get(s)) or "-",
        "consumers": ", ".join(t.spec.consumers) or "default",
        # In order: the first rule that holds decides.
        **({"routing": "\n".join(f"{i}: {r.condition} → {', '.join(r.groups)}"
                                  for i, r in enumerate(t.spec.routing_rules))}
           if t.spec.routing_rules else {}),
        # A limited group's backlog now, against its limit (back-pressure).
        **({"backlog": "\n".join(
            f"{b.group} {b.backlog}/{b.limit}" + ("  back-pressured: claims refused"
                                                  if b.over else "")
            for b in t.backlog)} if t.backlog else {}),
        "max_retries": str(t.spec.max_retries),
        "priority": f"{t.spec.priority}  (aging: +1 per {t.spec.aging_seconds:g} s waiting)",
        "backoff": f"base {b.base_seconds:g} s, factor {b.factor:g}, cap {b.cap_seconds:g} s",
        **({"fairness": fairness_row(t.spec.fairness)} if t.spec.HasField("fairness") else {}),
        "labels": ", ".join(f"{k}={v}" for k, v in sorted(t.spec.labels.items())) or "-",
        "staging": t.staging_dir,
        "created": t.created_at,
        "manifest": t.manifest_digest[:DIGEST_PREFIX],
    }
    for key, value in rows.items():
        table.add_row(key, value)
    emit_table(table)


def fairness_row(fairness: pb.Fairness) -> str:
    """A task's fair shares: its keys with their weights, and its default key."""
    keys = ", ".join(f"{k} {v.weight}" for k, v in sorted(fairness.keys.items()))
    return keys + (f"  (default: {fairness.default_key})" if fairness.default_key else "")


@task.command("ls")
@click.option("--archived", is_flag=True, help="list the archived tasks instead")
@output_option
@pass_settings
def task_ls(settings: Settings, archived: bool, output: str) -> None:
    """List tasks with their progress (or, --archived, the tasks archived out of etcd).

    done/total counts entries nothing more will happen to (consumed, dead, or
    verified with no consumer groups); dead ones are also counted on their own.
    """
    tasks = settings.client().operator.list_tasks(archived=archived)
    if output == "json":
        emit_json([as_dict(t) for t in tasks])
        return
    if archived:
        table = folding_table("task", "entries", "dead", "finished", "archived", "archive",
                              whole=("entries", "dead"))
        for t in tasks:
            table.add_row(t.spec.task_id, str(t.entry_count), str(t.dead), t.finished_at,
                          t.archived_at, t.archive)
        emit_table(table)
        return
    table = folding_table("task", "status", "done", "dead", "created", "staging",
                          whole=("status", "done", "dead"))
    for t in tasks:
        table.add_row(t.spec.task_id, status_name(t.status), progress(t), str(t.dead),
                      t.created_at, t.staging_dir)
    emit_table(table)


def progress(t: pb.Task) -> str:
    """``done/total``; ``-`` while the task is being created or deleted (its indexes are
    incomplete)."""
    from ...kernel.v1 import baton_pb2 as pb

    if t.status in (pb.TASK_STATUS_CREATING, pb.TASK_STATUS_DELETING, pb.TASK_STATUS_ARCHIVING):
        return f"-/{t.entry_count}"
    if t.status == pb.TASK_STATUS_ARCHIVED:
        return f"{t.entry_count}/{t.entry_count}"
    return f"{t.entry_count - t.open}/{t.entry_count}"


def _control(settings: Settings, action: str, task_id: str, reason: str, output: str,
             evidence: str = "") -> None:
    client = settings.client()
    if action == "archive":
        t = client.operator.archive_task(task_id, reason)
    else:
        call = {"pause": client.operator.pause_task, "resume": client.operator.resume_task,
                "cancel": client.operator.cancel_task}[action]
        t = call(task_id, reason, evidence)
    if output == "json":
        emit_json(as_dict(t))
        return
    why = f" ({t.status_reason})" if reason and t.status_reason else ""
    click.echo(f"task {t.spec.task_id}: {status_name(t.status)}{why}")


def reason_option(f: F) -> F:
    return click.option("--reason", default="", help="why; kept on the task as its "
                                                     "status reason")(f)


def evidence_option(f: F) -> F:
    return click.option("--evidence", default="", help="a link or text backing --reason, "
                                                       "kept with it")(f)


@task.command("pause")
@click.argument("task_id", metavar="TASK")
@reason_option
@evidence_option
@output_option
@pass_settings
def task_pause(settings: Settings, task_id: str, reason: str, evidence: str,
             output: str) -> None:
    """Stop handing out new work of a task: claims and consumes.

    Both are refused (exit 4, TaskNotActive) while it is paused. What is in
    hand may still be finished: claims committed or failed, consumes acked or
    nacked; the watcher still verifies. Nothing is lost: `baton task resume`
    hands out work again from where it was.
    """
    _control(settings, "pause", task_id, reason, output, evidence)


@task.command("resume")
@click.argument("task_id", metavar="TASK")
@reason_option
@evidence_option
@output_option
@pass_settings
def task_resume(settings: Settings, task_id: str, reason: str, evidence: str,
             output: str) -> None:
    """Make a paused task active again."""
    _control(settings, "resume", task_id, reason, output, evidence)


@task.command("cancel")
@click.argument("task_id", metavar="TASK")
@reason_option
@evidence_option
@output_option
@pass_settings
def task_cancel(settings: Settings, task_id: str, reason: str, evidence: str,
             output: str) -> None:
    """Stop a task for good.

    Every claim on it is revoked at once (its token is refused from then on)
    and nothing more is handed out. A cancelled task cannot be resumed.
    """
    _control(settings, "cancel", task_id, reason, output, evidence)


@task.command("archive")
@click.argument("task_id", metavar="TASK")
@reason_option
@output_option
@pass_settings
def task_archive(settings: Settings, task_id: str, reason: str, output: str) -> None:
    """Archive a completed or cancelled task now, out of etcd.

    Its header, entries and journal go to the registry's archive (--archive-dir),
    are checked there, and only then leave etcd; the task is then `archived`, and
    `baton task get`, `status`, `log` and `explain` read it from the archive. The
    registry does this by itself once a finished task is older than its
    archive_after. Interrupted, it finishes when run again; an active or paused
    task is refused (exit 4).
    """
    _control(settings, "archive", task_id, reason, output)


#: the order `task delete` reports what it removed in
REMOVED_KINDS = ("header", "entries", "journal", "ready", "delayed", "waiting", "cready",
                 "cdelayed", "open", "dead", "claims", "inflight", "slots")


def interactive() -> bool:
    """Whether a person can answer a question (stdin and stderr are terminals)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


@task.command("delete")
@click.argument("task_id", metavar="TASK")
@click.option("--reason", default="", help="why; logged by the registry")
@click.option("--discard-history", is_flag=True,
              help="also delete a cancelled task that ran, with its journal")
@click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation")
@output_option
@pass_settings
def task_delete(settings: Settings, task_id: str, reason: str, discard_history: bool,
                yes: bool, output: str) -> None:
    """Delete a task that never ran, and everything the registry keeps of it.

    A task none of whose entries was ever claimed (whatever its status), or one
    stuck being created, is deleted. A task that ran is refused (exit 4): it is
    kept for audit; cancel it to stop it. With --discard-history a cancelled
    task that ran is deleted too, journal and all. Its entries, indexes,
    journal, claims (whose slots are freed) and header go; files in the
    staging directory are left alone. An interrupted delete (the task shows as
    deleting) finishes when run again. On a terminal it asks first, unless
    --yes. `task rm` is the same command.
    """
    if not yes and interactive():
        click.confirm(f"Delete task {task_id} with its entries, journal and claims?",
                      abort=True, err=True)
    resp = settings.client().operator.delete_task(task_id, reason, discard_history=discard_history)
    if output == "json":
        emit_json(as_dict(resp))
        return
    kinds = [*REMOVED_KINDS, *sorted(set(resp.removed) - set(REMOVED_KINDS))]
    parts = [f"{kind} {resp.removed[kind]}" for kind in kinds if resp.removed.get(kind)]
    n = resp.keys_removed
    click.echo(f"removed task {task_id}: {n} key{'' if n == 1 else 's'}"
               + (f" ({', '.join(parts)})" if parts else ""))


# The earlier name, kept so that scripts written for it go on working; not listed.
task_rm = copy.copy(task_delete)
task_rm.hidden = True
task.add_command(task_rm, "rm")


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.option("--entries", is_flag=True, help="also one row per entry")
@output_option
@pass_settings
def status(settings: Settings, task_id: str, entries: bool, output: str) -> None:
    """Count a task's entries per state and per consumer group.

    Per group: entries it acked out of those it has to ack. Blocked entries
    are pending ones with a dead dependency (or part); stuck ones were committed
    longer ago than the registry's --stuck-written-after and no watcher verified
    them. "in staging": the bytes its entries' files still hold in staging (consumed
    ones leave after their staging retention). With --entries, also one row per entry:
    owner, retries, size, digest, error.
    """
    client = settings.client()
    t = client.operator.get_task(task_id)
    rows = client.operator.list_entries(task_id)
    counts = {s: int(t.states.get(s, 0)) for s in STATES}
    groups = group_progress(t, rows)
    if output == "json":
        data: dict[str, Any] = {
            "task": task_id, "status": status_name(t.status), "status_reason": t.status_reason,
            "entries_total": t.entry_count, "states": counts, "blocked": t.blocked,
            "stuck_written": t.stuck_written,
            "staging_bytes": t.staging_bytes,
            "done": t.entry_count - t.open,
            "groups": {g: {"consumed": n, "total": total} for g, (n, total) in groups.items()},
        }
        if entries:
            data["entries"] = [as_dict(e) for e in rows]
        emit_json(data)
        return
    from rich.table import Table

    summary = Table("state", "entries", title=f"{task_id} ({status_name(t.status)})",
                    caption=t.status_reason or None)
    for s, n in counts.items():
        summary.add_row(s, str(n))
        if s == "pending" and t.blocked:
            summary.add_row("  blocked", str(t.blocked))
        if s == "written" and t.stuck_written:
            summary.add_row("  stuck", str(t.stuck_written))
    summary.add_row("total", str(t.entry_count), style="bold")
    if t.staging_bytes:
        summary.add_row("in staging", _bytes(t.staging_bytes))
    emit_table(summary)
    by_group = Table("consumer group", "consumed")
    for g, (n, total) in groups.items():
        by_group.add_row(g, f"{n}/{total}")
    emit_table(by_group)
    if entries:
        table = Table()
        for name in ("file_id", "state", "owner", "retries", "size", "digest"):
            table.add_column(name, no_wrap=True)
        table.add_column("error", overflow="fold")  # the one that wraps when space is short
        for e in rows:
            table.add_row(e.file_id, state_name(e.state), e.owner or "-",
                          f"{e.retry_count}/{e.max_retries}", str(e.size) if e.size else "-",
                          e.digest[:DIGEST_PREFIX] or "-", e.error or "")
        emit_table(table)


def group_progress(t: pb.Task, rows: list[pb.Entry]) -> dict[str, tuple[int, int]]:
    """Per consumer group: (entries it acked, entries it has to ack).

    The registry counts the acks; how many entries each group has to ack
    depends on the entries' own consumer lists (parts have none) and on where
    routing rules sent them, so that is counted here. The task's default groups come first.
    """
    totals: dict[str, int] = dict.fromkeys(t.spec.consumers, 0)
    for e in rows:
        # A routing rule sent it to some of its groups: the others never see it.
        for g in e.routed_to if e.HasField("routing_rule") else e.consumers:
            totals[g] = totals.get(g, 0) + 1
    for g in t.consumed_by_group:
        totals.setdefault(g, 0)
    order = [*t.spec.consumers, *sorted(set(totals) - set(t.spec.consumers))]
    return {g: (int(t.consumed_by_group.get(g, 0)), totals[g]) for g in order}


def _bytes(n: int) -> str:
    """A size as people read it: bytes below a KiB, else in the largest binary unit."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:,.1f} {unit}"
