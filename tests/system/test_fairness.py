"""Fair shares: among claimable entries of equal priority, claims take the task's
fairness keys in proportion to their weights, and a key with nothing claimable takes
nothing from the others."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from registry_fixtures import TEST_RETRY, RegistryHandle, agent_processes, on_etcd

from baton_relay.client import Client, Session, parse_manifest
from baton_relay.kernel import errors
from baton_relay.registry.records.fairness import MAX_KEYS, MAX_WEIGHT
from baton_relay.registry.records.manifest import validate
from baton_relay.registry.store.etcd import Etcd
from baton_relay.registry.store.keys import Keys

#: a behaviour of the registry: held on etcd and on baton_relay.testing's store
pytestmark = pytest.mark.both_stores

FAIR_AGENT = Path(__file__).parents[1] / "fair_agent.py"
WEIGHTS = {"acme": 1, "globex": 1, "initech": 2}


def fair_spec(per_key: dict[str, int], weights: dict[str, int] | None = None,
              task_id: str = "t", **fields: Any) -> dict[str, Any]:
    """A manifest with ``per_key[k]`` entries of each key ``k``, listed key by key (so
    that claims in manifest order would drain one key first)."""
    entries = [{"file_id": f"{key}-{i:04d}", "path": f"{key}/{i:04d}", "fairness_key": key}
               for key, n in per_key.items() for i in range(n)]
    keys = {k: {"weight": w} for k, w in (weights or WEIGHTS).items()}
    return {"task_id": task_id, "entries": entries, "fairness": {"keys": keys}, **fields}


def key_of(file_id: str) -> str:
    return file_id.rsplit("-", 1)[0]


def claim_all(client: Client, session: Session, task_id: str) -> list[str]:
    """Claim the task's entries one at a time until nothing is left: their file ids."""
    claimed = []
    while True:
        try:
            claimed.append(client.claim(task_id, session=session).file_id)
        except errors.NothingToClaim:
            return claimed


# the manifest --------------------------------------------------------------------

@pytest.mark.parametrize(
    ("fairness", "entry_key", "match"),
    [
        ({"keys": {"a": {"weight": 1}}}, "b", r"entry 'x': fairness_key 'b' is not declared"),
        ({"keys": {"a": {"weight": 0}}}, "a", r"fairness.keys\['a'\].weight 0 not within "
         rf"1..{MAX_WEIGHT}"),
        ({"keys": {"a": {"weight": MAX_WEIGHT + 1}}}, "a", r"fairness.keys\['a'\].weight"),
        ({"keys": {"a": {"weight": -2}}}, "a", r"weight -2 not within"),
        ({"keys": {f"k{i}": {"weight": 1} for i in range(MAX_KEYS + 1)}}, "k0",
         rf"fairness.keys: {MAX_KEYS + 1} keys, at most {MAX_KEYS}"),
        ({"keys": {"a b": {"weight": 1}}}, "a b", r"fairness.keys: key 'a b' is not a valid id"),
        ({"keys": {"a": {"weight": 1}}, "default_key": "z"}, "a",
         r"fairness.default_key 'z' is not a declared key"),
        ({"keys": {"a": {"weight": 1}}}, "", r"entry 'x': no fairness_key, and the task has "
         r"no fairness.default_key"),
        ({"default_key": ""}, "", r"fairness.keys: declare at least one key"),
        (None, "a", r"entry 'x': fairness_key given, but the task declares no "
         r"fairness keys"),
    ],
)
def test_bad_fairness_is_refused(fairness: dict[str, Any] | None, entry_key: str,
                                 match: str) -> None:
    """Undeclared keys, weights outside 1..1000, too many keys, an undeclared default,
    an entry without a key: refused, naming the field."""
    entry = {"file_id": "x", "path": "x", "fairness_key": entry_key}
    fields = {"fairness": fairness} if fairness is not None else {}
    with pytest.raises(errors.InvalidManifest, match=match):
        validate(parse_manifest({"task_id": "t", "entries": [entry], **fields}))


def test_entries_get_the_default_key_and_virtual_times_by_weight() -> None:
    """An entry naming no key gets the default; the i-th entry of a key of weight w,
    among those of its priority, gets the virtual time i / w."""
    spec = parse_manifest({
        "task_id": "t", "fairness": {"keys": {"a": {"weight": 1}, "b": {"weight": 4}},
                                     "default_key": "b"},
        "entries": [{"file_id": "a0", "path": "a0", "fairness_key": "a"},
                    {"file_id": "b0", "path": "b0"},
                    {"file_id": "a1", "path": "a1", "fairness_key": "a"},
                    {"file_id": "b1", "path": "b1", "fairness_key": "b"},
                    {"file_id": "a-urgent", "path": "au", "fairness_key": "a", "priority": 5}]})
    valid = validate(spec)
    got = {e.file_id: (e.fairness_key, e.fair_time) for e in valid.entries}
    assert got == {"a0": ("a", 0), "b0": ("b", 0), "a1": ("a", 1_000_000),
                   "b1": ("b", 250_000), "a-urgent": ("a", 0)}
    assert (valid.fairness, valid.fairness_default) == ({"a": 1, "b": 4}, "b")


def test_a_task_without_fairness_keeps_its_index_keys(client: Client,
                                                      registry: RegistryHandle) -> None:
    """A task that declares no fairness keys: entries without a key, ready keys as
    before (``ready/{task}/{order}/{file}``), no fairness on the task."""
    task, _ = client.operator.create_task({"task_id": "plain", "entries": [
        {"file_id": "a", "path": "a"}]})
    assert not task.spec.HasField("fairness")
    assert client.operator.get_entry("plain", "a").fairness_key == ""
    keys = Keys(registry.prefix)

    async def ready(etcd: Etcd) -> list[bytes]:
        return [kv.key async for kv in etcd.scan(keys.ready_all("plain"), page=10)]

    (key,) = on_etcd(registry.etcd, ready)
    order = keys.parse_tail(key, keys.ready_all("plain"))[0]
    assert order.isdigit() and len(order) == 15


def test_task_get_shows_the_fair_shares(client: Client, registry: RegistryHandle) -> None:
    """`baton task get` shows the keys with their weights and the default key; a task
    without fairness has no such row."""
    from test_cli import invoke

    client.operator.create_task(fair_spec({"acme": 1, "initech": 1}) | {
        "fairness": {"keys": {"acme": {"weight": 1}, "initech": {"weight": 2}},
                     "default_key": "acme"}})
    client.operator.create_task({"task_id": "plain", "entries": [{"file_id": "a", "path": "a"}]})
    shown = invoke(registry, "task", "get", "t")
    assert shown.exit_code == 0, shown.output
    assert "fairness     acme 1, initech 2  (default: acme)" in shown.stdout
    assert "fairness" not in invoke(registry, "task", "get", "plain").stdout


# the order -----------------------------------------------------------------------

def test_one_claimer_interleaves_keys_by_weight(client: Client) -> None:
    """Keys of weights 1:1:2, listed one key after the other: a lone claimer takes
    them a, b, c, c, a, b, c, c, ... exactly, and the task shows its fairness."""
    task, _ = client.operator.create_task(fair_spec({"acme": 8, "globex": 8, "initech": 16}))
    assert {k: v.weight for k, v in task.spec.fairness.keys.items()} == WEIGHTS
    with client.open_session("solo", ttl=30) as s:
        claimed = claim_all(client, s, "t")
    assert [key_of(f) for f in claimed] == ["acme", "globex", "initech", "initech"] * 8
    assert client.operator.get_entry("t", "initech-0003").fairness_key == "initech"


def test_explain_names_the_fairness_key(client: Client) -> None:
    """`explain` of a claimable entry of a fair task names its key and weight."""
    client.operator.create_task(fair_spec({"acme": 1, "initech": 1}))
    text = client.operator.explain("t", "initech-0000").text
    assert "It is claimable (priority 0, fairness key initech of weight 2: it comes up " \
        "with its key's share of the claims)" in text, text


def test_a_key_with_nothing_claimable_takes_nothing(client: Client) -> None:
    """A declared key whose entries all wait (for an entry of another task) reserves
    nothing: the other keys share every claim by their weights, 1:2, with no gap."""
    client.operator.create_task({"task_id": "gate", "entries": [{"file_id": "g", "path": "g"}]})
    spec = fair_spec({"acme": 6, "globex": 6, "initech": 12})
    for e in spec["entries"]:
        if key_of(e["file_id"]) == "acme":
            e["depends_on"] = ["gate:g"]
    client.operator.create_task(spec)
    with client.open_session("solo", ttl=30) as s:
        claimed = claim_all(client, s, "t")
    assert [key_of(f) for f in claimed] == ["globex", "initech", "initech"] * 6


def test_a_retried_entry_goes_behind(client: Client, wait_for: Callable[..., None]) -> None:
    """An entry failed and retried re-enters with a later enqueue time: behind every
    entry claimable before it, its key's other entries included."""
    client.operator.create_task(fair_spec({"acme": 2, "globex": 2}, {"acme": 1, "globex": 1}))
    with client.open_session("solo", ttl=30) as s:
        first = client.claim("t", session=s)
        assert first.file_id == "acme-0000"
        client.fail("t", first.file_id, first.token, "try again", session=s, delay=0.05)
        wait_for(lambda: not client.operator.get_entry("t", first.file_id).not_before,
                 what="the retry's delay to pass")
        claimed = claim_all(client, s, "t")
    assert claimed == ["globex-0000", "acme-0001", "globex-0001", "acme-0000"]


def test_claims_are_counted_by_fairness_key(registry_factory: Callable[..., RegistryHandle]
                                            ) -> None:
    """`baton_claims_by_fairness_key_total{task, key}` counts the claims of each
    declared key: single, batched, and a commit-and-claim's next one."""
    from test_metrics import metrics_port, scrape

    registry = registry_factory(metrics="127.0.0.1:0")
    with Client(registry.address, timeout=10, retry=TEST_RETRY) as client, \
            client.open_session("a", ttl=30) as s:
        client.operator.create_task(fair_spec({"acme": 2, "globex": 2, "initech": 4}))
        client.operator.create_task({"task_id": "plain",
                                     "entries": [{"file_id": "p", "path": "p"}]})
        client.claim("plain", session=s)
        held = [client.claim("t", session=s) for _ in range(3)]
        _, taken = client.commit_and_claim("t", held[0].file_id, held[0].token, 1,
                                           "0" * 64, session=s)
        assert taken is not None
        client.claim_batch("t", 4, session=s)
    found = scrape(metrics_port(registry))
    name = "baton_claims_by_fairness_key_total"
    assert found.value(name, task="t", key="acme") == 2
    assert found.value(name, task="t", key="globex") == 2
    assert found.value(name, task="t", key="initech") == 4
    assert "plain" not in {ls.get("task") for n, ls, _ in found.samples if n == name}


# acceptance ------------------------------------------------------------------------

PER_KEY = 1000
AGENTS = 4
SPAN = 100


def shares_off(order: list[str], weights: dict[str, int]) -> list[tuple[int, str, float]]:
    """For every window of ``SPAN`` consecutive claims of ``order`` (keys): each key's
    share's relative deviation from its weight's (start of the window, key, deviation)."""
    total = sum(weights.values())
    out = []
    for start in range(len(order) - SPAN + 1):
        counts = Counter(order[start:start + SPAN])
        for key, weight in weights.items():
            expected = weight / total
            out.append((start, key, abs(counts[key] / SPAN - expected) / expected))
    return out


def test_agents_on_two_replicas_keep_shares_over_every_window(
        registry_factory: Callable[..., RegistryHandle]) -> None:
    """Three keys of weights 1:1:2, 1,000 entries each, claimed and committed by four
    agent processes on two registry replicas, claims ordered by token (the claim's etcd
    revision): over every window of 100 consecutive claims while every key has
    entries left (the first 2,000 claims: the key of weight 2 has then taken its
    1,000), each key's share is within 15 % of 25/25/50; over every window after it,
    the two keys left share the claims within 15 % of 50/50 (a key with nothing
    claimable takes nothing)."""
    replicas = [registry_factory(), registry_factory()]
    with Client(replicas[0].address, timeout=60) as client:
        client.operator.create_task(fair_spec({k: PER_KEY for k in WEIGHTS}))
    claims: list[tuple[int, str]] = []
    started = time.monotonic()
    with agent_processes(FAIR_AGENT, replicas[0]) as spawn0, \
            agent_processes(FAIR_AGENT, replicas[1]) as spawn1:
        procs = [(spawn0, spawn1)[i % 2]("t", f"agent-{i}") for i in range(AGENTS)]
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-2000:]
            lines = [json.loads(line) for line in out.splitlines()]
            made = [(x["token"], x["file_id"]) for x in lines if "token" in x]
            assert lines[-1] == {"done": len(made)}
            claims += made
    took = time.monotonic() - started
    assert len(claims) == len({f for _, f in claims}) == PER_KEY * len(WEIGHTS), took
    order = [key_of(f) for _, f in sorted(claims)]
    drained = max(i for i, key in enumerate(order) if key == "initech") + 1
    assert drained >= 2 * PER_KEY - 10, drained  # it drained with its share, not before
    worst = max(shares_off(order[:drained], WEIGHTS), key=lambda x: x[2])
    assert worst[2] <= 0.15, (worst, order[worst[0]:worst[0] + SPAN])
    rest = {"acme": 1, "globex": 1}
    worst_rest = max(shares_off(order[drained:], rest), key=lambda x: x[2])
    assert worst_rest[2] <= 0.15, (worst_rest, order[drained + worst_rest[0]:][:SPAN])
    print(f"{len(order)} claims by {AGENTS} agents on 2 replicas in {took:.1f} s; worst "
          f"window while all keys had work: {worst}; after: {worst_rest}")
