"""Testing agents without etcd: a registry served in-process on an in-memory store,
with a clock the test owns (docs/testing.md).

The in-memory store (:mod:`.store`) has the interface the registry uses of etcd and is
held to etcd's behaviour by a conformance suite; the registry running on it is the real
one, unchanged.
"""
