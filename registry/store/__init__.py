"""The store: the one etcd client (``etcd``), transactions and group commit (``txn``),
the watch-fed view, the keyspace (``keys``), the index counts and fan-out of task
events, etcd members and versions. Imports nothing above it."""
