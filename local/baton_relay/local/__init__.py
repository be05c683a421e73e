"""The local stack: ``baton up`` (a private etcd, a registry and a watcher on one
machine, supervised in the foreground), the etcd launcher it and the tests use, and
the demo pipeline. Server side: installed with ``baton-relay[local]``, never on an agent
host that only needs the client.
"""
