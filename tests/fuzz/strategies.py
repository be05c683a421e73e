"""Hostile protobuf messages of any type of the contract, built from its descriptors.

Every field gets values an attacker or a buggy client would send: ids that exist (so
the request gets past the first lookups and into the code behind them) next to empty,
huge, traversing, control-character and non-UTF-8-looking strings; integers at their
type's edges; NaN and infinities; unknown enum numbers; repeated fields from empty to
thousands of items; nested messages a few levels deep. The values come from hypothesis,
so a finding shrinks to a small input and is replayed by its seed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: inputs per target: small in the test suite, 100,000 in the long run (make fuzz)
EXAMPLES = int(os.environ.get("BATON_FUZZ_EXAMPLES", "0") or 0)

#: strings that reach past lookups (the fixture's task, entries, group, a JSONPath)
#: and strings that try the edges
HOSTILE = (
    "", " ", ".", "..", "../x", "../../etc/passwd", "/etc/passwd", "a/../../b", "a//b",
    "a/./b", "./a", "a/", "\x00", "a\x00b", "\n", "a\nb", "\r\n", "\t", "\x7f", "\u202e",
    "\ud7ff", "\ufeff", "é", "日本", "🙂" * 3, "%s%n", "{}", "{{x}}", "'; DROP TABLE t;--",
    "$", "$..*", "$[?(@.x > 1)]", "$[?(@.score > 95)]", "$[?(@.a == 'b')]", "[[[[", "$[",
    "$.." + ".a" * 200, "-1", "0", "9" * 40, "1e309", "nan", "true", "null",
    "default", "t", "f0", "f1", "sink", "a" * 64, "a" * 65, "a" * 255, "a" * 4096,
)
#: one long value, given only to a singular field of the outermost message
LONG = "x" * 100_000
INT32 = (0, 1, -1, 2, 3, 10, 2**31 - 1, -(2**31), 2**31 - 2, 65535, 1000)
INT64 = (*INT32, 2**63 - 1, -(2**63), 2**53, 2**32, 86400 * 365 * 1000)
UINT64 = (0, 1, 2, 3, 2**64 - 1, 2**63, 2**32 - 1, 1000)
UINT32 = (0, 1, 2, 2**32 - 1, 2**31)
FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan,
          86400.0, 1e12)


def strings(known: Sequence[str] = (), long: bool = False) -> st.SearchStrategy[str]:
    pool = (*known, *HOSTILE, *((LONG,) if long else ()))
    return st.one_of(st.sampled_from(pool),
                     st.text(max_size=40),
                     st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF,
                                                    blacklist_categories=("Cs",)),
                             max_size=300))


def _scalar(field: FieldDescriptor, known: Sequence[str],
            long: bool = False) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return strings(known, long)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\x00" * (70_000 if long else 70)),
                         st.sampled_from([s.encode() for s in HOSTILE[:30]]))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=True,
                                                            allow_infinity=True, width=32))
    if t == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-5, 200))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
             FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.sampled_from(UINT32), st.integers(0, 2**32 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.sampled_from(UINT64), st.integers(0, 2**64 - 1))
    return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE
            and field.message_type.GetOptions().map_entry)


#: values worth reaching by field name (a task id, a session, a token that exists);
#: set by a target before it draws (see ``named``)
NAMED: dict[str, tuple[Any, ...]] = {}


def named(values: dict[str, tuple[Any, ...]]) -> None:
    """Give fields of these names (anywhere in a message) their values often."""
    NAMED.clear()
    NAMED.update(values)


@st.composite
def _fill(draw: st.DrawFn, desc: Descriptor, cls: type[Message], depth: int,
          known: Sequence[str], present: float, top: bool = False) -> Message:
    """A message; only the outermost one may have a huge repeated field (one of them), so
    that a message stays within what a client can send."""
    msg = cls()
    huge = draw(st.sampled_from([f.name for f in desc.fields if f.is_repeated] or [""])) \
        if top and draw(st.integers(0, 9)) == 0 else ""
    for field in desc.fields:
        if not draw(st.floats(0, 1)) < present:
            continue
        repeated = field.is_repeated
        if _is_map(field):
            key_f, value_f = field.message_type.fields_by_name["key"], \
                field.message_type.fields_by_name["value"]
            n = 300 if field.name == huge else draw(st.integers(0, 3))
            target = getattr(msg, field.name)
            for _ in range(n):
                k = draw(_scalar(key_f, known))
                if value_f.type == FieldDescriptor.TYPE_MESSAGE:
                    if depth > 0:
                        target[k].CopyFrom(draw(_fill(value_f.message_type, type(target[k]),
                                                      depth - 1, known, present)))
                else:
                    target[k] = draw(_scalar(value_f, known))
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            sub = field.message_type
            if repeated:
                n = 2000 if field.name == huge else draw(st.integers(0, 4))
                container = getattr(msg, field.name)
                # the item of a huge list is kept small: few of its fields set
                one = draw(_fill(sub, type(container.add()), min(depth - 1, 1) if n > 4
                                 else depth - 1, known, 0.3 if n > 4 else present))
                del container[:]
                # A long list repeats one drawn item: the size is the hostile part.
                for _ in range(n):
                    item = container.add()
                    item.CopyFrom(one)
            else:
                getattr(msg, field.name).CopyFrom(
                    draw(_fill(sub, type(getattr(msg, field.name)), depth - 1, known, present)))
            continue
        values = _scalar(field, known, long=top and not repeated)
        if field.name in NAMED and draw(st.integers(0, 9)) < 7:
            values = st.sampled_from(NAMED[field.name])
        if repeated:
            n = 5000 if field.name == huge else draw(st.integers(0, 3))
            # a long list repeats one value: a known id where the field takes strings
            long_one = (st.sampled_from(known or ("a",))
                        if field.type == FieldDescriptor.TYPE_STRING else values)
            one = draw(long_one if n > 3 else values)
            getattr(msg, field.name).extend([one] * n if n > 3 else
                                            [draw(values) for _ in range(n)])
        else:
            setattr(msg, field.name, draw(values))
    return msg


def messages(cls: type[Message], known: Sequence[str] = (), depth: int = 3,
             valid: st.SearchStrategy[Message] | None = None) -> st.SearchStrategy[Message]:
    """Hostile messages of type ``cls``; ``known`` strings are ids worth reaching.

    With ``valid`` (requests that would be accepted), half of them are one of those with
    a few fields made hostile: what gets past the first check and into the code behind.
    """
    wild = st.floats(0.2, 1.0).flatmap(
        lambda present: _fill(cls.DESCRIPTOR, cls, depth, known, present, top=True))
    if valid is None:
        return wild
    sparse = st.floats(0.0, 0.15).flatmap(
        lambda present: _fill(cls.DESCRIPTOR, cls, depth, known, present, top=True))
    return st.one_of(wild, st.tuples(valid, sparse).map(lambda pair: _merged(*pair)))


def _merged(base: Message, hostile: Message) -> Message:
    out = type(base)()
    out.CopyFrom(base)
    out.MergeFrom(hostile)
    return out


def fuzz_settings(default: int) -> settings:
    """A target's settings: ``default`` inputs, the same ones at every run (the suite's
    bounded run), unless the long run (``make fuzz``) asks for ``BATON_FUZZ_EXAMPLES``
    fresh ones."""
    return settings(max_examples=EXAMPLES or default, derandomize=not EXAMPLES,
                    deadline=None, database=None, suppress_health_check=list(HealthCheck),
                    print_blob=True)
