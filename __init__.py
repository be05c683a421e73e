"""Baton: the coordination layer for pipelines of agents that hand files to each other
through a shared staging area.

This folder, the repository's root, is the package ``baton_relay`` (pyproject.toml maps
it so): its packages are the top-level folders ``kernel/`` (what every side agrees on),
``client/`` (the agents' library and the ``baton`` CLI), ``registry/`` (the gRPC server on
etcd), ``watcher/`` (the daemon that verifies staged files) and ``local/`` (``baton up``
and the demo). Each file has one import name, ``baton_relay.FOLDER.MODULE``; see
docs/architecture.md, "Layout".
"""
