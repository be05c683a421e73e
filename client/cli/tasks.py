"""Task commands: ``task create|get|ls`` and ``status``."""

from __future__ import annotations

import json
from typing import IO, Any

import click
from rich.table import Table

from .. import errors
from .._client import parse_manifest
from ..v1 import baton_pb2 as pb
from ._common import (
    DIGEST_PREFIX,
    STATES,
    BatonGroup,
    Settings,
    as_dict,
    emit_json,
    emit_table,
    output_option,
    pass_settings,
    state_name,
    status_name,
)
from ._root import cli


@cli.group(cls=BatonGroup)
def task() -> None:
    """Create and inspect tasks (manifests)."""


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
    created_task, created = settings.client().create_task(spec)
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
    t = settings.client().get_task(task_id)
    if output == "json":
        emit_json(as_dict(t))
        return
    table = Table(show_header=False, box=None)
    rows = {
        "task": t.spec.task_id,
        "status": status_name(t.status),
        "entries": str(t.entry_count),
        "states": "  ".join(f"{s} {t.states[s]}" for s in STATES if t.states.get(s)) or "-",
        "consumers": ", ".join(t.spec.consumers) or "default",
        "max_retries": str(t.spec.max_retries),
        "labels": ", ".join(f"{k}={v}" for k, v in sorted(t.spec.labels.items())) or "-",
        "staging": t.staging_dir,
        "created": t.created_at,
        "manifest": t.manifest_digest[:DIGEST_PREFIX],
    }
    for key, value in rows.items():
        table.add_row(key, value)
    emit_table(table)


@task.command("ls")
@output_option
@pass_settings
def task_ls(settings: Settings, output: str) -> None:
    """List tasks."""
    tasks = settings.client().list_tasks()
    if output == "json":
        emit_json([as_dict(t) for t in tasks])
        return
    table = Table("task", "status", "entries", "created", "staging")
    for t in tasks:
        table.add_row(t.spec.task_id, status_name(t.status), str(t.entry_count), t.created_at,
                      t.staging_dir)
    emit_table(table)


@cli.command()
@click.argument("task_id", metavar="TASK")
@click.option("--entries", is_flag=True, help="also one row per entry")
@output_option
@pass_settings
def status(settings: Settings, task_id: str, entries: bool, output: str) -> None:
    """Count a task's entries per state.

    With --entries, also one row per entry: owner, retries, size, digest, error.
    """
    client = settings.client()
    t = client.get_task(task_id)
    rows = client.list_entries(task_id) if entries else []
    counts = {s: int(t.states.get(s, 0)) for s in STATES}
    if output == "json":
        data: dict[str, Any] = {"task": task_id, "status": status_name(t.status),
                                "entries_total": t.entry_count, "states": counts}
        if entries:
            data["entries"] = [as_dict(e) for e in rows]
        emit_json(data)
        return
    summary = Table("state", "entries", title=f"{task_id} ({status_name(t.status)})")
    for s, n in counts.items():
        summary.add_row(s, str(n))
    summary.add_row("total", str(t.entry_count), style="bold")
    emit_table(summary)
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


# --- producers -------------------------------------------------------------------


