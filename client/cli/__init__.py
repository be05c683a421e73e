"""The ``baton`` command line: a thin shell over the client library.

Every command is one or two library calls plus rendering: ``-o table`` (the
default) for people, ``-o json`` for scripts. A :class:`~kernel.errors.BatonError`
ends a command with one ``baton: <message>`` line on stderr and the error's
``exit_code`` (see docs/cli.md). The environment is read only through click's
``envvar`` options (``BATON_REGISTRY``, ``BATON_TIMEOUT``, ``BATON_AGENT``).

``claim`` and ``consume`` open a session without a keepalive thread and leave it
open on exit, so the claim outlives the process for ``--ttl`` seconds; ``baton
keepalive SESSION`` extends it and ``baton release SESSION`` ends it, as
``etcdctl lease keep-alive`` / ``revoke`` do for a lease.
"""

from ._root import cli, main

__all__ = ["cli", "main"]
