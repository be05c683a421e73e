"""The task lifecycle as a table (registry/rules/lifecycle.py): its moves and refusals, the
diagram in the docs is the table's, and no module outside it assigns a task's status."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from baton_relay.kernel.errors import IllegalTransition, NotFound
from baton_relay.registry.records.model import TaskRecord
from baton_relay.registry.rules import lifecycle
from baton_relay.registry.rules.lifecycle import STATUSES, TABLE, TaskEvent, apply

ROOT = Path(__file__).resolve().parents[2]
OWNER = "lifecycle.py"

#: every move a task makes, as the writers made them before the table (operators'
#: pause/resume/cancel and a requeue or replay reopening a completed task, CreateTask's
#: activation, the scheduler's completion, the archiver's two steps, DeleteTask's mark)
EXPECTED = {
    ("creating", "activate"): "active",
    ("active", "pause"): "paused",
    ("paused", "resume"): "active",
    ("completed", "resume"): "active",
    **{(s, "cancel"): "cancelled" for s in ("active", "paused", "creating", "completed")},
    ("active", "complete"): "completed",
    ("completed", "reopen"): "active",
    ("completed", "archive"): "archiving",
    ("cancelled", "archive"): "archiving",
    ("archiving", "store"): "archived",
    **{(s, "delete"): "deleting"
       for s in ("creating", "active", "paused", "completed", "cancelled")},
}


def _task(status: str) -> TaskRecord:
    return TaskRecord(task_id="t", status=status, staging_dir="/s", entry_count=1,
                      manifest_digest="d", consumers=[], max_retries=3)


def test_the_table_is_the_moves_the_writers_made() -> None:
    """The table holds exactly the moves of every writer of a task's status."""
    assert {(s, str(e)): to for (s, e), to in TABLE.items()} == EXPECTED


@pytest.mark.parametrize(("status", "event"), sorted(TABLE))
def test_allowed_moves_reach_their_status(status: str, event: TaskEvent) -> None:
    """``apply`` makes each move of the table and says the new status."""
    task = _task(status)
    assert apply(task, event) == TABLE[status, event] == task.status
    assert lifecycle.allowed(status, event)
    assert lifecycle.target(event) == task.status


@pytest.mark.parametrize(("status", "event"), [
    pair for pair in itertools.product(STATUSES, TaskEvent) if pair not in TABLE])
def test_pairs_outside_the_table_are_refused_and_change_nothing(
        status: str, event: TaskEvent) -> None:
    """Every (status, event) the table lacks is refused, the record left as it was."""
    task = _task(status)
    before = dict(vars(task))
    with pytest.raises(IllegalTransition, match=f"cannot {event} task 't': it is {status}"):
        apply(task, event)
    assert vars(task) == before
    assert not lifecycle.allowed(status, event)


def test_a_refusal_is_the_callers_own_error() -> None:
    """A caller's ``refuse`` is raised as it is (its type and message kept)."""
    task = _task("archived")
    with pytest.raises(NotFound, match=r"^gone$"):
        apply(task, TaskEvent.PAUSE, lambda: NotFound("gone"))
    assert task.status == "archived"


def test_architecture_doc_holds_the_generated_diagram() -> None:
    """docs/architecture.md's task lifecycle diagram is exactly the one generated from
    the table."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- lifecycle:begin -->\n", "<!-- lifecycle:end -->"
    assert begin in doc and end in doc
    assert doc.split(begin, 1)[1].split(end, 1)[0] == lifecycle.mermaid()


def offences(source: str, filename: str) -> list[str]:
    """Each assignment of a ``.status`` attribute in ``source`` (plain, augmented or
    in a tuple), and each ``TaskRecord(status=...)`` not given ``lifecycle.INITIAL``,
    as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == "status":
                    found.append(f"{filename}:{node.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "TaskRecord"):
            for kw in node.keywords:
                if kw.arg == "status" and not (
                        isinstance(kw.value, ast.Attribute) and kw.value.attr == "INITIAL"):
                    found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def test_no_module_but_the_lifecycle_assigns_a_tasks_status() -> None:
    """Every change of a task's status in the registry goes through ``lifecycle.apply``."""
    found: list[str] = []
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if path.name != OWNER:
            found += offences(path.read_text(), path.name)
    assert found == []
    writers = {path.name for path in (ROOT / "registry").rglob("*.py")
               if "lifecycle.apply(" in path.read_text()}
    assert writers == {"operators.py", "tasks.py", "scheduler.py", "archive.py",
                       "removal.py"}


def test_the_check_finds_each_way_a_module_set_a_status() -> None:
    """The forms the registry set a task's status in before the table are found."""
    cases = {
        "plain": 'def f(task):\n    task.status = "active"\n',
        "tuple": 'def f(task):\n    task.status, task.finished_at = "completed", now()\n',
        "variable": "def f(task, target):\n    task.status = target\n",
        "created": 'def f():\n    return TaskRecord(task_id="t", status="active")\n',
    }
    for what, source in cases.items():
        assert offences(source, what) != [], what
    assert offences("def f(rec):\n    rec.state = PENDING\n", "entry") == []
    assert offences("def f():\n    TaskRecord(status=lifecycle.INITIAL)\n", "new") == []
