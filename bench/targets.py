"""The goals the hot path is held to, checked against a run's measured facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .report import Table

Facts = dict[str, float]


@dataclass(frozen=True)
class Target:
    goal: str
    #: the measured value, as text, from the facts (None: not measured in this run)
    measured: Callable[[Facts], str | None]
    met: Callable[[Facts], bool]


def _get(f: Facts, *keys: str) -> list[float] | None:
    values = [f.get(k) for k in keys]
    return None if any(v is None for v in values) else [float(v) for v in values if v is not None]


def _ratio(key: str, goal: float) -> Target:
    n = key.rsplit(".", 1)[-1]
    peer = "raw etcd single transactions/s" if ".vs_raw." in key else "PostgreSQL SKIP LOCKED"
    return Target(
        f"claim→commit cycles/s ≥ {goal:.1f}x {peer} at {n} agent(s)",
        lambda f: None if (v := _get(f, key)) is None else f"{v[0]:.2f}x",
        lambda f: (v := _get(f, key)) is not None and v[0] >= goal)


def _loops(key: str, goal: float, peer: str) -> Target:
    n = key.rsplit(".", 1)[-1]
    return Target(
        f"producer helper loop steps/s ≥ {goal:.1f}x {peer} at {n} agents",
        lambda f: None if (v := _get(f, key)) is None else f"{v[0]:.2f}x",
        lambda f: (v := _get(f, key)) is not None and v[0] >= goal)


def _stack(key: str, goal: float) -> Target:
    n = key.rsplit(".", 1)[-1]
    return Target(
        f"the stack (`baton up`, files verified): files/s ≥ {goal:.1f}x PostgreSQL's "
        f"batched SKIP LOCKED loop at {n} agents",
        lambda f: None if (v := _get(f, key)) is None else f"{v[0]:.2f}x",
        lambda f: (v := _get(f, key)) is not None and v[0] >= goal)


def _stack_cpu(process: str, goal: float) -> Target:
    key = f"stack.{process}_ms.16"
    return Target(
        f"the stack: {process} CPU per file ≤ {goal:.1f} ms at 16 agents",
        lambda f: None if (v := _get(f, key)) is None else f"{v[0]:.2f} ms",
        lambda f: (v := _get(f, key)) is not None and v[0] <= goal)


TARGETS = (
    _stack("stack.vs_pg.16", 0.4),
    _stack("stack.vs_pg.64", 0.4),
    _stack("stack.vs_pg.16", 1.0),
    _stack("stack.vs_pg.64", 1.0),
    _stack_cpu("registry", 0.6),
    _stack_cpu("watcher", 0.3),
    Target("the stack: ≥ 1,000 files/s verified with write → verified p99 ≤ 50 ms "
           "(its best agent count)",
           lambda f: None if (v := _get(f, "stack.best_per_s", "stack.best_p99")) is None
           else f"{v[0]:,.0f} files/s, p99 {v[1]:,.0f} ms",
           lambda f: (v := _get(f, "stack.best_per_s", "stack.best_p99")) is not None
           and v[0] >= 1000 and v[1] <= 50),
    _loops("loops.vs_before.16", 2.0, "the earlier revision run beside it"),
    _loops("loops.vs_before.64", 2.0, "the earlier revision run beside it"),
    _loops("loops.vs_pg.16", 1.0, "PostgreSQL SKIP LOCKED"),
    _loops("loops.vs_pg.64", 1.0, "PostgreSQL SKIP LOCKED"),
    Target("registry CPU per producer helper step ≤ 0.5 ms at 16 agents",
           lambda f: None if (v := _get(f, "loops.registry_ms.16")) is None
           else f"{v[0]:.2f} ms",
           lambda f: (v := _get(f, "loops.registry_ms.16")) is not None and v[0] <= 0.5),
    _ratio("claims.vs_raw.64", 1.0),
    _ratio("claims.vs_raw.1", 0.4),
    _ratio("claims.vs_pg.16", 1.0),
    _ratio("claims.vs_pg.64", 1.0),
    Target("0 double claims (every agent count and round)",
           lambda f: None if (v := _get(f, "claims.doubles")) is None else f"{v[0]:.0f}",
           lambda f: (v := _get(f, "claims.doubles")) is not None and v[0] == 0),
    Target("claim p99 at 16 agents ≤ 2 x raw transaction p99 + 2 ms",
           lambda f: None if (v := _get(f, "claims.p99.16", "claims.raw_p99.16")) is None
           else f"{v[0]:.1f} ms (limit {2 * v[1] + 2:.1f} ms)",
           lambda f: (v := _get(f, "claims.p99.16", "claims.raw_p99.16")) is not None
           and v[0] <= 2 * v[1] + 2),
    Target("≤ 2 etcd requests per claim→commit cycle at 1 agent (etcd's own count, "
           "background sweeps included)",
           lambda f: None if (v := _get(f, "claims.requests.1")) is None else f"{v[0]:.2f}",
           lambda f: (v := _get(f, "claims.requests.1")) is not None and v[0] <= 2.0),
    Target("claims/s in a 100,000-entry task ≥ 0.9x a 1,000-entry task",
           lambda f: None if (v := _get(f, "scale.slowdown")) is None else f"{v[0]:.2f}x",
           lambda f: (v := _get(f, "scale.slowdown")) is not None and v[0] >= 0.9),
    Target("creating 100,000 entries ≤ 3 s",
           lambda f: None if (v := _get(f, "scale.create_s", "scale.create_n")) is None
           else f"{v[0]:.1f} s for {v[1]:,.0f}",
           lambda f: (v := _get(f, "scale.create_s", "scale.create_n")) is not None
           and v[1] >= 100_000 and v[0] <= 3.0),
    Target("registry RSS ≤ 300 MB with it",
           lambda f: None if (v := _get(f, "scale.rss_mib")) is None else f"{v[0]:.0f} MiB",
           lambda f: (v := _get(f, "scale.rss_mib")) is not None and v[0] * 1.048576 <= 300),
    Target("write → verified sustained ≥ 1,000 files/s of 64 KiB",
           lambda f: None if (v := _get(f, "watcher.sustained")) is None
           else f"{'≥ ' if f.get('watcher.all_sustained') else ''}{v[0]:,.0f} files/s "
                f"(the highest rate tried that was sustained)",
           lambda f: (v := _get(f, "watcher.sustained")) is not None and v[0] >= 1000),
    Target("write → verified at 100 files/s: p50 ≤ 5 ms and p99 ≤ 20 ms",
           lambda f: None if (v := _get(f, "watcher.p50.100", "watcher.p99.100")) is None
           else f"p50 {v[0]:.1f} ms, p99 {v[1]:.1f} ms",
           lambda f: (v := _get(f, "watcher.p50.100", "watcher.p99.100")) is not None
           and v[0] <= 5 and v[1] <= 20),
)


def targets_table(facts: Facts) -> Table:
    table = Table("Targets (same run)", ["goal", "measured", "met"])
    for t in TARGETS:
        measured = t.measured(facts)
        if measured is not None:
            table.rows.append([t.goal, measured, "yes" if t.met(facts) else "no"])
    return table
