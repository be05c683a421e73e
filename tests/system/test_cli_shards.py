"""``baton watcher ls|drain`` and ``baton shard ls|move|rebalance`` against a real
registry, with watchers that speak the real protocol (register, heartbeat, hand a
shard over when asked), and ``baton up --watchers N``.

The registries here have a few shards, so that tables stay short and balancing is
quick; each test waits for the registry's assigner with ``wait_for``. What a command
prints is also compared with what docs/cli.md shows it printing (its transcripts of
these commands are not run by tests/system/test_docs_run.py: they show three hosts).
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from registry_fixtures import TEST_RETRY, RegistryHandle
from test_cli import invoke, ok_json, one_error_line
from test_cli_ops import plain_tables, table_rows  # noqa: F401  (a fixture)
from test_docs_run import CLI_MD, transcripts

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.client.cli.watchers import POLL_INTERVAL, StillMoving, Waiter
from baton_relay.kernel import errors
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import UpOptions, child_specs, default_staging

SHARDS = 12
HEARTBEAT = 0.1


class Watcher:
    """A watcher as the registry sees one: registered on its own lease, heartbeating
    with its capacity, and releasing each shard it is asked to hand over (unless
    ``hands_over`` is False: a stuck watcher whose shards can only be forced away)."""

    def __init__(self, client: Client, root: str, capacity: pb.WatcherCapacity,
                 hands_over: bool = True) -> None:
        self.client = client
        self.capacity = capacity
        self.hands_over = hands_over
        self.id = client.watcher.register_watcher(root, reporter=f"test@{root}", ttl=5,
                                                  capacity=capacity).watcher_id
        self.errors: list[errors.BatonError] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"watcher-{self.id}",
                                       daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            try:
                reply = self.client.watcher.watcher_heartbeat(self.id, self.capacity)
                for grant in reply.shards:
                    if grant.release and self.hands_over:
                        self.client.watcher.release_shard(self.id, grant.shard, grant.epoch)
            except errors.BatonError as e:
                self.errors.append(e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert not self.errors, self.errors


def capacity(used: int = 100, most: int = 8192, mbps: float = 512.0, backlog: int = 3,
             cold: int = 1) -> pb.WatcherCapacity:
    return pb.WatcherCapacity(watches_used=used, watches_max=most, hash_mbps=mbps,
                              backlog=backlog, tasks=4, cold_tasks=cold)


@pytest.fixture
def sharded(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    """A registry of SHARDS shards whose assigner sweeps every 0.2 s."""
    return registry_factory(shards=SHARDS)


@pytest.fixture
def lib(sharded: RegistryHandle) -> Iterator[Client]:
    with Client(sharded.address, timeout=10, retry=TEST_RETRY) as c:
        yield c


@pytest.fixture
def held(registry_factory: Callable[..., RegistryHandle]) -> RegistryHandle:
    """A registry of SHARDS shards whose assigner sweeps hourly: shards move when a
    watcher registers (it takes its share at once) and when the test moves them."""
    return registry_factory(shards=SHARDS, reap_interval=3600)


@pytest.fixture
def lib_held(held: RegistryHandle) -> Iterator[Client]:
    with Client(held.address, timeout=10, retry=TEST_RETRY) as c:
        yield c


@pytest.fixture
def watchers(lib: Client, tmp_path: Path) -> Iterator[Callable[..., Watcher]]:
    """Start watchers on the registry; all stop heartbeating at teardown."""
    started: list[Watcher] = []

    def start(cap: pb.WatcherCapacity | None = None, hands_over: bool = True) -> Watcher:
        w = Watcher(lib, str(tmp_path / "staging"), cap or capacity(), hands_over)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def owners(client: Client) -> Counter[str]:
    return Counter(s.owner for s in client.operator.list_shards().shards)


def balanced(client: Client, ws: list[Watcher]) -> bool:
    """Every shard owned by one of ``ws``, counts within one, no move in flight."""
    shards = client.operator.list_shards().shards
    counts = Counter(s.owner for s in shards)
    return (set(counts) == {w.id for w in ws} and max(counts.values()) - min(counts.values()) <= 1
            and not any(s.moving_to for s in shards))


def shown(command: str) -> list[str]:
    """The output docs/cli.md shows after ``$ baton COMMAND…``."""
    for steps in transcripts(CLI_MD):
        for step in steps:
            if step.command.startswith(f"baton {command}"):
                return step.output
    raise AssertionError(f"docs/cli.md shows no `baton {command}`")


def outline(lines: list[str]) -> list[str]:
    """Output as it is compared with the docs: a table as its header's cells and one
    mark for its rows; other lines with watcher ids as <id> and numbers as <n>."""
    out: list[str] = []
    for line in lines:
        if line.startswith("┃"):
            out.append(" | ".join(cell.strip() for cell in line.strip("┃").split("┃")))
        elif line.startswith("│"):
            if out[-1] != "<rows>":
                out.append("<rows>")
        elif not line.startswith(("┏", "┡", "└")):
            out.append(re.sub(r"\d+", "<n>", re.sub(r"\b[0-9a-f]{16}\b", "<id>", line)))
    return out


def as_shown(command: str, stdout: str) -> None:
    assert outline(stdout.splitlines()) == outline(shown(command)), stdout


# --- watcher ls -----------------------------------------------------------------------


def test_watcher_ls_shows_each_watcher_and_its_capacity(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """watcher ls: one row per watcher with its shards, watches used/max and free, hash
    rate, backlog, cold tasks, lease left and draining; -o json has the same, flat."""
    a = watchers(capacity())
    b = watchers(capacity(used=7, most=0, mbps=0.0, backlog=0, cold=0))
    wait_for(lambda: balanced(lib, [a, b]), what="6 shards each")
    result = invoke(sharded, "watcher", "ls")
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "id", "host", "pid", "root", "shards", "watches", "free", "hash_mbps", "backlog",
        "cold", "ttl_left", "draining"]
    rows = table_rows(result.stdout)
    assert rows[a.id][4:] == ["6", "100/8192", "8092", "512.0", "3", "1", rows[a.id][10], "no"]
    assert rows[b.id][4:8] == ["6", "7/?", "?", "-"]  # no limit known, nothing hashed yet
    assert rows[a.id][10].endswith(" s")
    as_shown("watcher ls", result.stdout)

    listed = {w["watcher_id"]: w for w in ok_json(invoke(sharded, "watcher", "ls", "-o", "json"))}
    assert set(listed) == {a.id, b.id}
    first = listed[a.id]
    assert set(first) == {"watcher_id", "host", "pid", "root", "reporter", "identity", "shards",
                          "watches_used", "watches_max", "watches_free", "hash_mbps",
                          "backlog", "tasks", "cold_tasks", "ttl_left", "draining",
                          "registered_at"}
    assert (first["shards"], first["watches_free"], first["hash_mbps"], first["draining"]) == \
        (6, 8092, 512.0, False)
    assert first["root"].endswith("staging") and 0 < first["ttl_left"] <= 5
    assert listed[b.id]["watches_free"] is None


def test_watcher_ls_with_no_watcher_says_so(sharded: RegistryHandle) -> None:
    """watcher ls on a registry no watcher registered with: a line saying so; json: []."""
    result = invoke(sharded, "watcher", "ls")
    assert (result.exit_code, result.stdout) == (0, "no watcher is registered\n")
    assert ok_json(invoke(sharded, "watcher", "ls", "-o", "json")) == []


# --- shard ls ---------------------------------------------------------------------------


def test_shard_ls_lists_every_shard_once_balanced_across_watchers(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """With three watchers the assigner gives each 4 of the 12 shards; shard ls lists
    every shard once with its owner, the owner's host and its epoch."""
    ws = [watchers() for _ in range(3)]
    wait_for(lambda: balanced(lib, ws), what="12 shards balanced over 3 watchers")
    result = invoke(sharded, "shard", "ls")
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert sorted(rows, key=int) == [str(n) for n in range(SHARDS)]
    counts = Counter(row[1] for row in rows.values())
    assert set(counts) == {w.id for w in ws} and set(counts.values()) == {4}
    assert all(int(row[3]) >= 1 and row[4] == "-" for row in rows.values())
    as_shown("shard ls", result.stdout)

    listed = ok_json(invoke(sharded, "shard", "ls", "-o", "json"))
    assert listed["shard_count"] == SHARDS
    assert [s["shard"] for s in listed["shards"]] == list(range(SHARDS))
    assert set(listed["shards"][0]) == {"shard", "owner", "host", "epoch", "moving_to",
                                        "move_deadline", "tasks", "backlog"}


def test_shard_ls_before_any_watcher_says_there_are_none(sharded: RegistryHandle) -> None:
    """With no watcher ever registered there are no shards: shard ls says so, exit 0."""
    result = invoke(sharded, "shard", "ls")
    assert result.exit_code == 0
    assert result.stdout == "no shards yet: no watcher has registered with this registry\n"
    assert ok_json(invoke(sharded, "shard", "ls", "-o", "json")) == {"shard_count": 0,
                                                                     "shards": []}


# --- shard move ---------------------------------------------------------------------------


def test_shard_move_waits_until_the_target_owns_it(
    held: RegistryHandle, lib_held: Client, tmp_path: Path, wait_for: Callable[..., None]
) -> None:
    """shard move hands one shard to another watcher at the next epoch, waits for the
    handover, and shard ls shows the new owner (the assigner held back, so that it
    does not even the counts out again meanwhile)."""
    a = Watcher(lib_held, str(tmp_path), capacity())
    b = Watcher(lib_held, str(tmp_path), capacity())
    try:
        wait_for(lambda: balanced(lib_held, [a, b]), what="6 shards each")
        before = {s.shard: s for s in lib_held.operator.list_shards().shards}
        n = max(s.shard for s in before.values() if s.owner == a.id)
        result = invoke(held, "shard", "move", str(n), "--to", b.id)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert lines[0].startswith(f"shard {n} moving from {a.id} to {b.id}; forced in ")
        assert lines[-1] == \
            f"shard {n} owned by {b.id} at epoch {before[n].epoch + 1} (handed over)"
        as_shown("shard move", result.stdout)
        row = table_rows(invoke(held, "shard", "ls").stdout)[str(n)]
        assert (row[1], int(row[3])) == (b.id, before[n].epoch + 1)
        assert owners(lib_held) == Counter({a.id: SHARDS // 2 - 1, b.id: SHARDS // 2 + 1})
    finally:
        a.close()
        b.close()


def test_shard_move_of_a_stuck_owner_is_forced_at_its_deadline(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """An owner that never hands the shard over loses it at --deadline; the command
    says the move was forced."""
    stuck = watchers(hands_over=False)
    wait_for(lambda: balanced(lib, [stuck]), what="every shard owned by the first watcher")
    other = watchers()
    # The assigner's own moves away from the stuck watcher are forced too, after the
    # registry's deadline (30 s): the one moved here goes at the one given.
    result = invoke(sharded, "shard", "move", "0", "--to", other.id, "--deadline", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].endswith(
        "(forced at its deadline: the owner did not hand it over)")
    assert next(s for s in lib.operator.list_shards().shards if s.shard == 0).owner == other.id


def test_shard_move_gives_up_waiting_at_its_timeout(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """shard move --timeout: still not handed over then, exit 1 with one line; the
    move goes on in the registry."""
    stuck = watchers(hands_over=False)
    wait_for(lambda: balanced(lib, [stuck]), what="every shard owned by the first watcher")
    other = watchers()
    result = invoke(sharded, "shard", "move", "0", "--to", other.id, "--deadline", "60",
                    "--timeout", "0.5")
    assert result.exit_code == 1
    assert one_error_line(result.stderr) == (
        f"baton: shard 0 still owned by {stuck.id} after 0.5 s; it goes on in the registry "
        "(see `baton shard ls`)")
    assert next(s for s in lib.operator.list_shards().shards if s.shard == 0).moving_to == other.id


def test_shard_move_to_an_unknown_watcher_exits_5(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """Moving a shard to a watcher that is not registered: exit 5, one line naming it."""
    a = watchers()
    wait_for(lambda: balanced(lib, [a]), what="every shard owned")
    result = invoke(sharded, "shard", "move", "3", "--to", "0123456789abcdef")
    assert result.exit_code == 5
    assert one_error_line(result.stderr) == \
        "baton: watcher '0123456789abcdef' is not registered"
    bad = invoke(sharded, "shard", "move", str(SHARDS), "--to", a.id)
    assert bad.exit_code == 2
    assert one_error_line(bad.stderr) == f"baton: shard {SHARDS} not within 0..{SHARDS - 1}"


def test_a_wait_looks_until_its_timeout_then_gives_up() -> None:
    """The wait of drain and move looks every POLL_INTERVAL by its clock and gives up
    once the timeout has passed, saying what is not done; a look that returns a text
    ends it with that text."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    waiter = Waiter(4 * POLL_INTERVAL, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(StillMoving, match=r"^shard 3 still owned by w after \d+ s; it goes on"):
        waiter.until(lambda: None, "shard 3 still owned by w")
    assert slept == [POLL_INTERVAL] * 4
    looks = iter([None, None, "moved"])
    assert waiter.until(lambda: next(looks), "not moved") == "moved"


# --- shard rebalance --------------------------------------------------------------------


def test_rebalance_dry_run_changes_nothing_and_rebalance_starts_the_moves(
    held: RegistryHandle, lib_held: Client, tmp_path: Path, wait_for: Callable[..., None]
) -> None:
    """A watcher that registered full (no shards for it) has room now: rebalance
    --dry-run lists the 6 moves onto it and leaves every shard as it was; rebalance
    starts them (and, with them in flight, starts no more)."""
    a = Watcher(lib_held, str(tmp_path), capacity(), hands_over=False)
    try:
        b = Watcher(lib_held, str(tmp_path), capacity(used=8000))
        try:
            assert owners(lib_held) == Counter({a.id: SHARDS})
            b.capacity = capacity()
            wait_for(lambda: {w.capacity.watches_used
                              for w in lib_held.operator.list_watchers()} == {100},
                     what="b's room at its next heartbeat")
            before = [(s.shard, s.owner, s.epoch, s.moving_to)
                      for s in lib_held.operator.list_shards().shards]
            dry = invoke(held, "shard", "rebalance", "--dry-run")
            assert dry.exit_code == 0, dry.output
            rows = table_rows(dry.stdout)
            assert len(rows) == SHARDS // 2
            assert {(r[1], r[2]) for r in rows.values()} == {(a.id, b.id)}
            assert dry.stdout.splitlines()[-1] == "6 moves would start (dry run)"
            as_shown("shard rebalance --dry-run", dry.stdout)
            assert [(s.shard, s.owner, s.epoch, s.moving_to)
                    for s in lib_held.operator.list_shards().shards] == before

            moves = ok_json(invoke(held, "shard", "rebalance", "-o", "json"))
            assert {m["to_watcher"] for m in moves} == {b.id} and len(moves) == SHARDS // 2
            moving = {s.shard for s in lib_held.operator.list_shards().shards
                      if s.moving_to == b.id}
            assert moving == {m["shard"] for m in moves}
            again = invoke(held, "shard", "rebalance")
            assert again.stdout == \
                "6 moves in progress: nothing more starts until they are done\n"
        finally:
            b.close()
    finally:
        a.close()


def test_rebalance_when_balanced_says_so(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """Nothing to move: one line saying it is balanced; -o json: []."""
    a, b = watchers(), watchers()
    wait_for(lambda: balanced(lib, [a, b]), what="6 shards each")
    assert invoke(sharded, "shard", "rebalance").stdout == "balanced: nothing to move\n"
    assert ok_json(invoke(sharded, "shard", "rebalance", "--dry-run", "-o", "json")) == []


# --- watcher drain ----------------------------------------------------------------------


def test_drain_moves_every_shard_away_and_undo_takes_shards_again(
    sharded: RegistryHandle, lib: Client, watchers: Callable[..., Watcher],
    wait_for: Callable[..., None]
) -> None:
    """watcher drain waits until the watcher owns no shard and says it may stop; it
    takes none meanwhile; --undo lets it take its share again."""
    a, b, c = watchers(), watchers(), watchers()
    wait_for(lambda: balanced(lib, [a, b, c]), what="4 shards each")
    result = invoke(sharded, "watcher", "drain", a.id)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    # The assigner may have started the moves a moment before the drain did, and the
    # watcher handed some over already.
    assert re.fullmatch(rf"watcher {a.id} draining: [0-4] shard moves started, [0-4] "
                        "shards owned", lines[0]), lines[0]
    assert lines[-1] == f"watcher {a.id} owns no shards: it may stop now"
    assert not result.stderr  # progress is shown on a terminal only
    as_shown("watcher drain", result.stdout)
    assert owners(lib)[a.id] == 0
    wait_for(lambda: balanced(lib, [b, c]), what="6 shards each on the others")
    row = table_rows(invoke(sharded, "watcher", "ls").stdout)[a.id]
    assert (row[4], row[-1]) == ("0", "yes")

    undo = invoke(sharded, "watcher", "drain", a.id, "--undo")
    assert undo.exit_code == 0, undo.output
    assert undo.stdout.startswith(f"watcher {a.id} takes shards again")
    wait_for(lambda: balanced(lib, [a, b, c]), what="4 shards each again")
    assert not next(w for w in lib.operator.list_watchers() if w.watcher_id == a.id).draining


def test_drain_of_an_unknown_watcher_exits_5(sharded: RegistryHandle) -> None:
    """Draining a watcher that is not registered: exit 5, one line naming it."""
    result = invoke(sharded, "watcher", "drain", "0123456789abcdef")
    assert result.exit_code == 5
    assert one_error_line(result.stderr) == \
        "baton: watcher '0123456789abcdef' is not registered"


def test_only_an_operator_moves_shards(registry_factory: Callable[..., RegistryHandle],
                                       tmp_path: Path) -> None:
    """Over mutual TLS an agent may not drain a watcher or move a shard (exit 7, one
    line); an operator may list the shards."""
    from test_security import PKI

    certs = PKI(tmp_path / "pki")
    handle = registry_factory(**certs.settings())

    def as_(who: str, *args: str) -> Any:
        issued = certs.ids[who]
        return CliRunner().invoke(cli, list(args), env={
            "BATON_REGISTRY": handle.address, "BATON_CA": certs.ca,
            "BATON_CERT": str(issued.cert), "BATON_KEY": str(issued.key)})

    for args in (["watcher", "drain", "0123456789abcdef"],
                 ["shard", "move", "0", "--to", "0123456789abcdef"], ["shard", "rebalance"]):
        refused = as_("agent", *args)
        assert refused.exit_code == 7, (args, refused.output)
        assert "not allowed" in one_error_line(refused.stderr)
    listed = as_("operator", "shard", "ls")
    assert (listed.exit_code, listed.stdout) == (
        0, "no shards yet: no watcher has registered with this registry\n")


# --- baton up --watchers N ---------------------------------------------------------------


def test_up_runs_each_watcher_with_files_of_its_own(tmp_path: Path) -> None:
    """baton up --watchers 3: three watcher processes over the one staging root, each
    with its own name, log, state file, metrics port and reporter name."""
    data = tmp_path / "baton"
    opts = UpOptions(data, default_staging(data), watchers=3,
                     watcher_metrics_ports=(9465, 9466, 9467))
    _, *specs = child_specs(opts, "127.0.0.1:2479")
    assert [s.name for s in specs] == ["watcher-1", "watcher-2", "watcher-3"]
    for n, spec in enumerate(specs, 1):
        argv: list[Any] = list(spec.argv)
        assert argv[argv.index("--staging") + 1] == str(opts.staging)
        assert argv[argv.index("--state-file") + 1] == str(data / f"watcher-{n}-state.sqlite")
        assert argv[argv.index("--reporter") + 1].startswith(f"watcher-{n}@")
        assert argv[argv.index("--metrics") + 1] == f"127.0.0.1:{9464 + n}"
        assert spec.log_path == data / f"watcher-{n}.log"
    with pytest.raises(ValueError, match=r"watchers 17 not within 1\.\.16"):
        UpOptions(data, default_staging(data), watchers=17)


@pytest.mark.parametrize("n", ["0", "17"])
def test_up_refuses_a_watcher_count_out_of_range(n: str, tmp_path: Path) -> None:
    """baton up --watchers outside 1..16: a usage error (exit 2) before anything starts."""
    result = CliRunner().invoke(cli, ["up", "--data-dir", str(tmp_path), "--watchers", n])
    assert result.exit_code == 2
    assert "--watchers" in result.stderr and "1" in result.stderr
    assert not (tmp_path / "etcd").exists()


@pytest.mark.slow
def test_up_with_two_watchers_lists_and_registers_both(
    tmp_path: Path, wait_for: Callable[..., None]
) -> None:
    """baton up --watchers 2 --insecure: the summary lists both watchers and their
    metrics; both register with the registry and share its shards."""
    import queue

    from baton_relay.local.stack import run_up

    data = tmp_path / "baton"
    opts = UpOptions(data, default_staging(data), etcd_port=free_port(),
                     registry_port=free_port(), insecure=True, watchers=2)
    lines: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_up(opts, lines.put, stop=stop)),
                              daemon=True)
    thread.start()
    seen: list[str] = []
    try:
        while not seen or not seen[-1].startswith("ready"):
            seen.append(lines.get(timeout=60))
        for name in ("watcher-1", "watcher-2"):
            assert any(line.startswith(f"{name} {opts.staging}  (") for line in seen), seen
            assert any(line.startswith("metrics ") and line.endswith(f"({name})")
                       for line in seen), seen
        with Client(f"127.0.0.1:{opts.registry_port}") as c:
            wait_for(lambda: len(c.operator.list_watchers()) == 2, timeout=20,
                     what="both watchers registered")
            wait_for(lambda: set(owners(c)) == {w.watcher_id for w in c.operator.list_watchers()},
                     timeout=20, what="both watchers owning shards")
    finally:
        stop.set()
        thread.join(60)
    assert result == [0]
