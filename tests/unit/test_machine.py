"""The entry state machine as a table: every pair outside it is refused by ``apply``,
allowed moves reset what they declare, the diagram in the docs is the table's, and no
module outside the machine assigns an entry's state."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from baton_relay.kernel.errors import IllegalTransition
from baton_relay.registry.records.model import DEAD, PENDING, WRITING, EntryRecord, State
from baton_relay.registry.rules import machine
from baton_relay.registry.rules.machine import ATTEMPT, TABLE, Event, apply

ROOT = Path(__file__).resolve().parents[2]


def _entry(state: State) -> EntryRecord:
    rec = EntryRecord(task_id="t", file_id="f", path="f", state=state)
    rec.owner, rec.session, rec.size, rec.digest = "a", 7, 5, "d"
    rec.committed_digest, rec.observed, rec.attributes = "c", {"size": 5}, '{"k":1}'
    rec.rule, rec.routed_to, rec.not_before, rec.error = 0, ["g"], 9.0, "old"
    return rec


@pytest.mark.parametrize(("state", "event"), [
    pair for pair in itertools.product(State, Event) if pair not in TABLE])
def test_pairs_outside_the_table_are_refused_and_change_nothing(state: State,
                                                                event: Event) -> None:
    """Every (state, event) the table lacks raises IllegalTransition and leaves the entry."""
    rec = _entry(state)
    before = dict(vars(rec))
    with pytest.raises(IllegalTransition, match=f"is {state}: {event} is not a move"):
        apply(rec, event)
    assert vars(rec) == before


@pytest.mark.parametrize(("state", "event"), list(TABLE))
def test_allowed_moves_reach_their_state_and_reset_their_fields(state: State,
                                                                 event: Event) -> None:
    """Each allowed move lands in the table's state with its declared fields at default."""
    rec = _entry(state)
    move = TABLE[(state, event)]
    assert apply(rec, event) == move.to
    assert rec.state == move.to
    fresh = EntryRecord(task_id="t", file_id="f", path="f")
    for name in move.resets:
        assert getattr(rec, name) == getattr(fresh, name), name
    for name, value in move.sets:
        assert getattr(rec, name) == value


def test_every_give_back_resets_the_whole_attempt() -> None:
    """retry, die and revoke all clear every attempt field (revoke once skipped some)."""
    for event in (Event.RETRY, Event.DIE, Event.REVOKE):
        rec = _entry(WRITING)
        apply(rec, event)
        assert (rec.owner, rec.session, rec.size, rec.digest, rec.committed_digest,
                rec.observed, rec.attributes, rec.rule, rec.routed_to) == (
            "", 0, 0, "", "", None, "", -1, []), event
        assert set(ATTEMPT) <= set(TABLE[(WRITING, event)].resets)


def test_unknown_stored_state_is_refused() -> None:
    """A record with a state the enum lacks is refused with its name, not moved."""
    rec = _entry(PENDING)
    rec.state = "lost"
    with pytest.raises(IllegalTransition, match="unknown state 'lost'"):
        apply(rec, Event.CLAIM)


def test_states_keep_their_stored_strings() -> None:
    """The enum dumps and loads as the plain strings stored records already hold."""
    rec = EntryRecord.load(b'{"task_id":"t","file_id":"f","path":"f","state":"dead"}')
    assert rec.state == DEAD
    apply(rec, Event.REQUEUE)
    apply(rec, Event.CLAIM)
    assert rec.dump().count(b'"state":"writing"') == 1


def test_architecture_doc_holds_the_generated_diagram() -> None:
    """docs/architecture.md's state diagram is exactly the one generated from the table."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- machine:begin -->\n", "<!-- machine:end -->"
    assert begin in doc and end in doc
    held = doc.split(begin, 1)[1].split(end, 1)[0]
    assert held == machine.mermaid()


def _state_assignments(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            lines += [e.lineno for e in elts
                      if isinstance(e, ast.Attribute) and e.attr == "state"]
    return lines


def test_only_the_machine_assigns_an_entry_state() -> None:
    """No registry module but machine.py assigns ``.state``: every move goes through apply."""
    found = {}
    for path in sorted((ROOT / "registry").rglob("*.py")):
        if path.name == "machine.py":
            continue
        lines = _state_assignments(ast.parse(path.read_text()))
        if lines:
            found[path.name] = lines
    assert found == {}
