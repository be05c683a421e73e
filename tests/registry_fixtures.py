"""Real registry replicas for tests: each runs in its own thread and event loop.

Loaded as a pytest plugin by ``conftest.py``. Every test gets its own key
prefix (``prefix`` fixture) on the one session-wide etcd, so replicas of one
test share state and tests never see each other's.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from baton_relay.client import Client, RetryPolicy, Session
from baton_relay.local.etcdproc import etcd_version, find_etcd
from baton_relay.registry import RegistryConfig, Running, start
from baton_relay.registry.store.etcd import Etcd, EtcdAuth
from baton_relay.testing.registry import InProcessRegistry, start_in_process

T = TypeVar("T")


@functools.cache
def suite_etcd_version() -> str:
    """The release of the etcd this suite runs (``BATON_TEST_ETCD``, else ``find_etcd``).

    CI runs the suite on 3.4 and on the wheel's 3.5.1, which has known bugs: a registry
    the suite starts on it must be told to serve anyway, and only for that exact release
    (tests/system/test_etcd_versions.py checks the refusal itself)."""
    return etcd_version(os.environ.get("BATON_TEST_ETCD") or find_etcd())


def allow_suite_etcd() -> list[str]:
    """The flag a registry process of the suite is started with (see
    :func:`suite_etcd_version`)."""
    return ["--allow-etcd-version", suite_etcd_version()]


class HasEndpoint(Protocol):
    @property
    def endpoint(self) -> str: ...


def on_etcd(where: str | HasEndpoint, body: Callable[[Etcd], Awaitable[T]],
            timeout: float = 5.0, auth: EtcdAuth | None = None) -> T:
    """Run ``body`` with a connection of its own to etcd (an endpoint, or the session's
    etcd; with ``auth``'s credentials): for tests that read or write keys straight, not
    through a registry. A registry on the in-memory store (``registry.etcd`` names it)
    is read and written on its own loop, through its store."""
    endpoint = where if isinstance(where, str) else where.endpoint
    if endpoint in MEMORY:
        memory = MEMORY[endpoint]
        return memory.call(body(memory.store), timeout=max(timeout, 30.0))  # type: ignore[no-any-return]

    async def main() -> T:
        conn = Etcd(endpoint, timeout=timeout, auth=auth or EtcdAuth())
        await conn.connect()
        try:
            return await body(conn)
        finally:
            await conn.close()

    return asyncio.run(main())


@dataclass
class RegistryHandle:
    """One live registry replica serving on loopback."""

    address: str
    port: int
    staging: Path
    prefix: str
    etcd: str
    _loop: asyncio.AbstractEventLoop
    _running: Running
    _thread: threading.Thread
    stopped: bool = field(default=False)
    #: the in-process registry when it runs on the in-memory store (``registry_store``)
    memory: InProcessRegistry | None = None

    @property
    def reaper(self) -> Any:
        return self._running.reaper

    @property
    def stalls(self) -> Any:
        return self._running.stalls

    @contextmanager
    def held(self) -> Iterator[None]:
        """The replica stuck while inside: its event loop held (it answers nothing,
        sends nothing), its connections still open."""
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            release.wait(60)

        self._loop.call_soon_threadsafe(hold)
        try:
            if not holding.wait(10):
                raise RuntimeError("the registry's loop was not held within 10 s")
            yield
        finally:
            release.set()

    def _tasks(self) -> str:
        """The registry loop's unfinished tasks and where each waits, then every
        thread's stack (a stop that hangs says what it waits for)."""
        import io
        import sys
        import traceback

        out = io.StringIO()
        done = threading.Event()

        def dump() -> None:
            try:
                for task in asyncio.all_tasks(self._loop):
                    try:
                        task.print_stack(limit=8, file=out)
                    except Exception as e:  # a frame without a line number
                        print(f"{task!r}: no stack ({e!r})", file=out)
            finally:
                done.set()

        self._loop.call_soon_threadsafe(dump)
        if not done.wait(5):
            print("(the loop did not answer)", file=out)
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            print(f"--- thread {names.get(ident, ident)}", file=out)
            traceback.print_stack(frame, limit=8, file=out)
        return out.getvalue()

    def stop(self, grace: float = 0.5) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.memory is not None:
            self.memory.stop(grace)
            MEMORY.pop(self.etcd, None)
            return
        fut = asyncio.run_coroutine_threadsafe(self._running.stop(grace), self._loop)
        try:
            fut.result(timeout=30)
        except TimeoutError:
            raise TimeoutError("the registry did not stop within 30 s; its tasks:\n"
                               + self._tasks()) from None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def start_registry(
    etcd: str,
    prefix: str,
    staging: Path,
    reap_interval: float = 0.2,
    listen: str = "127.0.0.1:0",
    **settings: Any,
) -> RegistryHandle:
    """A replica on ``prefix``: plaintext (``insecure``) unless ``settings`` give TLS
    files (``tls_ca``, ``tls_cert``, ``tls_key``) or other registry settings."""
    if not any(k.startswith("tls_") for k in settings):
        settings.setdefault("insecure", True)
    settings.setdefault("allow_etcd_version", suite_etcd_version())
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        config = RegistryConfig(etcd=etcd, listen=listen, staging=str(staging),
                                prefix=prefix, reap_interval=reap_interval, **settings)
        try:
            ready["running"] = loop.run_until_complete(start(config))
        except BaseException as e:  # surfaced to the test below
            ready["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="registry", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("registry did not start within 30 s")
    if "error" in ready:
        raise ready["error"]
    running: Running = ready["running"]
    return RegistryHandle(f"127.0.0.1:{running.port}", running.port, staging, prefix, etcd,
                          loop, running, thread)


#: the in-process registries on the in-memory store, by the name their handle gives as
#: its etcd (``on_etcd`` reads their store through it)
MEMORY: dict[str, InProcessRegistry] = {}

#: what a behavioural test runs on when marked ``both_stores``: etcd, the reference, and
#: baton_relay.testing's in-memory store, held to the same tests
STORES = ("etcd", "memory")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--registry-store", choices=(*STORES, "both"), default="both",
        help="the store(s) the both_stores tests run their registry on (make test-fast: "
             "memory; make test: both, etcd the reference)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (metafunc.definition.get_closest_marker("both_stores") is not None
            and metafunc.definition.get_closest_marker("etcd_only") is None
            and "registry_store" in metafunc.fixturenames):
        chosen = metafunc.config.getoption("registry_store")
        metafunc.parametrize("registry_store", STORES if chosen == "both" else (chosen,))


@pytest.fixture
def registry_store() -> str:
    """The store this test's registries run on (parametrised by ``both_stores``)."""
    return "etcd"


def start_memory_registry(prefix: str, staging: Path, reap_interval: float = 0.2,
                          **settings: Any) -> RegistryHandle:
    """A registry in-process on the in-memory store (baton_relay.testing), handled as
    one on etcd is."""
    if any(k.startswith("tls_") for k in settings) or "listen" in settings:
        pytest.skip("the in-memory registry serves plaintext on loopback only")
    memory = start_in_process(staging, prefix=prefix, reap_interval=reap_interval, **settings)
    name = f"memory:{uuid.uuid4().hex}"
    MEMORY[name] = memory
    return RegistryHandle(memory.address, memory.running.port, staging, prefix, name,
                          memory._loop, memory.running, memory._thread, memory=memory)


#: tests fail fast instead of retrying for the default 30 s
TEST_RETRY = RetryPolicy(attempts=3, initial=0.05, cap=0.2, deadline=3.0)


@pytest.fixture
def registry_factory(
    etcd: Any, prefix: str, staging: Path, registry_store: str
) -> Iterator[Callable[..., RegistryHandle]]:
    """Start any number of replicas on this test's prefix; all stopped at teardown. On
    the in-memory store (``registry_store``), one: it lives in its registry's process."""
    handles: list[RegistryHandle] = []

    def make(**kw: Any) -> RegistryHandle:
        if registry_store == "memory":
            if handles:
                pytest.skip("a second replica: the in-memory store serves one registry")
            handle = start_memory_registry(prefix, staging, **kw)
            handles.append(handle)
            return handle
        handle = start_registry(etcd.endpoint, prefix, staging, **kw)
        handles.append(handle)
        return handle

    yield make
    for h in handles:
        h.stop()


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    """One real registry replica for this test."""
    return registry_factory()


@pytest.fixture
def client(registry: RegistryHandle) -> Iterator[Client]:
    """A client of the ``registry`` fixture, with short retries."""
    with Client(registry.address, timeout=10, retry=TEST_RETRY) as c:
        yield c


def produce_verified(client: Client, session: Session, task_id: str, file_id: str) -> None:
    """Claim, write, commit and verify one entry, reporting as a lone watcher would
    (no watcher registered, so the registry believes any report)."""
    import blake3

    claim = client.claim(task_id, file_id, session=session)
    data = f"{task_id}/{file_id}".encode()
    Path(claim.path).parent.mkdir(parents=True, exist_ok=True)
    Path(claim.path).write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    client.commit(task_id, file_id, claim.token, len(data), digest, session=session)
    client.watcher.report(task_id, file_id, len(data), digest, reporter="test-watcher")


#: an agent process that claims, tells the test its token, then waits to be told to commit
AGENT_PROC = Path(__file__).with_name("agent_proc.py")


@contextmanager
def agent_processes(script: Path, registry: RegistryHandle
                    ) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``spawn(*args)`` starts ``python SCRIPT REGISTRY ARGS...`` (stdin and stdout piped,
    text); at the end any still running are resumed (a test may have SIGSTOPped one)
    and killed."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: object) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, str(script), registry.address,
                              *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        return p

    try:
        yield spawn
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()


@pytest.fixture
def agent(registry: RegistryHandle) -> Iterator[Callable[[str, int], subprocess.Popen[str]]]:
    """Start ``tests/agent_proc.py`` processes on the test's registry (task, session
    TTL); see ``agent_processes``."""
    with agent_processes(AGENT_PROC, registry) as spawn:
        yield spawn
