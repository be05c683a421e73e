"""The verbs: what callers ask, one module per noun (tasks, producers, consumers, the
fused steps, checkpoints, watcher reports, operators, sessions, leases, shards,
removal, retention). Imports the rules and below."""
