"""Baton's shared kernel: what the client, the registry and the watcher must agree on.

The wire contract (:mod:`.v1`, the ``.proto`` and its generated stubs), the constants
both sides share (:mod:`.contract`), the domain errors and the one table mapping them to
gRPC status codes (:mod:`.errors`), settings loading (:mod:`.settings`), the log style
(:mod:`.logs`), the backoff every retry uses (:mod:`.backoff`), certificate identities
(:mod:`.pki`) and the daemons' small shared pieces (:mod:`.metrics_endpoint`,
:mod:`.sdnotify`). It imports nothing else of Baton's: every other package imports it.
"""

if __name__ != "baton_relay.kernel":  # one import name per file
    raise ImportError(f"{__name__} is baton_relay.kernel: import it by that name "
                      "(the repository's root is the package baton_relay)")

