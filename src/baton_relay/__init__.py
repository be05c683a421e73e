"""Baton: the coordination layer for pipelines of agents that hand files to each other
through a shared staging area.

Three packages: :mod:`baton_relay.client` (the agents' library and the ``baton`` CLI),
:mod:`baton_relay.registry` (the gRPC server on etcd) and :mod:`baton_relay.watcher`
(the daemon that verifies staged files). In the repository they are the top-level
folders ``client/``, ``registry/`` and ``watcher/``.
"""
