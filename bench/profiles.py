"""How big and how long each scenario runs: the full benchmark and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    #: seconds each measured point runs at most
    seconds: float
    # claims
    claim_agents: tuple[int, ...]
    #: entries in each point's task (Baton) and manifest (the JSON peer)
    claim_entries: int
    claim_seconds: float
    claim_rounds: int
    #: agents in the extra Baton run profiled with py-spy (if installed)
    profile_agents: int
    # batches
    batch_agents: tuple[int, ...]
    #: agents of the pools scenario (a pool of that many units), and its rounds
    pool_agents: tuple[int, ...]
    pool_rounds: int
    batch_size: int
    batch_entries: int
    # scale
    scale_small: int
    scale_big: int
    #: claims per point, so the small task is never drained
    scale_claims: int
    scale_agents: int
    scale_rounds: int
    #: claims in flight on the large task when their sessions are revoked (the reaper)
    reap_claims: int
    #: sessions (one thread each) that hold those claims
    reap_sessions: int
    #: seconds the reaper may take to bring every entry back to pending
    reap_timeout: float
    #: entries held in etcd (across tasks) for the last claims of the scale scenario
    scale_total: int
    # watcher
    latency_files: int
    #: write rates tried upwards from 100 files/s until one is not sustained
    latency_rates: tuple[int, ...]
    #: seconds of writing per rate in that search
    latency_seconds: float
    #: after the first rate not sustained, try once halfway back
    latency_refine: bool
    wake_samples: int
    hash_big_mib: int
    hash_rounds: int
    hash_files: int
    #: install b3sum with apt-get when it is missing
    install: bool
    # lifetime
    #: entries handed over in all, in tasks of ``life_size``, by ``life_agents`` agents
    life_total: int = 1_000_000
    life_size: int = 2_000
    life_agents: int = 4
    #: seconds between samples of etcd's size and key count
    life_every: float = 10.0
    #: the history etcd keeps (periodic compaction), as baton up runs it
    life_compaction: str = "1m"
    #: seconds a consumed entry's file stays in staging (the registry's
    #: --staging-retention), and the bytes of each entry's file
    life_retention: float = 60.0
    life_file_bytes: int = 4096
    # producer loops
    loop_agents: tuple[int, ...] = (1, 16, 64)
    #: entries in each point's task
    loop_entries: int = 6_000
    loop_seconds: float = 5.0
    loop_rounds: int = 3
    #: the revision the loops are compared with ("" = none): the main branch before the
    #: session stream and the registry's reshaping
    loop_before: str = "f734371"
    # the stack (baton up and the client's loop, verified)
    stack_agents: tuple[int, ...] = (1, 16, 64)
    #: entries in each point's task
    stack_entries: int = 40_000
    stack_seconds: float = 8.0
    stack_rounds: int = 3
    #: a revision run beside this one, its own `baton up` and agents ("" = none): the
    #: main branch before the hand-off's cost was first cut (issue 38's baseline)
    stack_before: str = "1912c3f"
    # at rest
    #: entries held, across tasks (most pending; shares verified and consumed)
    rest_entries: int = 1_000_000
    rest_tasks: int = 100
    rest_verified: float = 0.04
    rest_consumed: float = 0.02
    #: etcd's history (periodic compaction), as baton up keeps it, and its watch
    #: progress interval ("": baton up's)
    rest_compaction: str = "1m"
    rest_notify: str = ""
    #: the idle window: at least this many compaction periods, and this many seconds
    rest_periods: float = 5.0
    rest_idle: float = 0.0
    #: seconds the watcher's counters must stay still before the window opens
    rest_settle: float = 10.0
    #: seconds between CPU samples in the window (the plot)
    rest_sample: float = 10.0
    #: mutual TLS to the registry and TLS to etcd, as baton up runs them
    rest_tls: bool = True
    #: threads loading the entries
    rest_workers: int = 6
    #: the watcher's --stream-timeout (0: its default, none: a stream lasts while healthy)
    rest_stream_timeout: float = 0.0
    #: seconds of py-spy on the busiest Baton process when one misses the goal (0: none)
    rest_profile: float = 60.0
    #: seconds etcd is measured alone after the window, the registry and the watcher
    #: stopped (the cost of what it stores with no client; 0: not measured)
    rest_alone: float = 120.0
    #: wait, before the window, until the load's request outcomes (kept
    #: ``REQUEST_TTL`` s for retries, on leases) have expired, and report that tail
    rest_tail: bool = True


FULL = Profile(
    name="full",
    seconds=8.0,
    claim_agents=(1, 4, 16, 64),
    claim_entries=1000,
    claim_seconds=5.0,
    claim_rounds=3,
    profile_agents=16,
    batch_agents=(1, 4, 16),
    pool_agents=(16,),
    pool_rounds=4,
    batch_size=21,
    batch_entries=12_000,
    scale_small=1_000,
    scale_big=100_000,
    scale_claims=400,
    scale_agents=4,
    scale_rounds=2,
    reap_claims=50_000,
    reap_sessions=4,
    reap_timeout=600.0,
    scale_total=1_000_000,
    latency_files=1000,
    latency_rates=(200, 400, 800, 1600),
    latency_seconds=5.0,
    latency_refine=True,
    wake_samples=200,
    hash_big_mib=1024,
    hash_rounds=3,
    hash_files=10_000,
    install=True,
)

QUICK = Profile(
    name="quick",
    seconds=1.5,
    claim_agents=(1, 4),
    claim_entries=200,
    claim_seconds=1.5,
    claim_rounds=1,
    profile_agents=4,
    batch_agents=(2,),
    pool_agents=(4,),
    pool_rounds=2,
    batch_size=21,
    batch_entries=2_000,
    scale_small=200,
    scale_big=5_000,
    scale_claims=60,
    scale_agents=2,
    scale_rounds=1,
    reap_claims=300,
    reap_sessions=2,
    reap_timeout=60.0,
    scale_total=15_000,
    latency_files=100,
    latency_rates=(200,),
    latency_seconds=0.5,
    latency_refine=False,
    wake_samples=15,
    hash_big_mib=64,
    hash_rounds=2,
    hash_files=300,
    install=False,
    life_total=3_000,
    life_size=500,
    life_agents=2,
    life_every=1.0,
    life_retention=2.0,
    loop_agents=(2,),
    loop_entries=300,
    loop_seconds=1.0,
    loop_rounds=1,
    loop_before="",
    stack_agents=(2,),
    stack_entries=400,
    stack_seconds=1.0,
    stack_rounds=1,
    stack_before="",
    rest_entries=20_000,
    rest_tasks=20,
    rest_verified=0.025,
    rest_consumed=0.025,
    rest_workers=4,
    rest_compaction="5s",
    rest_notify="1s",
    rest_periods=5.0,
    rest_settle=2.0,
    rest_sample=5.0,
    rest_profile=0.0,
    rest_alone=10.0,
    rest_tail=False,
)
