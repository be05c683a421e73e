"""Building, running and stopping a registry replica."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...kernel import collector, tracing
from ...kernel.contract import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    MIN_PING_INTERVAL_MS,
    REGISTRY_SERVICE,
    SERVICES,
)
from ...kernel.errors import BatonError, InvalidArgument
from ...kernel.logs import setup_logging
from ...kernel.sdnotify import Notifier
from ..records.archive_store import ArchiveStore
from ..rules.core import Core, every
from ..rules.election import Election, while_leading
from ..rules.sweeping import SweepWatch, run_sweep
from ..store.etcd import Etcd, EtcdAuth
from ..store.etcd_members import MEMBERS_KEY, REASON_KEY, EtcdMembers, allowed_versions
from ..store.keys import Keys
from ..sweeps.archive import Archiver, DirectoryStore
from ..sweeps.archive_s3 import S3Store
from ..sweeps.deadlines import Deadlines
from ..sweeps.scheduler import Scheduler
from ..sweeps.stalls import Stalls
from ..verbs.sessions import Reaper
from ..verbs.shards import Assigner, Shards
from . import interceptors
from .agent_stream import AgentStreams
from .config import RegistryConfig, check_archive, load_config
from .metrics import RegistryMetrics
from .service import Parts, serve_all
from .tls import ServerCertificates, is_loopback

log = logging.getLogger("baton.registry")


@dataclass
class Running:
    """A started replica: its bound port and how to stop it."""

    port: int
    server: grpc.aio.Server
    etcd: Etcd
    core: Core
    reaper: Reaper
    scheduler: Scheduler
    health: health.HealthServicer
    _stop: asyncio.Event
    _background: list[asyncio.Task[None]]
    #: keeps every watcher shard owned and the watchers balanced
    assigner: Assigner | None = None
    #: every etcd member's release, as last read
    etcd_members: EtcdMembers | None = None
    #: the replica's metrics, and the port ``/metrics`` is served on (None, 0: off)
    metrics: RegistryMetrics | None = None
    metrics_port: int = 0
    #: the agents' session streams this replica serves
    streams: AgentStreams | None = None
    #: takes back attempts that stopped checkpointing
    stalls: Stalls | None = None
    #: the election of the replica that runs the periodic sweeps
    sweeper: Election | None = None
    #: that replica's watch of the indexes its sweeps read
    sweep_watch: SweepWatch | None = None

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop taking calls, let in-flight ones finish within ``grace``, then close."""
        self.health.enter_graceful_shutdown()
        self._stop.set()
        began = asyncio.get_running_loop().time()
        await self.server.stop(grace)
        await self._background_stopped()
        ended = asyncio.get_running_loop().time()
        if ended - began > STOP_SLOW:
            log.warning("stop: calls and background tasks took %.1fs to end", ended - began)
        if self.metrics is not None:
            await self.metrics.close()
        await self.core.stop()
        await self.etcd.close()


    async def _background_stopped(self) -> None:
        """Every background task ended: each sees the stop and returns, and one that has
        not within ``STOP_TIMEOUT`` (an etcd call retrying, a sweep in its middle) is
        cancelled and named, so that a stop always ends. A task that failed raises here."""
        if not self._background:
            return
        _, pending = await asyncio.wait(self._background, timeout=STOP_TIMEOUT)
        if pending:
            log.warning("stop: %d background task(s) did not end within %gs, cancelled: %s",
                        len(pending), STOP_TIMEOUT,
                        ", ".join(sorted(repr(t.get_coro()) for t in pending)))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in self._background:
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error


#: seconds the background tasks get to see a stop and end before they are cancelled
STOP_TIMEOUT = 10.0
#: a stop's first part (calls, background tasks) that takes longer is logged
STOP_SLOW = 5.0

#: the names the health service answers: the server, the registry as a whole and each
#: of its services
HEALTH_NAMES = ("", REGISTRY_SERVICE, *SERVICES)


class _Health(health.HealthServicer):
    """gRPC health checking, with every etcd member's release in each reply's trailing
    metadata (and, while one is refused, why: ``etcd_members``), and the registry's
    service ``NOT_SERVING`` while an etcd member runs a refused release."""

    def __init__(self, members: EtcdMembers) -> None:
        super().__init__()
        self.members = members
        self._refused = False

    def Check(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        reply = super().Check(request, context)
        trailers = [(MEMBERS_KEY, self.members.versions())]
        if self.members.reason:
            trailers.append((REASON_KEY, self.members.reason))
        context.set_trailing_metadata(tuple(trailers))
        return reply

    async def check_etcd(self) -> None:
        """Read the members again; the registry's service follows the verdict."""
        refused = bool(await self.members.check())
        if refused != self._refused:
            self._refused = refused
            for name in HEALTH_NAMES[1:]:
                self.set(name, health_pb2.HealthCheckResponse.NOT_SERVING if refused
                         else health_pb2.HealthCheckResponse.SERVING)


def etcd_auth(config: RegistryConfig) -> EtcdAuth:
    """The registry's credentials towards etcd, from its settings."""
    password = ""
    if config.etcd_password_file:
        try:
            password = Path(config.etcd_password_file).read_text().strip()
        except OSError as e:
            raise InvalidArgument(
                f"--etcd-password-file: cannot read {config.etcd_password_file}: "
                f"{e.strerror}") from e
    elif config.etcd_user:
        raise InvalidArgument("--etcd-user needs --etcd-password-file")
    return EtcdAuth(ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key,
                    user=config.etcd_user, password=password)


def server_certificates(config: RegistryConfig) -> ServerCertificates | None:
    """The registry's TLS files, or None when it serves plaintext (``--insecure``)."""
    tls = bool(config.tls_ca or config.tls_cert or config.tls_key)
    if config.insecure:
        if tls:
            raise InvalidArgument("--insecure and --tls-* settings contradict each other: "
                                  "choose one")
        if not is_loopback(config.listen):
            if not config.insecure_beyond_loopback:
                raise InvalidArgument(
                    f"--insecure on {config.listen}, beyond loopback: anyone who reaches it "
                    "could do anything as anyone. Serve mutual TLS (--tls-ca, --tls-cert, "
                    "--tls-key), listen on a loopback address, or add "
                    "--insecure-beyond-loopback if that is what you mean")
            log.warning("serving PLAINTEXT on %s, beyond loopback (--insecure "
                        "--insecure-beyond-loopback): anyone who reaches it may do anything",
                        config.listen)
        return None
    if config.insecure_beyond_loopback:
        raise InvalidArgument("--insecure-beyond-loopback goes with --insecure (it allows "
                              "plaintext beyond loopback); without --insecure it means nothing")
    if not tls:
        raise InvalidArgument(
            "no TLS configured: give --tls-ca, --tls-cert and --tls-key (clients must then "
            "present certificates from that CA), or --insecure to serve plaintext with no "
            "identities")
    return ServerCertificates(config.tls_ca, config.tls_cert, config.tls_key)


async def start(config: RegistryConfig, *, store: Etcd | None = None) -> Running:
    """Connect to etcd and serve on ``config.listen`` (port 0 picks a free port).

    ``store``: serve on it instead of the etcd ``config.etcd`` names (an in-memory store
    of ``baton_relay.testing``, which has etcd's interface)."""
    certificates = server_certificates(config)
    check_archive(config)  # before etcd is asked: a contradiction ends the start
    allowed = allowed_versions(config.allow_etcd_version)
    if not config.metrics:
        return await _start(config, certificates, allowed, None, 0, store)
    metrics = RegistryMetrics()
    # First: a --metrics address that cannot be served ends the start before etcd is asked.
    metrics_port = await metrics.serve(config.metrics)
    try:
        return await _start(config, certificates, allowed, metrics, metrics_port, store)
    except BaseException:
        await metrics.close()
        raise


async def _start(config: RegistryConfig, certificates: ServerCertificates | None,
                 allowed: frozenset[str], metrics: RegistryMetrics | None,
                 metrics_port: int, store: Etcd | None = None) -> Running:
    etcd = store if store is not None else Etcd(config.etcd, auth=etcd_auth(config))
    if metrics is not None:
        etcd.observe = metrics.etcd_request
    await etcd.connect()
    members = EtcdMembers(etcd, allowed)
    try:
        await members.require()
    except BaseException:
        await etcd.close()
        raise
    version = await etcd.status()
    core = Core(etcd, Keys(config.prefix), config.staging)
    core.stuck_written_after = config.stuck_written_after
    core.staging_retention = config.staging_retention
    archiver = None
    archives = archive_store(config)
    if archives is not None:
        archiver = Archiver(core, archives, config.archive_after, config.archive_retention)
        core.archive = archiver
    await core.start()
    server = grpc.aio.server(
        options=[
            # A manifest travels in one CreateTask call; anything larger than the
            # largest valid one is refused by gRPC before it is read into memory.
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_send_message_length", MAX_REPLY_BYTES),
            # Clients ping quiet connections to notice a silent replica (contract.py).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        interceptors=interceptors.chain(secure=certificates is not None, metrics=metrics),
    )
    shards = Shards(core, config.shards, config.shard_move_deadline)
    service = Parts(core, shards)
    if metrics is not None:
        service.streams.record = metrics.stream_call
    serve_all(service, server)
    health_servicer = _Health(members)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    if certificates is None:
        port = server.add_insecure_port(config.listen)
    else:
        port = server.add_secure_port(config.listen, certificates.credentials())
    if port == 0:
        raise BatonError(f"cannot listen on {config.listen}")
    await server.start()
    for name in HEALTH_NAMES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    who = f"{socket.gethostname()}:{os.getpid()}"
    # The sweeps over the shared store run on one replica at a time, elected; each
    # reads only the head of an index of what is due, and only when its index was
    # written or a key of it falls due (docs/architecture.md, Sweeps).
    sweeper = Election(etcd, config.prefix, "sweeps", config.sweep_lease_ttl, who=who)
    watch = SweepWatch(core, sweeper)
    reaper = Reaper(core, config.reap_interval)
    scheduler = Scheduler(core, config.reap_interval)
    deadlines = Deadlines(core)
    stalls = Stalls(core)
    scheduler.follow(watch)
    woken = [(reaper.follow(watch), reaper.woken, "reaper"),
             (deadlines.follow(watch), deadlines.woken, "deadlines"),
             (stalls.follow(watch), stalls.woken, "stalls")]
    assigner = Assigner(shards, config.reap_interval)
    service.leases.interval = config.reap_interval
    full = config.full_sweep_interval
    background = [
        asyncio.create_task(sweeper.run(stop)),
        asyncio.create_task(watch.run(stop)),
        asyncio.create_task(scheduler.run(stop, sweeper, full)),
        *(asyncio.create_task(run_sweep(sweeper, alarm, sweep, what, config.reap_interval,
                                        stop, full))
          for alarm, sweep, what in woken),
        # On every replica: the shard assigner and the drain deadlines read what is as
        # small as the watchers and the drained hosts (never entries or tasks), from the
        # view, when it changes or a deadline comes; their guarded transactions race
        # safely. The etcd check is this replica's own health.
        asyncio.create_task(assigner.run(stop)),
        asyncio.create_task(service.leases.run(stop)),
        asyncio.create_task(every(config.etcd_check_interval, stop, health_servicer.check_etcd,
                                  "etcd versions")),
    ]
    if archiver is not None:
        # One replica archives (and expires) at a time; every one reads the store.
        election = Election(etcd, config.prefix, "archiver", config.archive_lease_ttl, who=who)
        archiver.election = election
        background.append(asyncio.create_task(election.run(stop)))
        background.append(asyncio.create_task(
            while_leading(election, config.archive_interval, stop, archiver.sweep, "archiver")))
    log.info("registry on port %d (%s), etcd %s (v%s), prefix %s, staging %s", port,
             "mutual TLS" if certificates else "plaintext, --insecure", config.etcd,
             version, config.prefix, config.staging)
    if metrics is not None:
        metrics.bind(core, reaper, service.sessions, shards, service.leases, members,
                     deadlines, archiver, stalls)
    return Running(port, server, etcd, core, reaper, scheduler, health_servicer, stop, background,
                   assigner, members, metrics, metrics_port, service.streams, stalls, sweeper,
                   watch)


def archive_store(config: RegistryConfig) -> ArchiveStore | None:
    """The store finished tasks are archived to (None: they stay in etcd)."""
    check_archive(config)
    if config.archive_s3_bucket:
        return S3Store(config.archive_s3_bucket, config.archive_s3_prefix,
                       config.archive_s3_endpoint)
    if config.archive_dir:
        return DirectoryStore(config.archive_dir)
    return None


async def serve(config: RegistryConfig, notifier: Notifier | None = None) -> None:
    notifier = notifier or Notifier()
    running = await start(config)
    # Before saying it serves: a SIGTERM sent as soon as the line is read drains too.
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    host = config.listen.rpartition(":")[0] or "0.0.0.0"
    # `baton up` and operators read this line to learn the bound address.
    print(f"baton-registry listening on {host}:{running.port}", flush=True)
    notifier.ready(f"serving on {host}:{running.port}, etcd {config.etcd}")
    pings = asyncio.create_task(notifier.watchdog_pings())
    await done.wait()
    notifier.stopping(f"draining calls (grace {config.grace:g}s)")
    log.info("shutting down (grace %.1fs)", config.grace)
    await running.stop(config.grace)
    pings.cancel()
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv, os.environ)
    except BatonError as e:
        print(f"baton-registry: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    tracing.setup("baton-registry")
    collector.tune(config.gc_young)
    try:
        asyncio.run(serve(config, Notifier.from_environ(os.environ)))
    except BatonError as e:
        print(f"baton-registry: {e}", file=sys.stderr)
        return 1
    return 0
