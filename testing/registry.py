"""The registry, in the test's process, on an in-memory store, by a clock the test owns.

    from baton_relay.testing import serve

    with serve() as registry:
        client = registry.client
        ...
        registry.clock.advance(600)   # ten minutes pass for the registry, at once

The registry is Baton's own (``baton_relay.registry``), started on a
:class:`~.store.MemoryEtcd` instead of etcd and on an event loop of its own thread whose
time is a :class:`~.clock.Clock`'s. It serves plaintext gRPC on one loopback port; no
etcd binary, no other port. Nothing it holds outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from ..client import AsyncClient, Client, RetryPolicy
from ..registry import RegistryConfig, Running, start
from ..registry.records import clock as wall_clock
from ..registry.store.etcd import Etcd
from ..registry.store.keys import Keys
from ..watcher import Watcher, WatcherConfig, start_watcher
from .clock import Clock, ClockLoop
from .store import MemoryEtcd

log = logging.getLogger("baton.testing")

#: a test's client gives up soon: a refusal it does not expect fails the test at once
#: instead of after the default retries (30 s)
RETRY = RetryPolicy(attempts=3, initial=0.05, cap=0.2, deadline=3.0)

#: the registry's settings here: sweeps at most every 50 ms (a test's time is short)
DEFAULTS = RegistryConfig(listen="127.0.0.1:0", prefix="/baton/v1/", reap_interval=0.05,
                          insecure=True, etcd="memory", etcd_check_interval=3600.0)

#: a watcher's settings here: retries soon, looks at every entry only when asked
WATCHER_DEFAULTS: dict[str, Any] = {"retry_delay": 0.05, "poll_interval": 0.1,
                                    "reconcile_interval": 300.0}

#: the in-memory store's progress notifications to idle watches, seconds of its clock
#: (what ``baton up`` has etcd do)
PROGRESS_INTERVAL = 10.0


class InProcessRegistry:
    """A started registry: its address, its clock, its store, clients of it."""

    def __init__(self, config: RegistryConfig, clock: Clock, store: MemoryEtcd,
                 loop: ClockLoop, running: Running, thread: threading.Thread) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.address = f"127.0.0.1:{running.port}"
        self.staging = Path(config.staging)
        self.running = running
        self._loop = loop
        self._thread = thread
        self._clients: list[Client] = []
        self._watchers: list[Watcher] = []
        self._stopped = False

    @property
    def client(self) -> Client:
        """A blocking client of this registry (made on first use; closed by :meth:`stop`)."""
        if not self._clients:
            self._clients.append(self.connect())
        return self._clients[0]

    def connect(self, **kw: Any) -> Client:
        """Another blocking client (an agent of its own), closed by :meth:`stop`."""
        kw.setdefault("timeout", 10)
        kw.setdefault("retry", RETRY)
        client = Client(self.address, **kw)
        self._clients.append(client)
        return client

    def async_client(self, **kw: Any) -> AsyncClient:
        """An asyncio client, for the caller's event loop (``async with`` it)."""
        kw.setdefault("timeout", 10)
        kw.setdefault("retry", RETRY)
        return AsyncClient(self.address, **kw)

    def watcher(self, **settings: Any) -> Watcher:
        """Start a watcher on this registry and its staging root (Baton's own, with
        real inotify), stopped by :meth:`stop`: committed files go verified.
        ``settings`` are :class:`WatcherConfig` fields."""
        config = WatcherConfig(registry=self.address, staging=str(self.staging),
                               **{**WATCHER_DEFAULTS, **settings})
        watcher = start_watcher(config, retry=RETRY)
        self._watchers.append(watcher)
        return watcher

    def advance(self, seconds: float, *, hold_sessions: bool = True) -> None:
        """``self.clock.advance``: see :meth:`.Clock.advance`."""
        self.clock.advance(seconds, hold_sessions=hold_sessions)

    def wait_for(self, condition: Callable[[], object], timeout: float = 10.0,
                 what: str = "") -> None:
        """Return once ``condition()`` holds, asking again every 20 ms; raise
        ``TimeoutError`` after ``timeout`` seconds of the machine's time (for what
        happens at its own pace: a watcher's verification, another agent's work)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what or condition} did not happen within {timeout:g} s")
            time.sleep(0.02)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the registry's loop (to read its store, say) and return
        what it returns."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if self._stopped:
            return
        self._stopped = True
        for watcher in self._watchers:
            watcher.stop()
        for client in self._clients:
            client.close()
        try:
            self.call(self.running.stop(grace))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self.clock.forget(self._loop)

    def __enter__(self) -> InProcessRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_process(staging: str | Path, *, clock: Clock | None = None,
                     **settings: Any) -> InProcessRegistry:
    """Start a registry on an in-memory store, serving on a free loopback port, its
    staging root at ``staging``; ``settings`` are :class:`RegistryConfig` fields."""
    clock = clock or Clock()
    config = replace(DEFAULTS, staging=str(staging), **settings)
    if not config.insecure:
        raise ValueError("the in-process registry serves plaintext on loopback only")
    loop = clock.loop()
    store = MemoryEtcd(progress_interval=PROGRESS_INTERVAL)
    started = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        with wall_clock.use(clock.time):
            try:
                # The store has Etcd's interface (held to it by the conformance suite).
                outcome["running"] = loop.run_until_complete(
                    start(config, store=cast(Etcd, store)))
            except BaseException as e:  # raised in the caller's thread below
                outcome["error"] = e
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="baton-registry", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("the in-process registry did not start within 30 s")
    if "error" in outcome:
        clock.forget(loop)
        raise outcome["error"]
    keys = Keys(config.prefix)

    async def hold(until: float) -> None:
        """Keep the leases of agents' sessions and watchers' registrations until
        ``until`` (a step of an advance): their holders are alive."""
        for prefix in (keys.agents(), keys.watchers()):
            for kv in store.snapshot(prefix).values():
                if kv.lease:
                    store.hold(kv.lease, until)

    clock.before_step(loop, hold)
    return InProcessRegistry(config, clock, store, loop, outcome["running"], thread)


@contextmanager
def serve(staging: str | Path | None = None, *, clock: Clock | None = None,
          **settings: Any) -> Iterator[InProcessRegistry]:
    """A registry for the length of a ``with`` block (its staging root a temporary
    directory unless given); see :func:`start_in_process`."""
    with ExitStack() as stack:
        if staging is None:
            staging = stack.enter_context(tempfile.TemporaryDirectory(prefix="baton-staging-"))
        registry = start_in_process(staging, clock=clock, **settings)
        stack.callback(registry.stop)
        yield registry
