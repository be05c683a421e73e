"""The ``/metrics`` endpoint of a daemon: its setting, prometheus_client's server, its error.

The registry and the watcher both serve their metrics through :func:`serve_metrics`:
the setting is ``--metrics HOST:PORT`` in both (``BATON_METRICS``, TOML ``metrics``;
empty is off), the server is prometheus_client's HTTP server on a thread of its own,
and every way the address can be wrong — not ``HOST:PORT``, a port out of range, a
host that does not resolve or is not this machine's, a port in use — is one
:class:`~baton_relay.kernel.errors.InvalidArgument` whose message is the line the
daemon prints before it exits: ``--metrics ADDRESS: REASON``.

prometheus_client comes with the registry's and the watcher's extras, not with an
agent's install: nothing of the client library or the ``baton`` CLI imports this
module. It is the only module of Baton that starts prometheus_client's server.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.registry import Collector

from .errors import InvalidArgument
from .logs import log

#: the flag that sets the address, as the error names it
SETTING = "--metrics"
#: seconds ``close`` waits for the server's thread
CLOSE_TIMEOUT = 5.0
_FORM = "expected HOST:PORT (an IPv6 host in brackets; port 0 = pick one)"
#: the reasons a bind fails that a reader should not have to look up
_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def address_error(address: str, reason: str) -> InvalidArgument:
    """The error of a ``--metrics`` address that cannot be served, for ``reason``."""
    return InvalidArgument(f"{SETTING} {address}: {reason}", setting=SETTING,
                           address=address, reason=reason)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); :func:`address_error`
    when it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise address_error(address, _FORM)
    if int(port) > 65535:
        raise address_error(address, f"port {int(port)} is out of range (0-65535)")
    return host, int(port)


def url_of(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


@dataclass
class MetricsEndpoint:
    """``/metrics`` served on ``address`` (``port`` the bound port), until :meth:`close`."""

    address: str
    host: str
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def close(self) -> bool:
        """Stop answering and free the port: normally within half a second (the
        server's poll), never more than twice :data:`CLOSE_TIMEOUT`, so that a daemon
        whose server thread is stuck still stops. Whether the server's thread ended."""
        # ``shutdown`` waits without a limit for the serving loop to notice; asked on a
        # thread of its own, the wait is bounded here.
        stopper = threading.Thread(target=self._server.shutdown, daemon=True,
                                   name="metrics-shutdown")
        stopper.start()
        stopper.join(CLOSE_TIMEOUT)
        self._server.server_close()
        self._thread.join(CLOSE_TIMEOUT)
        return not self._thread.is_alive()


def serve_metrics(address: str, registry: Collector, logger: logging.Logger) -> MetricsEndpoint:
    """Serve ``registry`` at ``/metrics`` on ``address`` and log where; a bad address is
    :func:`address_error`, with nothing left listening."""
    host, port = parse_address(address)
    try:
        server, thread = start_http_server(port, host, registry=registry)
    except socket.gaierror as e:
        raise address_error(address, f"cannot resolve {host} ({e.strerror})") from e
    except OSError as e:
        reason = _BIND_REASONS.get(e.errno or 0) or (e.strerror or str(e)).lower()
        raise address_error(address, f"cannot listen: {reason}") from e
    endpoint = MetricsEndpoint(address, host, server, thread)
    log(logger, logging.INFO, "serving metrics", url=endpoint.url)
    return endpoint
