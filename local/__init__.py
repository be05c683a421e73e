"""The local stack: ``baton up`` (a private etcd, a registry and a watcher on one
machine, supervised in the foreground), the etcd launcher it and the tests use, and
the demo pipeline. Server side: installed with ``baton-relay[local]``, never on an agent
host that only needs the client.
"""

if __name__ != "baton_relay.local":  # one import name per file
    raise ImportError(f"{__name__} is baton_relay.local: import it by that name "
                      "(the repository's root is the package baton_relay)")

