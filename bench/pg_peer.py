"""The PostgreSQL peer: a table as the queue, claimed with ``FOR UPDATE SKIP LOCKED``.

:class:`Postgres` runs a private server for the claims scenario: ``initdb`` in a
temporary directory, then ``postgres`` listening on a Unix socket only, with
``fsync`` and ``synchronous_commit`` on (every commit waits for its WAL to reach
the disk, as every etcd transaction does). PostgreSQL refuses to run as root, so
when the bench is root the server runs as the ``postgres`` user (or ``nobody``).

:func:`agent` is one agent on its own connection. Each loop is two transactions
(the connection is in autocommit mode, so each statement is one):

* claim — ``UPDATE … SET state = 'writing', owner = $1 WHERE id = (SELECT id …
  WHERE state = 'pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id``;
* commit — ``UPDATE … SET state = 'written' WHERE id = $1 AND owner = $2``.

Each agent records what it claimed, as the other systems' agents do.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from baton_relay.local.etcdproc import wait_ready

from .harness import BenchError, die_with_parent
from .pool import Ready

#: a directory holding ``initdb`` and ``postgres``; else Debian's newest, else $PATH
BIN_ENV = "BATON_BENCH_PG_BIN"
#: who runs the server when the bench runs as root (PostgreSQL refuses root)
SERVER_USERS = ("postgres", "nobody")
#: the database user initdb creates; local connections are trusted
DB_USER = "bench"
START_TIMEOUT = 60.0
#: the longest temporary directory the server's directory (and socket) go under
SOCKET_BASE_MAX = 60
#: the claim and the commit, as in the method text; {t} is the table
CLAIM_SQL = ("UPDATE {t} SET state = 'writing', owner = %s WHERE id = ("
             "SELECT id FROM {t} WHERE state = 'pending' ORDER BY id "
             "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id")
COMMIT_SQL = "UPDATE {t} SET state = 'written' WHERE id = %s AND owner = %s"
#: the batched loop's step, one transaction: mark written (with each file's BLAKE3) the
#: rows the agent still owns, then claim up to N more
BATCH_COMMIT_SQL = ("UPDATE {t} SET state = 'written', digest = d.digest "
                    "FROM unnest(%s::integer[], %s::text[]) AS d(id, digest) "
                    "WHERE {t}.id = d.id AND {t}.owner = %s AND {t}.state = 'writing'")
BATCH_CLAIM_SQL = ("UPDATE {t} SET state = 'writing', owner = %s WHERE id IN ("
                   "SELECT id FROM {t} WHERE state = 'pending' ORDER BY id "
                   "FOR UPDATE SKIP LOCKED LIMIT %s) RETURNING id")


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", path.parent.name)) or (0,)


def find_postgres() -> tuple[Path | None, str]:
    """The directory with ``initdb`` and ``postgres``; else None and why not."""
    candidates: list[Path] = []
    if os.environ.get(BIN_ENV):
        candidates.append(Path(os.environ[BIN_ENV]))
    else:
        debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key,
                        reverse=True)
        candidates += debian
        on_path = shutil.which("initdb")
        if on_path:
            candidates.append(Path(on_path).resolve().parent)
    for d in candidates:
        if (d / "initdb").is_file() and (d / "postgres").is_file():
            return d, ""
    where = os.environ.get(BIN_ENV) or "/usr/lib/postgresql/*/bin or $PATH"
    return None, f"PostgreSQL's initdb and postgres were not found in {where}"


def driver_missing() -> str:
    """Why the PostgreSQL driver cannot be used here ("" when it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        return f"psycopg is not installed ({e}); pip install -e '.[bench]'"
    return ""


def postgres_version(bindir: Path) -> str:
    done = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True,
                          text=True, timeout=30, check=False)
    return done.stdout.strip() or str(bindir)


def _traversable(path: Path, uid: int) -> bool:
    """Whether user ``uid`` (not root) can reach into ``path`` through its ancestors."""
    for d in (path, *path.parents):
        st = d.stat()
        if not st.st_mode & (stat.S_IXUSR if st.st_uid == uid else stat.S_IXOTH):
            return False
    return True


def _temp_root(uid: int | None) -> Path:
    """A new directory for the server, where ``uid`` can reach it and where the socket's
    path stays within the kernel's limit of about 100 bytes."""
    base = Path(tempfile.gettempdir())
    if len(str(base)) > SOCKET_BASE_MAX or (uid is not None and not _traversable(base, uid)):
        base = Path("/tmp")
    return Path(tempfile.mkdtemp(prefix="baton-bench-pg-", dir=base))


def _server_user() -> pwd.struct_passwd | None:
    """The account to run the server as: None for ourselves, unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise BenchError(f"running as root and none of the users {', '.join(SERVER_USERS)} "
                     "exists to run PostgreSQL as")


@dataclass
class Postgres:
    """A private PostgreSQL server on a Unix socket in a temporary directory."""

    bindir: Path
    max_connections: int
    root: Path = field(init=False)
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    @property
    def conninfo(self) -> str:
        return f"host={self.socket_dir} port=5432 user={DB_USER} dbname=postgres"

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def cpu(self) -> float:
        """CPU seconds the server has used so far: the postmaster, its live processes,
        and those that have exited (backends of closed connections, counted in the
        postmaster's children times)."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        for pid in [self.pid, *(int(c) for c in children.read_text().split())]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:  # a backend that exited since the listing (ESRCH, ENOENT)
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            if pid == self.pid:
                total += (int(fields[13]) + int(fields[14])) / tick
        return total

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run_as(self) -> dict[str, Any]:
        user = _server_user()
        if user is None:
            return {}
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def start(self) -> None:
        # Not under the scenario's temporary directory: that one is private to root,
        # and the server may run as another user.
        as_user = self._run_as()
        self.root = _temp_root(as_user.get("user"))
        data = self.root / "data"
        self.socket_dir.mkdir()
        if as_user:
            for path in (self.root, self.socket_dir):
                os.chown(path, as_user["user"], as_user["group"])
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        env.pop("PGDATA", None)
        # --no-sync: only initdb's own files skip the flush; the server below fsyncs.
        init = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(data), "-U", DB_USER, "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-sync"],
            env=env, cwd=self.root, capture_output=True, text=True, timeout=300, check=False,
            **as_user)
        if init.returncode != 0:
            raise BenchError(f"initdb failed ({init.returncode}):\n{init.stdout}\n"
                             f"{init.stderr}")
        argv = [str(self.bindir / "postgres"), "-D", str(data),
                "-c", "listen_addresses=", "-c", f"unix_socket_directories={self.socket_dir}",
                "-c", "port=5432", "-c", "fsync=on", "-c", "synchronous_commit=on",
                "-c", "full_page_writes=on", "-c", f"max_connections={self.max_connections}"]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.root, start_new_session=True, preexec_fn=die_with_parent, **as_user)
        wait_ready(self._accepts, self.process, daemon="postgres", log_path=self.log_path,
                   timeout=START_TIMEOUT)

    def _accepts(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.conninfo, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if getattr(self, "root", None) is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def settings(self) -> dict[str, str]:
        """The server's version and the settings that decide what a commit costs."""
        import psycopg

        names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method",
                 "full_page_writes")
        with psycopg.connect(self.conninfo) as conn:
            return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]

    def new_table(self, name: str, entries: int) -> None:
        """A table of ``entries`` pending rows, ids 0 … entries - 1."""
        import psycopg
        from psycopg import sql

        t = sql.Identifier(name)
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t))
            conn.execute(sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, state text NOT NULL, "
                                 "owner text, digest text)").format(t))
            conn.execute(sql.SQL("INSERT INTO {} SELECT g, 'pending', NULL, NULL "
                                 "FROM generate_series(0, %s) AS g").format(t), (entries - 1,))
            # The usual companion of a SKIP LOCKED queue: pending rows only.
            conn.execute(sql.SQL("CREATE INDEX ON {} (id) WHERE state = 'pending'").format(t))
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(t))

    def not_written(self, name: str, committed: list[int]) -> int:
        """How many of ``committed`` (ids) the table does not show as written."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.conninfo) as conn:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s) "
                                       "AND state <> 'written'").format(sql.Identifier(name)),
                               (committed,)).fetchone()
        return int(row[0]) if row else len(committed)


def file_id(row_id: int) -> str:
    """A row's id as the file id Baton's task and the manifest use for the same entry."""
    return f"e{row_id:06d}"


@dataclass(frozen=True)
class PgArgs:
    conninfo: str
    table: str
    agent: str
    seconds: float


@dataclass
class PgResult:
    cycles: int
    #: seconds each claim statement took (its commit's fsync included)
    latencies: list[float]
    claimed: list[str]
    #: commits whose UPDATE changed no row (the claim was not this agent's)
    failed_commits: int
    end: float


def agent(args: PgArgs, ready: Ready) -> PgResult:
    """One agent, one connection: claim → commit until nothing is pending or time is up."""
    import psycopg
    from psycopg import sql

    t = sql.Identifier(args.table)
    claim_q = sql.SQL(CLAIM_SQL).format(t=t)
    commit_q = sql.SQL(COMMIT_SQL).format(t=t)
    lat: list[float] = []
    claimed: list[str] = []
    failed = 0
    with psycopg.connect(args.conninfo, autocommit=True) as conn:
        conn.execute("SELECT 1")  # connected before the clock starts
        deadline = ready() + args.seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            row = conn.execute(claim_q, (args.agent,), prepare=True).fetchone()
            if row is None:
                break
            lat.append(time.perf_counter() - t0)
            claimed.append(file_id(row[0]))
            done = conn.execute(commit_q, (row[0], args.agent), prepare=True)
            failed += done.rowcount != 1
        end = time.monotonic()
    return PgResult(len(claimed), lat, claimed, failed, end)
