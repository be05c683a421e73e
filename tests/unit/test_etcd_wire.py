"""The etcd requests the registry builds in place carry exactly the messages the
protocol's constructors would build: every kind of compare and operation, in a lone
transaction and in a group (etcd's nested transactions). Checked against the
constructors' bytes, no etcd needed."""

from __future__ import annotations

from typing import Any

from baton_relay.registry.store.etcd import (
    Compare,
    Delete,
    Get,
    Guarded,
    Put,
    TxnOp,
    _txn_pb,
    prefix_end,
    rpc,
)

COMPARES = [
    Compare(b"/k/a", "version", "==", 0),
    Compare(b"/k/b", "version", ">", 0),
    Compare(b"/k/c", "mod", "==", 1234),
    Compare(b"/k/d", "create", "!=", 77),
    Compare(b"/k/e", "value", "==", b"v\x00w"),
    Compare(b"/k/p/", "version", "==", 0, range_end=prefix_end(b"/k/p/")),
    Compare(b"/k/f", "mod", "<", 9),
]
SUCCESS: list[TxnOp] = [
    Put(b"/k/a", b"value"), Put(b"/k/l", b"", lease=0x1234), Put(b"/k/m", b"x" * 300, lease=7),
    Delete(b"/k/b"), Get(b"/k/c"), Get(b"/k/p/", prefix=True, limit=128, keys_only=True),
    Get(b"/k/q/", prefix=True),
]
FAILURE: list[TxnOp] = [Get(b"/k/a"), Delete(b"/k/z")]

_RESULTS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, ">": rpc.Compare.GREATER,
            "<": rpc.Compare.LESS}
_TARGETS = {"version": (rpc.Compare.VERSION, "version"),
            "create": (rpc.Compare.CREATE, "create_revision"),
            "mod": (rpc.Compare.MOD, "mod_revision"), "value": (rpc.Compare.VALUE, "value")}


def expected_compare(c: Compare) -> Any:
    target, field = _TARGETS[c.target]
    return rpc.Compare(key=c.key, result=_RESULTS[c.op], range_end=c.range_end,
                       target=target, **{field: c.operand})


def expected_op(op: TxnOp) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value,
                                                        lease=op.lease))
    if isinstance(op, Delete):
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key))
    return rpc.RequestOp(request_range=rpc.RangeRequest(
        key=op.key, range_end=prefix_end(op.key) if op.prefix else b"", limit=op.limit,
        keys_only=op.keys_only))


def expected_txn(compares: list[Compare], success: list[TxnOp],
                 failure: list[TxnOp]) -> Any:
    return rpc.TxnRequest(compare=[expected_compare(c) for c in compares],
                          success=[expected_op(op) for op in success],
                          failure=[expected_op(op) for op in failure])


def test_a_transaction_built_in_place_is_the_constructors_one() -> None:
    built = _txn_pb(COMPARES, SUCCESS, FAILURE)
    assert built == expected_txn(COMPARES, SUCCESS, FAILURE)
    assert built.SerializeToString() == expected_txn(COMPARES, SUCCESS,
                                                     FAILURE).SerializeToString()


def test_a_group_built_in_place_nests_each_callers_transaction() -> None:
    group = [Guarded(COMPARES, SUCCESS, FAILURE), Guarded([], [Put(b"/k/x", b"1")]),
             Guarded(COMPARES[:2], [], FAILURE)]
    built = rpc.TxnRequest()
    for g in group:
        g._fill(built.success.add().request_txn)
    expected = rpc.TxnRequest(success=[
        rpc.RequestOp(request_txn=expected_txn(list(g.compares), list(g.success),
                                               list(g.failure))) for g in group])
    assert built.SerializeToString() == expected.SerializeToString()
    assert [r.request_txn.success[0].request_put.key for r in built.success[:2]] == [
        b"/k/a", b"/k/x"]
